"""Convert a llama-architecture GGUF file into a Hugging Face model directory, once.

Contract:
- receives the path of a GGUF file (quantized or not) whose `general.architecture` is
  `llama`, and the directory to create;
- writes a directory that `AutoModelForCausalLM.from_pretrained(dir)` and
  `AutoTokenizer.from_pretrained(dir)` load like any hub checkpoint: `config.json`
  (LlamaForCausalLM built from the GGUF metadata), `generation_config.json`,
  `model.safetensors` (float32, Hugging Face tensor names, llama.cpp's Q/K row permutation
  undone), the tokenizer files with the chat template stored in the GGUF, and `model.gguf`,
  a link to the source file (`--quantization gguf` computes with its quantized blocks);
- everything is written into a temporary sibling directory that is renamed onto
  `out_dir` only at the very end, so an interrupted conversion never leaves a half
  directory behind. An existing `out_dir` is replaced.

After this one conversion the model is an ordinary local checkpoint, loaded by the same
code path as a hub id; only `--quantization gguf` (the CPU default for such a folder) reads
the linked GGUF again, for its quantized blocks (gguf_quant.py).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import uuid
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import save_file
from tqdm.auto import tqdm

# GGUF per-layer tensor name -> Hugging Face name inside `model.layers.N.`.
_LAYER_TENSORS = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GLOBAL_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_RE = re.compile(r"^blk\.(\d+)\.([a-z_]+)\.weight$")


def hf_tensor_name(gguf_name: str) -> str:
    """Map a llama GGUF tensor name to its Hugging Face name; unknown names raise."""
    if gguf_name in _GLOBAL_TENSORS:
        return _GLOBAL_TENSORS[gguf_name]
    m = _LAYER_RE.match(gguf_name)
    if m and m.group(2) in _LAYER_TENSORS:
        return f"model.layers.{m.group(1)}.{_LAYER_TENSORS[m.group(2)]}.weight"
    # Failing loudly beats silently dropping a tensor (e.g. Llama 3's rope_freqs, which
    # would also need a rope_scaling entry in config.json).
    raise ValueError(f"unsupported GGUF tensor {gguf_name!r} for the llama converter")


def unpermute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's convert_hf_to_gguf `permute` of q_proj / k_proj rows.

    llama.cpp stores the two rotary halves of each head interleaved (GPT-J style);
    Hugging Face Llama rotates the first half against the second (NeoX style).
    w: (n_head * head_dim, hidden); n_head is num_key_value_heads for k_proj.
    """
    half = w.shape[0] // n_head // 2
    # (n_head, half, 2, hidden) -> (n_head, 2, half, hidden): pairs back into halves.
    return w.reshape(n_head, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _field(reader: Any, key: str, default: Any = None) -> Any:
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def _f32(x: float) -> float:
    # GGUF stores floats as float32; the shortest decimal that round-trips in float32
    # gives config.json values like 1e-05 instead of 9.999999747378752e-06.
    return float(str(np.float32(x)))


def build_config(reader: Any, has_output_weight: bool) -> dict[str, Any]:
    """A Hugging Face LlamaConfig dict from the GGUF `llama.*` and tokenizer metadata."""
    arch = _field(reader, "general.architecture")
    if arch != "llama":
        raise ValueError(f"only llama-architecture GGUF files are supported, got {arch!r}")

    def meta(key: str, default: Any = None) -> Any:
        value = _field(reader, f"llama.{key}", default)
        if value is None:
            raise ValueError(f"GGUF file lacks the metadata key llama.{key}")
        return value

    hidden = int(meta("embedding_length"))
    n_heads = int(meta("attention.head_count"))
    n_vocab = _field(reader, "llama.vocab_size") or len(_field(reader, "tokenizer.ggml.tokens"))
    config: dict[str, Any] = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": int(meta("feed_forward_length")),
        "num_hidden_layers": int(meta("block_count")),
        "num_attention_heads": n_heads,
        "num_key_value_heads": int(meta("attention.head_count_kv", n_heads)),
        "head_dim": int(meta("rope.dimension_count", hidden // n_heads)),
        "hidden_act": "silu",
        "rms_norm_eps": _f32(meta("attention.layer_norm_rms_epsilon")),
        # llama.cpp's own default when a file omits the key.
        "rope_theta": _f32(meta("rope.freq_base", 10000.0)),
        "rope_scaling": None,
        "max_position_embeddings": int(meta("context_length")),
        "vocab_size": int(n_vocab),
        "tie_word_embeddings": not has_output_weight,
        "attention_bias": False,
        "mlp_bias": False,
        "torch_dtype": "float32",
        "use_cache": True,
    }
    for name in ("bos", "eos", "padding"):
        token_id = _field(reader, f"tokenizer.ggml.{name}_token_id")
        if token_id is not None:
            config["pad_token_id" if name == "padding" else f"{name}_token_id"] = int(token_id)
    return config


def _eos_token_ids(reader: Any, eos_id: int | None) -> list[int]:
    """End-of-generation ids: the GGUF eos plus the usual chat/document terminators.

    llama.cpp (the runtime this file was made for) stops on every end-of-generation
    token it recognises, not just `eos_token_id`; listing them keeps plain completions
    from running past `<|endoftext|>`.
    """
    tokens: list[str] = list(_field(reader, "tokenizer.ggml.tokens", []))
    ids = [] if eos_id is None else [eos_id]
    for text in ("<|im_end|>", "<|endoftext|>", "<|eot_id|>", "<|end_of_text|>"):
        if text in tokens and tokens.index(text) not in ids:
            ids.append(tokens.index(text))
    return ids


def _write_weights(reader: Any, config: dict[str, Any], out: Path, desc: str) -> None:
    from gguf.quants import dequantize

    n_heads = config["num_attention_heads"]
    n_kv_heads = config["num_key_value_heads"]
    tensors: dict[str, torch.Tensor] = {}
    for t in tqdm(reader.tensors, desc=desc, unit="tensor"):
        name = hf_tensor_name(t.name)
        # (out_features, in_features) for matrices: GGUF lists dims innermost first.
        w = dequantize(t.data, t.tensor_type).reshape(tuple(reversed(t.shape.tolist())))
        if name.endswith("q_proj.weight"):
            w = unpermute_qk(w, n_heads)
        elif name.endswith("k_proj.weight"):
            w = unpermute_qk(w, n_kv_heads)
        # np.array copies out of the read-only memmap that F32 tensors are views of.
        tensors[name] = torch.from_numpy(np.array(w, dtype=np.float32, order="C"))
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})


