// Small helpers every part of the page shares: element lookup and building, figure
// formatting, and the browser-storage keys the page keeps its state under.

export const STORE = { chats: "specd.chats", current: "specd.current", settings: "specd.settings", key: "specd.apiKey" };
export const $ = (id) => document.getElementById(id);

export function load(key, fallback) {
  try {
    const raw = localStorage.getItem(key);
    return raw === null ? fallback : JSON.parse(raw);
  } catch {
    return fallback;
  }
}

export function el(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  for (const [name, value] of Object.entries(attrs)) {
    if (name === "text") node.textContent = value;
    else if (name.startsWith("on")) node.addEventListener(name.slice(2), value);
    else node.setAttribute(name, value);
  }
  for (const child of children) if (child) node.append(child);
  return node;
}

export function fmt(value, digits = 2) {
  return typeof value === "number" ? value.toFixed(digits) : "–";
}
