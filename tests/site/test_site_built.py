"""The built chapter site against the real run it was built from, and against itself.
No browser: these read the sources, the sample session's files and the built HTML.

Contract:
- The pages' real outputs come from the run this build made: the sample session
  (notebooks/site_samples.py) started after the build began; every sample a page includes
  exists, is no stand-in, and its text is on the built page (a code block equal to it, or
  the sentence in the page's text).
- Every field table marked `<!-- fields: NAME -->` names exactly the fields that run's
  server sent: `lifecycle` (GET /debug/lifecycle), `chat_chunk` (every chunk of a chat
  stream with usage), `metrics` (the metric families of /metrics). A field the server sends
  and the table omits fails, and so does a field in the table the server does not send.
  `code:module.Class` tables name exactly the fields of that dataclass or Struct.
- No page (Markdown or a notebook's Markdown) shows hand-pasted server output: a code
  block that looks like an SSE stream, an HTTP status line, a /debug/lifecycle or
  completion body, an error body, /metrics lines, log lines or a shell prompt must be a
  sample included from the run.
- Every internal link of every built page (<a href>, <img src>), notebooks included,
  resolves to a file of the site, and its #fragment to an id on the target page.
- The middleware section of beyond/http-edge.md names every route the API key protects
  (`minisgl.server.middleware.PROTECTED` and `PAGES`, and the operator's routes,
  `minisgl.server.tenants.OPERATOR_ROUTES`).
- No Markdown page is over `MAX_PAGE_CHARS` characters but those still to be split by
  topic (`TO_SPLIT`, now empty); beyond/, architecture/ and http-and-concurrency/6-gaps/
  hold the pages split from the long ones.
- The walkthrough (every page of http-and-concurrency/) is at most `WALKTHROUGH_MAX_CHARS`
  characters in all.
- Each quiz question's exercise is offered (a 动手 box naming its file and
  `pytest tests/quiz --learner -m qN`) on the chapter page that introduces its idea, and
  the code that answers it (the quiz's reference solution, the minimal design, and
  minisgl's) appears on the site only folded ("看 minisgl 的写法"), after the box; the built
  page renders the box as an admonition and the fold closed. Read in the nav's order, the
  boxes come q1, q2, ... q7.
- No executed notebook shows anything on stderr.
- No list item is swallowed by the paragraph before it (a `4.` or `-` line that Markdown
  took as a continuation, for want of a blank line).
"""

from __future__ import annotations

import json
import re
from functools import cache
from pathlib import Path
from urllib.parse import unquote, urljoin, urlsplit

import pytest
from site_pages import (
    CHAPTERS,
    NOTEBOOKS,
    ROOT,
    SAMPLES,
    SNIPPET,
    HtmlPage,
    Page,
    executed_notebook,
    fences,
    markdown_of,
    outside_fences,
)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]

PLACEHOLDER = "这段输出在完整构建时由真实的服务生成"
CHAPTER = CHAPTERS / "http-and-concurrency"

# the minisgl code that answers each quiz question: shown only folded, after its box
ANSWERED_BY = {
    "q1": [
        "tests/quiz/solutions/q1_off_the_loop.py:off_the_loop",
        "minisgl/utils/zmq.py:push_put",
        "minisgl/utils/zmq.py:async_pull_get",
    ],
    "q2": [
        "tests/quiz/solutions/q2_request_fields.py:tokenize_msg",
        "minisgl/server/chat.py:chat_route",
        "minisgl/server/response.py:respond",
    ],
    "q3": [
        "tests/quiz/solutions/q3_buffer_and_event.py:reply_inbox",
        "minisgl/server/buffer.py:reply_buffer",
    ],
    "q4": [
        "tests/quiz/solutions/q4_consumer_loop.py:consumer_loop",
        "minisgl/server/frontend.py:wait_for_ack",
    ],
    "q5": ["tests/quiz/solutions/q5_route_by_uid.py:route", "minisgl/server/frontend.py:listen"],
    "q6": [
        "tests/quiz/solutions/q6_sse_stream.py:stream_chat",
        "minisgl/server/response.py:stream_serve",
        "minisgl/server/formats.py:chunks",
    ],
    "q7": [
        "tests/quiz/solutions/q7_request_scope.py:request_scope",
        "minisgl/server/frontend.py:request_scope",
    ],
}
EXERCISE_FILES = {
    "q1": "q1_off_the_loop.py",
    "q2": "q2_request_fields.py",
    "q3": "q3_buffer_and_event.py",
    "q4": "q4_consumer_loop.py",
    "q5": "q5_route_by_uid.py",
    "q6": "q6_sse_stream.py",
    "q7": "q7_request_scope.py",
}

