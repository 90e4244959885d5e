"""What trees learned about a model pair, kept on disk between runs, so that a restart (or
the next `specd generate`) starts from what the last one measured rather than from the
prior: the acceptance tables (calibration, and with them `auto`'s verification choice:
speculative/acceptance.py) and `--budget auto`'s measured costs (speculative/auto_budget.py).

One small JSON file per model pair under `<state dir>/learned/` (beside the substitute
cache's `substitutes/`; `models.learned_cache`), named by a key over what acceptance
depends on: the target's weight files (path, size, modification time) and how it loads
(`--quantize`, dtype), the draft (its files and `--draft-quantize`, or the substitute's
bits, or n-gram), and the tables' own bins. Pass costs depend on the machine and the
placement too, so they are kept per placement (device, resident and streamed layers)
inside the file. A file is read as hostile input: bounded in size, every value checked;
one that does not check out is named in the log and replaced, never trusted. Writes go
through a temporary file renamed into place; the MAX_STORED most recently used are kept.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import re
import time
from pathlib import Path
from typing import Any

from daemon.small_files import read_small
from modeling.checkpoints.checkpoint import Checkpoint
from speculative.acceptance import Q_EDGES, RANK_EDGES, AcceptanceModel
from speculative.auto_budget import AutoBudget

log = logging.getLogger("specd.learned")

FORMAT = 1  # bump when what is stored changes
MAX_STORED = 64  # model pairs kept
MAX_BYTES = 1 << 20  # a file past this is not read (a real one is a few tens of kB)
MAX_PLACEMENTS = 8  # placements whose pass costs a file keeps
SAVE_EVERY_S = 30.0  # the daemon writes at most this often (and when it stops)
STORED_NAME = re.compile(r"[0-9a-f]{32}\.json")  # `pair_key`'s names: the only ones evicted


def _files(checkpoint: Checkpoint) -> list[list[Any]]:
    return [
        [str(f.resolve()), f.stat().st_size, f.stat().st_mtime_ns]
        for f in sorted(checkpoint.weight_files())
    ]


def pair_key(
    target: Checkpoint,
    quantize: str | None,
    dtype: str,
    draft_kind: str | None,
    draft: Checkpoint | None,
    draft_quantize: str | None,
    substitute_bits: int | None,
) -> str:
    identity = {
        "format": FORMAT,
        "bins": [list(Q_EDGES), list(RANK_EDGES)],
        "target": _files(target),
        "quantize": quantize,
        "dtype": dtype,
        "draft_kind": draft_kind,
        "draft": _files(draft) if draft is not None else None,
        "draft_quantize": draft_quantize if draft is not None else None,
        "substitute_bits": substitute_bits,
    }
    return hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:32]


class LearnedStore:
    """One model pair's file: `load` fills a runtime's acceptance model (and hands out the
    budget planner's record for this placement), `save` writes what they hold now."""

    def __init__(self, directory: Path, key: str, placement: str) -> None:
        self.directory = directory
        self.path = directory / f"{key}.json"
        self.placement = placement
        self.budgets: dict[str, Any] = {}  # placement → a planner's record, as read
        self.loaded_rounds = 0
        self._saved_at = 0.0

    def load(self, acceptance: AcceptanceModel) -> None:
        """Read the file into `acceptance` if there is one that checks out; anything else
        is one log line and a fresh start."""
        if not os.path.lexists(self.path):
            return  # nothing learned yet
        try:
            record = json.loads(read_small(self.path, MAX_BYTES))
            if not isinstance(record, dict) or record.get("format") != FORMAT:
                raise ValueError("not a learned-state file of this specd's format")
            budgets = record.get("budgets", {})
            if not isinstance(budgets, dict) or len(budgets) > MAX_PLACEMENTS:
                raise ValueError("budgets: not a record per placement")
            loaded = AcceptanceModel()
            rounds = loaded.load_state(record.get("acceptance"))
        except (OSError, ValueError, RecursionError, OverflowError) as err:
            # (OverflowError: a number past a float, the checks' own safety net)
            log.warning("ignoring learned state %s (it will be replaced): %s", self.path, err)
            return
        acceptance.tables = loaded.tables
        self.budgets = {str(k): v for k, v in budgets.items()}
        self.loaded_rounds = rounds
        log.info("learned state of this model pair: %d verified rounds (%s)", rounds, self.path)

    def restore(self, planner: AutoBudget) -> None:
        """Give `planner` what this placement measured before, if it checks out."""
        record = self.budgets.get(self.placement)
        if record is None:
            return
        try:
            planner.load_state(record)
        except (ValueError, OverflowError) as err:
            log.warning("ignoring the learned pass costs in %s: %s", self.path, err)
            self.budgets.pop(self.placement, None)

    def save(
        self, acceptance: AcceptanceModel, planner: AutoBudget | None, force: bool = True
    ) -> None:
        """Write the tables (and `planner`'s record for this placement); with `force`
        False, only if the last write is SAVE_EVERY_S old. A failing disk is a log line."""
        now = time.monotonic()
        if not force and now - self._saved_at < SAVE_EVERY_S:
            return
        self._saved_at = now
        if planner is not None:
            self.budgets.pop(self.placement, None)
            self.budgets[self.placement] = planner.state()  # the latest last
            while len(self.budgets) > MAX_PLACEMENTS:
                self.budgets.pop(next(iter(self.budgets)))
        record = {"format": FORMAT, "acceptance": acceptance.state(), "budgets": self.budgets}
        partial = self.path.with_suffix(f".{os.getpid()}.partial")
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            partial.write_text(json.dumps(record))
            os.replace(partial, self.path)
            # Only files named as this store names them: the folder may be the user's own.
            stored = sorted(
                (p for p in self.directory.glob("*.json") if STORED_NAME.fullmatch(p.name)),
                key=lambda p: p.stat().st_mtime_ns,
                reverse=True,
            )
            for old in stored[MAX_STORED:]:
                old.unlink(missing_ok=True)
        except OSError as err:
            log.warning("could not keep what trees learned in %s: %s", self.path, err)
            with contextlib.suppress(OSError):
                partial.unlink(missing_ok=True)
