// The connection: its status line and banner, what the server serves (the model's name, its
// context length, how it speculates), and the API key (see auth.js), asked for in a modal
// dialog when the server refuses the one held.

import { authHeaders, getKey, setKey } from "./auth.js";
import { announce, hideBanner, showBanner, ui } from "./dom.js";
import { failTurn, handleFrame } from "./generation.js";
import { proposerName, renderClaim, renderLegend } from "./speculation.js";
import { conn, lastTurn, state } from "./state.js";
import { renderFooter, updateControls } from "./view.js";

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
export async function connectIfAllowed() {
  if ((await loadServerInfo()) === "denied") {
    askForKey();
    return;
  }
  hideBanner();
  conn.start();
  ui.prompt.focus();
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
    if (model.speculation) {
      renderLegend(ui.legend, model.speculation);
      renderClaim(ui.claim, model.speculation);
      ui.specProposer.textContent = proposerName(model.speculation) || "none (speculation is off)";
    }
    // null while the model loads: ask again until it is known.
    else if (model.speculation === null && conn.isOpen) serverInfoRetry = setTimeout(loadServerInfo, LOADING_RETRY_MS);
    return "ok";
  } catch {
    // The name is decoration; the socket status already tells whether the server is there.
    return "unknown";
  }
}

export function initConnection() {
  conn.addEventListener("status", (e) => onStatus(e.detail));
  conn.addEventListener("frame", (e) => handleFrame(e.detail));
  conn.addEventListener("lost", onLost);
  conn.addEventListener("bad", () => showBanner("The server sent a frame that is not JSON; it was ignored.", null));
  ui.keyForm.addEventListener("submit", submitKey);
}
