"""Completions' prompt logprobs over the real server, in the request shapes lm-eval-harness's
`local-completions` model sends for loglikelihood tasks (`echo: true` with `logprobs: N`,
`max_tokens: 0` or 1, temperature 0, prompts as a string, as token ids, batched), against
transformers on the same checkpoint: the echoed prompt's tokens come back with their
logprobs (the first one null) and their alternatives, which always hold the token itself;
streamed and whole answers agree; a long prompt with the most alternatives is not taken for
a slow client; `logprobs: 0` gives the sampled token; the lifecycle is back at zero after
each test (the `server` fixture checks), a client that leaves mid-prompt included. The
echoed prompt is exactly the prompt, control tokens included (as OpenAI and vLLM echo it),
and every text_offset indexes the text returned: vLLM's own `test_echo_logprob_completion`
assertions hold against this server."""

from __future__ import annotations

import re
from typing import Literal

import httpx
import pytest
import torch
from e2e_helpers import PROTOCOL_SERVER
from openai.types import Completion, CompletionChoice
from openai.types.completion_choice import Logprobs
from protocol_helpers import ask, hf_tokenizer, plain

from minisgl.testing.sse import DONE, iter_payloads

pytestmark = pytest.mark.server(PROTOCOL_SERVER)

PROMPTS = ["The capital of France is Paris.", "def forward(self, x): return x", "什么是 KV Cache？"]


class _PromptLogprobs(Logprobs):
    # OpenAI sends null for the first prompt token, which the client's type cannot say
    token_logprobs: list[float | None] | None = None
    top_logprobs: list[dict[str, float] | None] | None = None


class _Choice(CompletionChoice):
    logprobs: _PromptLogprobs | None = None
    finish_reason: Literal["stop", "length", "content_filter"] | None = None  # null in chunks


class EchoCompletion(Completion):
    choices: list[_Choice]


@pytest.fixture(scope="module")
def hf(long_context_dir):
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(
        long_context_dir, dtype=torch.float32
    ).eval()
    return model, hf_tokenizer(str(long_context_dir))


def hf_scores(model, ids: list[int]) -> tuple[list[float], list[int]]:
    """transformers' logprob of each prompt token after the first, and the top token there."""
    with torch.no_grad():
        logp = model(torch.tensor([ids])).logits[0, :-1].log_softmax(-1)
    chosen = logp.gather(1, torch.tensor(ids[1:])[:, None]).squeeze(1)
    return chosen.tolist(), logp.argmax(-1).tolist()


def completions_url(server) -> str:
    return server.base_url + "/v1/completions"


def completion(server, **body) -> EchoCompletion:
    r = httpx.post(completions_url(server), json={"model": server.model_name, **body}, timeout=120)
    assert r.status_code == 200, r.text
    return EchoCompletion.model_validate(r.json(), strict=True)


def assert_prompt_scored(choice, model, tok, ids: list[int], text: str, n_alt: int) -> None:
    lp = choice.logprobs
    n = len(ids)
    assert choice.text.startswith(text)
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    chosen, best = hf_scores(model, ids)
    assert lp.token_logprobs[1:n] == pytest.approx(chosen, abs=2e-4)
    tokens = lp.tokens[:n]
    for p in range(1, n):
        top = lp.top_logprobs[p]
        token = tokens[p]
        assert top[token] == pytest.approx(lp.token_logprobs[p])  # the token is always there
        assert len(top) <= n_alt + 1
        best_text = tok.decode([best[p - 1]])
        if n_alt and plain(best_text):
            assert top[best_text] == pytest.approx(max(top.values()))
    offsets = lp.text_offset[:n]
    assert offsets[0] == 0 and offsets == sorted(offsets)
    for token, offset in zip(tokens, offsets):
        if plain(token):
            assert text[offset : offset + len(token)] == token, (token, offset)


@pytest.mark.parametrize("form", ["string", "token_ids"])
def test_scoring_a_prompt_without_generating_matches_transformers(server, hf, form):
    model, tok = hf
    text = PROMPTS[0]
    ids = tok.encode(text)
    out = completion(
        server, prompt=text if form == "string" else ids, echo=True, logprobs=2, max_tokens=0,
        temperature=0,
    )  # fmt: skip
    (choice,) = out.choices
    assert choice.text == text and choice.finish_reason == "length"
    assert len(choice.logprobs.tokens) == len(ids)
    assert out.usage.prompt_tokens == len(ids) and out.usage.completion_tokens == 0
    assert_prompt_scored(choice, model, tok, ids, text, 2)


