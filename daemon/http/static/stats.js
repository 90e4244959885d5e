// The daemon's figures in words: an answer's (its final chunk's `specd` statistics) and
// the tree budget GET /v1/specd/status says it runs with. No DOM here: tests run these
// functions as they are.
import { fmt } from "./page.js";

// An answer for which no target pass ran (every token replayed from the prefix cache, or
// forced by the response format) has no speed to speak of: its tokens/s would be the cost
// of a table look-up.
export function speedText(s) {
  if (s.target_passes === 0) return s.prefix_cache_hits ? "replayed from the prefix cache" : "no target pass";
  return fmt(s.tokens_per_second, 1);
}

// `budget` is the last round's; under "auto" (its reason says so) the planner chose it,
// and 0 means that round decoded without a tree, not that no tree was drawn.
export function budgetText(s) {
  if (s.budget === undefined || s.budget === null) return "–";
  if (typeof s.budget_reason !== "string" || !s.budget_reason.startsWith("auto")) return String(s.budget);
  if (s.budget) return `auto (${s.budget} nodes)`;
  if (s.tree_nodes) return `auto (last round plain; ${fmt(s.tree_nodes, 1)} nodes/round)`;
  return "auto (plain decoding)";
}

// The configured budget: a node count, or "auto" (chosen each round, up to the most nodes
// the memory plan holds).
export function configuredBudgetText(status) {
  if (status.budget === undefined || status.budget === null) return "–";
  if (status.budget !== "auto") return `${status.budget} nodes`;
  return typeof status.max_tree_budget === "number" ? `auto (up to ${status.max_tree_budget} nodes)` : "auto";
}

// [name, shown value, hover text] for each figure of an answer's statistics line.
export function statItems(s) {
  return [
    ["tokens/s", speedText(s), ""],
    ["first token", s.first_token_seconds !== undefined ? `${fmt(s.first_token_seconds, 3)} s` : "–", ""],
    ["tokens/pass", s.target_passes === 0 ? "–" : fmt(s.tokens_per_target_pass), ""],
    ["accepted", typeof s.acceptance_rate === "number" ? `${(100 * s.acceptance_rate).toFixed(0)}%` : "–", ""],
    ["strategy", s.strategy || "–", ""],
    ["tree budget", budgetText(s), s.budget_reason || ""],
    ["prefix-cache hits", s.prefix_cache_hits !== undefined ? String(s.prefix_cache_hits) : "–", ""],
    ["batch", fmt(s.batch_size, 1), ""],
  ];
}
