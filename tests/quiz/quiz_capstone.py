"""The capstone's server and what its checks say about it (test_capstone.py, conftest.py).

`start(model, pieces)` runs `python -m minisgl` on the checkpoint `model` with
MINISGL_QUIZ_DIR=`pieces`, so the API server answers with that folder's q3-q7
(minisgl/server/quiz_pieces.py); a server that does not start fails the test with one line
(the learner's error, if one of their files raised it). `tiny_model(folder)` writes the
tiny random Llama of the end-to-end tests, with a 4096-token context. `lifecycle` reads
/debug/lifecycle (a server that can no longer answer it fails the test in a line);
`last_error` and `nonzero` put what the server's log and /debug/lifecycle show into one
line of Chinese.
"""

from __future__ import annotations

import re
from pathlib import Path

import httpx
import pytest

from minisgl.server.quiz_pieces import QUIZ_DIR_ENV
from minisgl.testing.server import RunningServer

MAX_SEQ_LEN = 2048
LOG = pytest.StashKey[Path]()  # the capstone server's log, named in the learner's summary
# the per-request counts of /debug/lifecycle (the rest are sizes and cache statistics)
PER_REQUEST = {
    "frontend": ("requests", "pending_bytes"),
    "tokenizer": ("decode_states", "tokenizing", "grammar_compiles"),
    "scheduler": ("pending", "running", "table_slots_used", "kv_pages_used", "grammar_matchers"),
}


def tiny_model(folder: Path) -> Path:
    from tiny import make_checkpoint  # tests/tiny.py: imports torch

    return make_checkpoint("llama", folder, max_position_embeddings=4096)


def start(model: Path, pieces: Path) -> RunningServer:
    env = {QUIZ_DIR_ENV: str(pieces)}
    try:
        return RunningServer(str(model), "--max-seq-len", str(MAX_SEQ_LEN), env=env)
    except RuntimeError as exc:
        pytest.fail(f"服务器没有启动起来。{last_error(str(exc), pieces)}", pytrace=False)


def lifecycle(server: RunningServer, pieces: Path) -> dict:
    try:
        return server.lifecycle()
    except httpx.HTTPStatusError as exc:
        status = exc.response.status_code
        said = f"/debug/lifecycle 得到 HTTP {status}：服务器已经不能服务了。"
        pytest.fail(said + last_error(server.log(), pieces), pytrace=False)


def last_error(log: str, pieces: Path) -> str:
    """The last error in the server's log that a file of `pieces` raised, in a line; else
    the log's last line."""
    at = log.rfind(f'File "{pieces}/')
    if at < 0:
        lines = [line for line in log.splitlines() if line.strip()]
        return f"服务器日志的最后一行：{lines[-1][:160] if lines else '（空）'}"
    where = re.match(r'File "([^"]+)", line (\d+)', log[at:])
    after = log[at:].splitlines()[1:]
    error = next((line for line in after if line and not line.startswith(" ")), "")
    if error.startswith("NotImplementedError"):
        error = "NotImplementedError（还没有写：文件里还是练习的初始代码）"
    return f"服务器日志里的错误出自 {Path(where[1]).name} 第 {where[2]} 行：{error[:160]}"


def nonzero(state: dict) -> str:
    """The per-request counts of a /debug/lifecycle answer that are not zero."""
    counts = [
        f"{part}.{name}={state[part][name]}"
        for part, names in PER_REQUEST.items()
        for name in names
        if state[part].get(name)
    ]
    return "，".join(counts) or "（全是零）"
