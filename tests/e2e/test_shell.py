"""`python -m minisgl --shell` driven through a pseudo-terminal with pexpect: an answer
streams, Ctrl-C cancels just that answer and frees every component's state, `/lifecycle`
shows it, `/reset` and `/exit` work, Ctrl-D at the prompt exits, and no process is left.

The model is the tiny Llama with a 4096-token context and no end-of-sequence token, so an
answer runs for seconds (random text) until it is cancelled.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import sys
import time
from pathlib import Path

import pexpect
import pytest

from minisgl.testing.server import group_alive, is_zero

PROMPT = ">>> "
QUESTION = "What is a KV cache?"


@pytest.fixture(scope="module")
def endless_dir(long_context_dir, tmp_path_factory) -> Path:
    """The long-context tiny Llama without an end token: answers end only at the limit."""
    out = tmp_path_factory.mktemp("shell") / "endless"
    shutil.copytree(long_context_dir, out)
    for name in ("config.json", "generation_config.json"):
        path = out / name
        if path.exists():
            config = json.loads(path.read_text())
            config["eos_token_id"] = None
            path.write_text(json.dumps(config))
    return out


def _spawn(model: Path) -> pexpect.spawn:
    child = pexpect.spawn(
        sys.executable,
        ["-m", "minisgl", "--shell", "--device", "cpu", "--model", str(model)]
        + ["--max-seq-len", "4096", "--max-tokens", "4000"],
        encoding="utf-8",
        codec_errors="replace",
        timeout=120,  # start-up loads torch and spawns two workers
        dimensions=(40, 200),
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    child.expect_exact("/exit quits.")
    child.expect_exact(PROMPT)
    child.timeout = 60
    return child


def _assert_exited_cleanly(child: pexpect.spawn) -> None:
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 0 and child.signalstatus is None, (
        child.exitstatus,
        child.signalstatus,
    )
    # the shell leads its own session (the pty): its workers are in its process group
    deadline = time.monotonic() + 5
    while (alive := group_alive(child.pid)) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert alive == [], f"processes left behind: {alive}"


def _kill(child: pexpect.spawn) -> None:
    if child.isalive() or group_alive(child.pid):
        try:
            os.killpg(child.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    child.close(force=True)


def test_ctrl_c_cancels_just_the_answer_then_lifecycle_reset_and_exit(endless_dir):
    child = _spawn(endless_dir)
    try:
        child.sendline(QUESTION)
        child.expect_exact(QUESTION)  # the terminal's echo of the line
        # the answer streams: text keeps arriving while it is being generated
        child.expect(r"(?s).{40}")
        child.expect(r"(?s).{40}")
        assert PROMPT not in child.before + child.after  # not over yet

        child.sendintr()  # Ctrl-C mid-answer
        child.expect_exact("(answer cancelled)")
        child.expect_exact(PROMPT)

        child.sendline("/lifecycle")
        child.expect(r"\{.*\}")
        state = json.loads(child.after)
        child.expect_exact(PROMPT)
        assert set(state) == {"frontend", "tokenizer", "scheduler"}
        # every live count at zero; what the prefix cache keeps is not live (not a leak)
        assert is_zero(state), state
        assert state["scheduler"]["kv_pages_total"] > 0

        child.sendline("/reset")
        child.expect_exact("(history cleared)")
        child.expect_exact(PROMPT)

        child.sendline("/exit")
        _assert_exited_cleanly(child)
    finally:
        _kill(child)


def test_ctrl_d_at_the_prompt_exits(endless_dir):
    child = _spawn(endless_dir)
    try:
        child.sendeof()
        _assert_exited_cleanly(child)
    finally:
        _kill(child)
