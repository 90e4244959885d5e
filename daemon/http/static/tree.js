// The draft tree of one speculation round, as the daemon's opt-in trace sends it (tokens,
// parents, the accepted path), with buttons to step through the rounds kept per answer.
import { el } from "./page.js";

function shown(token) {
  // Spaces and line breaks made visible: a token is often just " the".
  return token.replace(/ /g, "\u00b7").replace(/\n/g, "\u21b5") || "\u2205";
}

function bestRound(trees) {
  let best = 0;
  trees.forEach((t, i) => { if (t.accepted_count > trees[best].accepted_count) best = i; });
  return best;
}

export function treeView(trees) {
  const box = el("details", { class: "tree", open: "" });
  let index = bestRound(trees);
  const summary = el("summary");
  const body = el("div", { class: "tree-body" });
  const show = () => {
    const t = trees[index];
    summary.textContent = `Draft tree, round ${t.round}${trees.length > 1 ? ` (tree ${index + 1} of ${trees.length} kept)` : ""}: ` +
      `${t.nodes} nodes, ${t.accepted_count} accepted` + (t.truncated ? ` (first ${t.tokens.length} nodes shown)` : "");
    body.replaceChildren(treeList(t));
  };
  const nav = el("div", { class: "tree-nav" },
    el("button", { type: "button", class: "small", text: "\u2039 round", "aria-label": "Previous round",
      onclick: () => { index = Math.max(0, index - 1); show(); } }),
    el("button", { type: "button", class: "small", text: "round \u203a", "aria-label": "Next round",
      onclick: () => { index = Math.min(trees.length - 1, index + 1); show(); } }),
    el("span", { class: "muted", text: "highlighted: the path the target accepted" }));
  box.append(summary, nav, body);
  show();
  return box;
}

function treeList(t) {
  const accepted = new Set([0, ...t.accepted]);
  const children = t.tokens.map(() => []);
  t.parents.forEach((p, i) => { if (p >= 0) children[p].push(i); });
  const item = (i) => {
    const label = el("span", { class: `tok${accepted.has(i) ? " accepted" : ""}${i === 0 ? " root" : ""}`,
      text: shown(t.tokens[i]), title: i === 0 ? "root (the last token already emitted)" : `node ${i}` });
    const li = el("li", {}, label);
    if (children[i].length) li.append(el("ul", {}, ...children[i].map(item)));
    return li;
  };
  return el("ul", { class: "tree-root" }, item(0));
}
