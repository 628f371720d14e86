"""The chapter site as a reader sees it: built, served, and opened in headless Chromium.

Contract:
- The site is built with `mkdocs build --strict` into a temporary folder; that build
  executes every notebook (notebooks/site_hooks.py), so a notebook that fails, or any
  strict warning, fails here. The build test needs no browser and always runs.
- The site is served on 127.0.0.1 and EVERY page (each index.html the build wrote) is
  opened in Debian's chromium through Playwright (`executable_path=/usr/bin/chromium`; no
  browser download). On each page:
  - one visible h1, and as many h2/h3 as the page's source (.md or notebook markdown) has;
  - each mermaid block of the source rendered to an SVG (no syntax-error SVG) in which no
    two text boxes (node labels, subgraph titles, edge labels, actor/message/note texts)
    overlap by more than 3 px each way (the lines of one multi-line label touch);
  - each diagram fits the content column: the SVG no wider than its container, nothing in
    the container scrolling sideways, and every one of those texts drawn at 11 px or more
    after mermaid has scaled the diagram down to the column (legible, not just fitted);
  - no code or output block whose text runs past its box with nothing to scroll it, and
    no page wider than the window (1280 px);
  - each snippet (`--8<-- "file:section"`) rendered as highlighted code containing the
    first line of that section of that file;
  - no uncaught script error.
- On each notebook page: the executed notebook offered for download has every code cell
  executed and no error output; the page shows all of its outputs (at least one), and
  each figure as an image that loaded: the count of <img> equals the PNG outputs of the
  executed notebook and the `show(...)` calls in the notebook's source.
- The site's search box, typed into like a reader does, lists the chapter page for 泄漏
  and for `wait_for_ack`.

Skipped with a one-line reason where /usr/bin/chromium, a CJK font,
the playwright package or the vendored mermaid is missing; `make test` installs chromium
and fonts-noto-cjk with apt-get where it runs as root, and vendors mermaid.
MINISGL_SITE_DIR=<built site> reuses a site built before instead of building one (for
working on these checks; CI never sets it).
"""

from __future__ import annotations

import functools
import http.server
import shutil
import subprocess
import threading
from pathlib import Path

import pytest
from site_pages import (
    CHAPTERS,
    NOTEBOOKS,
    ROOT,
    Page,
    executed_notebook,
    figures_shown,
    first_line_of,
    headings,
    mermaid_blocks,
    output_count,
    png_outputs,
    snippets,
)

# the first test builds the site, executing every notebook: minutes on a busy 2-core machine
pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]

CHROMIUM = Path("/usr/bin/chromium")
MERMAID_JS = CHAPTERS / "assets" / "vendor" / "mermaid.min.js"
CHAPTER_PAGE = "http-and-concurrency/"  # the chapter's pages: its index and sections

# text boxes in a rendered mermaid diagram that must not overlap one another
LABELS = ", ".join(
    [
        ".nodeLabel",  # flowchart node labels
        ".cluster-label",  # subgraph titles
        "span.edgeLabel",  # edge labels
        "text.actor",  # sequence diagram participants
        "text.messageText",
        "text.noteText",
        "text.loopText",
        "text.labelText",
    ]
)

# two text boxes overlap when they share more than this many pixels each way: the box of a
# text line includes its leading, so the lines of one multi-line label touch by a pixel or two
TOLERANCE_PX = 3

# material renders each mermaid diagram into a closed shadow root; open it for the test
OPEN_SHADOW_ROOTS = """
const attach = Element.prototype.attachShadow;
Element.prototype.attachShadow = function (init) {
  return attach.call(this, Object.assign({}, init, {mode: "open"}));
};
"""

DIAGRAMS_RENDERED = """(n) => {
  const done = [...document.querySelectorAll("div.mermaid")].filter(
    (el) => el.shadowRoot && el.shadowRoot.querySelector("svg"));
  return done.length >= n;
}"""

