// specd's web chat: conversations in localStorage, answers streamed from the daemon's own
// OpenAI endpoint, and what speculation did for each answer (the final chunk's `specd`
// figures). Plain DOM, no framework, nothing fetched from anywhere but this daemon.
"use strict";

const STORE = { chats: "specd.chats", current: "specd.current", settings: "specd.settings", key: "specd.apiKey" };
const $ = (id) => document.getElementById(id);

const state = {
  chats: load(STORE.chats, []),
  currentId: localStorage.getItem(STORE.current),
  controller: null, // AbortController of the answer being streamed
  pendingAfterKey: null, // what to retry once the API key is saved
};

function load(key, fallback) {
  try {
    const raw = localStorage.getItem(key);
    return raw === null ? fallback : JSON.parse(raw);
  } catch {
    return fallback;
  }
}

function save() {
  localStorage.setItem(STORE.chats, JSON.stringify(state.chats));
  if (state.currentId) localStorage.setItem(STORE.current, state.currentId);
}

function el(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  for (const [name, value] of Object.entries(attrs)) {
    if (name === "text") node.textContent = value;
    else if (name.startsWith("on")) node.addEventListener(name.slice(2), value);
    else node.setAttribute(name, value);
  }
  for (const child of children) if (child) node.append(child);
  return node;
}

// ---- conversations ----

function current() {
  return state.chats.find((c) => c.id === state.currentId);
}

function newChat() {
  const chat = { id: `c${Date.now().toString(36)}${Math.random().toString(36).slice(2, 6)}`,
    title: "New chat", system: "", messages: [] };
  state.chats.unshift(chat);
  state.currentId = chat.id;
  save();
  render();
  $("input").focus();
  return chat;
}

function selectChat(id) {
  if (state.controller) return; // one answer at a time: stop it first
  state.currentId = id;
  save();
  render();
}

function renameChat() {
  const chat = current();
  if (!chat) return;
  const title = window.prompt("Rename this conversation", chat.title);
  if (title !== null && title.trim()) {
    chat.title = title.trim();
    save();
    render();
  }
}

function deleteChat() {
  const chat = current();
  if (!chat || state.controller) return;
  if (!window.confirm(`Delete "${chat.title}"?`)) return;
  state.chats = state.chats.filter((c) => c.id !== chat.id);
  state.currentId = state.chats.length ? state.chats[0].id : null;
  if (!state.currentId) localStorage.removeItem(STORE.current);
  save();
  if (!state.chats.length) newChat();
  else render();
}

// ---- settings ----

const SETTINGS = ["temperature", "top-p", "max-tokens", "seed", "strategy", "budget", "trace"];
const MAX_TREES = 16; // rounds' trees kept per answer (the server sends at most 128)

function settingValue(id) {
  return $(id).type === "checkbox" ? $(id).checked : $(id).value;
}

function restoreSettings() {
  const saved = load(STORE.settings, {});
  for (const id of SETTINGS) {
    if (saved[id] === undefined) continue;
    if ($(id).type === "checkbox") $(id).checked = saved[id];
    else $(id).value = saved[id];
  }
  for (const id of SETTINGS) {
    $(id).addEventListener("change", () => {
      const values = {};
      for (const k of SETTINGS) values[k] = settingValue(k);
      localStorage.setItem(STORE.settings, JSON.stringify(values));
    });
  }
  $("system-prompt").addEventListener("change", () => {
    const chat = current();
    if (chat) {
      chat.system = $("system-prompt").value;
      save();
    }
  });
}

function requestBody(chat) {
  const messages = [];
  if (chat.system.trim()) messages.push({ role: "system", content: chat.system });
  for (const m of chat.messages) {
    if (m.role === "assistant" && m.state !== "done" && m.state !== "stopped") continue;
    messages.push({ role: m.role, content: m.content });
  }
  const body = { messages, stream: true };
  const number = (id, name, integer) => {
    const raw = $(id).value.trim();
    if (raw === "") return;
    const value = integer ? parseInt(raw, 10) : parseFloat(raw);
    if (!Number.isNaN(value)) body[name] = value;
  };
  number("temperature", "temperature", false);
  number("top-p", "top_p", false);
  number("max-tokens", "max_tokens", true);
  number("seed", "seed", true);
  number("budget", "budget", true);
  if ($("strategy").value) body.strategy = $("strategy").value;
  if ($("trace").checked) body.specd = { trace: true }; // each round's draft tree
  return body;
}

