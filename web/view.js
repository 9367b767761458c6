// Drawing the turns: each question and its reply, the reply's footer (figures, Retry,
// Regenerate), the stats panel and the composer's buttons.
//
// Replies are re-rendered as Markdown at most once per animation frame while they stream, with
// each token kept as a <span> (see markdown.js), so the provenance tint works on streaming and
// finished replies alike.

import { nearBottom, node, scrollToBottom, ui } from "./dom.js";
import { render } from "./markdown.js";
import { renderPositions, renderStrip, summary } from "./specview.js";
import { conn, lastTurn, state } from "./state.js";
import { format } from "./stats.js";

/** What a turn's buttons do: the replies and the composer own those, so app.js hands them in. */
let actions = null;

/** @param {{retry: (turn: object) => void, edit: (turn: object) => void}} handlers */
export function setTurnActions(handlers) {
  actions = handlers;
}

export function addTurnElements(turn) {
  ui.empty.hidden = true;
  const user = node("div", "msg user");
  const head = user.appendChild(node("div", "role", "You"));
  const edit = head.appendChild(node("button", "icon edit", "Edit"));
  edit.type = "button";
  edit.dataset.testid = "edit-message";
  edit.setAttribute("aria-label", "Edit this question and send it again");
  edit.addEventListener("click", () => actions.edit(turn));
  const bubble = user.appendChild(node("div", "bubble", turn.user));

  const bot = node("article", "msg assistant");
  bot.dataset.testid = "assistant-message";
  bot.setAttribute("aria-label", "Assistant reply");
  bot.appendChild(node("div", "role", "streamsd"));
  const body = bot.appendChild(node("div", "md"));
  const foot = bot.appendChild(node("div", "foot"));
  ui.log.append(user, bot);
  turn.el = { user, bubble, edit, bot, body, foot };
}

let renderQueued = false;
let renderCost = 0;
let renderedAt = 0;
export function scheduleRender() {
  if (renderQueued) return;
  renderQueued = true;
  // A long reply costs more to re-render; spacing renders by a few times their cost keeps
  // rendering under a quarter of the main thread however long the reply grows.
  const wait = Math.max(0, renderedAt + 3 * renderCost - performance.now());
  setTimeout(() => {
    requestAnimationFrame(() => {
      renderQueued = false;
      const t0 = performance.now();
      if (state.active) renderReply(state.active);
      renderStats();
      renderedAt = performance.now();
      renderCost = renderedAt - t0;
    });
  }, wait);
}

export function renderReply(turn) {
  const stick = nearBottom();
  const { bot, body } = turn.el;
  bot.dataset.status = turn.status;
  bot.setAttribute("aria-busy", String(turn.status === "streaming" || turn.status === "stopping"));
  if (turn.text) {
    body.replaceChildren(render(turn.text, { segments: turn.segments }));
  } else if (turn.status === "streaming") {
    body.replaceChildren(typingDots());
  } else {
    body.replaceChildren();
  }
  if (stick) scrollToBottom();
}

function typingDots() {
  const dots = node("span", "typing");
  dots.setAttribute("aria-label", "Waiting for the first token");
  for (let i = 0; i < 3; i++) dots.appendChild(node("span"));
  return dots;
}

export function renderFooter(turn) {
  const { foot } = turn.el;
  foot.replaceChildren();
  if (turn.status === "failed") {
    const err = foot.appendChild(node("span", "error"));
    err.setAttribute("role", "alert");
    err.textContent = turn.error || "The reply failed.";
    if (turn === lastTurn()) {
      const retry = foot.appendChild(node("button", "btn small", "Retry"));
      retry.type = "button";
      retry.dataset.action = "retry";
      retry.disabled = !conn.isOpen;
      retry.addEventListener("click", () => actions.retry(turn));
    }
    return;
  }
  if (turn.status !== "done" || !turn.stats) return;
  const s = turn.stats.snapshot();
  const bits = [`${s.tokens} tokens`];
  if (s.tps !== null) bits.push(`${format.tps(s.tps)} tok/s`);
  if (s.acceptance !== null) bits.push(`${format.percent(s.acceptance)} accepted`);
  if (s.meanAccepted !== null) bits.push(`${format.ratio(s.meanAccepted)} tokens/step`);
  foot.appendChild(node("span", "figures", bits.join(" · ")));
  if (turn.finish === "cancelled") foot.appendChild(node("span", "badge", "stopped"));
  if (turn.finish === "length") foot.appendChild(node("span", "badge", "max tokens reached"));
  if (turn.finish === "abort") foot.appendChild(node("span", "badge", "cut short: the server shut down"));
  if (turn === lastTurn()) {
    const again = foot.appendChild(node("button", "btn small", "Regenerate"));
    again.type = "button";
    again.dataset.testid = "regenerate";
    again.disabled = !conn.isOpen || state.active !== null;
    again.addEventListener("click", () => actions.retry(turn));
  }
}

export function renderStats() {
  const set = (key, text) => {
    const cell = document.querySelector(`[data-stat="${key}"]`);
    if (cell.textContent !== text) cell.textContent = text;
  };
  const r = state.lastReply ? state.lastReply.snapshot() : null;
  const s = state.session.snapshot();
  set("reply-tps", format.tps(r && r.tps));
  set("reply-ttft", format.seconds(r && r.ttft));
  set("reply-acceptance", format.percent(r && r.acceptance));
  set("reply-mean", format.ratio(r && r.meanAccepted));
  set("reply-share", format.percent(r && r.draftShare));
  set("reply-tokens", format.count(r && r.tokens));
  set("session-tps", format.tps(s.tps));
  set("session-ttft", format.seconds(s.ttft));
  set("session-acceptance", format.percent(s.acceptance));
  set("session-mean", format.ratio(s.meanAccepted));
  set("session-share", format.percent(s.draftShare));
  set("session-tokens", format.count(s.replies ? s.tokens : null));
  set("session-replies", String(s.replies));
  ui.statsNote.hidden = !(r && r.live);
  renderPositions(ui.specChart, state.lastTrace, state.sessionTrace);
  renderStrip(ui.specStrip, state.lastTrace ? state.lastTrace.steps : [], "This reply");
  renderStrip(ui.specSession, state.sessionTrace.steps, "Session");
  ui.specSummary.textContent = summary(state.lastTrace);
}

export function updateControls() {
  const busy = state.active !== null;
  ui.send.hidden = busy;
  ui.stop.hidden = !busy;
  ui.stop.disabled = busy && state.active.status === "stopping";
  for (const b of document.querySelectorAll("[data-testid=regenerate]")) b.disabled = busy || !conn.isOpen;
  for (const t of state.turns) if (t.el) t.el.edit.disabled = busy;
  ui.send.disabled = !conn.isOpen;
  ui.send.title = conn.isOpen ? "" : "Waiting for the connection";
}
