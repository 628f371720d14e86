"""The chapter site, built once for every site test of the session.

`site` runs `mkdocs build --strict` into a temporary folder; the build executes every
notebook and runs the sample session against a real server (notebooks/site_hooks.py), so
both test files check the same build. `site_build_started` is when that build began
(None when MINISGL_SITE_DIR=<built site> reuses a site built before, for working on these
checks; CI never sets it).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from site_pages import ROOT, Page, pages_of

_started: list[float | None] = []


@pytest.fixture(scope="session")
def site(tmp_path_factory) -> Path:
    prebuilt = os.environ.get("MINISGL_SITE_DIR")
    if prebuilt:
        assert (Path(prebuilt) / "index.html").is_file(), f"MINISGL_SITE_DIR={prebuilt}: no site"
        _started.append(None)
        return Path(prebuilt)
    out = tmp_path_factory.mktemp("site")
    mkdocs = [sys.executable, "-m", "mkdocs", "build", "--strict", "-q", "-d", str(out)]
    _started.append(time.time())
    start = time.monotonic()
    done = subprocess.run(
        mkdocs,
        cwd=ROOT,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1", "MINISGL_SITE_EXECUTE": "1"},
        capture_output=True,
        text=True,
        timeout=1800,
    )
    assert done.returncode == 0, f"mkdocs build --strict failed:\n{done.stderr[-6000:]}"
    print(f"\nsite built (notebooks executed, samples run) in {time.monotonic() - start:.0f} s")
    return out


@pytest.fixture(scope="session")
def site_build_started(site) -> float | None:
    return _started[0]


@pytest.fixture(scope="session")
def pages(site) -> list[Page]:
    return pages_of(site)