// ---- the API ----

function headers() {
  const h = { "Content-Type": "application/json" };
  const key = localStorage.getItem(STORE.key);
  if (key) h.Authorization = `Bearer ${key}`;
  return h;
}

class ApiError extends Error {
  constructor(status, error) {
    super((error && error.message) || `HTTP ${status}`);
    this.status = status;
    this.code = error && error.code;
  }
}

async function errorOf(response) {
  try {
    return new ApiError(response.status, (await response.json()).error);
  } catch {
    return new ApiError(response.status, null);
  }
}

function askForKey(retry) {
  state.pendingAfterKey = retry;
  const dialog = $("key-dialog");
  if (!dialog.open) dialog.showModal();
  $("key-input").focus();
}

async function getJson(path) {
  const response = await fetch(path, { headers: headers() });
  if (!response.ok) throw await errorOf(response);
  return response.json();
}

// Reads an SSE body: calls onEvent with each `data:` payload parsed as JSON.
async function readEvents(response, onEvent) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
    buffer += decoder.decode(value, { stream: true });
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const block = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      for (const line of block.split("\n")) {
        if (!line.startsWith("data: ")) continue; // ": keep-alive" comments
        const data = line.slice(6);
        if (data === "[DONE]") return;
        onEvent(JSON.parse(data));
      }
    }
  }
}

// ---- sending ----

async function send(text) {
  const chat = current() || newChat();
  if (state.controller) return;
  if (text !== undefined) {
    chat.messages.push({ role: "user", content: text });
    if (chat.title === "New chat") chat.title = text.slice(0, 40) || "New chat";
  }
  await answer(chat);
}

async function answer(chat) {
  hideNotice();
  const reply = { role: "assistant", content: "", state: "streaming", stats: null, trees: [] };
  const body = requestBody(chat); // before the reply joins the conversation
  chat.messages.push(reply);
  save();
  render();
  const controller = new AbortController();
  state.controller = controller;
  setBusy(true);
  const started = performance.now();
  let firstAt = null;
  try {
    const response = await fetch("/v1/chat/completions", {
      method: "POST", headers: headers(), body: JSON.stringify(body), signal: controller.signal,
    });
    if (!response.ok) throw await errorOf(response);
    await readEvents(response, (event) => {
      if (event.error) throw new ApiError(500, event.error);
      const choice = event.choices && event.choices[0];
      const delta = choice && choice.delta && choice.delta.content;
      if (delta) {
        if (firstAt === null) firstAt = performance.now();
        reply.content += delta;
        updateReply(reply);
      }
      if (event.specd && event.specd.trace) {
        if (reply.trees.length < MAX_TREES) reply.trees.push(event.specd.trace);
      } else if (event.specd) {
        reply.stats = event.specd;
      }
      if (choice && choice.finish_reason) reply.finish = choice.finish_reason;
    });
    reply.state = "done";
    reply.clientSeconds = (performance.now() - started) / 1000;
    if (firstAt !== null) reply.clientFirstToken = (firstAt - started) / 1000;
  } catch (err) {
    if (controller.signal.aborted) {
      reply.state = "stopped";
    } else {
      chat.messages.pop(); // a failed answer is not part of the conversation
      handleError(err, chat);
    }
  } finally {
    state.controller = null;
    setBusy(false);
    save();
    render();
  }
}

function handleError(err, chat) {
  if (err.status === 401) {
    askForKey(() => answer(chat));
  } else if (err.code === "context_length_exceeded") {
    showNotice("The conversation no longer fits the model's context. " +
      "Drop the oldest turn to make room (the page never does it on its own).", true);
  } else {
    showNotice(`The request failed: ${err.message}`, false);
  }
}

