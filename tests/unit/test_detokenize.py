"""Incremental detokenization never emits a broken character and loses no text; what it
returns is the UserReply the client gets."""

from __future__ import annotations

import pytest
from tiny import make_tokenizer

from minisgl.message import DetokenizeMsg, UserReply
from minisgl.tokenizer import DetokenizeManager

TEXTS = [
    "什么是 KV Cache？它保存注意力的键和值。",
    "Streaming 🚀 and ✨ emoji, then 中文 and 鲸鱼 again.",
    "plain ascii words with spaces",
]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return make_tokenizer(tmp_path_factory.mktemp("tok"))


@pytest.mark.parametrize("text", TEXTS)
def test_deltas_concatenate_to_the_text_and_never_hold_a_broken_character(tokenizer, text):
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert len(ids) > 5
    detok = DetokenizeManager(tokenizer)
    detok.add(7)
    deltas = []
    for i, token in enumerate(ids):
        finish = "length" if i == len(ids) - 1 else None
        (reply,), stopped = detok.feed([DetokenizeMsg(7, token, finish)])
        delta = reply.incremental_output
        assert "\ufffd" not in delta and reply.completion_tokens == i + 1 and not stopped
        assert reply.uid == 7 and reply.finished == (finish is not None)
        deltas.append(delta)
    assert "".join(deltas) == text
    assert 7 not in detok.decode_map  # the finishing token removed the state


def test_characters_split_across_tokens_are_held_back_until_complete(tokenizer):
    text = "鲸鱼🐳"  # unseen in training: each character is several byte tokens
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert len(ids) > 6
    detok = DetokenizeManager(tokenizer)
    detok.add(8)
    deltas = [r.incremental_output for (r,), _ in (detok.feed([DetokenizeMsg(8, t)]) for t in ids)]
    assert deltas.count("") >= len(ids) - 3  # only a completing token emits text
    assert [d for d in deltas if d] == ["鲸", "鱼", "🐳"]


def test_interleaved_requests_keep_their_own_text(tokenizer):
    a, b = (tokenizer.encode(t, add_special_tokens=False) for t in TEXTS[:2])
    detok = DetokenizeManager(tokenizer)
    detok.add(1)
    detok.add(2)
    out = {1: "", 2: ""}
    for i in range(max(len(a), len(b))):
        msgs = []
        if i < len(a):
            msgs.append(DetokenizeMsg(1, a[i], "length" if i == len(a) - 1 else None))
        if i < len(b):
            msgs.append(DetokenizeMsg(2, b[i], "length" if i == len(b) - 1 else None))
        for msg, reply in zip(msgs, detok.feed(msgs)[0]):
            out[msg.uid] += reply.incremental_output
    assert out == {1: TEXTS[0], 2: TEXTS[1]}
    assert detok.decode_map == {}


def test_a_late_token_for_a_removed_uid_is_dropped_and_recreates_nothing(tokenizer):
    detok = DetokenizeManager(tokenizer)
    detok.add(3)
    detok.remove(3)  # e.g. the request was aborted
    assert detok.feed([DetokenizeMsg(3, 42)]) == ([None], set())
    assert detok.decode_map == {}


def test_an_unfinished_multibyte_tail_is_not_emitted_at_finish(tokenizer):
    ids = tokenizer.encode("🚀", add_special_tokens=False)
    assert len(ids) > 1  # the emoji spans several byte-level tokens
    detok = DetokenizeManager(tokenizer)
    detok.add(4)
    (reply,), _ = detok.feed([DetokenizeMsg(4, ids[0], "length")])  # cut off mid-character
    assert reply == UserReply(4, "", finished=True, finish_reason="length", completion_tokens=1)


def test_several_steps_of_one_uid_in_one_batch_decode_in_order(tokenizer):
    text = TEXTS[1]
    ids = tokenizer.encode(text, add_special_tokens=False)
    detok = DetokenizeManager(tokenizer)
    detok.add(9, prompt_tokens=3)
    msgs = [DetokenizeMsg(9, t, "length" if i == len(ids) - 1 else None) for i, t in enumerate(ids)]
    replies, _ = detok.feed(msgs)  # a worker that fell behind: every step in one batch
    assert "".join(r.incremental_output for r in replies) == text
    assert [r.completion_tokens for r in replies] == list(range(1, len(ids) + 1))
    assert {r.prompt_tokens for r in replies} == {3}
    assert [r.finished for r in replies] == [False] * (len(ids) - 1) + [True]


def test_an_end_token_counts_but_its_text_is_not_output(tokenizer):
    """finish_reason "stop" from the scheduler means the last token is an end token (EOS or
    a stop_token_id): like a stop string, its text is not part of the output."""
    ids = tokenizer.encode("plain ascii", add_special_tokens=False)
    detok = DetokenizeManager(tokenizer)
    detok.add(10)
    *head, end = ids
    msgs = [DetokenizeMsg(10, t) for t in head] + [DetokenizeMsg(10, end, "stop")]
    replies, stopped = detok.feed(msgs)
    assert "".join(r.incremental_output for r in replies) == tokenizer.decode(head)
    assert replies[-1].completion_tokens == len(ids) and replies[-1].finish_reason == "stop"
    assert stopped == set()  # the scheduler ended it: nothing to stop there


