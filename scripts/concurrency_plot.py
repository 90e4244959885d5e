"""The plot of scripts/bench_concurrency.py: aggregate tokens/s and streamed bytes per token
against concurrent clients, batched against interleaved, in-process (solid) and over REST
(dashed). matplotlib draws it when installed (a test extra, not a dependency); otherwise the
same two panels are written as a hand-made SVG."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

PANELS = (("tokens_per_second", "aggregate tokens/s"), ("streamed_bytes_per_token", "bytes/token"))
STYLES = {  # (path, engine) → colour, dashed
    ("in-process", "batched"): ("#1f77b4", False),
    ("in-process", "interleaved"): ("#d62728", False),
    ("rest", "batched"): ("#1f77b4", True),
    ("rest", "interleaved"): ("#d62728", True),
}


def series(summary: list[dict[str, Any]], key: str) -> dict[tuple[str, str], list[tuple]]:
    out: dict[tuple[str, str], list[tuple]] = {}
    for s in summary:
        out.setdefault((s["path"], s["engine"]), []).append((s["clients"], s[key]))
    return out


def plot(summary: list[dict[str, Any]], path: Path, title: str) -> str:
    """Tokens/s and streamed bytes per token against clients, batched against interleaved.
    Returns how it was drawn."""
    try:
        import matplotlib
    except ImportError:
        path.write_text(svg_plot(summary, title))
        return "svg (matplotlib is not installed)"
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, (key, label) in zip(axes, PANELS, strict=True):
        for (p, engine), points in series(summary, key).items():
            colour, dashed = STYLES[(p, engine)]
            xs, ys = zip(*points, strict=True)
            ax.plot(xs, ys, marker="o", color=colour, ls="--" if dashed else "-",
                    label=f"{engine} ({p})")  # fmt: skip
        ax.set_xscale("log", base=2)
        ax.set_xticks(sorted({s["clients"] for s in summary}))
        ax.get_xaxis().set_major_formatter(matplotlib.ticker.ScalarFormatter())
        ax.set_xlabel("concurrent clients")
        ax.set_ylabel(label)
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return "matplotlib"


def svg_plot(summary: list[dict[str, Any]], title: str) -> str:
    """The same two panels as plain SVG (log2 x axis, linear y from 0)."""
    width, height, pad = 440, 300, 55
    clients = sorted({s["clients"] for s in summary})
    lo, hi = clients[0], clients[-1]
    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{2 * width}" height="{height + 30}" '
        'font-family="sans-serif" font-size="11">',
        f'<text x="{width}" y="16" text-anchor="middle">{_escape(title)}</text>',
    ]
    for panel, (key, label) in enumerate(PANELS):
        x0, y0 = panel * width + pad, 30
        w, h = width - pad - 15, height - pad - 10
        top = max(s[key] for s in summary) * 1.1 or 1.0

        def x(c: float, x0: int = x0, w: int = w) -> float:
            if hi == lo:
                return x0 + w / 2
            return x0 + w * math.log2(c / lo) / math.log2(hi / lo)

        def y(v: float, y0: int = y0, h: int = h, top: float = top) -> float:
            return y0 + h - h * v / top

        parts.append(
            f'<rect x="{x0}" y="{y0}" width="{w}" height="{h}" fill="none" stroke="#888"/>'
        )
        for c in clients:
            parts.append(f'<text x="{x(c):.1f}" y="{y0 + h + 15}" text-anchor="middle">{c}</text>')
        for frac in (0, 0.5, 1):
            v = top * frac / 1.1
            parts.append(f'<text x="{x0 - 4}" y="{y(v) + 4:.1f}" text-anchor="end">{v:.3g}</text>')
        parts.append(
            f'<text x="{x0 + w / 2}" y="{y0 + h + 32}" text-anchor="middle">'
            f"concurrent clients</text>"
        )
        parts.append(f'<text x="{x0}" y="{y0 - 4}">{label}</text>')
        for n, ((p, engine), points) in enumerate(series(summary, key).items()):
            colour, dashed = STYLES[(p, engine)]
            coords = " ".join(f"{x(c):.1f},{y(v):.1f}" for c, v in points)
            dash = ' stroke-dasharray="5,3"' if dashed else ""
            parts.append(f'<polyline points="{coords}" fill="none" stroke="{colour}"{dash}/>')
            if panel == 0:
                ly = y0 + 12 + 14 * n
                parts.append(
                    f'<line x1="{x0 + 8}" y1="{ly}" x2="{x0 + 28}" y2="{ly}" '
                    f'stroke="{colour}"{dash}/><text x="{x0 + 32}" y="{ly + 4}">'
                    f"{engine} ({p})</text>"
                )
    parts.append("</svg>")
    return "\n".join(parts) + "\n"


def _escape(text: str) -> str:
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
