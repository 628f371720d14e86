"""`POST /v1/completions` and the parameters that end a generation, through the official
`openai` client against the real three-process server (tiny Llama, 2048-token context,
4-token pages), every response and chunk validated strictly against the client's types.

- prompts: a string, a list of strings, token ids, a list of token-id lists; `echo`;
  several prompts x n choices are indexed prompt * n + choice; usage counts each prompt
  once and the completion tokens of every choice;
- `stop` strings matched across token boundaries, trimmed, and the scheduler stopped;
  `stop_token_ids`, `ignore_eos`, `min_tokens`, `max_completion_tokens`.

The tiny model's output is random text, so expected texts come from greedy reference runs
on the same server; token boundaries come from the reference's logprobs (each token's
text), and only plain ASCII tokens are used where a boundary matters.
"""

from __future__ import annotations

import openai
import pytest
from e2e_helpers import PROTOCOL_SERVER
from protocol_helpers import LONG, Answer, ask, assert_bad_param, hf_tokenizer, plain, token_texts
from tiny import EOS_ID

PROMPTS = ["The capital of France is", "def forward(self, x):", "Streaming responses send"]
PARIS = 407  # the token " Paris" of the tiny tokenizer

pytestmark = pytest.mark.server(PROTOCOL_SERVER)


@pytest.fixture(scope="module")
def tok(long_context_dir):
    return hf_tokenizer(str(long_context_dir))


def _greedy(client, server, prompt, max_tokens: int, **extra) -> str:
    ans = _completion(
        client,
        server,
        False,
        prompt=prompt,
        max_tokens=max_tokens,
        temperature=0,
        extra_body={"ignore_eos": True, **extra},
    )
    assert ans.usage.completion_tokens == max_tokens and ans.finish[0] == "length"
    return ans.only()


def _reference(client, server, max_tokens: int = 120) -> tuple[str, list[str]]:
    """A greedy completion of PROMPTS[0] and the text of each of its tokens."""
    ans = _completion(
        client,
        server,
        False,
        max_tokens=max_tokens,
        temperature=0,
        logprobs=0,
        extra_body={"ignore_eos": True},
    )
    tokens = [t for t, _, _, _ in ans.logprobs[0]]
    # one entry per token, position by position; only the last tokens go without one when
    # their bytes never complete a character (they are not in the text either)
    assert max_tokens - 8 <= len(tokens) <= max_tokens
    return ans.only(), tokens


def _completion(client, server, stream: bool, **params) -> Answer:
    """`ask` the server for a completion, of PROMPTS[0] unless `prompt` is given."""
    return ask(
        client, "completions", stream, model=server.model_name, **{"prompt": PROMPTS[0], **params}
    )


def _scheduler_idle(server) -> None:
    """The scheduler holds nothing for any request. Asked right after a request ended,
    this proves it was stopped, not left generating: the tokenizer worker sends the stop to
    the scheduler before it sends the final reply on, and the state query travels the
    same ordered channel after it."""
    sched = server.lifecycle()["scheduler"]
    assert sched["running"] == 0 and sched["pending"] == 0, sched
    assert sched["kv_pages_used"] == 0 and sched["table_slots_used"] == 0, sched


# ---------------------------------------------------------------- prompts
def test_string_prompt_gives_a_text_completion_with_real_usage(server, client, tok):
    ans = _completion(
        client,
        server,
        False,
        max_tokens=9,
        extra_body={"ignore_eos": True},
    )
    assert isinstance(ans.only(), str) and ans.finish == {0: "length"}
    assert ans.usage.prompt_tokens == len(tok.encode(PROMPTS[0]))
    assert ans.usage.completion_tokens == 9
    assert ans.usage.total_tokens == ans.usage.prompt_tokens + 9


