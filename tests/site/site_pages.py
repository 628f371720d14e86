"""The chapter site's sources and built pages, as the site tests read them.

- `Page`: one built page (its URL under the site root) and the .md or .ipynb it came from;
  `source_of(url)` finds that source; `executed_notebook` reads the notebook copy the build
  executed (offered for download beside the page).
- Reading a source: `markdown_of` (a notebook's markdown cells joined), `outside_fences`,
  `fences` (each fenced block with its language and whether a `??? ` fold holds it),
  `headings`, `mermaid_blocks`, `snippets` (the `--8<-- "file[:section]"` lines inside
  code blocks), `first_line_of(spec)` (the first line such a snippet quotes).
- Reading a built page: `HtmlPage` (its ids, links, code blocks and text, from the HTML
  file).
"""

from __future__ import annotations

import html
import json
import re
from dataclasses import dataclass, field
from html.parser import HTMLParser
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CHAPTERS = ROOT / "chapters"
NOTEBOOKS = ROOT / "notebooks"
SAMPLES = CHAPTERS / "generated" / "samples"
SNIPPET = re.compile(r'^(\s*)--8<--\s+"([^"]+)"\s*$')


@dataclass
class Page:
    url: str  # relative to the site root, "" for the home page
    source: Path  # the .md or .ipynb it was built from
    facts: dict = field(default_factory=dict)
    diagrams: list = field(default_factory=list)
    errors: list = field(default_factory=list)

    @property
    def is_notebook(self) -> bool:
        return self.source.suffix == ".ipynb"


def source_of(url: str) -> Path | None:
    """The file a page was built from (use_directory_urls: foo/bar/ <- foo/bar.md)."""
    stem = url.rstrip("/") or "index"
    for candidate in (CHAPTERS / f"{stem}.md", CHAPTERS / stem / "index.md"):
        if candidate.is_file():
            return candidate
    if stem.startswith("notebooks/") and (NOTEBOOKS / f"{stem[10:]}.ipynb").is_file():
        return NOTEBOOKS / f"{stem[10:]}.ipynb"
    return None


def pages_of(site: Path) -> list[Page]:
    found = []
    for index in sorted(site.rglob("index.html")):
        rel = index.parent.relative_to(site).as_posix()
        url = "" if rel == "." else f"{rel}/"
        if url.startswith(("assets/", "search/")):
            continue
        source = source_of(url)
        assert source is not None, f"page {url or '/'}: no source found for it"
        found.append(Page(url, source))
    return found


def executed_notebook(site: Path, page: Page) -> dict:
    """The notebook the page offers for download: the copy executed by the build."""
    return json.loads((site / page.url / page.source.name).read_text(encoding="utf-8"))


# ------------------------------------------------------------------ sources
def markdown_of(source: Path) -> str:
    if source.suffix == ".ipynb":
        cells = json.loads(source.read_text(encoding="utf-8"))["cells"]
        return "\n\n".join("".join(c["source"]) for c in cells if c["cell_type"] == "markdown")
    return source.read_text(encoding="utf-8")


@dataclass
class Fence:
    lang: str
    body: list[str]  # the lines between the fences
    start: int  # line number (0-based) of the opening fence
    folded: bool  # inside a `??? ` (collapsed) admonition


def fences(text: str) -> list[Fence]:
    """Every fenced code block of a markdown text, in order."""
    found, lines = [], text.splitlines()
    fold_indent = None  # indentation of the body of the `??? ` block we are in
    i = 0
    while i < len(lines):
        line = lines[i]
        stripped = line.lstrip()
        indent = len(line) - len(stripped)
        if stripped and fold_indent is not None and indent < fold_indent:
            fold_indent = None
        if stripped.startswith("??? "):
            fold_indent = indent + 4
        elif stripped.startswith(("```", "~~~")):
            mark, lang = stripped[:3], stripped[3:].strip()
            j = i + 1
            while j < len(lines) and not lines[j].lstrip().startswith(mark):
                j += 1
            found.append(Fence(lang, lines[i + 1 : j], i, fold_indent is not None))
            i = j
        i += 1
    return found


def outside_fences(text: str) -> list[str]:
    lines, fence = [], None
    for line in text.splitlines():
        stripped = line.lstrip()
        if fence is None and stripped.startswith(("```", "~~~")):
            fence = stripped[:3]
        elif fence is not None and stripped.startswith(fence):
            fence = None
        elif fence is None:
            lines.append(line)
    return lines


def headings(source: Path, level: int) -> int:
    mark = "#" * level + " "
    return sum(line.startswith(mark) for line in outside_fences(markdown_of(source)))


def mermaid_blocks(source: Path) -> list[str]:
    return re.findall(r"^\s*```mermaid\s*$", markdown_of(source), flags=re.M)


def snippets(source: Path) -> list[str]:
    """The snippets that a page shows as code: `--8<-- "..."` lines inside code blocks."""
    return [
        m[2] for f in fences(markdown_of(source)) for line in f.body if (m := SNIPPET.match(line))
    ]


def first_line_of(spec: str) -> str:
    """The first non-blank line that the snippet `file[:section]` quotes."""
    path, _, section = spec.partition(":")
    lines = (ROOT / path).read_text(encoding="utf-8").splitlines()
    if section:
        start = next(i for i, s in enumerate(lines) if f"--8<-- [start:{section}]" in s)
        lines = lines[start + 1 :]
    return next(s.strip() for s in lines if s.strip() and "--8<--" not in s)


def figures_shown(source: Path) -> int:
    """`show(...)` calls in the code cells: each one displays one figure (helpers.show)."""
    cells = json.loads(source.read_text(encoding="utf-8"))["cells"]
    code = "\n".join("".join(c["source"]) for c in cells if c["cell_type"] == "code")
    return len(re.findall(r"^\s*show\(", code, flags=re.M))


def png_outputs(notebook: dict) -> int:
    return sum(
        "image/png" in o.get("data", {}) for c in notebook["cells"] for o in c.get("outputs", [])
    )


def output_count(notebook: dict) -> int:
    return sum(len(c.get("outputs", [])) for c in notebook["cells"])


# ------------------------------------------------------------------ built pages
class HtmlPage(HTMLParser):
    """A built page as its HTML file says: element ids, links (href of <a>, src of <img>)
    and the text of every <pre> block (tags stripped, entities decoded)."""

    def __init__(self, path: Path) -> None:
        super().__init__(convert_charrefs=True)
        self.path = path
        self.ids: set[str] = set()
        self.links: list[str] = []
        self.pre: list[str] = []
        self._in_pre = 0
        self._text: list[str] = []
        self._all: list[str] = []
        self.feed(path.read_text(encoding="utf-8"))
        self.text = html.unescape("".join(self._all))  # every text node, tags stripped

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if attrs.get("id"):
            self.ids.add(attrs["id"])
        if tag == "a" and attrs.get("name"):
            self.ids.add(attrs["name"])
        if tag == "a" and attrs.get("href") is not None:
            self.links.append(attrs["href"])
        if tag == "img" and attrs.get("src"):
            self.links.append(attrs["src"])
        if tag == "pre":
            self._in_pre += 1
            if self._in_pre == 1:
                self._text = []

    def handle_endtag(self, tag):
        if tag == "pre" and self._in_pre:
            self._in_pre -= 1
            if not self._in_pre:
                self.pre.append(html.unescape("".join(self._text)))

    def handle_data(self, data):
        self._all.append(data)
        if self._in_pre:
            self._text.append(data)
