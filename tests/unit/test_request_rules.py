"""Request rules declared once, on `SamplingParams`: the HTTP request models and
`LLM.generate` refuse the same values with the same messages, before anything is queued;
top_k 0 means "off" (vLLM's meaning), and temperature is capped at 2 offline as over HTTP."""

from __future__ import annotations

import math

import pytest
from pydantic import ValidationError

from minisgl import LLM, SamplingParams
from minisgl.core import SAMPLING_RULES
from minisgl.message import TokenizeMsg
from minisgl.server.chat import ChatCompletionRequest
from minisgl.server.completions import CompletionRequest
from minisgl.server.protocol import ParamError

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
COMPLETION = {"model": "m", "prompt": "hi"}

# one value each rule refuses, as the same field offline and over HTTP
BAD = [
    ("temperature", 2.5),
    ("temperature", -0.1),
    ("temperature", math.nan),
    ("top_p", 0.0),
    ("top_p", 1.5),
    ("top_k", -2),
    ("top_k", 2**31),
    ("n", 0),
    ("n", 17),
    ("max_tokens", -1),
    ("min_tokens", -1),
    ("presence_penalty", 2.01),
    ("frequency_penalty", -3),
    ("repetition_penalty", 0.0),
    ("repetition_penalty", 2.5),
    ("seed", 2**64),
    ("stop", ["a", "b", "c", "d", "e"]),
    ("stop", [""]),
    ("stop", ["x" * 1001]),
    ("stop_token_ids", [-1]),
    ("stop_token_ids", [0] * 1025),  # a list a request sends is never unbounded
    ("logit_bias", {i: 1.0 for i in range(301)}),  # OpenAI's cap: 300 entries
    ("cache_salt", ""),
    ("cache_salt", "s" * 257),
]


def _http_refusal(model, body: dict) -> ParamError:
    with pytest.raises(ValidationError) as info:
        model.model_validate(body)
    cause = (info.value.errors()[0].get("ctx") or {}).get("error")
    assert isinstance(cause, ParamError), info.value.errors()
    return cause


@pytest.fixture(scope="module")
def llm(tiny_dirs) -> LLM:
    return LLM(str(tiny_dirs["llama"]), device="cpu", page_size=4, max_seq_len=64)


def _queued(llm: LLM, monkeypatch) -> list[TokenizeMsg]:
    """Every TokenizeMsg the LLM hands its tokenizer worker from now on."""
    sent: list[TokenizeMsg] = []
    handle = llm.worker.handle

    def spy(msgs):
        sent.extend(m for m in msgs if isinstance(m, TokenizeMsg))
        return handle(msgs)

    monkeypatch.setattr(llm.worker, "handle", spy)
    return sent


@pytest.mark.parametrize(("param", "value"), BAD, ids=[f"{p}={v!r}"[:40] for p, v in BAD])
def test_a_rule_refuses_the_same_value_with_the_same_message_over_http_and_offline(
    llm, monkeypatch, param, value
) -> None:
    problem = SamplingParams(**{param: value}).validate()
    assert problem is not None and problem[0] == param
    message = problem[1]
    assert param in message and message == SAMPLING_RULES[param].problem(param, value)
    for model, body in ((ChatCompletionRequest, CHAT), (CompletionRequest, COMPLETION)):
        if param == "max_tokens" and model is ChatCompletionRequest:
            continue  # chat must generate one token at least: stricter than the rule
        cause = _http_refusal(model, {**body, param: value})
        assert (cause.param, str(cause)) == (param, message)
    sent = _queued(llm, monkeypatch)
    good, bad = llm.generate(
        ["hi", "hi"], [SamplingParams(max_tokens=2), SamplingParams(**{param: value})]
    )
    assert bad.error == f"{param}: {message}" and bad.finish_reason is None
    assert good.error is None and len(good.token_ids) == 2
    assert len(sent) == 1  # the refused prompt was never queued


def test_logit_bias_values_follow_one_rule_with_their_keys_in_either_form(llm) -> None:
    problem = SamplingParams(logit_bias={5: 101.0}).validate()
    assert problem == ("logit_bias", "logit_bias values must be in [-100, 100], got 101.0")
    cause = _http_refusal(CompletionRequest, {**COMPLETION, "logit_bias": {"5": 101.0}})
    assert (cause.param, str(cause)) == problem
    (out,) = llm.generate("hi", SamplingParams(logit_bias={5: -math.inf}))
    assert out.error == "logit_bias: logit_bias values must be in [-100, 100], got -inf"