function dropOldestTurn() {
  const chat = current();
  if (!chat) return;
  // The first user message and everything up to the next user message.
  const next = chat.messages.findIndex((m, i) => i > 0 && m.role === "user");
  if (next <= 0) {
    showNotice("Only one turn is left and it does not fit: shorten it or the system prompt.", false);
    return;
  }
  chat.messages.splice(0, next);
  save();
  render();
  answer(chat);
}

function regenerate() {
  const chat = current();
  if (!chat || state.controller) return;
  const last = chat.messages[chat.messages.length - 1];
  if (last && last.role === "assistant") chat.messages.pop();
  answer(chat);
}

function stop() {
  if (state.controller) state.controller.abort();
}

function setBusy(busy) {
  $("send").hidden = busy;
  $("stop").hidden = !busy;
}

function showNotice(text, offerDrop) {
  $("notice-text").textContent = text;
  $("drop-oldest").hidden = !offerDrop;
  $("notice").hidden = false;
}

function hideNotice() {
  $("notice").hidden = true;
}

// ---- rendering ----

function fmt(value, digits = 2) {
  return typeof value === "number" ? value.toFixed(digits) : "–";
}

function statsLine(reply) {
  const s = reply.stats || {};
  const items = [
    ["tokens/s", fmt(s.tokens_per_second, 1)],
    ["first token", s.first_token_seconds !== undefined ? `${fmt(s.first_token_seconds, 3)} s` : "–"],
    ["tokens/pass", fmt(s.tokens_per_target_pass)],
    ["accepted", typeof s.acceptance_rate === "number" ? `${(100 * s.acceptance_rate).toFixed(0)}%` : "–"],
    ["strategy", s.strategy || "–"],
    ["tree budget", s.budget !== undefined && s.budget !== null ? String(s.budget) : "–"],
    ["prefix-cache hits", s.prefix_cache_hits !== undefined ? String(s.prefix_cache_hits) : "–"],
    ["batch", fmt(s.batch_size, 1)],
  ];
  const line = el("div", { class: "stats" });
  for (const [name, value] of items) {
    const item = el("span", { "data-stat": name });
    item.append(`${name} `, el("b", { text: value }));
    line.append(item);
  }
  return line;
}

function messageNode(m, index, chat) {
  const node = el("div", { class: `msg ${m.role}`, "data-index": String(index) });
  if (m.role === "assistant") node.dataset.state = m.state || "done";
  node.append(el("div", { class: "role", text: m.role === "user" ? "You" : "specd" }));
  node.append(el("div", { class: "content", text: m.content }));
  if (m.role !== "assistant" || m.state === "streaming") return node;
  if (m.stats) node.append(statsLine(m));
  if (m.trees && m.trees.length) node.append(treeView(m.trees));
  const actions = el("div", { class: "actions" });
  actions.append(el("button", { type: "button", class: "small copy", text: "Copy",
    onclick: (e) => copy(m.content, e.target) }));
  if (index === chat.messages.length - 1) {
    actions.append(el("button", { type: "button", class: "small regenerate", text: "Regenerate",
      onclick: regenerate }));
  }
  node.append(actions);
  return node;
}

// ---- the draft tree of one round ----

function shown(token) {
  // Spaces and line breaks made visible: a token is often just " the".
  return token.replace(/ /g, "\u00b7").replace(/\n/g, "\u21b5") || "\u2205";
}

function bestRound(trees) {
  let best = 0;
  trees.forEach((t, i) => { if (t.accepted_count > trees[best].accepted_count) best = i; });
  return best;
}

