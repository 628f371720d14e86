"""Checkpoints for the end-to-end tests, derived from the session's tiny checkpoints.

- `long_context_dir`: the tiny Llama with a 4096-token context, so that one request can
  stay in flight for seconds (disconnect, SIGKILL and over-long prompt tests).
- `long_token_dir`: the same weights with a word-level tokenizer whose every generated
  token decodes to about 16 KB of text. Linux loopback sockets absorb about 3 MB of
  unread output before a send blocks; with ordinary tokens a tiny model needs minutes to
  get there, with these it takes a few hundred tokens (the slow-client tests).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from e2e_helpers import TOKEN_CHARS, start_server
from tiny import CHAT_TEMPLATE, EOS_ID, VOCAB

LONG_CONTEXT = 4096


def _with_long_context(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    config_path = dst / "config.json"
    config = json.loads(config_path.read_text())
    config["max_position_embeddings"] = LONG_CONTEXT
    config_path.write_text(json.dumps(config))
    return dst


@pytest.fixture(scope="session")
def long_context_dir(tiny_dirs, tmp_path_factory) -> Path:
    return _with_long_context(tiny_dirs["llama"], tmp_path_factory.mktemp("e2e") / "long")


def _long_token_tokenizer(out_dir: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<unk>", "<|im_end|>", "<|im_start|>"]
    vocab = {name: i for i, name in enumerate(specials)}
    vocab.update({f"t{i}": i for i in range(len(specials), VOCAB)})
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens(specials)
    tok.decoder = decoders.Replace("t", "x" * TOKEN_CHARS)  # "t42" -> "xxx…x42"
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", unk_token="<unk>", pad_token="<unk>"
    )
    fast.chat_template = CHAT_TEMPLATE
    assert fast.eos_token_id == EOS_ID
    for stale in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        (out_dir / stale).unlink(missing_ok=True)
    fast.save_pretrained(out_dir)


@pytest.fixture(scope="session")
def long_token_dir(tiny_dirs, tmp_path_factory) -> Path:
    out = _with_long_context(tiny_dirs["llama"], tmp_path_factory.mktemp("e2e") / "long-token")
    _long_token_tokenizer(out)
    return out


@pytest.fixture(scope="session")
def protocol_server(long_context_dir):
    """One server for the OpenAI-protocol tests (test_protocol_*.py): the tiny Llama with
    a 2048-token context (a long generation stays in flight for seconds) and 4-token KV
    pages (page sharing between the n choices of a request is visible in page counts)."""
    s = start_server(long_context_dir, "--max-seq-len", "2048", "--page-size", "4")
    yield s
    s.stop()
