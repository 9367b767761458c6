// One WebSocket to /v1/ws that reconnects by itself with exponential backoff.
//
// Events (all CustomEvent, payload in `detail`):
//   "status" {state: "connecting"|"open"|"closed", retryIn?: ms, everOpened: bool}
//   "frame"  a parsed server frame
//   "lost"   the socket closed; requests in flight on it will get no more frames
//   "bad"    a frame that was not JSON (shown to the user; the socket stays up)

/** The socket URL: next to the page (so a reverse-proxy prefix keeps working), ws or wss to
 *  match http or https; nothing of the page's query (the key goes in a subprotocol). */
export function socketUrl(loc = window.location) {
  const url = new URL("v1/ws", loc.href);
  url.protocol = loc.protocol === "https:" ? "wss:" : "ws:";
  url.search = "";
  url.hash = "";
  return url.href;
}

export class Connection extends EventTarget {
  /** `protocols()`: the subprotocols to offer, asked at every (re)connect. */
  constructor(url, { protocols = () => [], minDelayMs = 500, maxDelayMs = 15000 } = {}) {
    super();
    this.url = url;
    this.protocols = protocols;
    this.stopped = true;
    this.minDelayMs = minDelayMs;
    this.maxDelayMs = maxDelayMs;
    this.ws = null;
    this.attempt = 0;
    this.timer = null;
    this.everOpened = false;
  }

  get isOpen() {
    return this.ws !== null && this.ws.readyState === WebSocket.OPEN;
  }

  start() {
    this.stopped = false;
    clearTimeout(this.timer);
    if (!this.ws) this.connect();
  }

  /** Close and stop reconnecting until `start` (while the server waits for an API key). */
  stop() {
    this.stopped = true;
    clearTimeout(this.timer);
    if (this.ws) this.ws.close();
  }

  /** Skip the wait and try again at once (the banner's "Reconnect now"). */
  reconnectNow() {
    if (this.stopped || (this.ws && this.ws.readyState <= WebSocket.OPEN)) return;
    clearTimeout(this.timer);
    this.connect();
  }

  /** Send a frame; false when the socket is not open (the caller shows why). */
  send(frame) {
    if (!this.isOpen) return false;
    this.ws.send(JSON.stringify(frame));
    return true;
  }

  connect() {
    this.emit("status", { state: "connecting", everOpened: this.everOpened });
    const protocols = this.protocols();
    const ws = protocols.length ? new WebSocket(this.url, protocols) : new WebSocket(this.url);
    this.ws = ws;
    ws.addEventListener("open", () => {
      this.attempt = 0;
      this.everOpened = true;
      this.emit("status", { state: "open", everOpened: true });
    });
    ws.addEventListener("message", (ev) => {
      let frame;
      try {
        frame = JSON.parse(ev.data);
      } catch {
        this.emit("bad", { data: String(ev.data).slice(0, 200) });
        return;
      }
      this.emit("frame", frame);
    });
    // "error" is always followed by "close"; all the handling lives there.
    ws.addEventListener("close", (ev) => {
      if (this.ws !== ws) return;
      this.ws = null;
      this.emit("lost", { code: ev.code, reason: ev.reason });
      if (this.stopped) return;
      // Full jitter keeps many tabs from reconnecting in lockstep after a server restart.
      const cap = Math.min(this.maxDelayMs, this.minDelayMs * 2 ** this.attempt);
      const delay = Math.round(cap / 2 + (Math.random() * cap) / 2);
      this.attempt++;
      this.emit("status", { state: "closed", retryIn: delay, code: ev.code, everOpened: this.everOpened });
      this.timer = setTimeout(() => this.connect(), delay);
    });
  }

  emit(type, detail) {
    this.dispatchEvent(new CustomEvent(type, { detail }));
  }
}