function treeView(trees) {
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

async function copy(text, button) {
  try {
    await navigator.clipboard.writeText(text);
    button.textContent = "Copied";
  } catch {
    button.textContent = "Copy failed";
  }
  setTimeout(() => { button.textContent = "Copy"; }, 1500);
}

function updateReply(reply) {
  const nodes = $("messages").querySelectorAll(".msg.assistant .content");
  const node = nodes[nodes.length - 1];
  if (node) node.textContent = reply.content;
  scrollDown();
}

function scrollDown() {
  const box = $("messages");
  box.scrollTop = box.scrollHeight;
}

function render() {
  const list = $("conversations");
  list.replaceChildren();
  for (const chat of state.chats) {
    const button = el("button", { type: "button", text: chat.title, title: chat.title,
      onclick: () => selectChat(chat.id) });
    if (chat.id === state.currentId) button.setAttribute("aria-current", "true");
    list.append(el("li", {}, button));
  }
  const chat = current();
  $("chat-title").textContent = chat ? chat.title : "specd";
  $("system-prompt").value = chat ? chat.system : "";
  const box = $("messages");
  box.replaceChildren();
  if (chat) chat.messages.forEach((m, i) => box.append(messageNode(m, i, chat)));
  scrollDown();
}

// ---- the machine panel ----

function bytes(n) {
  if (typeof n !== "number") return "–";
  const units = ["B", "KB", "MB", "GB", "TB"];
  let i = 0;
  while (n >= 1000 && i < units.length - 1) { n /= 1000; i += 1; }
  return `${n.toFixed(n >= 100 || i === 0 ? 0 : 1)} ${units[i]}`;
}

async function refreshMachine() {
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
  const plan = status.plan || {};
  const resident = plan.resident_layers || 0;
  const streamed = plan.streamed_layers || 0;
  const rows = [
    ["state", `${status.status} · ${status.active} active · ${status.queued} queued`],
    ["target", status.target],
    ["draft", status.draft || "none"],
    ["device", `${status.device || "–"} · ${status.dtype || "–"}`],
    ["strategy", status.strategy || "–"],
    ["context", status.context !== undefined ? `${status.context} tokens` : "–"],
    ["layers", `${resident} resident · ${streamed} streamed`],
    ["slots", plan.slots !== undefined ? String(plan.slots) : "–"],
    ["host tier", plan.host_tier || "–"],
    ["streamed/pass", bytes(plan.streamed_bytes_per_pass)],
    ["s/pass (plan)", typeof plan.seconds_per_pass === "number" ? plan.seconds_per_pass.toPrecision(3) : "–"],
    ["stream GB/s", status.stream && typeof status.stream.gbps === "number" ? status.stream.gbps.toFixed(2) : "nothing streamed"],
    ["tokens/pass", status.totals ? fmt(status.totals.tokens_per_target_pass) : "–"],
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

// ---- wiring ----

function init() {
  restoreSettings();
  if (!state.chats.length) newChat();
  else if (!current()) state.currentId = state.chats[0].id;
  render();
  $("new-chat").addEventListener("click", () => { if (!state.controller) newChat(); });
  $("rename-chat").addEventListener("click", renameChat);
  $("delete-chat").addEventListener("click", deleteChat);
  $("stop").addEventListener("click", stop);
  $("drop-oldest").addEventListener("click", dropOldestTurn);
  $("notice-close").addEventListener("click", hideNotice);
  $("machine-refresh").addEventListener("click", refreshMachine);
  $("composer").addEventListener("submit", (e) => {
    e.preventDefault();
    const input = $("input");
    const text = input.value;
    if (!text.trim() || state.controller) return;
    input.value = "";
    send(text).then(refreshMachine);
  });
  $("input").addEventListener("keydown", (e) => {
    if (e.key === "Enter" && !e.shiftKey && !e.isComposing) {
      e.preventDefault();
      $("composer").requestSubmit();
    }
  });
  document.addEventListener("keydown", (e) => {
    if (e.key === "Escape" && state.controller) {
      e.preventDefault();
      stop();
    }
  });
  $("key-form").addEventListener("submit", () => {
    const key = $("key-input").value.trim();
    if (!key) return;
    localStorage.setItem(STORE.key, key);
    $("key-input").value = "";
    const retry = state.pendingAfterKey;
    state.pendingAfterKey = null;
    if (retry) retry();
    refreshMachine();
  });
  refreshMachine();
}

init();
