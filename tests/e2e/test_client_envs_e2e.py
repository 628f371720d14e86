"""Clients that cannot share this environment's pins, each from a venv of its own
(client_envs.py), in their typical use against the real server with the embedded model:
the 1.x openai client (plain, stream, tool round trip with `model_dump()` history,
`beta.chat.completions.parse`) and instructor (a model extracted by a forced tool call and
by JSON schema, a partial model streamed). /debug/lifecycle is back at zero after each."""

from __future__ import annotations

import pytest
from client_envs import run_client
from e2e_helpers import DEFAULT_MODEL_SERVER

pytestmark = [pytest.mark.server(DEFAULT_MODEL_SERVER), pytest.mark.slow]


def test_the_1x_openai_client_in_its_typical_use(server):
    assert run_client("openai1", "openai1_typical.py", server).startswith("ok 1.")


def test_instructor_in_its_typical_use(server):
    assert run_client("instructor", "instructor_typical.py", server).startswith("ok")
