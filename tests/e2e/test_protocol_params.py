"""Sampling and response parameters of both endpoints, through the official `openai`
client against the real three-process server (tiny Llama, 2048-token context, 4-token KV
pages), every response and chunk validated strictly against the client's types:

- `n` > 1: one choice index per sample, streamed or not; seeded samples differ from each
  other; a client disconnect aborts all of them; the prompt's pages are shared;
- `seed`: the same text alone and among concurrent requests; other seeds, other text;
- `stream_options.include_usage`; `logprobs` / `top_logprobs`;
- `presence_penalty`, `frequency_penalty`, `repetition_penalty`; `logit_bias`;
- every unsupported parameter is a 400 naming it.
"""

from __future__ import annotations

import asyncio
import math
import threading

import httpx
import openai
import pytest
from e2e_helpers import PROTOCOL_SERVER, metric, prompt_len, scrape_metrics, wait_state
from protocol_helpers import LONG, ask, assert_bad_param, hf_tokenizer, plain
from tiny import EOS_ID

PROMPT = "The capital of France is"
PARIS = 407  # the token " Paris" of the tiny tokenizer
MESSAGES = [{"role": "user", "content": "Streaming responses"}]

pytestmark = pytest.mark.server(PROTOCOL_SERVER)


def _params(server, endpoint: str, **params) -> dict:
    """The prompt of the endpoint plus `params`."""
    if endpoint == "chat":
        return {"model": server.model_name, "messages": MESSAGES, **params}
    return {"model": server.model_name, "prompt": PROMPT, **params}


def _prompt_tokens(server, endpoint: str) -> int:
    if endpoint == "chat":
        return prompt_len(server.model_name, MESSAGES)
    return len(hf_tokenizer(server.model_name).encode(PROMPT))


ENDPOINTS = ["chat", "completions"]
STREAM = pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])


# ---------------------------------------------------------------- n
@pytest.mark.parametrize("endpoint", ENDPOINTS)
def test_n_seeded_samples_are_distinct_choices_and_stream_as_they_answer(server, client, endpoint):
    params = _params(
        server,
        endpoint,
        n=3,
        seed=11,
        temperature=1.0,
        max_tokens=24,
        extra_body={"ignore_eos": True},
    )
    whole = ask(client, endpoint, False, **params)
    assert whole.indices == [0, 1, 2]
    assert len(set(whole.text.values())) == 3, whole.text  # three different samples
    assert whole.finish == {0: "length", 1: "length", 2: "length"}
    assert whole.usage.completion_tokens == 3 * 24
    assert whole.usage.prompt_tokens == _prompt_tokens(server, endpoint)  # once, not 3 times
    streamed = ask(client, endpoint, True, **params, stream_options={"include_usage": True})
    assert streamed.text == whole.text  # same seed: the same three samples
    assert streamed.finish == whole.finish
    # the same counts; the second request may find the prompt in the prefix cache
    counts = ("prompt_tokens", "completion_tokens", "total_tokens")
    assert [getattr(streamed.usage, k) for k in counts] == [getattr(whole.usage, k) for k in counts]


