"""The offline API: results per prompt, errors as results, early exit leaves nothing behind;
configurations given whole or as keyword options."""

from __future__ import annotations

import pytest

from minisgl import LLM, SamplingParams
from minisgl.engine.config import EngineConfig
from minisgl.scheduler.config import SchedulerConfig


@pytest.fixture(scope="module")
def llm(tiny_dirs) -> LLM:
    return LLM(str(tiny_dirs["llama"]), device="cpu", page_size=4, max_seq_len=128)


def _idle(llm: LLM) -> bool:
    s = llm.scheduler.state()
    return s.pending == s.running == s.table_slots_used == s.kv_pages_used == 0


def test_text_prompts_chat_prompts_and_ids_give_text_ids_and_reason(llm) -> None:
    outs = llm.generate(
        ["The capital of France is", [{"role": "user", "content": "什么是 KV Cache？"}], [5, 6, 7]],
        SamplingParams(max_tokens=6, ignore_eos=True),
    )
    assert len(outs) == 3
    for out in outs:
        assert len(out.token_ids) == 6 and out.finish_reason == "length" and out.error is None
        # random weights may end mid-character: those bytes are never emitted (broken
        # bytes before them go out as U+FFFD)
        full = llm.tokenizer.decode(out.token_ids, skip_special_tokens=True)
        assert full.startswith(out.text) and not full[len(out.text) :].strip("\ufffd")
    assert outs[2].prompt_token_ids == [5, 6, 7]
    assert _idle(llm)


def test_a_refused_prompt_is_an_error_result_beside_good_ones(llm) -> None:
    outs = llm.generate([[5] * 200, [5, 6]], SamplingParams(max_tokens=3, ignore_eos=True))
    assert outs[0].error and "context" in outs[0].error and outs[0].finish_reason is None
    assert outs[1].error is None and len(outs[1].token_ids) == 3
    assert _idle(llm)


def test_leaving_a_stream_early_aborts_what_is_still_running(llm) -> None:
    events = llm.stream([[5, 6, 7], [8, 9]], SamplingParams(max_tokens=50, ignore_eos=True))
    for i, _ in enumerate(events):
        if i == 5:
            break
    events.close()  # what a `for` loop's break leaves to the garbage collector
    assert _idle(llm)


def test_sampling_params_per_prompt(llm) -> None:
    outs = llm.generate(
        [[5, 6], [7, 8]], [SamplingParams(max_tokens=2), SamplingParams(max_tokens=5)]
    )
    assert [len(o.token_ids) for o in outs] == [2, 5]
    with pytest.raises(ValueError, match="2 sampling params for 3 prompts"):
        llm.generate([[1], [2], [3]], [SamplingParams(), SamplingParams()])


def test_configurations_are_taken_as_they_are_and_options_override_them(tiny_dirs) -> None:
    engine = EngineConfig(model=str(tiny_dirs["llama"]), device="cpu", max_seq_len=128)
    llm = LLM(
        engine_config=engine, scheduler_config=SchedulerConfig(max_prefill_tokens=5), page_size=4
    )
    assert llm.engine.page_size == 4 and llm.engine.max_seq_len == 128
    assert llm.scheduler.config == SchedulerConfig(max_prefill_tokens=5)
    assert engine.page_size == EngineConfig().page_size  # the caller's config is not changed
    (out,) = llm.generate([[5, 6, 7, 8, 9, 10, 11]], SamplingParams(max_tokens=2, ignore_eos=True))
    assert len(out.token_ids) == 2  # with a 5-token budget: prefilled in two chunks
    assert _idle(llm)


def test_an_option_no_configuration_has_is_a_type_error() -> None:
    with pytest.raises(TypeError, match="max_prefill_token"):
        LLM(device="cpu", max_prefill_token=8)


def test_a_folder_with_only_a_config_serves_token_ids(tiny_dirs, tmp_path) -> None:
    # what the benchmarks' `--config NAME --dummy-weights` builds: random weights and no
    # tokenizer, so prompts are token ids and outputs are ids (no text to decode)
    (tmp_path / "config.json").write_text((tiny_dirs["llama"] / "config.json").read_text())
    with LLM(str(tmp_path), device="cpu", dummy_weights=True, max_seq_len=64) as bare:
        assert bare.tokenizer is None
        (out,) = bare.generate([[5, 6, 7]], SamplingParams(max_tokens=4, ignore_eos=True))
        assert out.error is None and len(out.token_ids) == 4 and out.text == ""
        # with no text to wait for, each token is a stream event
        seen = [
            len(e.output.token_ids)
            for e in bare.stream([[5, 6]], SamplingParams(max_tokens=3, ignore_eos=True))
        ]
        assert seen == [1, 2, 3]
        (refused,) = bare.generate([[5] * 100], SamplingParams(max_tokens=4))
        assert refused.error and "context" in refused.error


def test_chunks_inside_a_prompt_run_no_lm_head_and_change_no_token(llm, tiny_dirs) -> None:
    """A prompt longer than a step's budget: the steps whose chunks end inside it sample
    nothing, so no row goes through the LM head (it used to run on every row of such a
    chunk: a (chunk, vocab) float32 block, 1.6 GB at 8192 tokens of a 49k vocabulary)."""
    chunked = LLM(
        str(tiny_dirs["llama"]), device="cpu", page_size=4, max_seq_len=128, max_prefill_tokens=16
    )
    model = chunked.scheduler.engine.model
    rows: list[int] = []
    logits = model.logits
    model.logits = lambda hidden: rows.append(hidden.shape[0]) or logits(hidden)
    prompt = [3 + i % 50 for i in range(70)]  # five chunks: 16, 16, 16, 16, 6
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    (out,) = chunked.generate([prompt], params)
    assert rows == [1, 1, 1, 1], rows  # the last chunk's final row, then three decodes
    (whole,) = llm.generate([prompt], params)  # the same prompt in one chunk
    assert out.token_ids == whole.token_ids and len(out.token_ids) == 4
    assert _idle(chunked)
