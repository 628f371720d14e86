"""mkdocs hook (mkdocs.yml `hooks:`): the site shows each notebook as it runs now.

Contract:
- On every build, before the pages are rendered, each notebook page's .ipynb is executed
  top to bottom with nbclient: kernel from the notebook's metadata, working directory
  notebooks/ (so `from helpers import ...` and `from naive import ...` work), at most
  `CELL_TIMEOUT` seconds per cell, no error allowed. mkdocs-jupyter (`execute: false`)
  then renders the executed copy, outputs and figures included, and the page's download
  link serves that copy too. The copies live in a temporary folder, removed after the build.
- A cell that raises, a cell past the timeout, or a kernel that dies fails the build,
  naming the notebook and the error.
- Each notebook's execution time is logged at INFO (`mkdocs build` shows it).
- Figures a notebook saves for the chapter's pages (into chapters/generated/, which git
  ignores) join the site's files after the notebooks have run, so the pages that show
  them always show this build's run.
- The chapter's sample outputs (curl and SSE transcripts, JSON bodies, /debug/lifecycle,
  /metrics, the shell) come from one session against one real server, run once per
  build after the notebooks (notebooks/site_samples.py), into chapters/generated/samples/,
  where the pages include them from (`--8<-- "chapters/generated/samples/NAME"`). A
  session that fails fails the build. Its time is logged too.
- On each notebook page, two repairs of what mkdocs-jupyter writes: its headings get ids
  (it gives Chinese headings an empty one, and its table of contents links to ids no
  heading has), the same ids a Markdown page would give them, with the table of contents
  pointing at them; and a link written for the repository (`../chapters/PAGE.md#id`,
  which works from notebooks/ in Jupyter) points at that page of the site.
- `MINISGL_SITE_EXECUTE=0` skips the execution, for a quick local preview: the notebook
  pages then show no outputs, the chapter's generated figures and samples are those of the
  last build, and samples never made are stand-ins saying so. CI and the site test never
  set it.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import tempfile
import time
from pathlib import Path

from mkdocs.exceptions import PluginError
from mkdocs.plugins import event_priority

CELL_TIMEOUT = 600  # seconds for one cell; the slowest (a real server's start) takes ~30
GENERATED = "generated"  # under the docs folder: figures the notebooks make for the pages
SAMPLES = "samples"  # under GENERATED: the sample session's outputs (included, not copied)
NOTEBOOKS = Path(__file__).resolve().parent

log = logging.getLogger(f"mkdocs.plugins.{__name__}")
_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_tmp: str | None = None


def execute(src: Path, dest: Path) -> float:
    """Run the notebook at `src` top to bottom, write it with its outputs to `dest`, and
    return the seconds it took; raise PluginError if any cell fails."""
    import nbformat
    from nbclient import NotebookClient

    nb = nbformat.read(src, as_version=4)
    client = NotebookClient(
        nb,
        timeout=CELL_TIMEOUT,
        kernel_name=nb.metadata.get("kernelspec", {}).get("name", "python3"),
        allow_errors=False,
        resources={"metadata": {"path": str(NOTEBOOKS)}},  # the kernel's working directory
    )
    start = time.perf_counter()
    try:
        client.execute()
    except Exception as exc:  # CellExecutionError, CellTimeoutError, DeadKernelError
        raise PluginError(f"notebook {src.name} failed:\n{_ANSI.sub('', str(exc))}") from exc
    nbformat.write(nb, dest)
    return time.perf_counter() - start


# after mkdocs-jupyter's on_files (priority 0), which wraps each notebook file
@event_priority(-100)
def on_files(files, config):
    global _tmp
    samples = Path(config["docs_dir"]) / GENERATED / SAMPLES
    if os.environ.get("MINISGL_SITE_EXECUTE", "1") == "0":
        log.info("MINISGL_SITE_EXECUTE=0: notebook pages show no outputs")
        _samples_module().placeholders(samples)
        return files
    _cleanup()
    _tmp = tempfile.mkdtemp(prefix="site-notebooks-")  # not minisgl-*: those are IPC dirs
    for file in sorted(files, key=lambda f: f.src_uri):
        if not file.src_uri.endswith(".ipynb"):
            continue
        src = Path(file.abs_src_path)
        dest = Path(_tmp) / src.name
        seconds = execute(src, dest)
        log.info("executed %s in %.1f s", file.src_uri, seconds)
        file.abs_src_path = str(dest)  # what mkdocs-jupyter renders and offers for download
    _add_generated(files, config)
    start = time.perf_counter()
    try:
        _samples_module().run(samples)
    except Exception as exc:
        raise PluginError(f"the sample session failed: {exc!r}") from exc
    log.info("ran the sample session in %.1f s", time.perf_counter() - start)
    return files


def _samples_module():
    """notebooks/site_samples.py (the hook's folder is not on sys.path)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("site_samples", NOTEBOOKS / "site_samples.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _add_generated(files, config) -> None:
    """Figures the notebooks wrote for the chapter (chapters/generated/) join the site."""
    from mkdocs.structure.files import File

    docs = Path(config["docs_dir"])
    for path in sorted(p for p in (docs / GENERATED).glob("*") if p.is_file()):
        uri = path.relative_to(docs).as_posix()
        if files.get_file_from_path(uri) is None:
            files.append(File(uri, str(docs), config["site_dir"], config["use_directory_urls"]))


_HEADING = re.compile(r'<h([1-6]) id="([^"]*)">(.*?)</h\1>', re.S)
_REPO_LINK = re.compile(r'href="\.\./chapters/([^"#]+)\.md(#[^"]*)?"')


def on_post_page(output: str, page, config) -> str:
    if not page.file.src_uri.endswith(".ipynb"):
        return output
    return _site_links(_heading_ids(output, page))


def _heading_ids(output: str, page) -> str:
    """Give each heading the id a Markdown page would (pymdownx slugify, lower case) and
    point the table of contents, which lists the headings in the same order, at them."""
    from pymdownx.slugs import slugify

    slug = slugify(case="lower")
    toc_ids: list[str] = []

    def walk(items) -> None:
        for item in items:
            toc_ids.append(item.id)
            walk(item.children)

    walk(page.toc)
    headings = list(_HEADING.finditer(output))
    if len(headings) != len(toc_ids):
        log.warning("%s: %d headings, %d entries in its contents: ids left as they are",
                    page.file.src_uri, len(headings), len(toc_ids))  # fmt: skip
        return output
    seen: set[str] = set()
    new_ids = []
    for m in headings:
        text = re.sub(r"<[^>]+>", "", m[3]).replace("¶", "").strip()
        base = new = slug(text, "-") or "section"
        n = 1
        while new in seen:
            new, n = f"{base}_{n}", n + 1
        seen.add(new)
        new_ids.append(new)
    out, last = [], 0
    for m, new in zip(headings, new_ids):
        body = m[3].replace(
            f'class="anchor-link" href="#{m[2]}"', f'class="anchor-link" href="#{new}"'
        )
        out.append(output[last : m.start()] + f'<h{m[1]} id="{new}">{body}</h{m[1]}>')
        last = m.end()
    output = "".join(out) + output[last:]
    renamed = dict(zip(toc_ids, new_ids))  # contents, "skip to content": every #old link
    return re.sub(r'href="#([^"]*)"', lambda m: f'href="#{renamed.get(m[1], m[1])}"', output)


def _site_links(output: str) -> str:
    """`../chapters/PAGE.md#id` (relative to notebooks/ in the repository) -> the page's
    URL relative to the notebook's page (notebooks/NAME/)."""

    def url(m) -> str:
        path = m[1][: -len("index")] if m[1].endswith("index") else m[1] + "/"
        return f'href="../../{path}{m[2] or ""}"'

    return _REPO_LINK.sub(url, output)


def on_post_build(config):
    _cleanup()


def on_build_error(error):
    _cleanup()


def _cleanup() -> None:
    global _tmp
    if _tmp is not None:
        shutil.rmtree(_tmp, ignore_errors=True)
        _tmp = None
