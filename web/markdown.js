// A small, safe Markdown renderer for model output.
//
// Safety: the renderer only ever creates elements from a fixed list and puts model text in
// through text nodes (createTextNode / textContent). Nothing it is given reaches innerHTML,
// attributes that browsers execute, or URLs, so `<script>` in a reply stays visible text.
//
// Supported: paragraphs (single newlines kept as line breaks), ATX headings, bullet and
// ordered lists (nested by indentation), block quotes, thematic breaks, fenced code blocks
// (with a copy button), emphasis/strong (CommonMark's delimiter rules), inline code and
// backslash escapes. Links and raw HTML are shown as text on purpose.
//
// Provenance: every character the renderer emits remembers its offset in the source. When
// the caller passes `segments` (the reply's tokens as [start, end) character ranges), text
// is split along token boundaries and each token's visible characters become
// <span class="tok">, plus `draft` when speculation proposed it (whitespace at a token's
// edges stays outside its span). So a finished, formatted reply still shows, token by token,
// where speculation paid.

/** A run of source text: `s` is the text, `p[i]` the source offset of `s[i]`. */
function run(s, p) {
  return { s, p };
}

/** Split the source into lines that remember where they start. */
function splitLines(src) {
  const lines = [];
  let start = 0;
  for (;;) {
    const nl = src.indexOf("\n", start);
    const end = nl < 0 ? src.length : nl;
    let s = src.slice(start, end);
    if (s.endsWith("\r")) s = s.slice(0, -1);
    lines.push({ s, o: start });
    if (nl < 0) return lines;
    start = nl + 1;
  }
}

/** Drop the first `n` characters of a line, keeping its source offset right. */
function dropPrefix(line, n) {
  return { s: line.s.slice(n), o: line.o + n };
}

function indentOf(s) {
  let i = 0;
  while (i < s.length && (s[i] === " " || s[i] === "\t")) i++;
  return i;
}

const isBlank = (s) => /^[ \t]*$/.test(s);
const FENCE = /^( {0,3})(`{3,}|~{3,})[ \t]*([^`\s]*)[^`]*$/;
const HEADING = /^ {0,3}(#{1,6})(?=[ \t]|$)/;
const RULE = /^ {0,3}([-*_])(?:[ \t]*\1){2,}[ \t]*$/;
const QUOTE = /^ {0,3}> ?/;
const ITEM = /^( {0,3})([-*+]|(\d{1,9})[.)])([ \t]+|$)/;

/** Does this line start a block that interrupts a paragraph? */
function startsBlock(s) {
  return FENCE.test(s) || HEADING.test(s) || RULE.test(s) || QUOTE.test(s) || ITEM.test(s);
}

// ---------------------------------------------------------------------------------------
// Block structure: lines -> a small tree of block nodes.

function parseBlocks(lines) {
  const blocks = [];
  let i = 0;
  while (i < lines.length) {
    const line = lines[i];
    const s = line.s;
    if (isBlank(s)) {
      i++;
      continue;
    }
    let m;
    if ((m = FENCE.exec(s))) {
      i = parseFence(lines, i, m, blocks);
    } else if ((m = HEADING.exec(s))) {
      blocks.push({ type: "heading", level: m[1].length, inline: headingText(line, m[0].length) });
      i++;
    } else if (RULE.test(s)) {
      blocks.push({ type: "rule" });
      i++;
    } else if (QUOTE.test(s)) {
      const inner = [];
      while (i < lines.length && !isBlank(lines[i].s)) {
        const q = QUOTE.exec(lines[i].s);
        // Lines without ">" continue the quote lazily, as in CommonMark.
        inner.push(q ? dropPrefix(lines[i], q[0].length) : lines[i]);
        i++;
      }
      blocks.push({ type: "quote", children: parseBlocks(inner) });
    } else if (ITEM.test(s)) {
      i = parseList(lines, i, blocks);
    } else {
      const para = [];
      while (i < lines.length && !isBlank(lines[i].s) && (para.length === 0 || !startsBlock(lines[i].s))) {
        para.push(lines[i]);
        i++;
      }
      blocks.push({ type: "paragraph", inline: joinLines(para) });
    }
  }
  return blocks;
}

function parseFence(lines, i, m, blocks) {
  const indent = m[1].length;
  const marker = m[2];
  const body = [];
  i++;
  while (i < lines.length) {
    const s = lines[i].s;
    const close = /^ {0,3}(`{3,}|~{3,})[ \t]*$/.exec(s);
    if (close && close[1][0] === marker[0] && close[1].length >= marker.length) {
      i++;
      break;
    }
    // Content lines lose up to the opening fence's indentation.
    body.push(dropPrefix(lines[i], Math.min(indent, indentOf(s))));
    i++;
  }
  // An unclosed fence runs to the end: that is what a reply still streaming looks like.
  const chars = [];
  const pos = [];
  body.forEach((l, k) => {
    if (k > 0) {
      chars.push("\n");
      pos.push(l.o - 1);
    }
    for (let j = 0; j < l.s.length; j++) {
      chars.push(l.s[j]);
      pos.push(l.o + j);
    }
  });
  blocks.push({ type: "code", lang: m[3] || "", text: run(chars.join(""), pos) });
  return i;
}

