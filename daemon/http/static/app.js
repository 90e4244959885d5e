// specd's web chat, the entry module: wires the page's buttons, keys and forms to the
// conversations (chat.js), the machine panel (machine.js) and the key dialog (api.js).
// Plain DOM and ES modules, no framework, nothing fetched from anywhere but this daemon.
import { wireKeyDialog } from "./api.js";
import {
  current, deleteChat, dropOldestTurn, hideNotice, newChat, renameChat, render, restoreSettings,
  send, state, stop,
} from "./chat.js";
import { refreshMachine } from "./machine.js";
import { $ } from "./page.js";

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
  wireKeyDialog(refreshMachine);
  refreshMachine();
}

init();