DIAGRAM_FACTS = """([selector, tolerance]) => [...document.querySelectorAll("div.mermaid")].map((host) => {
  const svg = host.shadowRoot.querySelector("svg");
  const r = svg.getBoundingClientRect();
  const boxes = [...host.shadowRoot.querySelectorAll(selector)]
    .map((el) => ({el, text: el.textContent.trim(), r: el.getBoundingClientRect()}))
    .filter((b) => b.text && b.r.width > 0 && b.r.height > 0)
    .filter((b, _, all) => !all.some((o) => o.el !== b.el && o.el.contains(b.el)));  // outermost
  const overlaps = [];
  for (let i = 0; i < boxes.length; i++) {
    for (let j = i + 1; j < boxes.length; j++) {
      const a = boxes[i], b = boxes[j];
      const w = Math.min(a.r.right, b.r.right) - Math.max(a.r.left, b.r.left);
      const h = Math.min(a.r.bottom, b.r.bottom) - Math.max(a.r.top, b.r.top);
      if (w > tolerance && h > tolerance) overlaps.push(`${a.text} / ${b.text} (${w.toFixed(0)}x${h.toFixed(0)} px)`);
    }
  }
  const vb = svg.viewBox && svg.viewBox.baseVal;
  const scale = vb && vb.width ? r.width / vb.width : 1;  // < 1: shrunk to fit the column
  const sizes = boxes.map((b) => ({text: b.text.slice(0, 40),
                                   px: parseFloat(getComputedStyle(b.el).fontSize) * scale}));
  const smallest = sizes.reduce((a, b) => (b.px < a.px ? b : a), {text: "", px: Infinity});
  const scrolling = [host, ...host.shadowRoot.querySelectorAll("*")]
    .filter((el) => el.scrollWidth > el.clientWidth + 1);
  return {width: r.width, height: r.height, error: /Syntax error/i.test(svg.textContent),
          labels: boxes.length, overlaps, scale, smallest,
          column: host.clientWidth,
          scrolls: scrolling.map((el) => `${el.tagName.toLowerCase()} ${el.scrollWidth}/${el.clientWidth} px`)};
})"""

# a diagram's text, once mermaid has scaled the diagram down to the column, is at least
# this big (material draws it at 16 px: 11 px is a diagram shrunk to about two thirds)
MIN_TEXT_PX = 11

# the search worker has loaded the index: the result list shows its placeholder line
SEARCH_READY = """() => {
  const config = JSON.parse(document.getElementById("__config").textContent);
  const meta = document.querySelector(".md-search-result__meta");
  return meta && meta.textContent.trim() === config.translations["search.result.placeholder"];
}"""

PAGE_FACTS = """() => {
  const article = document.querySelector("article");
  const visible = (el) => !!(el.offsetWidth || el.offsetHeight || el.getClientRects().length);
  const count = (sel) => article.querySelectorAll(sel).length;
  return {
    h1: [...article.querySelectorAll("h1")].filter(visible).map((h) => h.textContent.trim()),
    h2: count("h2"), h3: count("h3"),
    code: [...article.querySelectorAll(".highlight pre code")].map((c) => c.textContent),
    outputs: count(".jp-OutputArea-child"),
    output_text: [...article.querySelectorAll(".jp-OutputArea-output")]
      .map((o) => o.innerText).join("").trim().length,
    images: [...article.querySelectorAll(".jp-OutputArea-output img")]
      .map((img) => ({loaded: img.complete && img.naturalWidth > 0, width: img.naturalWidth})),
    // code and output blocks whose text runs past their box with nothing to scroll it
    cut: [...article.querySelectorAll("pre, pre > code")]
      .filter((el) => el.scrollWidth > el.clientWidth + 1
                      && !["auto", "scroll"].includes(getComputedStyle(el).overflowX))
      .map((el) => el.textContent.trim().slice(0, 60)),
    page_overflow: document.documentElement.scrollWidth - window.innerWidth,
  };
}"""


# ------------------------------------------------------------------ the site, served


