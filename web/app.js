// The chat page: conversation state, the composer, settings, stats and the socket.
//
// One reply streams at a time. Each turn sends the whole conversation (`messages`), so the
// server stays stateless between turns. Replies are re-rendered as Markdown at most once per
// animation frame while they stream, with each token kept as a <span> (see markdown.js), so
// the provenance tint works on streaming and finished replies alike.

// First: it moves a `?api_key=` out of the address bar before anything else runs.
import { authHeaders, getKey, setKey, socketProtocols } from "./auth.js";
import { render } from "./markdown.js";
import { Connection, socketUrl } from "./socket.js";
import { renderLegend } from "./speculation.js";
import { format, ReplyStats, SessionStats } from "./stats.js";

const $ = (id) => document.getElementById(id);
const ui = {
  log: $("log"),
  empty: $("empty"),
  prompt: $("prompt"),
  composer: $("composer"),
  send: $("send"),
  stop: $("stop"),
  newChat: $("new-chat"),
  provenance: $("provenance"),
  panelToggle: $("panel-toggle"),
  sidebar: $("sidebar"),
  conn: $("conn"),
  connText: $("conn-text"),
  banner: $("banner"),
  bannerText: $("banner-text"),
  bannerAction: $("banner-action"),
  settings: $("settings-form"),
  modelName: $("model-name"),
  legend: $("legend"),
  announce: $("announce"),
  statsNote: $("stats-note"),
  keyDialog: $("key-dialog"),
  keyForm: $("key-form"),
  keyInput: $("key-input"),
  keyError: $("key-error"),
};

const SETTINGS_KEY = "streamsd.settings";
const PROVENANCE_KEY = "streamsd.provenance";
const CANCEL_GRACE_MS = 5000;

/** @typedef {{user: string, text: string, segments: object[], status: string, id: string|null,
 *   error: string|null, finish: string|null, stats: ReplyStats|null, el: object}} Turn */
const state = {
  /** @type {Turn[]} */
  turns: [],
  /** @type {Turn|null} the turn whose reply is streaming */
  active: null,
  session: new SessionStats(), // since the page loaded; "New chat" keeps it
  lastReply: null,
  nextId: 1,
};

const conn = new Connection(socketUrl(), { protocols: socketProtocols });

// ---------------------------------------------------------------------------------------
// Settings (kept in localStorage so a reload keeps them).

function readSettings() {
  const f = ui.settings.elements;
  const num = (input, lo, hi, fallback) => {
    const v = Number(input.value);
    return Number.isFinite(v) && input.value !== "" ? Math.min(hi, Math.max(lo, v)) : fallback;
  };
  return {
    temperature: num(f.temperature, 0, 2, 0.7),
    top_p: num(f.top_p, 0.01, 1, 1),
    max_tokens: Math.round(num(f.max_tokens, 1, Number(f.max_tokens.max) || 1e6, 512)),
    spec_enabled: f.spec_enabled.checked,
    spec_k: Math.round(num(f.spec_k, 1, 16, 4)),
  };
}

function loadSettings() {
  let saved = {};
  try {
    saved = JSON.parse(localStorage.getItem(SETTINGS_KEY) || "{}") || {};
  } catch {
    saved = {};
  }
  const f = ui.settings.elements;
  for (const key of ["temperature", "top_p", "max_tokens", "spec_k"]) {
    if (typeof saved[key] === "number") f[key].value = String(saved[key]);
  }
  if (typeof saved.spec_enabled === "boolean") f.spec_enabled.checked = saved.spec_enabled;
  f.spec_k.disabled = !f.spec_enabled.checked;
}

function saveSettings() {
  const s = readSettings();
  ui.settings.elements.spec_k.disabled = !s.spec_enabled;
  try {
    localStorage.setItem(SETTINGS_KEY, JSON.stringify(s));
  } catch {
    // Private mode or storage full: settings just won't survive a reload.
  }
}

// ---------------------------------------------------------------------------------------
// Rendering of turns.

function node(tag, className, text) {
  const e = document.createElement(tag);
  if (className) e.className = className;
  if (text !== undefined) e.textContent = text;
  return e;
}

function addTurnElements(turn) {
  ui.empty.hidden = true;
  const user = node("div", "msg user");
  user.appendChild(node("div", "role", "You"));
  user.appendChild(node("div", "bubble", turn.user));

  const bot = node("article", "msg assistant");
  bot.dataset.testid = "assistant-message";
  bot.setAttribute("aria-label", "Assistant reply");
  bot.appendChild(node("div", "role", "streamsd"));
  const body = bot.appendChild(node("div", "md"));
  const foot = bot.appendChild(node("div", "foot"));
  ui.log.append(user, bot);
  turn.el = { user, bot, body, foot };
}

