// The speculation view: how drafting went for the current reply and for the session.
//
// Each `delta` frame is one verify step and says what it drafted and what the target accepted
// (`step`); `done` carries acceptance by draft position (`usage.speculative`'s
// `accepted_per_position` over `drafted_per_position`) and the prompt's cached tokens. A step
// that drafted nothing did not speculate (speculation off, or switched off by the adaptive policy).

const STRIP_STEPS = 160; // the session strip keeps the latest steps only

/** What one reply's speculation looked like; kept with the turn so a reopened chat shows it. */
export class SpecTrace {
  constructor(saved = null) {
    this.steps = saved?.steps ?? []; // [tokens, drafted, accepted] per step
    this.accepted = saved?.accepted ?? []; // per draft position
    this.drafted = saved?.drafted ?? [];
    this.promptTokens = saved?.promptTokens ?? null;
    this.cached = saved?.cached ?? null;
  }

  onDelta(frame, tokens) {
    const step = frame.step;
    if (!step || typeof step !== "object") return;
    this.steps.push([tokens, Number(step.drafted) || 0, Number(step.accepted) || 0]);
  }

  onDone(frame) {
    const usage = frame.usage || {};
    const spec = usage.speculative || {};
    if (Array.isArray(spec.accepted_per_position)) this.accepted = spec.accepted_per_position.map(Number);
    if (Array.isArray(spec.drafted_per_position)) this.drafted = spec.drafted_per_position.map(Number);
    if (Number.isFinite(usage.prompt_tokens)) this.promptTokens = usage.prompt_tokens;
    const cached = usage.prompt_tokens_details?.cached_tokens;
    this.cached = Number.isFinite(cached) ? cached : 0;
  }

  toJSON() {
    return { steps: this.steps, accepted: this.accepted, drafted: this.drafted,
      promptTokens: this.promptTokens, cached: this.cached };
  }
}

/** The session's totals: positions summed, steps in order (the latest kept). */
export class SessionTrace {
  constructor() {
    this.accepted = [];
    this.drafted = [];
    this.steps = [];
  }

  add(trace) {
    const sum = (into, from) => from.forEach((v, i) => (into[i] = (into[i] || 0) + v));
    sum(this.accepted, trace.accepted);
    sum(this.drafted, trace.drafted);
    this.steps.push(...trace.steps);
    if (this.steps.length > STRIP_STEPS) this.steps.splice(0, this.steps.length - STRIP_STEPS);
  }
}

function el(tag, className, text) {
  const e = document.createElement(tag);
  if (className) e.className = className;
  if (text !== undefined) e.textContent = text;
  return e;
}

const pct = (v) => `${Math.round(v * 100)} %`;

/** Acceptance by draft position: per position, a bar for this reply and one for the session. */
export function renderPositions(chart, reply, session) {
  const n = Math.max(reply?.drafted.length ?? 0, session.drafted.length);
  chart.replaceChildren();
  if (!n) {
    chart.append(el("p", "spec-empty", "No drafts yet."));
    chart.setAttribute("aria-label", "Acceptance by draft position: no drafts yet");
    return;
  }
  const words = [];
  for (let i = 0; i < n; i++) {
    const col = chart.appendChild(el("div", "spec-col"));
    const bars = col.appendChild(el("div", "spec-bars"));
    const said = [];
    for (const [who, t] of [["reply", reply], ["session", session]]) {
      const d = t?.drafted[i] || 0;
      const rate = d ? (t.accepted[i] || 0) / d : null;
      const bar = bars.appendChild(el("div", `bar ${who}`));
      bar.style.height = `${rate === null ? 0 : Math.max(2, rate * 100)}%`;
      bar.title = rate === null ? `${who}: nothing drafted here` : `${who}: ${pct(rate)} of ${d} accepted`;
      if (rate !== null) said.push(`${who} ${pct(rate)}`);
    }
    col.appendChild(el("div", "spec-pos", String(i + 1)));
    words.push(`position ${i + 1}: ${said.join(", ") || "no drafts"}`);
  }
  chart.setAttribute("aria-label", `Acceptance by draft position. ${words.join("; ")}`);
}

/** Tokens per verify step over time; a step that did not speculate is drawn apart. */
export function renderStrip(strip, steps, label) {
  strip.replaceChildren();
  const shown = steps.slice(-STRIP_STEPS);
  if (!shown.length) {
    strip.setAttribute("aria-label", `${label}: no steps yet`);
    return;
  }
  const most = Math.max(2, ...shown.map((s) => s[0]));
  let on = 0;
  for (const [tokens, drafted, accepted] of shown) {
    const bar = strip.appendChild(el("span", drafted ? "step on" : "step off"));
    bar.style.height = `${Math.max(8, (tokens / most) * 100)}%`;
    bar.title = drafted ? `${tokens} tokens, ${accepted} of ${drafted} drafts accepted` : `${tokens} tokens, no speculation`;
    if (drafted) on++;
  }
  const total = shown.reduce((a, s) => a + s[0], 0);
  strip.setAttribute("aria-label",
    `${label}: ${shown.length} steps, ${(total / shown.length).toFixed(2)} tokens per step, speculating in ${on}`);
}

/** The words under the chart: steps that speculated, and the prompt's cached tokens. */
export function summary(reply) {
  if (!reply) return "";
  const on = reply.steps.filter((s) => s[1] > 0).length;
  const bits = [];
  if (reply.steps.length) bits.push(`speculated in ${on} of ${reply.steps.length} steps`);
  if (reply.promptTokens !== null) bits.push(`prompt ${reply.promptTokens} tokens, ${reply.cached ?? 0} cached`);
  return bits.join(" · ");
}