def _write_tokenizer(
    reader: Any, gguf_path: Path, config: dict[str, Any], out: Path, chat_template: str | None
) -> None:
    from transformers import AutoTokenizer

    # transformers rebuilds a fast tokenizer (vocab, merges, pre-tokenizer, special
    # tokens) from the GGUF metadata; re-implementing that here would only add bugs.
    tok = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    chat_template = chat_template or _field(reader, "tokenizer.chat_template")
    if chat_template:
        tok.chat_template = chat_template
    tok.save_pretrained(str(out))

    # Normalise tokenizer_config.json so older and newer transformers (and readers that
    # only parse JSON) agree: the generic fast-tokenizer class, the chat template inline
    # as well as in chat_template.jinja, the real context length, no load-time noise.
    cfg_path = out / "tokenizer_config.json"
    tok_cfg = json.loads(cfg_path.read_text())
    for key in ("is_local", "local_files_only", "backend"):
        tok_cfg.pop(key, None)
    tok_cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    tok_cfg["model_max_length"] = config["max_position_embeddings"]
    tok_cfg["add_bos_token"] = bool(_field(reader, "tokenizer.ggml.add_bos_token", False))
    if chat_template:
        tok_cfg["chat_template"] = chat_template
    cfg_path.write_text(json.dumps(tok_cfg, indent=2, ensure_ascii=False) + "\n")

    special = {
        key: getattr(tok, key)
        for key in ("bos_token", "eos_token", "unk_token", "pad_token")
        if getattr(tok, key, None) is not None
    }
    (out / "special_tokens_map.json").write_text(json.dumps(special, indent=2) + "\n")

    eos_id = config.get("eos_token_id")
    if eos_id is not None and tok.convert_ids_to_tokens(eos_id) != tok.eos_token:
        raise ValueError(f"tokenizer eos {tok.eos_token!r} disagrees with eos id {eos_id}")


def _write_generation_config(reader: Any, config: dict[str, Any], out: Path) -> None:
    gen: dict[str, Any] = {
        "bos_token_id": config.get("bos_token_id"),
        "eos_token_id": _eos_token_ids(reader, config.get("eos_token_id")),
        "pad_token_id": config.get("pad_token_id"),
    }
    gen = {k: v for k, v in gen.items() if v is not None}
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")


def _link_source(gguf_path: Path, out: Path) -> None:
    """`model.gguf` -> the source file: `--quantization gguf` computes with its blocks."""
    try:
        os.symlink(gguf_path.resolve(), out / "model.gguf")
    except OSError:  # no symlinks here: the folder still serves its float weights
        pass


# --8<-- [start:convert_gguf]
def convert_gguf_to_hf_dir(
    gguf_path: Path, out_dir: Path, *, desc: str | None = None, chat_template: str | None = None
) -> Path:
    """Dequantize `gguf_path` into a Hugging Face checkpoint at `out_dir`; returns out_dir.
    `chat_template` replaces the GGUF's own."""
    from gguf import GGUFReader

    gguf_path, out_dir = Path(gguf_path), Path(out_dir)
    reader = GGUFReader(str(gguf_path))
    has_output = any(t.name == "output.weight" for t in reader.tensors)
    config = build_config(reader, has_output_weight=has_output)
    if desc is None:
        desc = f"Dequantizing {gguf_path.name.split('.')[0]}"

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_dir.parent / f".{out_dir.name}.tmp-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        _write_generation_config(reader, config, tmp)
        _write_tokenizer(reader, gguf_path, config, tmp, chat_template)
        _write_weights(reader, config, tmp, desc)
        _link_source(gguf_path, tmp)
        if out_dir.exists():
            # Move the old directory aside first: rename onto a non-empty dir fails.
            old = out_dir.parent / f".{out_dir.name}.old-{uuid.uuid4().hex[:8]}"
            os.rename(out_dir, old)
            shutil.rmtree(old, ignore_errors=True)
        os.rename(tmp, out_dir)  # atomic on one filesystem: all files or none
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir


# --8<-- [end:convert_gguf]