def test_the_request_fields_named_otherwise_follow_the_rule_of_their_sampling_field() -> None:
    for value in (-1, 21):
        offline = SamplingParams(logprobs=value).validate()
        chat = _http_refusal(
            ChatCompletionRequest, {**CHAT, "logprobs": True, "top_logprobs": value}
        )
        completion = _http_refusal(CompletionRequest, {**COMPLETION, "logprobs": value})
        assert str(completion) == offline[1] and completion.param == "logprobs"
        assert chat.param == "top_logprobs" and str(chat) == offline[1].replace(
            "logprobs", "top_logprobs"
        )


def test_min_tokens_above_max_tokens_is_refused_at_both_entrances(llm) -> None:
    problem = SamplingParams(min_tokens=5, max_tokens=2).validate()
    assert problem is not None and problem[0] == "min_tokens"
    for model, body, max_name in (
        (CompletionRequest, COMPLETION, "max_tokens"),
        (ChatCompletionRequest, CHAT, "max_tokens"),
        (ChatCompletionRequest, CHAT, "max_completion_tokens"),
    ):
        cause = _http_refusal(model, {**body, "min_tokens": 5, max_name: 2})
        assert (cause.param, str(cause)) == problem
    (out,) = llm.generate("hi", SamplingParams(min_tokens=5, max_tokens=2))
    assert out.error == f"min_tokens: {problem[1]}"


def test_temperature_is_capped_at_2_offline_as_over_http(llm) -> None:
    assert SamplingParams(temperature=2.0).validate() is None
    (capped, over) = llm.generate(
        ["hi", "hi"],
        [SamplingParams(temperature=2.0, max_tokens=2, seed=1), SamplingParams(temperature=2.01)],
    )
    assert capped.error is None and len(capped.token_ids) == 2
    assert over.error == "temperature: temperature must be in [0, 2], got 2.01"
    ChatCompletionRequest.model_validate({**CHAT, "temperature": 2.0})
    assert (
        _http_refusal(ChatCompletionRequest, {**CHAT, "temperature": 2.01}).param == "temperature"
    )


@pytest.mark.parametrize("off", [0, -1])
def test_top_k_0_and_minus_1_mean_off_over_http_and_offline(llm, off) -> None:
    """vLLM's meaning (clients send either); before, 0 passed the request model and was
    refused by the scheduler, two processes later."""
    for model, body in ((ChatCompletionRequest, CHAT), (CompletionRequest, COMPLETION)):
        assert model.model_validate({**body, "top_k": off}).sampling_params().top_k == off
    params = dict(temperature=1.0, max_tokens=6, ignore_eos=True, seed=7)
    (filtered_off, unfiltered) = llm.generate(
        ["hi", "hi"], [SamplingParams(top_k=off, **params), SamplingParams(**params)]
    )
    # the same seed draws the same tokens: no filter at all, not a filter of k=0
    assert filtered_off.error is None and filtered_off.token_ids == unfiltered.token_ids


def test_the_http_schema_shows_the_bounds_the_rules_declare() -> None:
    props = ChatCompletionRequest.model_json_schema()["properties"]
    assert (props["temperature"]["minimum"], props["temperature"]["maximum"]) == (0.0, 2.0)
    assert props["top_k"]["minimum"] == -1
    assert props["top_p"]["exclusiveMinimum"] == 0.0 and props["top_p"]["maximum"] == 1.0
    assert props["top_p"]["description"] == SAMPLING_RULES["top_p"].meaning
    stop_list = next(s for s in props["stop"]["anyOf"] if s.get("type") == "array")
    assert stop_list["maxItems"] == 4 and stop_list["items"]["maxLength"] == 1000


def test_every_sampling_field_declares_a_rule_with_its_meaning() -> None:
    from dataclasses import fields

    assert {f.name for f in fields(SamplingParams)} == set(SAMPLING_RULES)
    assert all(rule.meaning for rule in SAMPLING_RULES.values())
    assert SAMPLING_RULES["max_tokens"].nullable and not SAMPLING_RULES["top_k"].nullable


@pytest.mark.parametrize(("param", "value"), [("temperature", 2.5), ("top_p", 0.0)])
def test_the_responses_request_follows_the_same_rules(param, value) -> None:
    from minisgl.server.responses import ResponsesRequest

    cause = _http_refusal(ResponsesRequest, {"model": "m", "input": "hi", param: value})
    assert (cause.param, str(cause)) == SamplingParams(**{param: value}).validate()
    bad = _http_refusal(ResponsesRequest, {"model": "m", "input": "hi", "top_logprobs": 21})
    assert bad.param == "top_logprobs" and "[0, 20]" in str(bad)
