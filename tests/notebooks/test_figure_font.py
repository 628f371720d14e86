"""The notebooks' figures show their Chinese labels on any machine, CJK font or none.

helpers.py draws with the font shipped in notebooks/fonts/ (a subset of Noto Sans CJK SC,
notebooks/fonts/make_subset.py) and matplotlib's own DejaVu Sans, nothing else:
- every character that a notebook's code or helpers.py can put in a figure is in one of
  the two (a new Chinese label needs `python notebooks/fonts/make_subset.py`);
- drawn the way a notebook draws it (helpers imported, its warning filters in force) on a
  matplotlib that knows no font but its own and the shipped one, as on a machine without
  CJK fonts, no glyph is missing; and a character outside the subset does warn, so the
  check can fail and helpers does not silence the warning (the site's test fails on any
  notebook that writes to stderr, where the warning goes).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
NOTEBOOKS = ROOT / "notebooks"
RARE = "龘"  # U+9F98: in Noto Sans CJK, in no notebook, so not in the subset


def _make_subset():
    path = NOTEBOOKS / "fonts" / "make_subset.py"
    spec = importlib.util.spec_from_file_location("make_subset", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _cmap(path: Path) -> set[str]:
    from fontTools.ttLib import TTFont

    with TTFont(path) as font:
        return {chr(code) for code in font.getBestCmap()}


def test_every_character_of_the_notebooks_is_in_the_shipped_font_or_dejavu():
    import matplotlib

    subset = _make_subset()
    assert subset.FONT.is_file(), f"{subset.FONT} missing: python notebooks/fonts/make_subset.py"
    shipped = _cmap(subset.FONT)
    dejavu = _cmap(Path(matplotlib.get_data_path()) / "fonts" / "ttf" / "DejaVuSans.ttf")
    wanted = subset.figure_characters()
    assert any("\u4e00" <= ch <= "\u9fff" for ch in wanted), "no Chinese found in the notebooks"
    lacking = sorted(wanted - shipped - dejavu)
    assert not lacking, (
        f"{''.join(lacking)}: in a notebook but in neither the shipped font nor DejaVu Sans; "
        "run python notebooks/fonts/make_subset.py"
    )
    assert RARE not in shipped, f"{RARE} is in the subset: pick another character for the check"


# run in a fresh interpreter: helpers sets matplotlib's fonts and warning filters globally
DRAW = r"""
import json, sys, warnings
from pathlib import Path

import matplotlib
from matplotlib import font_manager

# a machine without CJK fonts: matplotlib knows only the fonts it ships with
mpl_fonts = Path(matplotlib.get_data_path()) / "fonts"
font_manager.fontManager.ttflist = [
    f for f in font_manager.fontManager.ttflist if Path(f.fname).is_relative_to(mpl_fonts)
]
import helpers  # noqa: E402  (adds the shipped font, sets font.family and its filters)
import matplotlib.pyplot as plt  # noqa: E402

def missing(text):
    with warnings.catch_warnings(record=True) as caught:  # helpers' filters stay in force
        fig, ax = plt.subplots(figsize=(12, 8))
        lines = [text[i : i + 40] for i in range(0, len(text), 40)]
        for i, line in enumerate(lines):
            fig.text(0.01, 0.98 - i * 0.04, line)
        ax.set_title(lines[0]), ax.set_xlabel(lines[-1])
        helpers.show(fig)
    return [str(w.message) for w in caught if "missing from font" in str(w.message)]

labels = json.loads(sys.argv[1])
families = plt.rcParams["font.family"]
print(json.dumps({
    "families": families,
    "files": [font_manager.findfont(f, fallback_to_default=False) for f in families],
    "labels": missing(labels),
    "control": missing(sys.argv[2]),
}))
"""


def test_figures_draw_every_label_without_a_system_font_and_warn_on_a_missing_glyph():
    subset = _make_subset()
    text = "".join(sorted(subset.figure_characters()))
    done = subprocess.run(
        [sys.executable, "-c", DRAW, json.dumps(text), f"缺字：{RARE}"],
        cwd=NOTEBOOKS,  # where the notebooks run
        env={**os.environ, "PYTHONPATH": os.pathsep.join([str(NOTEBOOKS), str(ROOT)])},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    facts = json.loads(done.stdout.strip().splitlines()[-1])
    assert facts["families"] == [subset.FAMILY, "DejaVu Sans"]
    assert facts["files"][0] == str(subset.FONT)
    assert Path(facts["files"][1]).name == "DejaVuSans.ttf"
    assert facts["labels"] == [], f"glyphs missing from the figures: {facts['labels']}"
    assert any(f"Glyph {ord(RARE)} " in w for w in facts["control"]), (
        f"drawing {RARE} (not in the subset) gave no missing-glyph warning: {facts['control']}"
    )