def test_batched_token_id_prompts_are_each_scored(server, hf):
    model, tok = hf
    prompts = [tok.encode(p) for p in PROMPTS]
    out = completion(server, prompt=prompts, echo=True, logprobs=5, max_tokens=0, temperature=0)
    assert [c.index for c in out.choices] == [0, 1, 2]
    for choice, ids in zip(out.choices, prompts):
        text = tok.decode(ids)
        assert choice.text == text
        assert_prompt_scored(choice, model, tok, ids, text, 5)


def test_lm_eval_loglikelihood_of_a_continuation(server, hf):
    """lm-eval's request: echo, logprobs 1, max_tokens 1, then the continuation's logprob
    is `sum(token_logprobs[ctxlen:-1])` and greedy means each one is its top's maximum."""
    model, tok = hf
    context, continuation = tok.encode("The capital of France is"), tok.encode(" Paris.")
    ids = context + continuation
    out = completion(
        server, prompt=[ids], echo=True, logprobs=1, max_tokens=1, temperature=0, seed=1234
    )
    lp = out.choices[0].logprobs
    assert len(lp.token_logprobs) == len(ids) + 1  # the prompt's, then the generated token's
    chosen, best = hf_scores(model, ids)
    ctxlen = len(context)
    assert sum(lp.token_logprobs[ctxlen:-1]) == pytest.approx(sum(chosen[ctxlen - 1 :]), abs=1e-3)
    greedy = all(
        t == max(top.values())
        for t, top in zip(lp.token_logprobs[ctxlen:-1], lp.top_logprobs[ctxlen:-1])
    )
    assert greedy == (best[ctxlen - 1 :] == ids[ctxlen:])


def test_streamed_prompt_logprobs_equal_the_whole_answer(server, hf):
    _, tok = hf
    body = dict(
        prompt=PROMPTS[1], echo=True, logprobs=3, max_tokens=4, temperature=0, ignore_eos=True
    )
    whole = completion(server, **body)
    streamed = {"model": server.model_name, **body, "stream": True}
    with httpx.stream("POST", completions_url(server), json=streamed, timeout=120) as r:
        payloads = list(iter_payloads(r.iter_lines()))
    assert payloads[-1] == DONE
    text, tokens, logprobs = "", [], []
    for payload in payloads[:-1]:
        for choice in EchoCompletion.model_validate_json(payload).choices:
            text += choice.text
            if choice.logprobs is not None:
                tokens += choice.logprobs.tokens
                logprobs += choice.logprobs.token_logprobs
    want = whole.choices[0]
    assert text == want.text and tokens == want.logprobs.tokens
    assert logprobs == pytest.approx(want.logprobs.token_logprobs)
    # every prompt token, then the generated ones whose text came (the last tokens of a
    # random model may be bytes of a character never completed: no text, no logprob)
    assert len(tok.encode(PROMPTS[1])) < len(tokens) <= len(tok.encode(PROMPTS[1])) + 4


def test_a_long_prompt_with_the_most_alternatives_is_not_a_slow_client(server, hf):
    """More than a MiB of prompt logprobs arrive in one reply: more than the default
    --max-pending-bytes, which bounds output piling up, not the size of an answer."""
    model, tok = hf
    ids = (tok.encode(" ".join(PROMPTS)) * 120)[:2040]  # the context is 2048
    body = {"model": server.model_name, "prompt": ids, "echo": True, "logprobs": 20,
            "max_tokens": 0}  # fmt: skip
    r = httpx.post(completions_url(server), json=body, timeout=120)
    assert r.status_code == 200, r.text
    assert len(r.content) > 1 << 20
    lp = EchoCompletion.model_validate_json(r.content, strict=True).choices[0].logprobs
    assert len(lp.token_logprobs) == len(ids) and lp.token_logprobs[0] is None
    chosen, _ = hf_scores(model, ids)
    assert lp.token_logprobs[1:] == pytest.approx(chosen, abs=2e-3)


def test_logprobs_zero_gives_the_sampled_token_in_its_alternatives(server, client):
    ans = ask(
        client, "completions", False, model=server.model_name, prompt=PROMPTS[0], max_tokens=5,
        logprobs=0, temperature=1.0, seed=3, extra_body={"ignore_eos": True},
    )  # fmt: skip
    for token, logprob, top, _ in ans.logprobs[0]:
        assert top == {token: logprob}


