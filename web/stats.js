// Speed and speculation figures for one reply and for the whole page session.
//
// While a reply streams only the client's clock is known, so tokens/s and time to first
// token are measured from delta arrival. When the `done` frame lands, the server's own
// `timing` and `usage.speculative` replace them: they exclude network and rendering time
// and are the same numbers `streamsd bench` reports. Acceptance rate and accepted tokens
// per step need the count of drafts the target rejected, which only `done` carries.

const now = () => performance.now();

/** Decode speed: tokens after the first over the time after the first, as llama.cpp does. */
function decodeRate(tokens, seconds) {
  if (tokens > 1 && seconds > 0) return (tokens - 1) / seconds;
  return null;
}

export class ReplyStats {
  constructor() {
    this.sentAt = now();
    this.firstAt = null;
    this.tokens = 0;
    this.draftTokens = 0;
    this.final = null; // figures from the done frame
  }

  /** Count one delta frame's tokens. */
  onDelta(tokens) {
    const t = now();
    if (this.firstAt === null && tokens.length) this.firstAt = t;
    this.tokens += tokens.length;
    for (const tok of tokens) if (tok.draft) this.draftTokens++;
  }

  /** Take the server's figures from a done frame. */
  onDone(frame) {
    const usage = frame.usage || {};
    const timing = frame.timing || {};
    const spec = usage.speculative || null;
    const tokens = Number.isFinite(usage.completion_tokens) ? usage.completion_tokens : this.tokens;
    const ttft = Number.isFinite(timing.ttft_s) ? timing.ttft_s : this.clientTtft();
    const elapsed = Number.isFinite(timing.elapsed_s) ? timing.elapsed_s : null;
    const decodeS = elapsed !== null && ttft !== null ? elapsed - ttft : null;
    const drafted = spec && spec.drafted > 0 ? spec.drafted : 0;
    this.final = {
      tokens,
      ttft,
      decodeS,
      tps: decodeRate(tokens, decodeS) ?? (elapsed > 0 ? tokens / elapsed : null),
      drafted,
      accepted: drafted ? spec.accepted : 0,
      acceptance: drafted ? spec.acceptance_rate : null,
      meanAccepted: drafted && spec.mean_accepted_length > 0 ? spec.mean_accepted_length : null,
    };
  }

  /** What a saved conversation keeps: the finished figures. */
  toJSON() {
    return { tokens: this.tokens, draftTokens: this.draftTokens, final: this.final };
  }

  /** A finished reply's figures, from toJSON's object. */
  static restore(saved) {
    const r = new ReplyStats();
    r.tokens = Number(saved?.tokens) || 0;
    r.draftTokens = Number(saved?.draftTokens) || 0;
    r.final = saved?.final ?? null;
    return r;
  }

  clientTtft() {
    return this.firstAt === null ? null : (this.firstAt - this.sentAt) / 1000;
  }

  /** The figures to show now. */
  snapshot() {
    const draftShare = this.tokens ? this.draftTokens / this.tokens : null;
    if (this.final) return { ...this.final, draftShare, live: false };
    const since = this.firstAt === null ? 0 : (now() - this.firstAt) / 1000;
    return {
      tokens: this.tokens,
      ttft: this.clientTtft(),
      tps: decodeRate(this.tokens, since),
      acceptance: null,
      meanAccepted: null,
      draftShare,
      live: true,
    };
  }
}

export class SessionStats {
  constructor() {
    this.replies = 0;
    this.tokens = 0;
    this.draftTokens = 0;
    this.decodeTokens = 0; // tokens after the first, over replies with a decode time
    this.decodeS = 0;
    this.ttftSum = 0;
    this.ttftCount = 0;
    this.drafted = 0;
    this.accepted = 0;
    this.specTokens = 0; // tokens of replies that speculated ...
    this.specSteps = 0; // ... and the verify steps that produced them
  }

  /** Fold in a finished reply (a ReplyStats whose done frame has arrived). */
  add(reply) {
    const f = reply.final;
    if (!f) return;
    this.replies++;
    this.tokens += f.tokens;
    this.draftTokens += reply.draftTokens;
    if (f.decodeS > 0 && f.tokens > 1) {
      this.decodeTokens += f.tokens - 1;
      this.decodeS += f.decodeS;
    }
    if (f.ttft !== null) {
      this.ttftSum += f.ttft;
      this.ttftCount++;
    }
    this.drafted += f.drafted;
    this.accepted += f.accepted;
    // Mean accepted length is tokens per verify step, so steps = tokens / mean; summing
    // steps weights each reply by how long it ran rather than averaging the means.
    if (f.meanAccepted) {
      this.specTokens += f.tokens;
      this.specSteps += f.tokens / f.meanAccepted;
    }
  }

  snapshot() {
    return {
      replies: this.replies,
      tokens: this.tokens,
      tps: this.decodeS > 0 ? this.decodeTokens / this.decodeS : null,
      ttft: this.ttftCount ? this.ttftSum / this.ttftCount : null,
      acceptance: this.drafted ? this.accepted / this.drafted : null,
      meanAccepted: this.specSteps ? this.specTokens / this.specSteps : null,
      draftShare: this.tokens ? this.draftTokens / this.tokens : null,
    };
  }
}

const DASH = "—";

export const format = {
  tps: (v) => (v === null || v === undefined ? DASH : v >= 100 ? v.toFixed(0) : v.toFixed(1)),
  seconds: (v) => (v === null || v === undefined ? DASH : v < 1 ? `${Math.round(v * 1000)} ms` : `${v.toFixed(2)} s`),
  percent: (v) => (v === null || v === undefined ? DASH : `${Math.round(v * 100)} %`),
  ratio: (v) => (v === null || v === undefined ? DASH : v.toFixed(2)),
  count: (v) => (v === null || v === undefined ? DASH : String(v)),
};