def test_completions_default_to_16_tokens_like_openai(server, client):
    ans = _completion(
        client,
        server,
        False,
        extra_body={"ignore_eos": True},
    )
    assert ans.usage.completion_tokens == 16 and ans.finish == {0: "length"}


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("form", ["string", "list_of_strings", "token_ids", "list_of_id_lists"])
def test_every_prompt_form_gives_the_same_greedy_text(server, client, tok, form, stream):
    expected = _greedy(client, server, PROMPTS[0], 12)
    ids = tok.encode(PROMPTS[0])
    prompt = {
        "string": PROMPTS[0],
        "list_of_strings": [PROMPTS[0]],
        "token_ids": ids,
        "list_of_id_lists": [ids],
    }[form]
    ans = _completion(
        client,
        server,
        stream,
        prompt=prompt,
        max_tokens=12,
        temperature=0,
        extra_body={"ignore_eos": True},
        **({"stream_options": {"include_usage": True}} if stream else {}),
    )
    assert ans.only() == expected
    assert ans.finish == {0: "length"}
    assert ans.usage.prompt_tokens == len(ids) and ans.usage.completion_tokens == 12


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("as_ids", [False, True], ids=["strings", "id_lists"])
def test_prompts_times_n_choices_are_indexed_prompt_times_n_plus_choice(
    server, client, tok, stream, as_ids
):
    n, max_tokens = 2, 6
    expected = [_greedy(client, server, p, max_tokens) for p in PROMPTS]
    assert len(set(expected)) == len(PROMPTS)  # distinct texts: the index mapping shows
    prompts = [tok.encode(p) for p in PROMPTS] if as_ids else PROMPTS
    ans = _completion(
        client,
        server,
        stream,
        prompt=prompts,
        n=n,
        max_tokens=max_tokens,
        temperature=0,
        extra_body={"ignore_eos": True},
        **({"stream_options": {"include_usage": True}} if stream else {}),
    )
    assert ans.indices == list(range(len(PROMPTS) * n))
    for p in range(len(PROMPTS)):
        for c in range(n):
            assert ans.text[p * n + c] == expected[p], (p, c)
            assert ans.finish[p * n + c] == "length"
    # each prompt counted once (not n times); the completion tokens of every choice
    assert ans.usage.prompt_tokens == sum(len(tok.encode(p)) for p in PROMPTS)
    assert ans.usage.completion_tokens == len(PROMPTS) * n * max_tokens
    assert ans.usage.total_tokens == ans.usage.prompt_tokens + ans.usage.completion_tokens


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_echo_puts_the_prompt_text_first_in_every_choice(server, client, tok, stream):
    expected = [_greedy(client, server, p, 5) for p in PROMPTS[:2]]
    ids = tok.encode(PROMPTS[1])
    ans = _completion(
        client,
        server,
        stream,
        prompt=PROMPTS[:2],
        n=2,
        echo=True,
        max_tokens=5,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    for p in range(2):
        for c in range(2):
            assert ans.text[p * 2 + c] == PROMPTS[p] + expected[p], (p, c)
    # a prompt given as token ids is echoed as its text
    by_ids = _completion(
        client,
        server,
        stream,
        prompt=ids,
        echo=True,
        max_tokens=5,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert by_ids.only() == tok.decode(ids) + expected[1]
    assert by_ids.usage is None or by_ids.usage.completion_tokens == 5


# ---------------------------------------------------------------- stop strings
def _crafted_stop(text: str, tokens: list[str]) -> tuple[int, str]:
    """A stop string made of the end of token j-1 and the start of token j (both plain
    text, so they sit side by side in `text`) that occurs exactly once in `text`."""
    for j in range(3, len(tokens)):
        a, b = tokens[j - 1], tokens[j]
        if plain(a) and plain(b):
            stop = a[-3:] + b[:3]
            if text.count(stop) == 1:
                return j, stop
    raise AssertionError(f"no token boundary to craft a stop string from: {tokens}")


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("as_list", [False, True], ids=["string", "list"])
def test_stop_string_across_a_token_boundary_is_trimmed_and_stops_the_scheduler(
    server, client, stream, as_list
):
    text, tokens = _reference(client, server)
    j, stop = _crafted_stop(text, tokens)
    ans = _completion(
        client,
        server,
        stream,
        max_tokens=LONG,
        temperature=0,
        stop=["never in this output \u2603", stop] if as_list else stop,
        extra_body={"ignore_eos": True},
        **({"stream_options": {"include_usage": True}} if stream else {}),
    )
    _scheduler_idle(server)
    assert ans.only() == text[: text.index(stop)]
    assert ans.finish == {0: "stop"}
    # the stop string is complete with token j: generation ended there, far below max_tokens
    assert ans.usage.completion_tokens == j + 1 < LONG


def test_stop_string_in_a_streamed_chat_is_trimmed_and_stops_the_scheduler(server, client):
    messages = [{"role": "user", "content": "Streaming responses"}]
    ref = ask(
        client,
        "chat",
        False,
        model=server.model_name,
        messages=messages,
        max_tokens=120,
        temperature=0,
        logprobs=True,
        extra_body={"ignore_eos": True},
    )
    text, tokens = ref.only(), [e.token for e in ref.logprobs[0]]
    j, stop = _crafted_stop(text, tokens)
    ans = ask(
        client,
        "chat",
        True,
        model=server.model_name,
        messages=messages,
        max_tokens=LONG,
        temperature=0,
        stop=[stop],
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    _scheduler_idle(server)
    assert ans.only() == text[: text.index(stop)]
    assert ans.finish == {0: "stop"} and ans.usage.completion_tokens == j + 1


def test_stop_string_ends_each_of_n_choices_on_its_own(server, client):
    text, tokens = _reference(client, server)
    j, stop = _crafted_stop(text, tokens)
    ans = _completion(
        client,
        server,
        False,
        n=3,
        max_tokens=LONG,
        temperature=0,
        stop=stop,
        extra_body={"ignore_eos": True},
    )
    _scheduler_idle(server)
    assert ans.text == {i: text[: text.index(stop)] for i in range(3)}
    assert ans.finish == {i: "stop" for i in range(3)}
    assert ans.usage.completion_tokens == 3 * (j + 1)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_stop_strings_apply_to_the_output_not_to_the_echoed_prompt(server, client, stream):
    expected = _greedy(client, server, PROMPTS[0], 10)
    ans = _completion(
        client,
        server,
        stream,
        echo=True,
        stop=["capital"],  # in the prompt only
        max_tokens=10,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert "capital" not in expected
    assert ans.only() == PROMPTS[0] + expected and ans.finish == {0: "length"}


# ---------------------------------------------------------------- stop tokens, eos
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_stop_token_id_ends_with_stop_and_its_text_is_not_in_the_output(
    server, client, long_context_dir, stream
):
    text, tokens = _reference(client, server)
    vocab = token_texts(long_context_dir)
    # token j: plain text that only one vocabulary entry has, seen here for the first time
    j = next(
        j
        for j in range(2, len(tokens))
        if plain(tokens[j])
        and plain(tokens[j - 1])
        and len(vocab[tokens[j]]) == 1
        and tokens[j] not in tokens[:j]
    )
    (stop_id,) = vocab[tokens[j]]
    before = _greedy(client, server, PROMPTS[0], j)
    ans = _completion(
        client,
        server,
        stream,
        max_tokens=LONG,
        temperature=0,
        extra_body={"ignore_eos": True, "stop_token_ids": [stop_id]},
        **({"stream_options": {"include_usage": True}} if stream else {}),
    )
    _scheduler_idle(server)
    assert ans.finish == {0: "stop"}
    assert ans.usage.completion_tokens == j + 1  # the stop token was generated, and counted
    assert text.startswith(before + tokens[j])
    assert ans.only() == before, f"stop token {tokens[j]!r} leaked into the output"


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_eos_ends_the_choice_unless_ignore_eos(server, client, stream):
    common = dict(
        max_tokens=8,
        temperature=0,
        logit_bias={str(EOS_ID): 100},  # greedy now picks the end token every time
    )
    extra = {"stream_options": {"include_usage": True}} if stream else {}
    ended = _completion(client, server, stream, **common, **extra)
    assert ended.finish == {0: "stop"} and ended.usage.completion_tokens == 1
    assert ended.only() == ""
    ignored = _completion(
        client, server, stream, **common, **extra, extra_body={"ignore_eos": True}
    )
    assert ignored.finish == {0: "length"} and ignored.usage.completion_tokens == 8
    assert ignored.only() == ""  # the end token is special: it has no text


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("end", ["eos", "stop_token_id"])
def test_min_tokens_holds_off_a_forced_end_token(server, client, tok, stream, end):
    """The end token is forced with a +100 logit_bias: without min_tokens it would be the
    first token; with min_tokens 5 it may only come sixth."""
    assert tok.decode([PARIS]) == " Paris"
    end_id = EOS_ID if end == "eos" else PARIS
    extra = {} if end == "eos" else {"stop_token_ids": [PARIS]}
    # the five tokens that come instead: greedy with the end token pushed away
    expected = _greedy(client, server, PROMPTS[0], 5, logit_bias={str(end_id): -100})
    common = dict(
        max_tokens=20,
        temperature=0,
        logit_bias={str(end_id): 100},
    )
    if stream:
        common["stream_options"] = {"include_usage": True}
    at_once = _completion(client, server, stream, **common, extra_body=extra)
    assert at_once.finish == {0: "stop"} and at_once.usage.completion_tokens == 1
    held = _completion(client, server, stream, **common, extra_body={**extra, "min_tokens": 5})
    assert held.finish == {0: "stop"}
    assert held.usage.completion_tokens == 6
    # the five tokens' text (an incomplete last character may be dropped or shown as
    # U+FFFD), without the end token's text
    assert held.only().rstrip("\ufffd") == expected.rstrip("\ufffd")


# ---------------------------------------------------------------- max_completion_tokens
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_max_completion_tokens_limits_a_chat_answer(server, client, stream):
    ans = ask(
        client,
        "chat",
        stream,
        model=server.model_name,
        messages=[{"role": "user", "content": "hi"}],
        max_completion_tokens=5,
        extra_body={"ignore_eos": True},
        **({"stream_options": {"include_usage": True}} if stream else {}),
    )
    assert ans.finish == {0: "length"} and ans.usage.completion_tokens == 5


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_max_tokens_and_max_completion_tokens_together_are_a_400(server, client, stream):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model=server.model_name,
            messages=[{"role": "user", "content": "hi"}],
            max_tokens=5,
            max_completion_tokens=5,
            stream=stream,
        )
    assert_bad_param(info.value, "max_completion_tokens")
