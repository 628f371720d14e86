"""Schema fuzzing of the real server (tiny Llama, 256-token context) with schemathesis.

Every operation of the server's own `/openapi.json` gets a bounded number of generated
requests, schema-valid ones ("positive") and schema-violating ones ("negative": wrong types,
missing fields, bodies that are not JSON). Half the chat requests name the served model, so
that they reach the tokenizer and the scheduler instead of stopping at the 404. Checks: no
5xx (schemathesis' `not_a_server_error`), an answer within a time limit (no hang), every
4xx an OpenAI error body, every 200 chat completion a valid `chat.completion`, and
/debug/lifecycle back at zero afterwards. Each run draws new cases; a failure names the
seed that replays it (`MINISGL_FUZZ_SEED`).

Then the edge values the fuzzer hit, as plain regression tests: integers past 64 bits and
temperatures too small for float32.
"""

from __future__ import annotations

import json
import os
import random
import signal
from collections import Counter

import httpx
import hypothesis
import pytest
import schemathesis
from e2e_helpers import CHAT_PATH, ServerSpec, assert_error_body, chat_body, chat_url
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis.errors import Unsatisfiable
from openai.types.chat import ChatCompletion
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.errors import FailureGroup

TIME_LIMIT_S = 20.0  # a 256-token context decodes in well under a second; this is a hang
EXAMPLES = {"POST /v1/chat/completions": 100}  # per mode; operations without input need few
FEW_EXAMPLES = 5
OPERATIONS = {
    "POST /v1/chat/completions",
    "GET /v1/models",
    "GET /health",
    "GET /metrics",
    "GET /debug/lifecycle",
}

pytestmark = pytest.mark.server(ServerSpec("llama"))


@pytest.fixture
def fuzz_server(start_server):
    """One server per fuzz run: a case that brings a worker down fails only its own run."""
    return start_server("llama")


def _check_answer(server, case, response) -> None:
    case.validate_response(response, checks=[not_a_server_error])
    if response.status_code >= 400:
        assert_error_body(response.json())
    elif case.path == CHAT_PATH and isinstance(case.body, dict) and not case.body.get("stream"):
        ChatCompletion.model_validate(response.json())


def _fuzz(server, operation, mode, seed: int, failures: list[str], statuses: Counter) -> None:
    """Run one operation's generated cases; collect failures and answer statuses."""
    ran = 0

    @hypothesis.seed(seed)
    @settings(
        max_examples=EXAMPLES.get(operation.label, FEW_EXAMPLES),
        deadline=None,
        database=None,
        phases=[Phase.explicit, Phase.generate],  # no shrinking: keep the run bounded
        suppress_health_check=list(HealthCheck),
    )
    @given(case=operation.as_strategy(mode))
    def run(case) -> None:
        nonlocal ran
        ran += 1
        # three in four name the served model (hypothesis' own draws favour the first
        # choice too much to decide this)
        if ran % 4 and isinstance(case.body, dict) and "model" in case.body:
            case.body["model"] = server.model_name
        try:
            response = case.call(base_url=server.base_url, timeout=TIME_LIMIT_S)
            statuses[(operation.label, response.status_code)] += 1
            _check_answer(server, case, response)
        except (Exception, FailureGroup) as exc:  # collected and reported together
            failures.append(f"{type(exc).__name__}: {exc}\n  {case.as_curl_command()}"[:1500])

    try:
        run()
    except Unsatisfiable:  # e.g. no way to violate the schema of an input-less GET
        pass


