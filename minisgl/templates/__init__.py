"""Chat templates shipped with minisgl, and the markers the templates and the output parsers
agree on.

Contract: `chat_template_text(name_or_path)` returns a template's text: a `.jinja` file, or
the name of one shipped in this folder (`TEMPLATES`); anything else is a `ValueError` naming
the shipped ones. `TOOL_CALL_START` / `TOOL_CALL_END` delimit a Hermes-style tool call (the
format the tool parser reads back, minisgl/parsers/hermes.py); `THINK_START` / `THINK_END` a reasoning
model's thinking (minisgl/parsers/think.py); `REASONING_STARTS_OPEN` says, per
`--reasoning-parser`, whether the output starts inside the think block when the prompt shows
neither marker.

Why a module of its own: the tokenizer (which renders the templates), the default model's
converter (which writes one into the model folder) and the API server's parsers all need these
names, and none of them may import another's package to reach them. This module imports
nothing of minisgl.
"""

from __future__ import annotations

from pathlib import Path

TEMPLATES = Path(__file__).parent  # the chat templates shipped with minisgl (*.jinja)
TOOL_CALL_START, TOOL_CALL_END = "<tool_call>", "</tool_call>"
# a reasoning model's thinking (Qwen3, DeepSeek-R1), read out by --reasoning-parser
THINK_START, THINK_END = "<think>", "</think>"
# per --reasoning-parser: whether the output starts inside the think block when the prompt
# shows neither marker (a DeepSeek-R1 model often thinks without writing `<think>`)
REASONING_STARTS_OPEN = {"qwen3": False, "deepseek-r1": True}


def chat_template_text(name_or_path: str) -> str:
    """The text of a chat template: a file, or the name of one in TEMPLATES."""
    shipped = TEMPLATES / f"{name_or_path}.jinja"
    if shipped.is_file():
        return shipped.read_text()
    path = Path(name_or_path).expanduser()
    if path.is_file():
        return path.read_text()
    names = ", ".join(sorted(p.stem for p in TEMPLATES.glob("*.jinja")))
    raise ValueError(f"chat template {name_or_path!r}: no such file, nor one shipped ({names})")
