// The conversations (kept in localStorage), the settings sent with each request, and the
// answers streamed from the daemon's own OpenAI endpoint, each with what speculation did
// for it (the final chunk's `specd` figures), its tool calls when the request offered
// tools, and, when traced, its rounds' draft trees.
import { ApiError, askForKey, errorOf, headers, readEvents } from "./api.js";
import { $, STORE, el, load } from "./page.js";
import { statItems } from "./stats.js";
import { treeView } from "./tree.js";

export const state = {
  chats: load(STORE.chats, []),
  currentId: localStorage.getItem(STORE.current),
  controller: null, // AbortController of the answer being streamed
};

function save() {
  // A full browser storage (about 5 M characters an origin) throws: the page goes on,
  // the answer is still shown, and a notice says the conversations are not being kept.
  try {
    localStorage.setItem(STORE.chats, JSON.stringify(state.chats));
    if (state.currentId) localStorage.setItem(STORE.current, state.currentId);
  } catch (err) {
    showNotice("The browser's storage for this page is full, so conversations are not " +
      `being saved (${err.name}): delete old conversations to make room.`, false);
  }
}

// ---- conversations ----

export function current() {
  return state.chats.find((c) => c.id === state.currentId);
}

export function newChat() {
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

export function renameChat() {
  const chat = current();
  if (!chat) return;
  const title = window.prompt("Rename this conversation", chat.title);
  if (title !== null && title.trim()) {
    chat.title = title.trim();
    save();
    render();
  }
}

export function deleteChat() {
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

const SETTINGS = ["temperature", "top-p", "max-tokens", "seed", "strategy", "budget", "trace",
  "tools", "tool-choice"];
const MAX_TREES = 16; // rounds' trees kept per answer (the server sends at most 128)

function settingValue(id) {
  return $(id).type === "checkbox" ? $(id).checked : $(id).value;
}

export function restoreSettings() {
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

// The Tools setting: the request's `tools` as the API takes them, or undefined when blank.
// Only its JSON is checked here; the daemon says what is wrong with a function (a 400).
function toolsSetting() {
  const raw = $("tools").value.trim();
  if (!raw) return undefined;
  let tools;
  try {
    tools = JSON.parse(raw);
  } catch (err) {
    throw new Error(`Tools is not JSON (${err.message}): give a list of functions, or leave it ` +
      "empty.");
  }
  if (!Array.isArray(tools)) {
    throw new Error('Tools must be a JSON list: [{"type": "function", ...}]');
  }
  return tools;
}

// A tool call's arguments as an object; undefined while they stream, or when they never
// completed (stopped, or cut by Max tokens): an object parses only once it is whole.
function argumentsOf(call) {
  try {
    return JSON.parse(call.function.arguments);
  } catch {
    return undefined;
  }
}

// An answer as the conversation sends it back: with its calls (the daemon writes them into
// the prompt), less any that never completed, since the daemon refuses arguments that are
// not JSON.
function sentBack(m) {
  const calls = (m.tool_calls || []).filter((c) => c && argumentsOf(c) !== undefined);
  const back = calls.length
    ? { role: "assistant", content: m.content || null, tool_calls: calls }
    : { role: "assistant", content: m.content };
  if (m.reasoning) back.reasoning_content = m.reasoning; // (a reasoning model's template reads it)
  return back;
}

function requestBody(chat, user) {
  const messages = [];
  if (chat.system.trim()) messages.push({ role: "system", content: chat.system });
  for (const m of [...chat.messages, ...user]) {
    if (m.role === "assistant" && m.state !== "done" && m.state !== "stopped") continue;
    messages.push(m.role === "assistant" ? sentBack(m) : { role: m.role, content: m.content });
  }
  const body = { messages, stream: true };
  const tools = toolsSetting();
  if (tools && tools.length) {
    body.tools = tools;
    body.tool_choice = $("tool-choice").value;
  }
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

// ---- sending ----

export async function send(text) {
  const chat = current() || newChat();
  if (!state.controller) await answer(chat, text);
}

// Asks for the next answer, after the user's new message `text` if there is one.
async function answer(chat, text) {
  hideNotice();
  const user = text === undefined ? [] : [{ role: "user", content: text }];
  let body;
  try {
    body = requestBody(chat, user);
  } catch (err) { // the Tools setting is not a JSON list: nothing is sent
    showNotice(err.message, false);
    if (text !== undefined) $("input").value = text; // the message goes back to the box
    return;
  }
  chat.messages.push(...user);
  if (text !== undefined && chat.title === "New chat") chat.title = text.slice(0, 40) || "New chat";
  const reply = { role: "assistant", content: "", tool_calls: [], state: "streaming", stats: null,
    trees: [] };
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
      const delta = (choice && choice.delta) || {};
      if (delta.content || delta.tool_calls || delta.reasoning_content) {
        if (firstAt === null) firstAt = performance.now();
        reply.reasoning = (reply.reasoning || "") + (delta.reasoning_content || "");
        reply.content += delta.content || "";
        for (const part of delta.tool_calls || []) addToCall(reply.tool_calls, part);
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

// A streamed tool-call delta, merged under its index: the first carries the call's id and
// name, the rest fragments of its arguments (OpenAI's stream).
function addToCall(calls, part) {
  const call = calls[part.index] ||
    (calls[part.index] = { id: "", type: "function", function: { name: "", arguments: "" } });
  if (part.id) call.id = part.id;
  const fn = part.function || {};
  if (fn.name) call.function.name = fn.name;
  call.function.arguments += fn.arguments || "";
}

function handleError(err, chat) {
  if (err.status === 401) {
    askForKey(() => answer(chat));
  } else if (err.code === "context_length_exceeded" && err.param === "max_tokens") {
    // The conversation fits, the answer's Max tokens does not: the server says how many do.
    showNotice(`${err.message} (or drop the oldest turn to make room)`, true);
  } else if (err.code === "context_length_exceeded") {
    showNotice("The conversation no longer fits the model's context. " +
      "Drop the oldest turn to make room (the page never does it on its own).", true);
  } else {
    showNotice(`The request failed: ${err.message}`, false);
  }
}

export function dropOldestTurn() {
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

export function stop() {
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

export function hideNotice() {
  $("notice").hidden = true;
}

// ---- rendering ----

function statsLine(reply) {
  const line = el("div", { class: "stats" });
  for (const [name, value, hover] of statItems(reply.stats || {})) {
    const item = el("span", hover ? { "data-stat": name, title: hover } : { "data-stat": name });
    item.append(`${name} `, el("b", { text: value }));
    line.append(item);
  }
  return line;
}

// An answer's tool calls, one block each: the function's name, and its arguments as they
// stream, pretty-printed once they are whole.
function callsView(calls) {
  const box = el("div", { class: "calls" });
  calls.forEach((call, index) => {
    if (!call) return; // a hole kept by localStorage (JSON writes it as null)
    const args = argumentsOf(call);
    box.append(el("div", { class: "call", "data-index": String(index) },
      el("div", { class: "call-name", text: call.function.name }),
      el("pre", { class: "call-arguments",
        text: args === undefined ? call.function.arguments : JSON.stringify(args, null, 2) })));
  });
  return box;
}

const copyText = (m) => [m.content, ...(m.tool_calls || []).filter(Boolean)
  .map((c) => `${c.function.name}(${c.function.arguments})`)].filter(Boolean).join("\n");

function messageNode(m, index, chat) {
  const node = el("div", { class: `msg ${m.role}`, "data-index": String(index) });
  if (m.role === "assistant") node.dataset.state = m.state || "done";
  node.append(el("div", { class: "role", text: m.role === "user" ? "You" : "specd" }));
  if (m.reasoning) node.append(reasoningView(m));
  node.append(el("div", { class: "content", text: m.content }));
  if (m.tool_calls && m.tool_calls.length) node.append(callsView(m.tool_calls));
  if (m.role !== "assistant" || m.state === "streaming") return node;
  if (m.stats) node.append(statsLine(m));
  if (m.trees && m.trees.length) node.append(treeView(m.trees));
  const actions = el("div", { class: "actions" });
  actions.append(el("button", { type: "button", class: "small copy", text: "Copy",
    onclick: (e) => copy(copyText(m), e.target) }));
  if (index === chat.messages.length - 1) {
    actions.append(el("button", { type: "button", class: "small regenerate", text: "Regenerate",
      onclick: regenerate }));
  }
  node.append(actions);
  return node;
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

// A reasoning model's reasoning (`reasoning_content`): open while it streams, folded once
// the answer has begun.
function reasoningView(m) {
  const view = el("details", { class: "reasoning" },
    el("summary", { text: "Reasoning" }), el("div", { class: "reasoning-text", text: m.reasoning }));
  view.open = m.state === "streaming" && !m.content;
  return view;
}

function updateReply(reply) {
  const nodes = $("messages").querySelectorAll(".msg.assistant");
  const node = nodes[nodes.length - 1];
  if (node) {
    if (reply.reasoning) {
      const shown = node.querySelector(".reasoning");
      if (shown) {
        shown.querySelector(".reasoning-text").textContent = reply.reasoning;
        if (reply.content) shown.open = false;
      } else {
        node.querySelector(".content").before(reasoningView(reply));
      }
    }
    node.querySelector(".content").textContent = reply.content;
    const calls = node.querySelector(".calls");
    if (calls) calls.replaceWith(callsView(reply.tool_calls));
    else if (reply.tool_calls.length) node.append(callsView(reply.tool_calls));
  }
  scrollDown();
}

function scrollDown() {
  const box = $("messages");
  box.scrollTop = box.scrollHeight;
}

export function render() {
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
