// A reply's life: the request frame for a turn, the streamed deltas (each token's characters
// remembered for the provenance tint), stopping, and the end (done or failed).
//
// One reply streams at a time. Each turn sends the whole conversation (`messages`), so the
// server stays stateless between turns.

import { saveConversation } from "./conversations.js";
import { announce, nearBottom, scrollToBottom, showBanner, ui } from "./dom.js";
import { readSettings } from "./settings.js";
import { SpecTrace } from "./specview.js";
import { conn, lastTurn, state } from "./state.js";
import { ReplyStats } from "./stats.js";
import { renderFooter, renderReply, renderStats, scheduleRender, updateControls } from "./view.js";

const CANCEL_GRACE_MS = 5000;

/** The messages to send for `turn`: every earlier turn that produced a reply, then its own. */
function historyFor(turn) {
  const messages = [];
  const system = ui.system.value.trim();
  if (system) messages.push({ role: "system", content: system });
  for (const t of state.turns) {
    if (t === turn) break;
    // Failed turns are left out so the roles keep alternating; a stopped reply still counts.
    if (t.status !== "done" || !t.text) continue;
    messages.push({ role: "user", content: t.user }, { role: "assistant", content: t.text });
  }
  messages.push({ role: "user", content: turn.user });
  return messages;
}

export function startReply(turn) {
  const s = readSettings();
  turn.id = `r${state.nextId++}-${Date.now().toString(36)}`;
  turn.text = "";
  turn.segments = [];
  turn.status = "streaming";
  turn.error = null;
  turn.finish = null;
  turn.stats = new ReplyStats();
  turn.spec = new SpecTrace();
  state.active = turn;
  state.lastReply = turn.stats;
  state.lastTrace = turn.spec;
  const frame = {
    type: "generate",
    id: turn.id,
    messages: historyFor(turn),
    max_tokens: s.max_tokens,
    temperature: s.temperature,
    top_p: s.top_p,
    speculative: s.spec_enabled ? { enabled: true, num_tokens: s.spec_k } : { enabled: false },
  };
  renderFooter(turn);
  renderReply(turn);
  updateControls();
  if (!conn.send(frame)) {
    failTurn(turn, "Not connected to the server.");
    return;
  }
  announce("streamsd is replying.");
  renderStats();
}

export function retryTurn(turn) {
  if (state.active || turn !== lastTurn() || !conn.isOpen) return;
  startReply(turn);
}

export function stopReply() {
  const turn = state.active;
  if (!turn || turn.status !== "streaming") return;
  turn.status = "stopping";
  updateControls();
  if (!conn.send({ type: "cancel", id: turn.id })) {
    finishTurn(turn, "cancelled");
    return;
  }
  // The server answers a cancel with `done`; if that never comes, stop waiting anyway.
  const id = turn.id;
  setTimeout(() => {
    if (state.active === turn && turn.id === id) finishTurn(turn, "cancelled");
  }, CANCEL_GRACE_MS);
}

/** The stop button disappears when a reply ends; keep keyboard users in the message box. */
function keepFocus() {
  const a = document.activeElement;
  if (!a || a === document.body || a === ui.stop) ui.prompt.focus();
}

function finishTurn(turn, finish) {
  turn.finish = finish;
  const said = { cancelled: "Reply stopped.", abort: "Reply cut short: the server shut down." };
  endTurn(turn, "done", said[finish] || "Reply finished.");
}

export function failTurn(turn, message) {
  turn.error = message;
  endTurn(turn, "failed", `Reply failed: ${message}`);
}

/** A reply is over (done or failed): redraw it, free the composer, tell screen readers. */
function endTurn(turn, status, announcement) {
  const stick = nearBottom();
  turn.status = status;
  if (state.active === turn) state.active = null;
  renderReply(turn);
  renderFooter(turn);
  if (stick) scrollToBottom();
  renderStats();
  updateControls();
  keepFocus();
  announce(announcement);
  saveConversation();
}

// ---------------------------------------------------------------------------------------
// Server frames.

export function handleFrame(frame) {
  if (!frame || typeof frame !== "object") return;
  const turn = state.active && frame.id === state.active.id ? state.active : null;
  switch (frame.type) {
    case "delta":
      if (turn) onDelta(turn, frame);
      break;
    case "done":
      if (turn) {
        turn.stats.onDone(frame);
        turn.spec.onDone(frame);
        state.session.add(turn.stats);
        state.sessionTrace.add(turn.spec);
        finishTurn(turn, frame.finish_reason || "stop");
      }
      break;
    case "error": {
      const err = frame.error || {};
      const message = err.message || "The server reported an error.";
      if (turn) failTurn(turn, message);
      else if (frame.id === null || frame.id === undefined) showBanner(`Server error: ${message}`, null);
      break;
    }
    default:
      break; // unknown frame types are ignored so newer servers keep working
  }
}

/** Append a delta's text, remembering which characters each token covers. */
function onDelta(turn, frame) {
  const tokens = Array.isArray(frame.tokens) ? frame.tokens : [];
  const joined = tokens.map((t) => t.text || "").join("");
  const text = typeof frame.text === "string" ? frame.text : joined;
  let pos = turn.text.length;
  if (joined === text) {
    for (const t of tokens) {
      const len = (t.text || "").length;
      if (len) turn.segments.push({ start: pos, end: pos + len, draft: t.draft === true, id: t.id });
      pos += len;
    }
  } else if (text) {
    // Token texts that do not add up to the delta (e.g. a multi-byte character split across
    // tokens) are kept as one run: the text stays exact, the tint goes to the whole run.
    turn.segments.push({ start: pos, end: pos + text.length, draft: tokens.length > 0 && tokens.every((t) => t.draft) });
  }
  turn.text += text;
  turn.stats.onDelta(tokens);
  turn.spec.onDelta(frame, tokens.length);
  scheduleRender();
}