# what server output looks like, line by line
OUTPUT = re.compile(
    r"""^\s*(
      data:\ [\[{]                                  # an SSE event
    | HTTP/\d(\.\d)?\ \d{3}\b                       # a status line
    | \{\s*"(frontend|id|error|prompt_tokens|status|flushed_pages)"\s*:   # a JSON answer
    | minisgl_[a-z0-9_]+(\{[^}]*\})?\ [-+0-9.e]+$   # a /metrics line
    | .*\ (INFO|WARNING|ERROR)\ +\S                 # a log line
    | >>>\ \S                                       # the shell's prompt, answered
    )""",
    re.X,
)


def sources() -> list[Path]:
    md = [p for p in CHAPTERS.rglob("*.md") if "generated" not in p.relative_to(CHAPTERS).parts]
    return sorted(md) + sorted(NOTEBOOKS.glob("*.ipynb"))


def squash(text: str) -> str:
    return " ".join(text.split())


@cache
def html_page(path: Path) -> HtmlPage:
    return HtmlPage(path)


def built(site: Path, source: Path) -> Path:
    """The index.html a source was built into."""
    if source.suffix == ".ipynb":
        return site / "notebooks" / source.stem / "index.html"
    rel = source.relative_to(CHAPTERS).with_suffix("")
    if rel.name == "index":
        rel = rel.parent
    return site / rel / "index.html"


# ------------------------------------------------------------------ samples from this build
def included_samples(source: Path) -> list[tuple[str, bool]]:
    """(sample file name, shown as code) for each sample the source includes."""
    text = markdown_of(source)
    in_code = {m[2] for f in fences(text) for line in f.body if (m := SNIPPET.match(line))}
    found = []
    for line in text.splitlines():
        m = SNIPPET.match(line)
        if m and m[2].startswith("chapters/generated/samples/"):
            found.append((m[2].rsplit("/", 1)[1], m[2] in in_code))
    return found


def test_the_samples_come_from_the_run_this_build_made(site, site_build_started):
    manifest = json.loads((SAMPLES / "manifest.json").read_text())
    if site_build_started is not None:
        assert manifest["started_at"] >= site_build_started, (
            "the samples are older than this build: the build did not run the sample session"
        )
    assert manifest["finished_at"] >= manifest["started_at"]
    shown = 0
    for source in sources():
        page = built(site, source)
        for name, as_code in included_samples(source):
            sample = (SAMPLES / name).read_text(encoding="utf-8")
            assert PLACEHOLDER not in sample, f"{name} is a stand-in, not a sample of the run"
            html = html_page(page)
            if as_code:
                blocks = {squash(b) for b in html.pre}
                assert squash(sample) in blocks, f"{page}: no code block shows {name} as it is"
            else:
                assert squash(sample.replace("`", "")) in squash(html.text), (
                    f"{page}: the sentence of {name} is not on the page"
                )
            shown += 1
    assert shown >= 20, f"only {shown} samples included in the pages"


# ------------------------------------------------------------------ field tables
def flat(value, prefix: str = "") -> set[str]:
    """Every key path of a JSON value: a.b, and a list's items under the list's own name."""
    names = set()
    if isinstance(value, dict):
        for key, inner in value.items():
            path = f"{prefix}.{key}" if prefix else key
            names |= {path} | flat(inner, path)
    elif isinstance(value, list):
        for item in value:
            names |= flat(item, prefix)
    return names


