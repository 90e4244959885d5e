// The daemon's API as the page calls it: the key (kept in localStorage, asked for in a
// dialog on a 401, then the failed call is retried), JSON errors, and SSE bodies.
import { $, STORE } from "./page.js";

let pendingAfterKey = null; // what to retry once the API key is saved

export function headers() {
  const h = { "Content-Type": "application/json" };
  const key = localStorage.getItem(STORE.key);
  if (key) h.Authorization = `Bearer ${key}`;
  return h;
}

export class ApiError extends Error {
  constructor(status, error) {
    super((error && error.message) || `HTTP ${status}`);
    this.status = status;
    this.code = error && error.code;
    this.param = error && error.param;
  }
}

export async function errorOf(response) {
  try {
    return new ApiError(response.status, (await response.json()).error);
  } catch {
    return new ApiError(response.status, null);
  }
}

export function askForKey(retry) {
  pendingAfterKey = retry;
  const dialog = $("key-dialog");
  if (!dialog.open) dialog.showModal();
  $("key-input").focus();
}

// The key dialog's form: stores the key, retries what asked for it, then calls afterSave.
export function wireKeyDialog(afterSave) {
  $("key-form").addEventListener("submit", () => {
    const key = $("key-input").value.trim();
    if (!key) return;
    localStorage.setItem(STORE.key, key);
    $("key-input").value = "";
    const retry = pendingAfterKey;
    pendingAfterKey = null;
    if (retry) retry();
    afterSave();
  });
}

export async function getJson(path) {
  const response = await fetch(path, { headers: headers() });
  if (!response.ok) throw await errorOf(response);
  return response.json();
}

// Reads an SSE body: calls onEvent with each `data:` payload parsed as JSON.
export async function readEvents(response, onEvent) {
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
