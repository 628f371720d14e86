"""Fixtures of the end-to-end tests: checkpoints derived from the session's tiny ones, and
the real three-process servers the tests talk to.

Checkpoints (built once per session):
- `long_context_dir`: the tiny Llama with a 4096-token context, so that one request can
  stay in flight for seconds (disconnect, SIGKILL and over-long prompt tests).
- `context_32k_dir`: the same with a 32k-token context, where a stream of 30,000 tokens
  takes minutes: it stays in flight until the test ends it (the operations tests).
- `long_token_dir`: the 4096-token model with a word-level tokenizer whose every generated
  token decodes to about 16 KB of text. Linux loopback sockets absorb about 3 MB of
  unread output before a send blocks; with ordinary tokens a tiny model needs minutes to
  get there, with these it takes a few hundred tokens (the slow-client tests).

Servers:
- `server`: the server that the test's module (or the test itself) names with
  `pytest.mark.server(ServerSpec(...))`. A spec with `shared=True` is one server for every
  module that names it, any other spec one server per module; either is started for the
  first test that needs it and stopped after the last. After every test that used it,
  /debug/lifecycle must be back at zero in all three processes within a second.
- `client`: the official `openai` client for `server`.
- `start_server(model, *args, env=None)`: servers of the test's own, for tests that
  signal, kill or restart them (`model` as in `ServerSpec`); each is stopped, if it still
  runs, when the test ends.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
from e2e_helpers import TOKEN_CHARS, ServerSpec, openai_client
from tiny import CHAT_TEMPLATE, EOS_ID, VOCAB

from minisgl.testing.server import RunningServer


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "server(spec): the ServerSpec of the `server` fixture (tests/e2e/conftest.py)"
    )


# ---------------------------------------------------------------- checkpoints
def _with_context(src: Path, dst: Path, context: int) -> Path:
    shutil.copytree(src, dst)
    config_path = dst / "config.json"
    config = json.loads(config_path.read_text())
    config["max_position_embeddings"] = context
    config_path.write_text(json.dumps(config))
    return dst


@pytest.fixture(scope="session")
def long_context_dir(tiny_dirs, tmp_path_factory) -> Path:
    return _with_context(tiny_dirs["llama"], tmp_path_factory.mktemp("e2e") / "long", 4096)


@pytest.fixture(scope="session")
def context_32k_dir(tiny_dirs, tmp_path_factory) -> Path:
    return _with_context(tiny_dirs["llama"], tmp_path_factory.mktemp("e2e") / "ctx32k", 32768)


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
    dst = tmp_path_factory.mktemp("e2e") / "long-token"
    out = _with_context(tiny_dirs["llama"], dst, 4096)
    _long_token_tokenizer(out)
    return out


# ---------------------------------------------------------------- servers
def _model_path(request: pytest.FixtureRequest, model: str | None) -> str | None:
    """The checkpoint directory that `model` (as in `ServerSpec`) names."""
    if model is None:
        return None
    tiny = request.getfixturevalue("tiny_dirs")
    return str(tiny[model] if model in tiny else request.getfixturevalue(model))


def _start(request: pytest.FixtureRequest, model: str | None, *args: str, env=None):
    # no thread settings here: the scheduler leaves cores to the other processes itself
    return RunningServer(_model_path(request, model), *args, env=env)


def _key(item: pytest.Item) -> tuple | None:
    """Which server `item` runs against: its spec, and its module unless the spec is
    shared; None when it names none."""
    marker = item.get_closest_marker("server")
    if marker is None:
        return None
    (spec,) = marker.args
    assert isinstance(spec, ServerSpec), marker
    return (spec,) if spec.shared else (spec, item.path)


def _needed_later(item: pytest.Item, key: tuple) -> bool:
    items = item.session.items
    later = items[items.index(item) + 1 :]
    return any("server" in i.fixturenames and _key(i) == key for i in later)


@pytest.fixture(scope="session")
def _servers():
    """The session's running `server`s by key (or why one failed to start)."""
    running: dict[tuple, RunningServer | str] = {}
    yield running
    for s in running.values():
        if isinstance(s, RunningServer):
            s.stop()


@pytest.fixture
def server(request, _servers) -> RunningServer:
    key = _key(request.node)
    if key is None:
        pytest.fail("a test that uses `server` must name one: pytest.mark.server(ServerSpec(…))")
    if key not in _servers:
        spec = key[0]
        try:
            _servers[key] = _start(request, spec.model, *spec.args)
        except RuntimeError as exc:  # once: the module's other tests fail without a retry
            _servers[key] = f"the server {spec} did not start: {exc}"
    s = _servers[key]
    if isinstance(s, str):
        pytest.fail(s)
    yield s
    try:
        s.wait_zero(1.0)
    finally:
        if not _needed_later(request.node, key):
            del _servers[key]
            s.stop()


@pytest.fixture
def client(server):
    with openai_client(server) as c:
        yield c


@pytest.fixture
def start_server(request) -> Callable[..., RunningServer]:
    started: list[RunningServer] = []

    def start(model: str | None, *args: str, env: dict[str, str] | None = None):
        started.append(_start(request, model, *args, env=env))
        return started[-1]

    yield start
    for s in started:
        s.stop()