def live_fields(name: str) -> set[str]:
    if name.startswith("code:"):  # a class of the package: its dataclass or Struct fields
        import dataclasses
        import importlib

        module, _, cls = name[len("code:") :].rpartition(".")
        obj = getattr(importlib.import_module(module), cls)
        if dataclasses.is_dataclass(obj):
            return {f.name for f in dataclasses.fields(obj)}
        return set(obj.__struct_fields__)
    live = json.loads((SAMPLES / "live.json").read_text())
    if name == "lifecycle":
        return {n for n in flat(live["lifecycle"]) if "." in n}  # the leaves under a component
    if name == "chat_chunk":
        return set().union(*(flat(chunk) for chunk in live["chat_chunks"]))
    if name == "metrics":
        types = re.findall(r"^# TYPE (\S+) \S+", live["metrics"], flags=re.M)
        return {t for t in types if t.startswith("minisgl_") and not t.endswith("_created")}
    raise KeyError(name)


def field_tables() -> list[tuple[Path, str, set[str]]]:
    """(source, table name, the field names its first column lists) per marked table."""
    found = []
    for source in sources():
        lines = outside_fences(markdown_of(source))
        for i, line in enumerate(lines):
            m = re.match(r"\s*<!-- fields: ([a-z_]+|code:[\w.]+) -->", line)
            if not m:
                continue
            rows = []
            for row in lines[i + 1 :]:
                if row.startswith("|"):
                    rows.append(row)
                elif rows or row.strip():
                    break
            names = set()
            for row in rows[2:]:  # past the header and its separator
                first = row.split("|")[1]
                parent = ""
                for name in re.findall(r"`([^`]+)`", first):
                    name = re.sub(r"\{.*\}", "", name).replace("[]", "").split(":")[0].strip()
                    if "." not in name and parent:
                        name = f"{parent}.{name}"
                    parent = name.rsplit(".", 1)[0] if "." in name else ""
                    names.add(name)
            found.append((source, m[1], names))
    return found


def test_field_tables_name_exactly_the_fields_the_live_server_sends(site):
    tables = field_tables()
    assert {name for _, name, _ in tables} >= {"lifecycle", "chat_chunk", "metrics"}
    problems = []
    for source, name, names in tables:
        live = live_fields(name)
        where = source.relative_to(ROOT)
        if missing := sorted(live - names):
            problems.append(f"{where} ({name}): the server sends {missing}, the table omits them")
        if extra := sorted(names - live):
            problems.append(f"{where} ({name}): the table shows {extra}, the server sends none")
    assert not problems, "\n".join(problems)


# ------------------------------------------------------------------ no hand-pasted output
def test_no_page_shows_hand_pasted_output():
    found = []
    for source in sources():
        for fence in fences(markdown_of(source)):
            if fence.lang == "mermaid" or any(SNIPPET.match(line) for line in fence.body):
                continue
            for line in fence.body:
                if OUTPUT.match(line):
                    found.append(f"{source.relative_to(ROOT)}: {line.strip()[:80]}")
    assert not found, "server output pasted by hand, not included from the run:\n" + "\n".join(
        found
    )


# ------------------------------------------------------------------ links
def test_every_internal_link_resolves(site):
    broken = []
    pages = [p for p in site.rglob("*.html") if "assets" not in p.relative_to(site).parts]
    assert len(pages) > 15
    for page in pages:
        base = "/" + page.relative_to(site).as_posix()
        for href in html_page(page).links:
            parts = urlsplit(href)
            if parts.scheme or href.startswith(("//", "mailto:")) or not href:
                continue
            target = urlsplit(urljoin(base, href))
            path = unquote(target.path)
            file = site / path.lstrip("/")
            if path.endswith("/"):
                file = file / "index.html"
            elif not file.exists() and (file / "index.html").exists():
                file = file / "index.html"
            where = f"{page.relative_to(site)}: {href}"
            if not file.is_file():
                broken.append(f"{where} (no {path})")
            elif target.fragment and file.suffix == ".html":
                if unquote(target.fragment) not in html_page(file).ids:
                    broken.append(f"{where} (no #{unquote(target.fragment)} there)")
    assert not broken, "dead links:\n" + "\n".join(broken)