def test_a_client_leaving_while_its_prompt_is_scored_leaves_nothing(server, hf):
    _, tok = hf
    ids = (tok.encode(" ".join(PROMPTS)) * 80)[:1800]  # and 240 more: the context is 2048
    body = {"model": server.model_name, "prompt": ids, "echo": True, "logprobs": 5,
            "max_tokens": 240, "stream": True, "ignore_eos": True}  # fmt: skip
    with httpx.stream("POST", completions_url(server), json=body, timeout=120) as r:
        assert r.status_code == 200
        next(r.iter_lines())  # the echoed prompt and its logprobs: then leave
    # the `server` fixture waits for /debug/lifecycle to be back at zero


def _offsets_index_the_text(choice) -> None:
    lp = choice.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset)
    assert lp.text_offset == sorted(lp.text_offset)
    for token, offset in zip(lp.tokens, lp.text_offset):
        if token.startswith("bytes:") or "\ufffd" in token:
            continue  # part of a character (a random model's output): no text of its own
        assert choice.text[offset : offset + len(token)] == token, (token, offset, choice.text)


@pytest.mark.parametrize("logprobs_arg", [1, 0])
def test_vllms_echo_logprob_completion(server, client, logprobs_arg):
    """vLLM's tests/entrypoints/openai/test_completion.py::test_echo_logprob_completion,
    through the official client, and every offset pointing at its token in the text."""
    tok = hf_tokenizer(server.model_name)
    for prompt in ("Hello, my name is", [0, 0, 0, 0, 0]):  # token 0: <|endoftext|>
        completion = client.completions.create(
            model=server.model_name, prompt=prompt, max_tokens=5, temperature=0.0, echo=True,
            logprobs=logprobs_arg, extra_body={"ignore_eos": True},
        )  # fmt: skip
        prompt_text = tok.decode(prompt) if isinstance(prompt, list) else prompt
        assert re.search(r"^" + prompt_text, completion.choices[0].text)
        assert completion.choices[0].text.startswith(prompt_text)  # the same, literally
        logprobs = completion.choices[0].logprobs
        assert logprobs is not None
        assert len(logprobs.text_offset) > 5
        assert len(logprobs.token_logprobs) > 5 and logprobs.token_logprobs[0] is None
        assert len(logprobs.top_logprobs) > 5 and logprobs.top_logprobs[0] is None
        for top_logprobs in logprobs.top_logprobs[1:]:
            assert max(logprobs_arg, 1) <= len(top_logprobs) <= logprobs_arg + 1
        assert len(logprobs.tokens) > 5
        _offsets_index_the_text(completion.choices[0])
    assert prompt_text == "<|endoftext|>" * 5


@pytest.mark.parametrize("form", ["string", "token_ids"])
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_an_echoed_chat_shaped_prompt_keeps_its_control_tokens(server, form, stream):
    """The issue's case: `<|im_start|>user\nHi<|im_end|>` comes back as sent, and the offsets
    are the running lengths of the tokens' texts (12 for `<|im_start|>`, ...)."""
    tok = hf_tokenizer(server.model_name)
    text = "<|im_start|>user\nHi<|im_end|>"
    ids = tok.encode(text)
    assert ids[0] == tok.convert_tokens_to_ids("<|im_start|>")
    body = {
        "model": server.model_name, "prompt": text if form == "string" else ids, "echo": True,
        "logprobs": 1, "max_tokens": 2, "temperature": 0, "ignore_eos": True, "stream": stream,
    }  # fmt: skip
    if stream:
        with httpx.stream("POST", completions_url(server), json=body, timeout=120) as r:
            payloads = list(iter_payloads(r.iter_lines()))
        chunks = [EchoCompletion.model_validate_json(p).choices[0] for p in payloads[:-1]]
        joined = {"text": "", "tokens": [], "token_logprobs": [], "top_logprobs": [],
                  "text_offset": []}  # fmt: skip
        for chunk in chunks:
            joined["text"] += chunk.text
            for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
                joined[key] += getattr(chunk.logprobs, key) if chunk.logprobs else []
        text_out = joined.pop("text")
        choice = _Choice(index=0, text=text_out, logprobs=_PromptLogprobs(**joined))
    else:
        choice = completion(server, **{k: v for k, v in body.items() if k != "model"}).choices[0]
    assert choice.text.startswith(text)
    lengths = [len(t) for t in choice.logprobs.tokens[: len(ids)]]
    assert choice.logprobs.text_offset[: len(ids)] == [sum(lengths[:i]) for i in range(len(ids))]
    assert choice.logprobs.text_offset[len(ids)] == len(text)  # the first sampled token
    _offsets_index_the_text(choice)
