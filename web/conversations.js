// Saved conversations (store.js): a conversation is saved when a reply ends and listed newest
// first in the history sidebar (history.js), from where it reopens with its turns, figures,
// system prompt and settings. "New chat" clears the screen for the next one.

import { announce, scrollToBottom, showBanner, ui } from "./dom.js";
import * as chats from "./history.js";
import { applySettings, readSettings } from "./settings.js";
import { SpecTrace } from "./specview.js";
import { conn, lastTurn, state } from "./state.js";
import { ReplyStats } from "./stats.js";
import * as store from "./store.js";
import { addTurnElements, renderFooter, renderReply, renderStats, updateControls } from "./view.js";

function newChat() {
  if (state.active) {
    conn.send({ type: "cancel", id: state.active.id });
    state.active = null;
  }
  state.turns = [];
  state.lastReply = null;
  state.lastTrace = null;
  state.conv = null;
  ui.system.value = "";
  ui.log.replaceChildren(ui.empty);
  ui.empty.hidden = false;
  renderStats();
  updateControls();
  refreshList();
  ui.prompt.focus();
}

/** The conversation on screen as the store keeps it. */
function conversationRecord() {
  const c = state.conv;
  return {
    id: c.id,
    title: c.title,
    created: c.created,
    updated: Date.now(),
    system: ui.system.value,
    settings: readSettings(),
    turns: state.turns.map((t) => ({
      user: t.user,
      text: t.text,
      segments: t.segments,
      status: t.status === "failed" ? "failed" : "done",
      error: t.error,
      finish: t.finish,
      stats: t.stats ? t.stats.toJSON() : null,
      spec: t.spec ? t.spec.toJSON() : null,
    })),
  };
}

export async function saveConversation() {
  if (!state.conv || !state.turns.length) return;
  try {
    await store.put(conversationRecord());
  } catch (err) {
    showBanner(`This conversation could not be saved: ${err && err.message ? err.message : err}`, null);
  }
  await refreshList();
}

export async function refreshList() {
  let items = [];
  try {
    items = await store.list();
  } catch {
    items = []; // no IndexedDB (a private window in some browsers): nothing is kept
  }
  ui.historyEmpty.hidden = items.length > 0;
  chats.renderList(ui.conversations, items, state.conv && state.conv.id, {
    open: openConversation,
    rename: renameConversation,
    remove: removeConversation,
  });
}

async function openConversation(id) {
  if (state.active) return;
  const c = await store.get(id);
  if (!c) return refreshList();
  newChat();
  state.conv = { id: c.id, title: c.title, created: c.created };
  ui.system.value = c.system || "";
  if (c.settings) applySettings(c.settings);
  for (const saved of c.turns) {
    const turn = { ...saved, id: null, stats: saved.stats ? ReplyStats.restore(saved.stats) : null,
      spec: saved.spec ? new SpecTrace(saved.spec) : null, segments: saved.segments || [] };
    state.turns.push(turn);
    addTurnElements(turn);
    renderReply(turn);
  }
  for (const t of state.turns) renderFooter(t);
  const last = lastTurn();
  state.lastReply = last ? last.stats : null;
  state.lastTrace = last ? last.spec : null;
  renderStats();
  updateControls();
  await refreshList();
  setHistory(false);
  scrollToBottom();
  ui.prompt.focus();
  announce(`Opened “${c.title}”.`);
}

async function renameConversation(id, title) {
  const c = await store.get(id);
  if (c && c.title !== title) {
    c.title = title;
    await store.put(c);
  }
  if (state.conv && state.conv.id === id) state.conv.title = title;
  await refreshList();
  ui.conversations.querySelector(`[data-focus-key="${CSS.escape(`rename:${id}`)}"]`)?.focus();
}

async function removeConversation(id) {
  await store.remove(id);
  if (state.conv && state.conv.id === id) newChat();
  await refreshList();
  announce("Conversation deleted.");
  ui.prompt.focus();
}

function setHistory(open) {
  ui.history.classList.toggle("open", open);
  ui.historyToggle.setAttribute("aria-expanded", String(open));
}

/** The history sidebar's controls: open and close it, export and import, and the system prompt,
 *  which belongs to the conversation. */
export function initConversations() {
  ui.newChat.addEventListener("click", newChat);
  ui.historyToggle.addEventListener("click", () => {
    const open = !ui.history.classList.contains("open");
    setHistory(open);
    if (open) (ui.conversations.querySelector("button") || ui.exportChats).focus();
  });
  ui.history.addEventListener("keydown", (e) => {
    if (e.key === "Escape" && ui.history.classList.contains("open")) {
      setHistory(false);
      ui.historyToggle.focus();
    }
  });
  ui.exportChats.addEventListener("click", () => chats.download());
  ui.importChats.addEventListener("change", async () => {
    try {
      const n = await chats.upload(ui.importChats);
      announce(`Imported ${n} conversation${n === 1 ? "" : "s"}.`);
    } catch (err) {
      showBanner(`Import failed: ${err && err.message ? err.message : err}`, null);
    }
    await refreshList();
  });
  // The system prompt belongs to the conversation: keep it with it as it is typed.
  ui.system.addEventListener("change", saveConversation);
}
