// The composer: the message box (Enter sends, Shift+Enter breaks the line, Escape stops a
// streaming reply), the Send and Stop buttons, and editing an earlier question in place.

import { scrollToBottom, ui } from "./dom.js";
import { openEditor } from "./editor.js";
import { startReply, stopReply } from "./generation.js";
import { conn, lastTurn, state } from "./state.js";
import * as store from "./store.js";
import { addTurnElements, renderFooter } from "./view.js";

function sendMessage() {
  const text = ui.prompt.value.trim();
  if (!text || state.active || !conn.isOpen) return;
  const turn = { user: text, text: "", segments: [], status: "idle", id: null, error: null, finish: null, stats: null, spec: null };
  if (!state.conv) state.conv = { id: store.newId(), title: text.split("\n")[0].slice(0, 80), created: Date.now() };
  const previous = lastTurn();
  state.turns.push(turn);
  addTurnElements(turn);
  if (previous) renderFooter(previous); // its Regenerate goes: only the last reply has one
  ui.prompt.value = "";
  autosize();
  startReply(turn);
  scrollToBottom();
}

/** Edit an earlier question in place; sending it replaces every later turn. */
export function editTurn(turn) {
  if (state.active || !turn.el) return;
  openEditor(turn.el.user, turn.el.bubble, turn.user, {
    send: (text) => {
      if (state.active || !conn.isOpen) return false;
      for (const later of state.turns.splice(state.turns.indexOf(turn) + 1)) {
        later.el.user.remove();
        later.el.bot.remove();
      }
      turn.user = text;
      turn.el.bubble.textContent = text;
      startReply(turn);
      ui.prompt.focus();
      return true;
    },
    cancel: () => turn.el.edit.focus(),
  });
}

function autosize() {
  const p = ui.prompt;
  p.style.height = "auto";
  p.style.height = `${Math.min(p.scrollHeight, 240)}px`;
}

export function initComposer() {
  ui.composer.addEventListener("submit", (e) => {
    e.preventDefault();
    sendMessage();
  });
  ui.prompt.addEventListener("keydown", (e) => {
    if (e.key === "Enter" && !e.shiftKey && !e.isComposing) {
      e.preventDefault();
      sendMessage();
    } else if (e.key === "Escape" && state.active) {
      e.preventDefault();
      stopReply();
    }
  });
  ui.prompt.addEventListener("input", autosize);
  // Escape stops a streaming reply wherever the focus is (the dialogs and editors handle their own).
  document.addEventListener("keydown", (e) => {
    if (e.key === "Escape" && state.active && !e.defaultPrevented) stopReply();
  });
  ui.stop.addEventListener("click", stopReply);
}
