// Token spans: text emitted by the Markdown renderer, split along the reply's tokens.
//
// When the caller passes `segments` (the reply's tokens as [start, end) character ranges of the
// source), text is split along token boundaries and each token's visible characters become
// <span class="tok">, plus `draft` when speculation proposed it (whitespace at a token's edges
// stays outside its span). So a finished, formatted reply still shows, token by token, where
// speculation paid.

/** Leading whitespace, the visible rest, trailing whitespace; no match when all is whitespace. */
const VISIBLE = /^(\s*)(\S(?:[^]*\S)?)(\s*)$/;

/** Emits text, split into per-token spans when segments are known. */
export class TextSink {
  constructor(doc, segments) {
    this.doc = doc;
    this.segs = segments || null;
  }

  segAt(pos) {
    const segs = this.segs;
    let lo = 0;
    let hi = segs.length - 1;
    while (lo <= hi) {
      const mid = (lo + hi) >> 1;
      if (segs[mid].end <= pos) lo = mid + 1;
      else if (segs[mid].start > pos) hi = mid - 1;
      else return mid;
    }
    return -1;
  }

  append(parent, r) {
    if (!r.s) return;
    if (!this.segs) {
      parent.appendChild(this.doc.createTextNode(r.s));
      return;
    }
    let from = 0;
    let cur = this.segAt(r.p[0]);
    for (let k = 1; k <= r.s.length; k++) {
      const seg = k < r.s.length ? this.segAt(r.p[k]) : NaN;
      if (seg === cur) continue;
      this.piece(parent, r.s.slice(from, k), cur);
      from = k;
      cur = seg;
    }
  }

  /** A token's text: the span holds its visible characters only, so the tint never covers the
   *  space before a word (or a whitespace-only token) and words stay the tinted unit. */
  piece(parent, text, segIndex) {
    const visible = segIndex < 0 ? null : VISIBLE.exec(text);
    if (!visible) {
      parent.appendChild(this.doc.createTextNode(text));
      return;
    }
    const [, lead, core, trail] = visible;
    if (lead) parent.appendChild(this.doc.createTextNode(lead));
    const span = this.doc.createElement("span");
    span.className = this.segs[segIndex].draft ? "tok draft" : "tok";
    span.appendChild(this.doc.createTextNode(core));
    parent.appendChild(span);
    if (trail) parent.appendChild(this.doc.createTextNode(trail));
  }
}