def test_the_strict_build_has_every_page_and_runs_every_notebook(site, pages):
    sources = {p.source for p in pages}
    markdown = {
        p for p in CHAPTERS.rglob("*.md") if "generated" not in p.relative_to(CHAPTERS).parts
    }
    expected = markdown | set(NOTEBOOKS.glob("*.ipynb"))  # http-and-concurrency/6-gaps/ too
    assert expected <= sources, f"no page for {sorted(str(p) for p in expected - sources)}"
    for page in (p for p in pages if p.is_notebook):
        code = [c for c in executed_notebook(site, page)["cells"] if c["cell_type"] == "code"]
        unrun = [i for i, c in enumerate(code) if c.get("execution_count") is None]
        errors = [o for c in code for o in c.get("outputs", []) if o["output_type"] == "error"]
        assert not unrun, f"{page.source.name}: code cells {unrun} were not executed"
        assert not errors, f"{page.source.name}: error outputs {errors}"
        assert any(c.get("outputs") for c in code), f"{page.source.name}: no outputs at all"


@pytest.fixture(scope="module")
def server(site):
    handler = functools.partial(_QuietHandler, directory=str(site))
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}/"
    httpd.shutdown()
    httpd.server_close()


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, format, *args):
        pass


# ------------------------------------------------------------------ the browser
def _missing() -> str | None:
    if not CHROMIUM.is_file():
        return f"{CHROMIUM} not installed (make test installs chromium with apt-get as root)"
    if not _cjk_font():
        return "no CJK font (make test installs fonts-noto-cjk with apt-get as root)"
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        return "the playwright package is not installed (pip install -e '.[dev]')"
    if not MERMAID_JS.is_file():
        return f"{MERMAID_JS.relative_to(ROOT)} missing (make docs or make test vendors it)"
    return None


def _cjk_font() -> bool:
    if shutil.which("fc-list"):
        found = subprocess.run(["fc-list", ":lang=zh"], capture_output=True, text=True)
        return bool(found.stdout.strip())
    return any(Path("/usr/share/fonts").rglob("*CJK*"))


@pytest.fixture(scope="module")
def browser():
    reason = _missing()
    if reason:
        pytest.skip(reason)
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        chromium = p.chromium.launch(executable_path=str(CHROMIUM), headless=True)
        yield chromium
        chromium.close()


@pytest.fixture(scope="module")
def rendered(browser, server, pages) -> list[Page]:
    """Every page opened once; what the checks below need, read from the live DOM."""
    context = browser.new_context(viewport={"width": 1280, "height": 900})
    context.add_init_script(OPEN_SHADOW_ROOTS)
    for page in pages:
        tab = context.new_page()
        tab.on("pageerror", lambda exc, page=page: page.errors.append(str(exc)))
        tab.goto(server + page.url, wait_until="load")
        expected = len(mermaid_blocks(page.source))
        if expected:
            tab.wait_for_function(DIAGRAMS_RENDERED, arg=expected, timeout=30_000)
            tab.wait_for_timeout(300)  # let the fonts settle before measuring
            page.diagrams = tab.evaluate(DIAGRAM_FACTS, [LABELS, TOLERANCE_PX])
        page.facts = tab.evaluate(PAGE_FACTS)
        tab.close()
    context.close()
    return pages


# ------------------------------------------------------------------ the checks
def _check_all(rendered, check) -> None:
    failures = [f"{p.url or '/'}: {msg}" for p in rendered for msg in check(p)]
    assert not failures, "\n".join(failures)


def test_every_page_shows_its_headings(rendered):
    def check(page):
        f = page.facts
        if len(f["h1"]) != 1 or not f["h1"][0].strip("¶ "):
            yield f"expected one visible h1, found {f['h1']}"
        for level in (2, 3):
            want = headings(page.source, level)
            if f[f"h{level}"] != want:
                yield f"{f[f'h{level}']} h{level} on the page, {want} in {page.source.name}"

    _check_all(rendered, check)


def test_every_mermaid_block_renders_to_svg_without_overlapping_labels(rendered):
    assert any(p.diagrams for p in rendered), "no mermaid diagram found on any page"

    def check(page):
        want = len(mermaid_blocks(page.source))
        if len(page.diagrams) != want:
            yield f"{len(page.diagrams)} diagrams rendered, {want} mermaid blocks in the source"
        for i, d in enumerate(page.diagrams, 1):
            if d["error"] or d["width"] < 50 or d["height"] < 50:
                yield f"diagram {i} did not render: {d}"
            elif d["labels"] < 2:
                yield f"diagram {i}: only {d['labels']} text boxes found"
            for overlap in d["overlaps"]:
                yield f"diagram {i}: text boxes overlap: {overlap}"

    _check_all(rendered, check)