def test_a_stop_string_ends_its_choice_alone_and_is_reported_for_the_scheduler(tokenizer):
    """Two choices, one batch holding several steps of each: the stop string ends choice 0
    at the token that completes it (its position is returned, so that the scheduler stops
    that choice), its later tokens are dropped, and choice 1, which never says it, goes on."""
    texts = ["plain ascii words", "plain words, no stop"]
    zero, one = (tokenizer.encode(t, add_special_tokens=False) for t in texts)
    detok = DetokenizeManager(tokenizer)
    detok.add(11, prompt_tokens=2, n=2, stop=["ascii"])
    msgs = [DetokenizeMsg(11, t, index=0) for t in zero]
    msgs += [
        DetokenizeMsg(11, t, "length" if j == len(one) - 1 else None, index=1)
        for j, t in enumerate(one)
    ]
    replies, stopped = detok.feed(msgs)
    (end,) = stopped
    assert msgs[end].index == 0 and replies[end].finish_reason == "stop"
    assert not replies[end].finished  # choice 1 still runs
    assert all(r is None for r in replies[end + 1 : len(zero)])  # choice 0: dropped after
    assert "".join(r.incremental_output for r in replies[: end + 1]) == "plain "
    assert "".join(r.incremental_output for r in replies[len(zero) :]) == texts[1]
    assert replies[-1].finished and replies[-1].finish_reason == "length"
    assert detok.decode_map == {}


def test_bytes_that_can_never_complete_go_out_as_replacement_characters_at_once(tokenizer):
    """A model biased onto a lone 0xF0 byte: each such byte starts a 4-byte character the
    next one breaks, so no more than one is ever held, the output is U+FFFD per byte and not
    empty text for thousands of tokens, and each step decodes only the few held tokens."""
    lone = tokenizer.convert_tokens_to_ids("ð")  # byte-level BPE's symbol for byte 0xF0
    assert tokenizer.decode([lone]) == "\ufffd"
    detok = DetokenizeManager(tokenizer)
    detok.add(9)
    text, quiet = "", 0
    for i in range(2000):
        (reply,), _ = detok.feed([DetokenizeMsg(9, lone)])
        text += reply.incremental_output
        quiet = 0 if reply.incremental_output else quiet + 1
        assert quiet <= 1, i  # held one step at most: the next byte breaks it
        choice = detok.decode_map[9].choices[0]
        assert len(choice.ids) - choice.prefix_offset <= 4  # the decode window stays small
    a = tokenizer.encode("a", add_special_tokens=False)
    (reply,), _ = detok.feed([DetokenizeMsg(9, a[0], "length")])
    text += reply.incremental_output
    assert text == "\ufffd" * 2000 + "a"


def test_a_character_begun_after_a_broken_byte_still_completes(tokenizer):
    """0xFF (never in UTF-8), then the two bytes of "ʫ" one token each, then 0xFF again: a
    broken byte goes out as U+FFFD at once, the character's first byte waits for its second."""
    byte = {
        b: tokenizer.convert_tokens_to_ids(s) for b, s in ((0xFF, "ÿ"), (0xCA, "Ê"), (0xAB, "«"))
    }
    assert tokenizer.decode([byte[0xCA], byte[0xAB]]) == "ʫ"
    detok = DetokenizeManager(tokenizer)
    detok.add(5)
    out = []
    for token in (byte[0xFF], byte[0xCA], byte[0xAB], byte[0xFF]):
        (reply,), _ = detok.feed([DetokenizeMsg(5, token)])
        out.append(reply.incremental_output)
    assert out == ["\ufffd", "", "ʫ", "\ufffd"]


def test_random_tokens_lose_no_character_whatever_bytes_they_hold(tokenizer):
    """Random byte-level tokens (broken bytes, characters split anywhere): the text sent is
    the tokens' bytes as UTF-8, every character in it, U+FFFD where bytes are broken."""
    import random

    from minisgl.tokenizer.tokenize import token_bytes

    rng = random.Random(0)
    plain = [
        i for i in range(len(tokenizer)) if not token_bytes(tokenizer, [i])[0].startswith(b"<|")
    ]
    for _ in range(500):
        ids = [rng.choice(plain) for _ in range(rng.randrange(1, 12))]
        detok = DetokenizeManager(tokenizer)
        detok.add(1)
        text = ""
        for k, token in enumerate(ids):
            finish = "length" if k == len(ids) - 1 else None
            text += detok.feed([DetokenizeMsg(1, token, finish)])[0][0].incremental_output
        expected = b"".join(token_bytes(tokenizer, ids)).decode(errors="replace")
        assert text.replace("\ufffd", "") == expected.replace("\ufffd", ""), ids