# ------------------------------------------------------------------ the key's routes
def test_every_route_behind_the_api_key_is_named_where_the_key_is_explained():
    from minisgl.server.middleware import PAGES, PROTECTED
    from minisgl.server.tenants import OPERATOR_ROUTES

    text = (CHAPTERS / "beyond" / "http-edge.md").read_text()
    section = text[text.index("{#middleware}") :]
    section = section[: section.index("\n## ")]
    tokens = {tok for code in re.findall(r"`([^`]+)`", section) for tok in code.split()}
    routes = {p.rstrip("/") for p in (*PROTECTED, *OPERATOR_ROUTES)} | set(PAGES)
    missing = sorted(
        r for r in routes if not any(tok.rstrip("*").rstrip("/") == r.rstrip("/") for tok in tokens)
    )
    assert not missing, (
        f"beyond/http-edge.md#middleware does not name {missing} among the key's routes"
    )


# ------------------------------------------------------------------ page length
# Every Markdown page under chapters/ (generated/ excluded) is at most MAX_PAGE_CHARS
# characters (characters, not bytes), but for the pages still to be split by topic, named in
# TO_SPLIT (paths relative to chapters/). None is left: beyond.md, architecture.md and
# http-and-concurrency/6-gaps.md were split into folders of pages; a page that grows past
# the limit is split the same way, not added here.
MAX_PAGE_CHARS = 15_000
TO_SPLIT: set[str] = set()

# the pages split from the long ones: each folder's index and its topic pages
SPLIT_PAGES = {
    "beyond": "index load http-edge observability drain generation openai engine"
    " parallel-and-quantization",
    "architecture": "index processes request-path rules-1-4 rules-5-7",
    "http-and-concurrency/6-gaps": "index early-exit cancellation non-streaming-disconnect"
    " decode-state-leak over-long-prompt slow-client",
}


def test_no_page_is_over_the_length_limit():
    pages = [p for p in sources() if p.suffix == ".md"]
    for folder, names in SPLIT_PAGES.items():
        missing = [n for n in names.split() if not (CHAPTERS / folder / f"{n}.md").is_file()]
        assert not missing, f"{folder}/ is split into its topics: no {missing}"
        assert not (CHAPTERS / f"{folder}.md").exists(), f"{folder}.md is split, yet still there"
    long = [
        f"{page.relative_to(CHAPTERS)}: {n} characters"
        for page in pages
        if str(page.relative_to(CHAPTERS)) not in TO_SPLIT
        and (n := len(page.read_text(encoding="utf-8"))) > MAX_PAGE_CHARS
    ]
    assert not long, f"pages over {MAX_PAGE_CHARS} characters:\n" + "\n".join(long)


# ------------------------------------------------------------------ exercises before answers
def boxes(source: Path) -> list[tuple[int, str, str]]:
    """(line, question, box text) for each 动手 box of a page."""
    lines = markdown_of(source).splitlines()
    found = []
    for i, line in enumerate(lines):
        if line.startswith('!!! example "动手'):
            body = [line]
            for more in lines[i + 1 :]:
                if more.strip() and not more.startswith("    "):
                    break
                body.append(more)
            text = "\n".join(body)
            questions = set(re.findall(r"-m (q\d)\b", text))
            assert len(questions) == 1, f"{source}: a 动手 box names {questions or 'no question'}"
            found.append((i, questions.pop(), text))
    return found


