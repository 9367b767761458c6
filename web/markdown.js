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
// Provenance: every character the renderer emits remembers its offset in the source, so text can
// be split into per-token spans (tokenspans.js) that show where speculation paid.

import { parseBlocks, parseInline, splitLines } from "./mdparse.js";
import { TextSink } from "./tokenspans.js";

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
