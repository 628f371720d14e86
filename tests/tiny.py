"""Tiny random checkpoints written with transformers, plus a tiny byte-level tokenizer.

Small for testing: 2 layers, hidden 64, vocab 512. Each family exercises what sets it apart:
Llama with Llama 3 RoPE scaling and tied embeddings, Qwen2 with q/k/v biases and sharded
safetensors, Qwen3 with q/k norms and a head_dim that is not hidden / heads.
"""

from __future__ import annotations

from pathlib import Path

import torch

VOCAB = 512
EOS_ID = 1
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
_CORPUS = [
    "The capital of France is Paris. The capital of Italy is Rome.",
    "什么是 KV Cache？它保存注意力的键和值。流式输出与取消。",
    "Streaming responses send tokens as soon as they are ready 🚀 and ✨.",
    "def forward(self, x): return self.norm(x + self.attn(x))",
] * 8


def _common(arch: str) -> dict:
    return dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        rms_norm_eps=1e-6,
        # larger than usual so random logits have clear winners: greedy comparisons then
        # test the implementation, not float rounding between near-equal logits
        initializer_range=0.2,
        eos_token_id=EOS_ID,
        bos_token_id=None,
        pad_token_id=None,
    )


def make_config(arch: str):
    import transformers

    if arch == "llama":
        return transformers.LlamaConfig(
            **_common(arch),
            tie_word_embeddings=True,
            rope_theta=10000.0,
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
        )
    if arch == "qwen2":
        return transformers.Qwen2Config(**_common(arch), tie_word_embeddings=False)
    if arch == "qwen3":
        return transformers.Qwen3Config(**_common(arch), head_dim=32, tie_word_embeddings=False)
    raise ValueError(arch)


def make_tokenizer(out_dir: Path):
    """A byte-level BPE tokenizer trained on a few sentences, saved as a fast tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB,
        special_tokens=["<|endoftext|>", "<|im_end|>", "<|im_start|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(_CORPUS, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        unk_token="<|endoftext|>",
        pad_token="<|endoftext|>",
    )
    fast.chat_template = CHAT_TEMPLATE
    assert fast.eos_token_id == EOS_ID and len(fast) <= VOCAB
    fast.save_pretrained(out_dir)
    return fast


def make_checkpoint(arch: str, out_dir: Path, **overrides) -> Path:
    """Write config (`overrides` replace its fields), random weights (seeded) and tokenizer
    into `out_dir`."""
    import transformers

    config = make_config(arch)
    for name, value in overrides.items():
        setattr(config, name, value)
    torch.manual_seed({"llama": 1, "qwen2": 2, "qwen3": 3}[arch])
    model = transformers.AutoModelForCausalLM.from_config(config).to(torch.float32)
    shard = "40KB" if arch == "qwen2" else "50GB"  # qwen2 exercises sharded loading
    model.save_pretrained(out_dir, max_shard_size=shard)
    make_tokenizer(out_dir)
    return out_dir


def hf_references(dirs: dict, archs: list[str], prompts, n: int) -> dict[str, list[list[int]]]:
    """transformers' greedy continuations (`n` tokens) of `prompts`, per checkpoint in
    `dirs` (float32): the tokens our engine must give."""
    import transformers

    refs = {}
    for arch in archs:
        model = transformers.AutoModelForCausalLM.from_pretrained(
            dirs[arch], dtype=torch.float32
        ).eval()
        refs[arch] = [hf_greedy(model, p, n) for p in prompts]
    return refs


def hf_greedy(model, prompt: list[int], n: int) -> list[int]:
    """Greedy continuation with transformers, by full forward passes (no generate() config)."""
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            logits = model(torch.tensor([ids])).logits[0, -1]
            ids.append(int(logits.argmax()))
    return ids[len(prompt) :]


def tiny_cpu_engine(model_dir: Path, **overrides):
    """An engine on the CPU over a tiny checkpoint with the scheduler tests' settings: pages
    of 4 tokens, a 64-token context, 4 request slots (overrides replace any of them)."""
    from minisgl.engine.build import build_engine
    from minisgl.engine.config import EngineConfig

    settings = dict(device="cpu", page_size=4, max_seq_len=64, max_running_requests=4)
    return build_engine(EngineConfig(model=str(model_dir), **(settings | overrides)))