function headingText(line, markerLen) {
  let s = line.s.slice(markerLen);
  // Optional closing run of '#', which must follow a space.
  s = s.replace(/(^|[ \t]+)#+[ \t]*$/, "").replace(/[ \t]+$/, "");
  const lead = indentOf(s);
  const o = line.o + markerLen + lead;
  s = s.slice(lead);
  return run(s, Array.from({ length: s.length }, (_, k) => o + k));
}

/** Paragraph lines joined by "\n" with leading and trailing blanks of each line dropped. */
function joinLines(lines) {
  let s = "";
  const p = [];
  lines.forEach((l, k) => {
    const lead = indentOf(l.s);
    const text = l.s.slice(lead).replace(/[ \t]+$/, "");
    if (k > 0) {
      s += "\n";
      p.push(l.o - 1);
    }
    s += text;
    for (let j = 0; j < text.length; j++) p.push(l.o + lead + j);
  });
  return run(s, p);
}

function parseList(lines, i, blocks) {
  const first = ITEM.exec(lines[i].s);
  const ordered = first[3] !== undefined;
  const bullet = ordered ? first[2].slice(-1) : first[2];
  const list = { type: "list", ordered, start: ordered ? parseInt(first[3], 10) : 1, items: [] };
  while (i < lines.length) {
    const m = ITEM.exec(lines[i].s);
    if (!m || (m[3] !== undefined) !== ordered || (ordered ? m[2].slice(-1) : m[2]) !== bullet) break;
    // Content indent: marker plus its following spaces (a lone marker or 5+ spaces counts 1).
    const spaces = m[4].length;
    const width = m[1].length + m[2].length + (spaces === 0 || spaces > 4 ? 1 : spaces);
    const item = [dropPrefix(lines[i], Math.min(width, lines[i].s.length))];
    i++;
    let sawBlank = false;
    while (i < lines.length) {
      const s = lines[i].s;
      if (isBlank(s)) {
        sawBlank = true;
        item.push({ s: "", o: lines[i].o });
        i++;
        continue;
      }
      const ind = indentOf(s);
      if (ind >= width) {
        item.push(dropPrefix(lines[i], width));
      } else if (!sawBlank && !startsBlock(s)) {
        item.push(lines[i]); // lazy paragraph continuation
      } else {
        break;
      }
      sawBlank = false;
      i++;
    }
    list.items.push(parseBlocks(item));
    // A blank line followed by something that is not the next item ends the list.
    if (sawBlank && (i >= lines.length || !ITEM.test(lines[i].s))) break;
  }
  blocks.push(list);
  return i;
}

// ---------------------------------------------------------------------------------------
// Inline structure: a run -> a list of inline nodes (text, code, em, strong).

const PUNCT = /[\p{P}\p{S}]/u;
const SPACE = /\s/u;

function parseInline(r) {
  const { s, p } = r;
  const items = [];
  let text = "";
  let tpos = [];
  const flush = () => {
    if (text) items.push({ t: "text", r: run(text, tpos) });
    text = "";
    tpos = [];
  };
  let i = 0;
  while (i < s.length) {
    const c = s[i];
    if (c === "\\" && i + 1 < s.length && /[!-/:-@[-`{-~]/.test(s[i + 1])) {
      text += s[i + 1];
      tpos.push(p[i + 1]);
      i += 2;
    } else if (c === "`") {
      let n = 1;
      while (s[i + n] === "`") n++;
      const close = findBackticks(s, i + n, n);
      if (close < 0) {
        text += s.slice(i, i + n);
        tpos.push(...p.slice(i, i + n));
        i += n;
        continue;
      }
      flush();
      let a = i + n;
      let b = close;
      // One space of padding on both sides is stripped, so `` `x` `` can show backticks.
      if (b - a >= 2 && s[a] === " " && s[b - 1] === " " && s.slice(a, b).trim() !== "") {
        a++;
        b--;
      }
      items.push({ t: "code", r: run(s.slice(a, b), p.slice(a, b)) });
      i = close + n;
    } else if (c === "*" || c === "_") {
      let n = 1;
      while (s[i + n] === c) n++;
      flush();
      const before = i > 0 ? s[i - 1] : " ";
      const after = i + n < s.length ? s[i + n] : " ";
      const left = !SPACE.test(after) && (!PUNCT.test(after) || SPACE.test(before) || PUNCT.test(before));
      const right = !SPACE.test(before) && (!PUNCT.test(before) || SPACE.test(after) || PUNCT.test(after));
      // Underscores inside words are literal (snake_case must survive).
      const open = c === "*" ? left : left && (!right || PUNCT.test(before));
      const close = c === "*" ? right : right && (!left || PUNCT.test(after));
      items.push({ t: "delim", ch: c, n, orig: n, open, close, r: run(s.slice(i, i + n), p.slice(i, i + n)) });
      i += n;
    } else {
      text += c;
      tpos.push(p[i]);
      i++;
    }
  }
  flush();
  processEmphasis(items);
  return items;
}

function findBackticks(s, from, n) {
  let i = from;
  while (i < s.length) {
    if (s[i] !== "`") {
      i++;
      continue;
    }
    let m = 1;
    while (s[i + m] === "`") m++;
    if (m === n) return i;
    i += m;
  }
  return -1;
}

/** CommonMark's "process emphasis": match each closer with the nearest usable opener. */
function processEmphasis(items) {
  let ci = 0;
  while (ci < items.length) {
    const c = items[ci];
    if (c.t !== "delim" || !c.close || c.n === 0) {
      ci++;
      continue;
    }
    let oi = ci - 1;
    for (; oi >= 0; oi--) {
      const o = items[oi];
      if (o.t !== "delim" || o.ch !== c.ch || !o.open || o.n === 0) continue;
      // The "rule of 3" keeps `*foo**bar*` from pairing the wrong runs.
      const both = o.close || c.open;
      if (both && (o.orig + c.orig) % 3 === 0 && !(o.orig % 3 === 0 && c.orig % 3 === 0)) continue;
      break;
    }
    if (oi < 0) {
      ci++;
      continue;
    }
    const o = items[oi];
    const use = o.n >= 2 && c.n >= 2 ? 2 : 1;
    const node = { t: use === 2 ? "strong" : "em", kids: items.slice(oi + 1, ci) };
    // The innermost characters of each run are the ones used up.
    o.n -= use;
    o.r = run(o.r.s.slice(0, o.n), o.r.p.slice(0, o.n));
    c.n -= use;
    c.r = run(c.r.s.slice(use), c.r.p.slice(use));
    items.splice(oi + 1, ci - oi - 1, node);
    ci = oi + 2;
    if (o.n === 0) {
      items.splice(oi, 1);
      ci--;
    }
    if (c.n === 0) items.splice(ci, 1);
  }
}

// ---------------------------------------------------------------------------------------
// DOM building.

/** Leading whitespace, the visible rest, trailing whitespace; no match when all is whitespace. */
const VISIBLE = /^(\s*)(\S(?:[^]*\S)?)(\s*)$/;

/** Emits text, split into per-token spans when segments are known. */
class TextSink {
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

function el(doc, tag, className) {
  const e = doc.createElement(tag);
  if (className) e.className = className;
  return e;
}

function renderInline(doc, sink, parent, nodes) {
  for (const n of nodes) {
    if (n.t === "text" || n.t === "delim") sink.append(parent, n.r);
    else if (n.t === "code") sink.append(parent.appendChild(el(doc, "code")), n.r);
    else renderInline(doc, sink, parent.appendChild(el(doc, n.t)), n.kids);
  }
}

function renderBlocks(doc, sink, parent, blocks) {
  for (const b of blocks) {
    switch (b.type) {
      case "paragraph":
        renderInline(doc, sink, parent.appendChild(el(doc, "p")), parseInline(b.inline));
        break;
      case "heading":
        renderInline(doc, sink, parent.appendChild(el(doc, `h${b.level}`)), parseInline(b.inline));
        break;
      case "rule":
        parent.appendChild(el(doc, "hr"));
        break;
      case "quote":
        renderBlocks(doc, sink, parent.appendChild(el(doc, "blockquote")), b.children);
        break;
      case "list": {
        const list = parent.appendChild(el(doc, b.ordered ? "ol" : "ul"));
        if (b.ordered && b.start !== 1) list.start = b.start;
        for (const item of b.items) renderBlocks(doc, sink, list.appendChild(el(doc, "li")), item);
        break;
      }
      case "code":
        parent.appendChild(codeBlock(doc, sink, b));
        break;
    }
  }
}

function codeBlock(doc, sink, b) {
  const wrap = el(doc, "div", "code-block");
  const head = wrap.appendChild(el(doc, "div", "code-head"));
  const lang = head.appendChild(el(doc, "span", "code-lang"));
  lang.textContent = b.lang;
  const copy = head.appendChild(el(doc, "button", "copy"));
  copy.type = "button";
  copy.textContent = "Copy";
  copy.setAttribute("aria-label", b.lang ? `Copy ${b.lang} code` : "Copy code");
  const code = wrap.appendChild(el(doc, "pre")).appendChild(el(doc, "code"));
  if (/^[\w+#.-]{1,32}$/.test(b.lang)) code.dataset.lang = b.lang;
  sink.append(code, b.text);
  copy.addEventListener("click", () => copyText(code.textContent, copy));
  return wrap;
}

async function copyText(text, button) {
  let ok = false;
  try {
    await navigator.clipboard.writeText(text);
    ok = true;
  } catch {
    // The async clipboard needs a secure context; a plain-http host falls back to a
    // temporary textarea and the legacy copy command.
    const ta = document.createElement("textarea");
    ta.value = text;
    ta.setAttribute("readonly", "");
    ta.className = "offscreen";
    document.body.appendChild(ta);
    ta.select();
    try {
      ok = document.execCommand("copy");
    } catch {
      ok = false;
    }
    ta.remove();
  }
  button.textContent = ok ? "Copied" : "Copy failed";
  setTimeout(() => {
    button.textContent = "Copy";
  }, 1500);
}

/**
 * Render Markdown `src` to a DocumentFragment.
 * @param {string} src
 * @param {{segments?: {start:number,end:number,draft:boolean}[], document?: Document}} [opts]
 *   segments: the reply's tokens as sorted, non-overlapping character ranges of `src`.
 */
export function render(src, opts = {}) {
  const doc = opts.document || document;
  const frag = doc.createDocumentFragment();
  const sink = new TextSink(doc, opts.segments && opts.segments.length ? opts.segments : null);
  renderBlocks(doc, sink, frag, parseBlocks(splitLines(String(src))));
  return frag;
}
