"""The embedded default model (SmolLM2-135M-Instruct, real weights) through the offline API."""

from __future__ import annotations

from minisgl import LLM, SamplingParams


def test_capital_of_france_is_paris() -> None:
    llm = LLM(device="cpu")
    (out,) = llm.generate(["The capital of France is"], SamplingParams(max_tokens=12))
    assert "Paris" in out.text
    (chat,) = llm.generate(
        [[{"role": "user", "content": "What is the capital of France?"}]],
        SamplingParams(max_tokens=20),
    )
    assert "Paris" in chat.text and chat.finish_reason == "stop"
