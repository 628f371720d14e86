"""Tokenizer loading and prompt building.

Contract: `load_tokenizer(model_dir)` returns a Hugging Face fast tokenizer from a model
folder, or None when the folder has no tokenizer (a bare config for --dummy-weights
benchmarks: such a model takes token ids only). `build_prompt_ids(tokenizer, prompt)` turns what a user sent (plain text, chat
messages, or token ids) into prompt token ids: chat messages go through the model's chat
template with the generation prompt appended; plain text is encoded as is.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

Prompt = str | list[int] | list[dict[str, Any]]


_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def load_tokenizer(model_dir: str | Path):
    from transformers import AutoTokenizer

    model_dir = Path(model_dir)
    if not any((model_dir / name).exists() for name in _TOKENIZER_FILES):
        return None
    return AutoTokenizer.from_pretrained(str(model_dir))


def build_prompt_ids(tokenizer, prompt: Prompt) -> list[int]:
    if tokenizer is None and not all(isinstance(t, int) for t in prompt):
        raise ValueError("this model folder has no tokenizer: give prompts as token ids")
    if isinstance(prompt, str):
        return tokenizer.encode(prompt, add_special_tokens=True)
    if prompt and all(isinstance(t, int) for t in prompt):
        return list(prompt)  # type: ignore[arg-type]
    if prompt and all(isinstance(m, dict) for m in prompt):
        if tokenizer.chat_template is None:
            raise ValueError("this model's tokenizer has no chat template; send a plain prompt")
        ids = tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=True)
        if isinstance(ids, dict) or hasattr(
            ids, "input_ids"
        ):  # transformers 5 returns BatchEncoding
            ids = ids["input_ids"]
        return list(ids)
    if not prompt:
        return []
    raise TypeError("a prompt is a string, a list of token ids or a list of chat messages")


def _bytes_to_unicode() -> dict[int, str]:
    """Byte-level BPE's alphabet (GPT-2 and its descendants): every byte is one printable
    character; printable Latin-1 bytes stand for themselves, the rest are shifted past 255."""
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    mapping = {b: chr(b) for b in printable}
    shifted = 0
    for b in range(256):
        if b not in mapping:
            mapping[b] = chr(256 + shifted)
            shifted += 1
    return mapping


_UNICODE_TO_BYTE = {c: b for b, c in _bytes_to_unicode().items()}
_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def token_bytes(tokenizer, ids: list[int]) -> list[bytes]:
    """The exact bytes each token stands for (a token may hold part of a character)."""
    out = []
    for piece in tokenizer.convert_ids_to_tokens(ids):
        piece = piece or ""
        if (m := _BYTE_FALLBACK.fullmatch(piece)) is not None:  # SentencePiece byte fallback
            out.append(bytes([int(m[1], 16)]))
        elif all(c in _UNICODE_TO_BYTE for c in piece):  # byte-level BPE
            out.append(bytes(_UNICODE_TO_BYTE[c] for c in piece))
        else:  # SentencePiece word pieces: "▁" is a space
            out.append(piece.replace("\u2581", " ").encode())
    return out