def test_n_choices_through_the_client_stream_iterator(server, client):
    stream = client.chat.completions.create(
        model=server.model_name,
        messages=MESSAGES,
        n=2,
        seed=5,
        temperature=1.0,
        max_tokens=10,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    texts: dict[int, str] = {}
    finish: dict[int, str] = {}
    for chunk in stream:
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + (choice.delta.content or "")
            if choice.finish_reason:
                finish[choice.index] = choice.finish_reason
    assert sorted(texts) == [0, 1] and texts[0] != texts[1]
    assert finish == {0: "length", 1: "length"}


def test_disconnect_mid_stream_aborts_all_n_choices(server, client):
    before = scrape_metrics(server)
    stream = client.completions.create(
        model=server.model_name,
        prompt=PROMPT,
        n=4,
        temperature=1.0,
        max_tokens=LONG,  # 4 x 1500 tokens: seconds of work if nobody stopped it
        stream=True,
        extra_body={"ignore_eos": True},
    )
    try:
        chunks = iter(stream)
        next(chunks)
        wait_state(server, lambda s: s["scheduler"]["running"] >= 4, timeout=20)
        next(chunks)
    finally:
        stream.close()  # the client goes away mid-stream
    state = server.wait_zero(1.0)
    assert state["scheduler"]["running"] == 0
    after = scrape_metrics(server)
    name = "minisgl_requests_total"
    aborted = metric(after, name, outcome="aborted_client", code="")
    assert aborted - metric(before, name, outcome="aborted_client", code="") == 1


def test_n_choices_prefill_the_prompt_once_and_share_its_pages(server, client):
    page, n, prompt_len, max_tokens = 4, 4, 400, 120
    ids = [(7 * j) % 400 + 3 for j in range(prompt_len)]
    prompt_pages = prompt_len // page
    samples: list[dict] = []
    failed: list[str] = []  # queries that got no state: kept for the message, not fatal
    stop = threading.Event()

    def sample() -> None:
        # a thread that raised would stop sampling silently and leave `samples` empty
        while not stop.is_set():
            try:
                samples.append(server.lifecycle()["scheduler"])
            except httpx.HTTPError as e:
                failed.append(repr(e))

    before = scrape_metrics(server)
    sampler = threading.Thread(target=sample)
    sampler.start()
    try:
        ans = ask(
            client,
            "completions",
            False,
            model=server.model_name,
            prompt=ids,
            n=n,
            temperature=1.0,
            seed=3,
            max_tokens=max_tokens,
            extra_body={"ignore_eos": True},
        )
    finally:
        stop.set()
        sampler.join()
    after = scrape_metrics(server)
    assert ans.usage.prompt_tokens == prompt_len  # counted once, not n times
    assert ans.usage.completion_tokens == n * max_tokens
    prompt_in = "minisgl_prompt_tokens_total"
    assert metric(after, prompt_in) - metric(before, prompt_in) == prompt_len

    all_running = [s for s in samples if s["running"] == n]
    assert all_running, f"never saw the {n} choices decode together: {samples}, {failed}"
    # n separate copies would hold n * prompt_pages pages for the prompts alone; shared,
    # the prompt is held once, each choice adds its own copy of the prompt's last page
    # and the pages of its own output
    bound = prompt_pages + n * (1 + math.ceil(max_tokens / page))
    for s in samples:
        assert s["kv_pages_used"] <= bound < n * prompt_pages, (s, bound)


# ---------------------------------------------------------------- seed
@pytest.mark.parametrize("endpoint", ENDPOINTS)
async def test_same_seed_gives_the_same_text_alone_and_among_concurrent_requests(server, endpoint):
    seeded = _params(
        server,
        endpoint,
        seed=1234,
        temperature=1.0,
        top_p=0.95,
        max_tokens=48,
        extra_body={"ignore_eos": True},
    )
    others = [
        _params(
            server,
            endpoint,
            temperature=1.0,
            max_tokens=150 + 10 * i,
            extra_body={"ignore_eos": True},
        )
        for i in range(8)
    ]
    async with openai.AsyncOpenAI(
        base_url=server.base_url + "/v1", api_key="x", max_retries=0
    ) as aclient:

        async def text(params: dict) -> str:
            if endpoint == "chat":
                r = await aclient.chat.completions.create(**params)
                return r.choices[0].message.content
            r = await aclient.completions.create(**params)
            return r.choices[0].text

        alone = await text(seeded)
        busy = [asyncio.ensure_future(text(p)) for p in others]
        await asyncio.sleep(0.05)  # the others are admitted and decoding
        together = await text(seeded)
        await asyncio.gather(*busy)
        again = await text(seeded)
        other_seed = await text({**seeded, "seed": 4321})
    assert together == alone
    assert again == alone
    assert other_seed != alone


# ---------------------------------------------------------------- stream_options
@pytest.mark.parametrize("endpoint", ENDPOINTS)
def test_include_usage_sends_one_usage_chunk_right_before_done(server, client, endpoint):
    params = _params(server, endpoint, n=2, max_tokens=7, extra_body={"ignore_eos": True})
    whole = ask(client, endpoint, False, **params)
    streamed = ask(client, endpoint, True, **params, stream_options={"include_usage": True})
    last = streamed.chunks[-1]
    assert last["choices"] == [] and last["usage"] is not None
    counts = ("prompt_tokens", "completion_tokens", "total_tokens")  # (cached may differ)
    assert [getattr(streamed.usage, k) for k in counts] == [getattr(whole.usage, k) for k in counts]
    assert streamed.usage.completion_tokens == 2 * 7
    for chunk in streamed.chunks[:-1]:
        assert chunk["choices"] and chunk.get("usage") is None, chunk


@pytest.mark.parametrize("endpoint", ENDPOINTS)
@pytest.mark.parametrize("options", [None, {"include_usage": False}], ids=["absent", "false"])
def test_without_include_usage_no_chunk_carries_usage(server, client, endpoint, options):
    extra = {} if options is None else {"stream_options": options}
    streamed = ask(client, endpoint, True, **_params(server, endpoint, max_tokens=5, **extra))
    assert streamed.usage is None
    for chunk in streamed.chunks:
        assert chunk["choices"] and chunk.get("usage") is None, chunk


@pytest.mark.parametrize("endpoint", ENDPOINTS)
def test_stream_options_without_stream_is_a_400(server, client, endpoint):
    resource = client.chat.completions if endpoint == "chat" else client.completions
    with pytest.raises(openai.BadRequestError) as info:
        resource.create(
            **_params(server, endpoint, max_tokens=3),
            stream=False,
            stream_options={"include_usage": True},
        )
    assert_bad_param(info.value, "stream_options")


# ---------------------------------------------------------------- logprobs
@STREAM
def test_chat_logprobs_rank_alternatives_and_greedy_picks_the_top_one(server, client, stream):
    ans = ask(
        client,
        "chat",
        stream,
        **_params(
            server,
            "chat",
            max_tokens=16,
            temperature=0,
            logprobs=True,
            top_logprobs=5,
            extra_body={"ignore_eos": True},
        ),
    )
    entries = ans.logprobs[0]
    assert len(entries) == 16  # one per generated token
    for e in entries:
        assert e.logprob <= 0.0
        assert len(e.top_logprobs) == 5
        values = [t.logprob for t in e.top_logprobs]
        assert values == sorted(values, reverse=True) and values[0] <= 0.0
        assert (e.token, e.logprob) == (e.top_logprobs[0].token, e.top_logprobs[0].logprob)


@STREAM
def test_chat_logprobs_without_alternatives_and_without_logprobs(server, client, stream):
    params = _params(server, "chat", max_tokens=6, temperature=0, extra_body={"ignore_eos": True})
    bare = ask(client, "chat", stream, **params, logprobs=True, top_logprobs=0)
    assert len(bare.logprobs[0]) == 6
    assert all(e.top_logprobs == [] and e.logprob <= 0.0 for e in bare.logprobs[0])
    none = ask(client, "chat", stream, **params)
    assert none.logprobs == {}  # `logprobs: null` on every choice and chunk


def test_chat_logprob_bytes_join_into_the_answer_text(server, client):
    """OpenAI: `bytes` are the token's UTF-8 bytes, so that a character split over several
    tokens can be rebuilt by joining them. The tiny byte-level tokenizer splits most
    characters of its random output."""
    ans = ask(
        client,
        "chat",
        False,
        **_params(
            server,
            "chat",
            max_tokens=40,
            temperature=0,
            logprobs=True,
            logit_bias={str(EOS_ID): -100},
            extra_body={"ignore_eos": True},
        ),
    )
    joined = b"".join(bytes(e.bytes) for e in ans.logprobs[0])
    assert joined.decode("utf-8", errors="replace").rstrip("\ufffd") == ans.only().rstrip(
        "\ufffd"
    ), [e.token for e in ans.logprobs[0]]


@STREAM
def test_completion_logprobs_shapes_and_greedy_picks_the_top_one(server, client, stream):
    ans = ask(
        client,
        "completions",
        stream,
        **_params(
            server,
            "completions",
            max_tokens=16,
            temperature=0,
            logprobs=3,
            extra_body={"ignore_eos": True},
        ),
    )
    entries = ans.logprobs[0]
    assert len(entries) == 16
    for token, logprob, top, _ in entries:
        assert logprob <= 0.0
        assert 1 <= len(top) <= 3  # a dict: alternatives with the same text collapse
        assert all(v <= 0.0 for v in top.values())
        assert token in top and max(top.values()) == logprob  # greedy: the top one


def test_completion_text_offsets_point_at_each_token_streamed_or_not(server, client):
    """`text_offset[i]` is where token i starts in the choice's text: a token whose text is
    plain ASCII is found there verbatim, and streaming reports the same offsets."""
    params = _params(
        server,
        "completions",
        max_tokens=40,
        temperature=0,
        logprobs=1,
        extra_body={"ignore_eos": True},
    )
    whole = ask(client, "completions", False, **params)
    streamed = ask(client, "completions", True, **params)
    assert streamed.text == whole.text
    text, entries = whole.only(), whole.logprobs[0]
    offsets = [e[3] for e in entries]
    assert offsets == sorted(offsets) and offsets[0] == 0
    misplaced = [
        (token, offset, text[offset : offset + len(token)])
        for token, _, _, offset in entries
        if plain(token) and text[offset : offset + len(token)] != token
    ]
    assert misplaced == [], f"tokens not at their text_offset in {text!r}"
    assert [e[3] for e in streamed.logprobs[0]] == offsets, "streamed offsets differ"


def test_top_logprobs_without_logprobs_is_a_400(server, client):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(**_params(server, "chat", max_tokens=3), top_logprobs=2)
    assert_bad_param(info.value, "top_logprobs")


# ---------------------------------------------------------------- penalties
def _known_repeats(tokens: list[str]) -> int:
    """Repeated tokens among those whose text is known (not a fragment of a character)."""
    known = [t for t in tokens if "\ufffd" not in t]
    return len(known) - len(set(known))


@pytest.mark.parametrize(
    "penalty",
    [
        {"presence_penalty": 2.0},
        {"frequency_penalty": 2.0},
        {"extra_body": {"repetition_penalty": 2.0}},
    ],
    ids=["presence", "frequency", "repetition"],
)
def test_strong_penalty_changes_greedy_output_and_repeats_tokens_less(server, client, penalty):
    def greedy(**extra) -> tuple[str, list[str]]:
        extra_body = {"ignore_eos": True, **extra.pop("extra_body", {})}
        ans = ask(
            client,
            "completions",
            False,
            **_params(server, "completions", max_tokens=300, temperature=0, logprobs=0),
            extra_body=extra_body,
            **extra,
        )
        return ans.only(), [t for t, _, _, _ in ans.logprobs[0]]

    text, tokens = greedy()
    penalized_text, penalized_tokens = greedy(**penalty)
    assert penalized_text != text
    assert _known_repeats(penalized_tokens) < _known_repeats(tokens)


@pytest.mark.parametrize(
    ("param", "value"),
    [
        ("presence_penalty", 2.5),
        ("presence_penalty", -2.01),
        ("frequency_penalty", 3),
        ("frequency_penalty", -2.5),
        ("repetition_penalty", 0),
        ("repetition_penalty", -1.0),
        ("repetition_penalty", 2.5),
    ],
)
@pytest.mark.parametrize("endpoint", ENDPOINTS)
def test_out_of_range_penalty_is_a_400_naming_it(server, client, endpoint, param, value):
    resource = client.chat.completions if endpoint == "chat" else client.completions
    with pytest.raises(openai.BadRequestError) as info:
        resource.create(**_params(server, endpoint, max_tokens=3), extra_body={param: value})
    assert_bad_param(info.value, param)


# ---------------------------------------------------------------- logit_bias
@STREAM
@pytest.mark.parametrize("endpoint", ENDPOINTS)
def test_logit_bias_plus_100_makes_greedy_emit_that_token_everywhere(
    server, client, endpoint, stream
):
    ans = ask(
        client,
        endpoint,
        stream,
        **_params(server, endpoint, max_tokens=12, temperature=0, logit_bias={str(PARIS): 100}),
    )
    assert ans.only() == " Paris" * 12
    assert ans.finish == {0: "length"}


@pytest.mark.parametrize("key", ["abc", "-1", "1.5", "", " 5", "+5", "0x10", "²", "٣"])
def test_logit_bias_keys_that_are_not_token_ids_are_a_400(server, client, key):
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(
            **_params(server, "completions", max_tokens=3), logit_bias={key: 1}
        )
    assert_bad_param(info.value, "logit_bias")


@pytest.mark.parametrize("bias", [{"600": 1}, {"5": 101}, {"5": -100.5}])
def test_logit_bias_outside_the_vocabulary_or_range_is_a_400(server, client, bias):
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(**_params(server, "completions", max_tokens=3), logit_bias=bias)
    assert_bad_param(info.value, "logit_bias")


@pytest.mark.parametrize(
    ("param", "value"),
    [("logit_bias", {str(i): 1 for i in range(301)}), ("stop_token_ids", [7] * 1025)],
    ids=["logit_bias-301", "stop_token_ids-1025"],
)
def test_a_list_parameter_past_its_count_is_a_400_naming_it(server, client, param, value):
    """Each list a request carries is bounded (logit_bias as OpenAI's, 300 entries), so
    its cost is too; one entry fewer is served."""
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(
            **_params(server, "completions", max_tokens=3), extra_body={param: value}
        )
    assert_bad_param(info.value, param)
    assert "at most" in info.value.response.json()["error"]["message"]
    fewer = dict(list(value.items())[:-1]) if isinstance(value, dict) else value[:-1]
    out = client.completions.create(
        **_params(server, "completions", max_tokens=3), extra_body={param: fewer}
    )
    assert out.choices[0].finish_reason in ("stop", "length")


# ---------------------------------------------------------------- unsupported parameters
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
UNSUPPORTED = [
    ("chat", "tool_choice", {"tool_choice": "none"}),  # without tools it means nothing
    ("chat", "functions", {"functions": [{"name": "f", "parameters": {"type": "object"}}]}),
    ("chat", "function_call", {"function_call": "none"}),
    ("completions", "suffix", {"suffix": "!"}),
    ("completions", "best_of", {"best_of": 2}),
    ("completions", "best_of", {"best_of": 3, "n": 2}),
]


@STREAM
@pytest.mark.parametrize("tool_choice", ["auto", "required", "none"])
def test_tools_for_a_model_whose_template_has_none_are_a_400(server, client, tool_choice, stream):
    """The tiny models' chat template ignores tools: a request that would have the model
    call them is refused before anything is generated; "none" needs no tools shown."""
    params = _params(server, "chat", max_tokens=3)
    if tool_choice == "none":
        ask(client, "chat", stream, **params, tools=[TOOL], tool_choice=tool_choice)
        return
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            **params, stream=stream, tools=[TOOL], tool_choice=tool_choice
        )
    assert_bad_param(info.value, "tools")
    assert "does not support tools" in info.value.body["message"]


@STREAM
@pytest.mark.parametrize(
    ("endpoint", "param", "extra"), UNSUPPORTED, ids=[f"{e}-{p}" for e, p, _ in UNSUPPORTED]
)
def test_unsupported_parameter_is_a_400_naming_it(server, client, endpoint, param, extra, stream):
    resource = client.chat.completions if endpoint == "chat" else client.completions
    with pytest.raises(openai.BadRequestError) as info:
        resource.create(**_params(server, endpoint, max_tokens=3), stream=stream, **extra)
    assert_bad_param(info.value, param)


@pytest.mark.parametrize(
    ("endpoint", "extra"),
    [
        ("chat", {"response_format": {"type": "text"}}),
        ("chat", {"response_format": {"type": "json_object"}}),
        ("completions", {"best_of": 2, "n": 2}),
    ],
    ids=["response_format_text", "response_format_json_object", "best_of_equal_to_n"],
)
def test_supported_forms_of_those_parameters_are_served(server, client, endpoint, extra):
    ans = ask(client, endpoint, False, **_params(server, endpoint, max_tokens=3), **extra)
    assert len(ans.indices) == extra.get("n", 1)