def test_every_diagram_fits_the_column_with_legible_text(rendered):
    assert any(p.diagrams for p in rendered), "no mermaid diagram found on any page"

    def check(page):
        for i, d in enumerate(page.diagrams, 1):
            if d["width"] > d["column"] + 1:
                yield f"diagram {i} is {d['width']:.0f} px wide, its column {d['column']} px"
            for scrolling in d["scrolls"]:
                yield f"diagram {i} scrolls sideways: {scrolling}"
            small = d["smallest"]
            if small["px"] < MIN_TEXT_PX:
                yield (
                    f"diagram {i}, scaled to {d['scale']:.2f} to fit, draws {small['text']!r} "
                    f"at {small['px']:.1f} px (< {MIN_TEXT_PX}): shorten or break its labels"
                )

    _check_all(rendered, check)


def test_every_snippet_is_rendered_as_code(rendered):
    assert any(snippets(p.source) for p in rendered), "no snippet found in any source"

    def squash(text):
        return " ".join(text.split())

    def check(page):
        code = [squash(c) for c in page.facts["code"]]
        if any('--8<-- "' in c for c in code):
            yield "a snippet marker was rendered instead of the code it names"
        for spec in snippets(page.source):
            line = squash(first_line_of(spec))
            if not any(line in c for c in code):
                yield f"snippet {spec}: {line!r} is in no highlighted code block"

    _check_all(rendered, check)


def test_every_notebook_page_shows_its_outputs_and_figures(rendered, site):
    notebooks = [p for p in rendered if p.is_notebook]
    assert len(notebooks) == len(list(NOTEBOOKS.glob("*.ipynb")))

    def check(page):
        if not page.is_notebook:
            return
        f, executed = page.facts, executed_notebook(site, page)
        if f["outputs"] < 1 or f["output_text"] == 0:
            yield "no output shown"
        if f["outputs"] != output_count(executed):
            yield f"{f['outputs']} outputs shown, {output_count(executed)} in the notebook"
        shown, pngs = figures_shown(page.source), png_outputs(executed)
        if not shown == pngs == len(f["images"]):
            yield (
                f"{len(f['images'])} <img> on the page, {pngs} PNG outputs in the executed "
                f"notebook, {shown} show() calls in its source"
            )
        if not all(img["loaded"] and img["width"] > 100 for img in f["images"]):
            yield f"a figure did not load: {f['images']}"

    _check_all(rendered, check)


def test_no_code_block_is_cut_off_and_no_page_is_wider_than_the_window(rendered):
    def check(page):
        for text in page.facts["cut"]:
            yield f"a code block runs past its box with no way to scroll it: {text!r}"
        if page.facts["page_overflow"] > 1:
            yield f"the page is {page.facts['page_overflow']} px wider than the window"

    _check_all(rendered, check)


def test_no_page_has_a_script_error(rendered):
    _check_all(rendered, lambda page: (f"uncaught: {e}" for e in page.errors))


@pytest.mark.parametrize("query", ["泄漏", "wait_for_ack"])
def test_the_search_box_finds_the_chapter(browser, server, query):
    tab = browser.new_page(viewport={"width": 1280, "height": 900})
    try:
        tab.goto(server, wait_until="load")
        box = tab.locator("input.md-search__input")
        box.click()
        tab.wait_for_function(SEARCH_READY, timeout=60_000)  # the index is loaded
        box.press_sequentially(query, delay=30)  # typed, as a reader does
        # Chinese arrives as inserted text, without key events; an IME commits it with a key
        # press, and material's search reads the box on keyup: press one that types nothing
        box.press("End")
        results = tab.locator(".md-search-result__item a")
        results.first.wait_for(timeout=20_000)
        hrefs = [a.get_attribute("href") or "" for a in results.all()]
    finally:
        tab.close()
    assert any(CHAPTER_PAGE in h for h in hrefs), f"{query!r}: results {hrefs}"
