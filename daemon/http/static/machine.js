// The machine panel: what GET /v1/specd/status says the daemon runs with (models, engine
// state, the memory plan, measured streaming), with a bar of resident vs streamed layers.
import { askForKey, getJson } from "./api.js";
import { $, el, fmt } from "./page.js";
import { configuredBudgetText } from "./stats.js";

function bytes(n) {
  if (typeof n !== "number") return "–";
  const units = ["B", "KB", "MB", "GB", "TB"];
  let i = 0;
  while (n >= 1000 && i < units.length - 1) { n /= 1000; i += 1; }
  return `${n.toFixed(n >= 100 || i === 0 ? 0 : 1)} ${units[i]}`;
}

// "tight · RAM 1.2 GB free · prefix_cache, cached_sessions": the memory monitor's level,
// what it last saw, and the relief steps in force.
function pressureText(p) {
  if (!p || p.level === "off") return "not watched";
  const parts = [p.level, `RAM ${bytes(p.host_available_bytes)} free`];
  if (typeof p.device_free_bytes === "number") parts.push(`GPU ${bytes(p.device_free_bytes)} free`);
  parts.push(p.steps && p.steps.length ? `relief: ${p.steps.join(", ")}` : "no relief steps");
  return parts.join(" · ");
}

export async function refreshMachine() {
  const box = $("machine-body");
  let status;
  try {
    status = await getJson("/v1/specd/status");
  } catch (err) {
    if (err.status === 401) askForKey(refreshMachine);
    box.textContent = `unavailable: ${err.message}`;
    return;
  }
  $("model-name").textContent = status.model || "";
  // The Temperature box, left empty, sends none: the daemon's own default applies.
  if (typeof status.default_temperature === "number") {
    $("temperature").placeholder = `server default (${status.default_temperature})`;
  }
  const plan = status.plan || {};
  const resident = plan.resident_layers || 0;
  const streamed = plan.streamed_layers || 0;
  const rows = [
    ["state", `${status.status} · ${status.active} active · ${status.queued} queued`],
    ["target", status.target],
    ["draft", status.draft_kind === "substitute"
      ? `substitute (${status.substitute_bits}-bit, the target's own layers)`
      : status.draft || "none"],
    ["device", `${status.device || "–"} · ${status.dtype || "–"}`],
    ["strategy", status.strategy || "–"],
    ["tree budget", configuredBudgetText(status)],
    ["context", status.context !== undefined ? `${status.context} tokens` : "–"],
    ["layers", `${resident} resident · ${streamed} streamed`],
    ["slots", plan.slots !== undefined ? String(plan.slots) : "–"],
    ["host tier", plan.host_tier || "–"],
    ["streamed/pass", bytes(plan.streamed_bytes_per_pass)],
    ["s/pass (plan)", typeof plan.seconds_per_pass === "number" ? plan.seconds_per_pass.toPrecision(3) : "–"],
    ["stream GB/s", status.stream && typeof status.stream.gbps === "number" ? status.stream.gbps.toFixed(2) : "nothing streamed"],
    ["tokens/pass", status.totals ? fmt(status.totals.tokens_per_target_pass) : "–"],
    ["memory", pressureText(status.memory_pressure)],
  ];
  const dl = el("dl");
  for (const [name, value] of rows) {
    dl.append(el("dt", { text: name }), el("dd", { text: String(value), "data-field": name }));
  }
  const total = resident + streamed;
  const bar = el("div", { class: "layers", title: `${resident} resident, ${streamed} streamed layers` });
  if (total) {
    // Widths through the CSSOM: the page's CSP refuses style attributes.
    const part = (cls, n) => {
      const span = el("span", { class: cls });
      span.style.width = `${(100 * n) / total}%`;
      return span;
    };
    bar.append(part("resident", resident), part("streamed", streamed));
  }
  box.replaceChildren(bar, dl);
}