@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE])
def test_generated_requests_never_get_a_server_error_or_hang(fuzz_server, mode):
    server = fuzz_server
    schema = schemathesis.openapi.from_url(f"{server.base_url}/openapi.json")
    # a failure's curl command shows every value (max_tokens is not a secret)
    schema.config.output.sanitization.update(enabled=False)
    operations = [result.ok() for result in schema.get_all_operations()]
    assert OPERATIONS <= {op.label for op in operations}
    # new cases every run (that is how the edge cases below were found); the seed in a
    # failure message replays them: MINISGL_FUZZ_SEED=<seed>
    seed = int(os.environ.get("MINISGL_FUZZ_SEED") or random.randrange(2**32))
    failures: list[str] = []
    statuses: Counter = Counter()
    for op in operations:
        _fuzz(server, op, mode, seed, failures, statuses)
    chat = {s: n for (label, s), n in statuses.items() if label == "POST /v1/chat/completions"}
    assert sum(chat.values()) + len(failures) >= 30, statuses
    if mode == GenerationMode.POSITIVE:  # valid requests reached the model and were served
        assert chat.get(200, 0) >= 5, statuses
    assert httpx.get(server.base_url + "/health", timeout=10).status_code == 200
    server.wait_zero(2.0)
    assert not failures, (
        f"MINISGL_FUZZ_SEED={seed}: {len(failures)} failing cases, e.g.:\n"
        + "\n".join(failures[:5])
    )


# ---------------------------------------------------------------- edge values, one by one
EDGE_INTEGERS = [
    ("seed", 2**64),
    ("seed", -(2**63) - 1),
    ("seed", 10**30),
    ("top_k", 2**63),
    ("top_k", 2**64 - 1),
    ("top_k", 10**30),
    ("max_tokens", 2**63),
    ("max_tokens", 2**64 - 1),
    ("max_tokens", 10**30),
]


def test_integers_past_64_bits_are_refused_or_clamped_never_a_server_error(start_server):
    """Each is either served (a seed reduced to 64 bits, top_k and max_tokens clamped to
    the vocabulary and the context) or refused with 400 naming the parameter; never a 500,
    and never a dead worker."""
    problems = []
    server = start_server("llama")
    for name, value in EDGE_INTEGERS:
        body = {**chat_body(server.model_name, max_tokens=4, temperature=0.7), name: value}
        r = httpx.post(
            chat_url(server),
            content=json.dumps(body),
            timeout=30,
            headers={"content-type": "application/json"},
        )
        if r.status_code == 200:
            assert r.json()["choices"][0]["finish_reason"] in ("stop", "length")
        elif r.status_code == 400:
            error = assert_error_body(r.json(), "invalid_value")
            assert error["param"] == name, error
        else:
            problems.append(f"{name}={value}: HTTP {r.status_code} {r.text[:200]}")
        if httpx.get(server.base_url + "/health", timeout=10).status_code != 200:
            problems.append(f"{name}={value}: the server is down: {server.log()[-1500:]}")
            server.stop(signal.SIGKILL)
            server = start_server("llama")
        else:
            server.wait_zero(2.0)
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("temperature", [1e-30, 1e-38, 1e-44, 1e-300])
def test_a_tiny_temperature_samples_like_greedy(server, temperature):
    """temperature -> 0 is greedy decoding; a positive temperature too small for float32
    must not turn the logits into inf/NaN."""
    body = chat_body(server.model_name, "The capital of", max_tokens=12, ignore_eos=True)
    url = chat_url(server)
    greedy = httpx.post(url, json={**body, "temperature": 0.0}, timeout=30).json()
    tiny = httpx.post(url, json={**body, "temperature": temperature, "seed": 7}, timeout=30)
    assert tiny.status_code == 200, tiny.text
    assert (
        tiny.json()["choices"][0]["message"]["content"]
        == (greedy["choices"][0]["message"]["content"])
    )
    server.wait_zero(1.0)


@pytest.mark.parametrize("stream", [False, True])
def test_a_lone_surrogate_escape_in_the_content_is_not_a_server_error(server, stream):
    """`"\\udaf1"` is valid JSON but no Unicode character: refused (400) or replaced, and
    in either case the server keeps serving."""
    body = chat_body(server.model_name, "a\udaf1b", max_tokens=3, stream=stream)
    raw = json.dumps(body)  # ensure_ascii: the lone surrogate goes out as the escape
    assert "\\udaf1" in raw
    r = httpx.post(
        chat_url(server),
        content=raw.encode(),
        headers={"content-type": "application/json"},
        timeout=30,
    )
    assert r.status_code in (200, 400), r.text
    if r.status_code == 400:
        assert_error_body(r.json(), "invalid_value")
    server.wait_zero(1.0)
    assert httpx.get(server.base_url + "/health", timeout=10).status_code == 200
