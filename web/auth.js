// The API key of a server started with --api-key: asked for when the server answers 401 or 403,
// kept for this tab only (sessionStorage), and sent in headers: `Authorization: Bearer` over
// HTTP, a subprotocol on the WebSocket (a browser can set no other header there). Never in an
// address, where it would reach the history, proxies' logs and screenshots.

const STORE = "streamsd.apiKey";
const PARAM = "api_key";
/** The WebSocket subprotocol the server echoes; the key travels in a second one next to it. */
export const PROTOCOL = "streamsd";

let memory = null; // where sessionStorage is blocked: the key lasts as long as the page

export function getKey() {
  try {
    return window.sessionStorage.getItem(STORE) ?? memory;
  } catch {
    return memory;
  }
}

export function setKey(key) {
  memory = key;
  try {
    window.sessionStorage.setItem(STORE, key);
  } catch {
    // blocked storage: kept in memory only
  }
}

/** Headers for an API request. */
export function authHeaders() {
  const key = getKey();
  return key ? { Authorization: `Bearer ${key}` } : {};
}

/** Subprotocols for the WebSocket: the key as `streamsd.bearer.<base64url>` (a subprotocol admits
 *  no spaces nor separators), with `streamsd`, the one the server answers with. */
export function socketProtocols() {
  const key = getKey();
  return key ? [PROTOCOL, `${PROTOCOL}.bearer.${base64url(key)}`] : [];
}

function base64url(text) {
  let binary = "";
  for (const byte of new TextEncoder().encode(text)) binary += String.fromCharCode(byte);
  return btoa(binary).replace(/\+/g, "-").replace(/\//g, "_").replace(/=+$/, "");
}

/** A `?api_key=` given anyway is taken and removed from the address bar before anything else runs
 *  (app.js imports this module first). */
function takeKeyFromAddress() {
  const url = new URL(window.location.href);
  if (!url.searchParams.has(PARAM)) return;
  const key = url.searchParams.get(PARAM);
  url.searchParams.delete(PARAM);
  window.history.replaceState(window.history.state, "", url.href);
  if (key) setKey(key);
}

takeKeyFromAddress();
