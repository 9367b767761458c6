// Markdown parsing for markdown.js: source lines -> block nodes, and a block's text -> inline
// nodes (text, code, em, strong). It builds no DOM.
//
// Every character keeps its offset in the source (a run's `p`), so that the renderer can split
// text along the reply's token boundaries (see tokenspans.js).

/** A run of source text: `s` is the text, `p[i]` the source offset of `s[i]`. */
function run(s, p) {
  return { s, p };
}

/** Split the source into lines that remember where they start. */
export function splitLines(src) {
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

export function parseBlocks(lines) {
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

export function parseInline(r) {
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