def test_every_exercise_is_offered_before_the_code_that_answers_it(site):
    offered = {}
    for source in sorted(CHAPTER.rglob("*.md")):  # 6-gaps/ included
        for line, question, text in boxes(source):
            assert question not in offered, f"{question} is offered twice"
            offered[question] = (source, line)
            assert f"tests/quiz/exercises/{EXERCISE_FILES[question]}" in text, (
                f"{source.name}: the box of {question} does not name its exercise file"
            )
            assert f"pytest tests/quiz --learner -m {question}" in text
    assert sorted(offered) == sorted(EXERCISE_FILES), (
        f"no 动手 box for {set(EXERCISE_FILES) - set(offered)}"
    )

    for source in sources():
        text = markdown_of(source)
        for fence in fences(text):
            for line in fence.body:
                m = SNIPPET.match(line)
                spec = m[2] if m else None
                question = next((q for q, specs in ANSWERED_BY.items() if spec in specs), None)
                if question is None:
                    continue
                where = f"{source.relative_to(ROOT)}: {spec}"
                assert fence.folded, f"{where}: the answer to {question} is shown unfolded"
                box_source, box_line = offered[question]
                assert source == box_source and fence.start > box_line, (
                    f"{where}: the answer to {question} is not after its 动手 box"
                )
        # each box is followed by its fold before the next heading
        lines = text.splitlines()
        for line, question, _ in boxes(source):
            rest = lines[line + 1 :]
            upto = next((i for i, ln in enumerate(rest) if ln.startswith("#")), len(rest))
            assert any(ln.startswith('??? note "看 minisgl 的写法') for ln in rest[:upto]), (
                f"{source.name}: no folded 看 minisgl 的写法 after the box of {question}"
            )
        if boxes(source):
            page = built(site, source).read_text(encoding="utf-8")
            assert page.count('class="admonition example"') == len(boxes(source))
            folds = re.findall(
                r"<details class=\"note\"( open)?>\s*<summary>看 minisgl 的写法", page
            )
            assert len(folds) >= len(boxes(source)) and not any(folds), (
                f"{source.name}: the folds are missing or open"
            )


# ------------------------------------------------------------------ notebooks
def test_no_executed_notebook_writes_to_stderr(site):
    noisy = []
    for source in sorted(NOTEBOOKS.glob("*.ipynb")):
        notebook = executed_notebook(site, Page(f"notebooks/{source.stem}/", source))
        for i, cell in enumerate(notebook["cells"]):
            for out in cell.get("outputs", []):
                if out.get("output_type") == "stream" and out.get("name") == "stderr":
                    noisy.append(f"{source.name} cell {i}: {''.join(out['text'])[:120]!r}")
    assert not noisy, "stderr on a notebook page:\n" + "\n".join(noisy)


# ------------------------------------------------------------------ rendering
def test_no_list_item_is_swallowed_by_the_paragraph_before_it(site):
    swallowed = []
    for page in sorted(site.rglob("index.html")):
        html = page.read_text(encoding="utf-8")
        for body in re.findall(r"<p>(.*?)</p>", html, flags=re.S):
            text = re.sub(r"<[^>]+>", "", body)
            if m := re.search(r"\n\s*(\d+\.|[-*]) \S.{0,40}", text):
                swallowed.append(f"{page.relative_to(site)}: {m[0].strip()!r}")
    assert not swallowed, "list items rendered as paragraph text:\n" + "\n".join(swallowed)


WALKTHROUGH_MAX_CHARS = 40_000


def test_the_walkthrough_is_at_most_its_budget():
    pages = sorted(CHAPTER.rglob("*.md"))
    sizes = {str(p.relative_to(CHAPTER)): len(p.read_text(encoding="utf-8")) for p in pages}
    assert sum(sizes.values()) <= WALKTHROUGH_MAX_CHARS, (
        f"the walkthrough is {sum(sizes.values())} characters, over {WALKTHROUGH_MAX_CHARS}: "
        + ", ".join(f"{name} {n}" for name, n in sorted(sizes.items(), key=lambda kv: -kv[1]))
    )


def nav_pages() -> list[Path]:
    """The Markdown pages in the order of mkdocs.yml's nav: the order a reader meets them."""
    after = (ROOT / "mkdocs.yml").read_text(encoding="utf-8").split("\nnav:\n", 1)[1]
    nav = re.split(r"^\S", after, maxsplit=1, flags=re.M)[0]  # up to the next top-level key
    return [CHAPTERS / m[1] for m in re.finditer(r":\s+(\S+\.md)\s*$", nav, re.M)]


def test_the_exercises_come_in_reading_order():
    """Read page by page in the nav's order, the 动手 boxes are q1, q2, ... q7."""
    met = [question for page in nav_pages() for _, question, _ in boxes(page)]
    assert met == sorted(EXERCISE_FILES), f"a reader meets the exercises in the order {met}"
