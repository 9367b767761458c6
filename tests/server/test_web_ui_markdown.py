"""The page's Markdown renderer (web/markdown.js) in the browser: cases, token spans, fuzz; dark theme."""

from __future__ import annotations

import re

import pytest

from tests.server import web_ui_helpers as web_ui
from tests.server.web_ui_helpers import MODELS

# The browser, the servers and the page factory are web_ui_helpers.py's fixtures.
browser = web_ui.browser
static_server = web_ui.static_server
new_page = web_ui.new_page

pytestmark = pytest.mark.browser


def _quiet_page(new_page, static_server, **ctx_args):
    """Load web/ with a socket that opens and never speaks: for testing modules in the page."""
    page = new_page(**ctx_args)
    page.route("**/v1/models", lambda route: route.fulfill(json=MODELS))
    page.route_web_socket(re.compile(r".*/v1/ws.*"), lambda ws: None)
    page.goto(static_server)
    return page


RENDER = """async (cases) => {
  const { render } = await import('/markdown.js');
  return cases.map(([src, segments]) => {
    const div = document.createElement('div');
    div.append(render(src, segments ? { segments } : {}));
    div.querySelectorAll('button').forEach((b) => b.remove());  // the copy button is UI, not content
    return div.innerHTML;
  });
}"""

CASES = [
    ("Hello *world*", "<p>Hello <em>world</em></p>"),
    ("**bold** and __also__", "<p><strong>bold</strong> and <strong>also</strong></p>"),
    ("*a **b** c*", "<p><em>a <strong>b</strong> c</em></p>"),
    ("***both***", "<p><em><strong>both</strong></em></p>"),
    ("snake_case_name and 2*3*4", "<p>snake_case_name and 2<em>3</em>4</p>"),
    ("a * b * c", "<p>a * b * c</p>"),
    ("\\*not em\\* and `a*b*c`", "<p>*not em* and <code>a*b*c</code></p>"),
    ("`` a`b ``", "<p><code>a`b</code></p>"),
    ("# Title\n## Sub ##\nbody", "<h1>Title</h1><h2>Sub</h2><p>body</p>"),
    ("line one\nline two\n\nnext", "<p>line one\nline two</p><p>next</p>"),
    (
        "- a\n- b\n  - c\n- d",
        "<ul><li><p>a</p></li><li><p>b</p><ul><li><p>c</p></li></ul></li><li><p>d</p></li></ul>",
    ),
    ("3. three\n4. four", '<ol start="3"><li><p>three</p></li><li><p>four</p></li></ol>'),
    ("> quoted\n\n---", "<blockquote><p>quoted</p></blockquote><hr>"),
    (
        "```js\nif (a < b) {}\n```",
        '<div class="code-block"><div class="code-head"><span class="code-lang">js</span></div>'
        '<pre><code data-lang="js">if (a &lt; b) {}</code></pre></div>',
    ),
    # An unclosed fence (a reply still streaming) is already a code block.
    (
        "```\nopen",
        '<div class="code-block"><div class="code-head"><span class="code-lang"></span></div><pre><code>open</code></pre></div>',
    ),
    ("<script>alert(1)</script>", "<p>&lt;script&gt;alert(1)&lt;/script&gt;</p>"),
    (
        '<img src=x onerror="alert(1)"> [x](javascript:alert(1))',
        '<p>&lt;img src=x onerror="alert(1)"&gt; [x](javascript:alert(1))</p>',
    ),
    ("# <b>not bold</b>", "<h1>&lt;b&gt;not bold&lt;/b&gt;</h1>"),
]


def test_markdown_renderer(new_page, static_server):
    page = _quiet_page(new_page, static_server)
    got = page.evaluate(RENDER, [[src, None] for src, _ in CASES])
    for (src, want), html in zip(CASES, got, strict=True):
        assert html == want, src
    assert page.evaluate("window.__pwned") is None


def test_markdown_renderer_keeps_token_spans(new_page, static_server):
    page = _quiet_page(new_page, static_server)
    # Tokens "**ab" | " c" | "d**" : the markers vanish, the tokens keep their characters.
    segments = [
        {"start": 0, "end": 4, "draft": True},
        {"start": 4, "end": 6, "draft": False},
        {"start": 6, "end": 9, "draft": True},
    ]
    (html,) = page.evaluate(RENDER, [["**ab cd**", segments]])
    assert html == (
        '<p><strong><span class="tok draft">ab</span> <span class="tok">c</span>'
        '<span class="tok draft">d</span></strong></p>'
    )
    # Whitespace at a token's edges stays outside its span; a whitespace-only token has none.
    # Tokens "Hyd" | "rated" | " water" | " " | " ok " | "yes".
    bounds = [(0, 3, True), (3, 8, False), (8, 14, True), (14, 15, False), (15, 19, True), (19, 22, False)]
    segments = [{"start": a, "end": b, "draft": d} for a, b, d in bounds]
    (html,) = page.evaluate(RENDER, [["Hydrated water  ok yes", segments]])
    assert html == (
        '<p><span class="tok draft">Hyd</span><span class="tok">rated</span> <span class="tok draft">water</span>'
        '  <span class="tok draft">ok</span> <span class="tok">yes</span></p>'
    )

    # Code blocks keep their tokens too, newline included.
    segments = [
        {"start": 0, "end": 4, "draft": False},
        {"start": 4, "end": 8, "draft": True},
        {"start": 8, "end": 14, "draft": False},
    ]
    (html,) = page.evaluate(RENDER, [["```\nab\ncd\n```", segments]])
    assert '<code><span class="tok draft">ab\nc</span><span class="tok">d</span></code>' in html


def test_dark_theme_follows_the_system(new_page, static_server):
    colours = {}
    for scheme in ("light", "dark"):
        page = _quiet_page(new_page, static_server, color_scheme=scheme)
        colours[scheme] = page.evaluate("getComputedStyle(document.body).backgroundColor")
    assert colours["light"] != colours["dark"]


FUZZ = """async (n) => {
  const { render } = await import('/markdown.js');
  const alphabet = ['*', '_', '`', '#', '-', '+', '>', '\\\\', '\\n', '\\n', '1.', ' ', ' ', 'a', 'b', '~', '<', 'x', '\\t', '2)'];
  let seed = 7;
  const rand = () => (seed = (seed * 1103515245 + 12345) % 2147483648) / 2147483648;
  const lost = [];
  for (let k = 0; k < n; k++) {
    let src = '';
    for (let i = Math.floor(rand() * 40); i > 0; i--) src += alphabet[Math.floor(rand() * alphabet.length)];
    if (/^ {0,3}(```|~~~)/m.test(src)) continue;
    const segments = [];
    for (let i = 0; i < src.length; i += 2) segments.push({ start: i, end: Math.min(src.length, i + 2), draft: i % 4 === 0 });
    for (const opts of [{}, { segments }]) {
      const div = document.createElement('div');
      div.append(render(src, opts));
      div.querySelectorAll('button').forEach((b) => b.remove());
      if (div.textContent.replace(/[^abx]/g, '') !== src.replace(/[^abx]/g, '')) lost.push(src);
    }
  }
  return lost;
}"""


def test_markdown_renderer_never_loses_text(new_page, static_server):
    """Random Markdown-ish input (no fences, whose info strings are dropped by design): markup
    characters may be consumed, but every letter is rendered, with or without token spans."""
    page = _quiet_page(new_page, static_server)
    assert page.evaluate(FUZZ, 2000) == []