let renderQueued = false;
let renderCost = 0;
let renderedAt = 0;
function scheduleRender() {
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

function renderReply(turn) {
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

function renderFooter(turn) {
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
      retry.addEventListener("click", () => retryTurn(turn));
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
}

function renderStats() {
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
}

function nearBottom() {
  const log = ui.log;
  return log.scrollHeight - log.scrollTop - log.clientHeight < 80;
}

function scrollToBottom() {
  ui.log.scrollTop = ui.log.scrollHeight;
}

function announce(text) {
  // Re-setting the same text would not be announced again; clear first.
  ui.announce.textContent = "";
  requestAnimationFrame(() => {
    ui.announce.textContent = text;
  });
}

// ---------------------------------------------------------------------------------------
// Conversation.

const lastTurn = () => state.turns[state.turns.length - 1] || null;

/** The messages to send for `turn`: every earlier turn that produced a reply, then its own. */
function historyFor(turn) {
  const messages = [];
  for (const t of state.turns) {
    if (t === turn) break;
    // Failed turns are left out so the roles keep alternating; a stopped reply still counts.
    if (t.status !== "done" || !t.text) continue;
    messages.push({ role: "user", content: t.user }, { role: "assistant", content: t.text });
  }
  messages.push({ role: "user", content: turn.user });
  return messages;
}

function sendMessage() {
  const text = ui.prompt.value.trim();
  if (!text || state.active || !conn.isOpen) return;
  const turn = { user: text, text: "", segments: [], status: "idle", id: null, error: null, finish: null, stats: null };
  state.turns.push(turn);
  addTurnElements(turn);
  ui.prompt.value = "";
  autosize();
  startReply(turn);
  scrollToBottom();
}

function startReply(turn) {
  const s = readSettings();
  turn.id = `r${state.nextId++}-${Date.now().toString(36)}`;
  turn.text = "";
  turn.segments = [];
  turn.status = "streaming";
  turn.error = null;
  turn.finish = null;
  turn.stats = new ReplyStats();
  state.active = turn;
  state.lastReply = turn.stats;
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

function retryTurn(turn) {
  if (state.active || turn !== lastTurn() || !conn.isOpen) return;
  startReply(turn);
}

function stopReply() {
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

function failTurn(turn, message) {
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
}

function newChat() {
  if (state.active) {
    conn.send({ type: "cancel", id: state.active.id });
    state.active = null;
  }
  state.turns = [];
  state.lastReply = null;
  ui.log.replaceChildren(ui.empty);
  ui.empty.hidden = false;
  renderStats();
  updateControls();
  ui.prompt.focus();
}

// ---------------------------------------------------------------------------------------
// Server frames.

function handleFrame(frame) {
  if (!frame || typeof frame !== "object") return;
  const turn = state.active && frame.id === state.active.id ? state.active : null;
  switch (frame.type) {
    case "delta":
      if (turn) onDelta(turn, frame);
      break;
    case "done":
      if (turn) {
        turn.stats.onDone(frame);
        state.session.add(turn.stats);
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
  scheduleRender();
}

// ---------------------------------------------------------------------------------------
// Connection state.

function showBanner(text, action) {
  ui.bannerText.textContent = text;
  ui.banner.hidden = false;
  ui.bannerAction.hidden = !action;
  if (action) {
    ui.bannerAction.textContent = action.label;
    ui.bannerAction.onclick = action.run;
  }
}

function hideBanner() {
  ui.banner.hidden = true;
}

let countdown = null;
function onStatus({ state: s, retryIn, everOpened }) {
  clearInterval(countdown);
  ui.conn.dataset.state = s;
  if (s === "open") {
    ui.connText.textContent = "Connected";
    hideBanner();
    loadServerInfo();
  } else if (s === "connecting") {
    ui.connText.textContent = "Connecting…";
  } else {
    ui.connText.textContent = "Disconnected";
    const what = everOpened ? "Connection to the server lost." : "Cannot connect to the server.";
    const until = Date.now() + retryIn;
    const tick = () => {
      const left = Math.max(0, Math.ceil((until - Date.now()) / 1000));
      showBanner(`${what} Reconnecting in ${left} s…`, { label: "Reconnect now", run: () => conn.reconnectNow() });
    };
    tick();
    countdown = setInterval(tick, 1000);
  }
  updateControls();
  // Retry buttons follow the connection.
  const last = lastTurn();
  if (last && last.status === "failed") renderFooter(last);
}

function onLost() {
  if (state.active) failTurn(state.active, "Connection to the server was lost during this reply.");
  announce("Connection to the server lost.");
  // A refused key looks like any failed handshake to a page: the HTTP API says which it was.
  if (!conn.stopped) loadServerInfo().then((access) => access === "denied" && askForKey());
}

// ---------------------------------------------------------------------------------------
// The API key (see auth.js): asked for in a modal dialog when the server refuses the one held.

/** Stop connecting and ask; `refused` when there was a key and the server turned it down. */
function askForKey() {
  const refused = Boolean(getKey());
  conn.stop();
  clearInterval(countdown);
  ui.conn.dataset.state = "closed";
  ui.connText.textContent = "API key needed";
  showBanner("This server needs an API key.", { label: "Enter API key", run: askForKey });
  updateControls();
  ui.keyError.hidden = !refused;
  ui.keyInput.setAttribute("aria-invalid", String(refused));
  ui.keyInput.value = "";
  if (!ui.keyDialog.open) ui.keyDialog.showModal();
  ui.keyInput.focus();
}

async function submitKey(e) {
  e.preventDefault();
  const key = ui.keyInput.value.trim();
  if (!key) {
    ui.keyInput.focus();
    return;
  }
  setKey(key);
  ui.keyInput.value = "";
  ui.keyDialog.close();
  await connectIfAllowed();
}

/** Open the socket unless the server refuses this page's key (then ask for one). */
async function connectIfAllowed() {
  if ((await loadServerInfo()) === "denied") {
    askForKey();
    return;
  }
  hideBanner();
  conn.start();
  ui.prompt.focus();
}

function updateControls() {
  const busy = state.active !== null;
  ui.send.hidden = busy;
  ui.stop.hidden = !busy;
  ui.stop.disabled = busy && state.active.status === "stopping";
  ui.send.disabled = !conn.isOpen;
  ui.send.title = conn.isOpen ? "" : "Waiting for the connection";
}

// ---------------------------------------------------------------------------------------
// Wiring.

function autosize() {
  const p = ui.prompt;
  p.style.height = "auto";
  p.style.height = `${Math.min(p.scrollHeight, 240)}px`;
}

function setProvenance(on) {
  document.body.classList.toggle("show-provenance", on);
  ui.provenance.setAttribute("aria-checked", String(on));
  try {
    localStorage.setItem(PROVENANCE_KEY, on ? "1" : "0");
  } catch {
    // not persisted; fine
  }
}

const LOADING_RETRY_MS = 2000;
let serverInfoRetry = null;

/** What the server serves: the model's name, its context length, how it speculates. Asked on
 *  every (re)connect, since a restarted server may serve something else. Resolves to "denied"
 *  when the server refuses this page's API key (or wants one), else to "ok" or "unknown". */
async function loadServerInfo() {
  clearTimeout(serverInfoRetry);
  try {
    const res = await fetch(new URL("v1/models", location.href), { headers: authHeaders() });
    if (res.status === 401 || res.status === 403) return "denied";
    if (!res.ok) return "unknown";
    const model = (await res.json()).data?.[0];
    if (!model) return "ok";
    ui.modelName.textContent = model.id;
    document.title = `${model.id} · streamsd`;
    if (Number.isInteger(model.max_model_len)) ui.settings.elements.max_tokens.max = String(model.max_model_len);
    if (model.speculation) renderLegend(ui.legend, model.speculation);
    // null while the model loads: ask again until it is known.
    else if (model.speculation === null && conn.isOpen) serverInfoRetry = setTimeout(loadServerInfo, LOADING_RETRY_MS);
    return "ok";
  } catch {
    // The name is decoration; the socket status already tells whether the server is there.
    return "unknown";
  }
}

function init() {
  loadSettings();
  ui.settings.addEventListener("input", saveSettings);
  ui.settings.addEventListener("change", saveSettings);
  ui.settings.addEventListener("submit", (e) => e.preventDefault());

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
  ui.stop.addEventListener("click", stopReply);
  ui.newChat.addEventListener("click", newChat);
  ui.provenance.addEventListener("click", () => setProvenance(!document.body.classList.contains("show-provenance")));
  const setPanel = (open) => {
    ui.sidebar.classList.toggle("open", open);
    ui.panelToggle.setAttribute("aria-expanded", String(open));
  };
  ui.panelToggle.addEventListener("click", () => setPanel(!ui.sidebar.classList.contains("open")));
  ui.sidebar.addEventListener("keydown", (e) => {
    if (e.key === "Escape" && ui.sidebar.classList.contains("open")) {
      setPanel(false);
      ui.panelToggle.focus();
    }
  });

  let provenance = false;
  try {
    provenance = localStorage.getItem(PROVENANCE_KEY) === "1";
  } catch {
    // storage blocked: start with the tint off
  }
  setProvenance(provenance);
  conn.addEventListener("status", (e) => onStatus(e.detail));
  conn.addEventListener("frame", (e) => handleFrame(e.detail));
  conn.addEventListener("lost", onLost);
  conn.addEventListener("bad", () => showBanner("The server sent a frame that is not JSON; it was ignored.", null));
  ui.keyForm.addEventListener("submit", submitKey);
  renderStats();
  updateControls();
  ui.prompt.focus();
  connectIfAllowed();
}

init();
