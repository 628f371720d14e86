"""Cut Noto Sans CJK SC down to the characters the notebooks' figures can show.

The notebooks label their figures in Chinese. `helpers.py` draws them with the font this
script writes (FONT, beside it, with the font's licence in OFL.txt) and DejaVu Sans,
matplotlib's own font, for anything else, so the labels show on a machine that has no CJK
font installed (a learner's laptop, macOS, Windows) exactly as they do here.

The characters: printable ASCII and every non-ASCII character that appears in a code cell
of a notebook or in helpers.py (`figure_characters`), a few hundred glyphs.
tests/notebooks/test_figure_font.py fails when one of them is missing from the font, and
when a figure warns about a missing glyph. After adding Chinese to a figure, run

    python notebooks/fonts/make_subset.py [SOURCE]

SOURCE is Noto Sans CJK SC, Regular (SIL Open Font License 1.1): the collection Debian's
fonts-noto-cjk installs (the default below) or NotoSansCJKsc-Regular.otf from
https://github.com/notofonts/noto-cjk. The subset is renamed (FAMILY), so that matplotlib
never confuses it with a full Noto Sans CJK installed on the machine.
"""

from __future__ import annotations

import json
import string
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
NOTEBOOKS = HERE.parent
FONT = HERE / "NotoSansSC-minisgl.otf"
FAMILY = "Noto Sans SC minisgl"
SOURCE = Path("/usr/share/fonts/opentype/noto/NotoSansCJK-Regular.ttc")
SOURCE_FAMILY = "Noto Sans CJK SC"  # the face to take from a collection (.ttc)


def figure_characters() -> set[str]:
    """Printable ASCII and every non-ASCII character of the notebooks' code cells and of
    helpers.py: whatever text a figure draws is written in one of them."""
    text = [(NOTEBOOKS / "helpers.py").read_text(encoding="utf-8")]
    for path in sorted(NOTEBOOKS.glob("*.ipynb")):
        cells = json.loads(path.read_text(encoding="utf-8"))["cells"]
        text += ["".join(c["source"]) for c in cells if c["cell_type"] == "code"]
    wanted = {ch for ch in "".join(text) if ord(ch) > 127 and ch.isprintable()}
    return wanted | set(string.printable.strip()) | {" "}


def _source_face(path: Path):
    from fontTools.ttLib import TTCollection, TTFont

    if path.suffix.lower() not in (".ttc", ".otc"):
        return TTFont(path)
    faces = TTCollection(path).fonts
    found = [f for f in faces if f["name"].getDebugName(1) == SOURCE_FAMILY]
    if not found:
        sys.exit(f"{path}: no {SOURCE_FAMILY} in it ({[f['name'].getDebugName(1) for f in faces]})")
    return found[0]


def make(source: Path = SOURCE, dest: Path = FONT) -> set[str]:
    """Write the subset of `source` to `dest`; return the characters it lacks (they fall
    back to DejaVu Sans when a figure draws them)."""
    from fontTools import subset

    font = _source_face(source)
    chars = figure_characters()
    cmap = font.getBestCmap()
    options = subset.Options()
    options.hinting = False  # matplotlib hints the outlines itself
    options.name_IDs = ["*"]
    options.notdef_outline = True
    subsetter = subset.Subsetter(options)
    subsetter.populate(unicodes=[ord(ch) for ch in chars if ord(ch) in cmap])
    subsetter.subset(font)
    _rename(font)
    font.recalcTimestamp = False  # the same source gives the same file
    font.save(dest)
    return {ch for ch in chars if ord(ch) not in cmap}


def _rename(font) -> None:
    """FAMILY in every name a font menu or matplotlib reads (the OFL asks a modified font
    not to pass for the original)."""
    ps_name = FAMILY.replace(" ", "") + "-Regular"
    new = {1: FAMILY, 2: "Regular", 3: f"{ps_name};minisgl subset", 4: FAMILY, 6: ps_name,
           16: FAMILY, 17: "Regular"}  # fmt: skip
    names = font["name"]
    for r in list(names.names):
        if r.nameID in new:
            names.setName(new[r.nameID], r.nameID, r.platformID, r.platEncID, r.langID)
    if "CFF " in font:
        cff = font["CFF "].cff
        cff.fontNames = [ps_name]
        top = cff.topDictIndex[0]
        top.FamilyName, top.FullName = FAMILY, FAMILY
        if hasattr(top, "CIDFontName"):
            top.CIDFontName = ps_name


if __name__ == "__main__":
    src = Path(sys.argv[1]) if len(sys.argv) > 1 else SOURCE
    if not src.is_file():
        sys.exit(f"{src}: no such font; pass Noto Sans CJK SC Regular (.otf or .ttc)")
    lacking = make(src)
    kib = FONT.stat().st_size // 1024
    print(
        f"wrote {FONT.relative_to(NOTEBOOKS.parent)}: {len(figure_characters())} characters, {kib} KiB"
    )
    if lacking:
        print(f"not in {src.name} (DejaVu Sans draws them): {''.join(sorted(lacking))}")
