"""The decoder-only transformer shared by Llama (SmolLM2, Llama 3), Qwen2 and Qwen3.

Contract: `CausalLM.forward(input_ids, positions, attn)` runs the T tokens of one step
(all requests flattened, no padding) and returns hidden states (T, hidden). The model does
not know about requests or pages: the `attn` context it is handed stores K/V and computes
attention for each layer. `CausalLM.logits(hidden)` turns selected rows into (B, vocab)
float32 logits. Parameter names follow Hugging Face's, except that q/k/v and gate/up are
fused; `load_weights` maps the Hugging Face names onto the fused parameters.

Tensor parallelism (`tp`, this process's rank of N): each rank holds its part of every
layer, Megatron-style. q/k/v and gate/up are column-parallel (a rank computes its heads
and its slice of the MLP), the attention output and MLP down projections row-parallel
(each rank's partial sums are added with one all-reduce per block); the embedding and the
LM head are vocabulary-parallel (a rank holds a slice of the vocabulary rows: lookups are
masked and summed, logits gathered). KV heads are split like query heads, or replicated
when there are fewer KV heads than ranks. `load_weights` copies each rank only its slice
of each checkpoint tensor (and reads only that slice from safetensors files). With one
rank, every collective returns at once and the shapes are the full ones.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from minisgl.distributed import TPInfo, all_gather, all_reduce, kv_heads, shard

from .config import ModelConfig
from .layers import GatedMLP, Linear, RMSNorm, RotaryEmbedding, apply_rotary
from .quant import exact_top_logits

Rope = tuple[torch.Tensor, torch.Tensor]  # a step's cos and signed sin rows, (T, 1, D) each


class AttentionContext(Protocol):
    """What a layer needs from the engine for one step (see minisgl.attention)."""

    def attention(
        self, layer_id: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor: ...


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer_id: int, tp: TPInfo) -> None:
        super().__init__()
        self.layer_id, self.tp = layer_id, tp
        _, self.num_heads = shard(config.num_heads, tp)  # this rank's heads
        _, self.num_kv_heads = kv_heads(config.num_kv_heads, tp)
        self.head_dim = config.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = Linear(
            config.hidden_size, self.q_size + 2 * self.kv_size, bias=config.attention_bias
        )
        self.o_proj = Linear(self.q_size, config.hidden_size, bias=False)
        if config.qk_norm:  # Qwen3 normalises each head of q and k before RoPE
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.qk_norm = config.qk_norm

    def forward(self, x: torch.Tensor, rope: Rope, attn: AttentionContext) -> torch.Tensor:
        T, H, Hkv, D = x.shape[0], self.num_heads, self.num_kv_heads, self.head_dim
        qkv = self.qkv_proj(x)  # (T, (H + 2 Hkv) * D): q's heads, then k's, then v's
        v = qkv[:, self.q_size + self.kv_size :].view(T, Hkv, D)
        if self.qk_norm:
            q = self.q_norm(qkv[:, : self.q_size].view(T, H, D))
            k = self.k_norm(qkv[:, self.q_size : self.q_size + self.kv_size].view(T, Hkv, D))
            q, k = apply_rotary(q, *rope), apply_rotary(k, *rope)
        else:  # q and k heads side by side: one rotation for both
            qk = apply_rotary(qkv[:, : self.q_size + self.kv_size].view(T, H + Hkv, D), *rope)
            q, k = qk[:, :H], qk[:, H:]
        out = attn.attention(self.layer_id, q, k, v)  # (T, H, D)
        return all_reduce(self.o_proj(out.reshape(T, self.q_size)), self.tp)  # row-parallel


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_id: int, tp: TPInfo) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, layer_id, tp)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        _, intermediate = shard(config.intermediate_size, tp)
        self.mlp = GatedMLP(config.hidden_size, intermediate)
        self.tp = tp

    def forward(self, x: torch.Tensor, rope: Rope, attn: AttentionContext) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), rope, attn)
        return x + all_reduce(self.mlp(self.post_attention_layernorm(x)), self.tp)  # row-parallel


class VocabEmbedding(nn.Module):
    """The embedding table, or with N ranks this rank's slice of its rows (the vocabulary
    padded to a multiple of N): a token outside the slice looks up zeros, and the ranks'
    lookups are summed."""

    def __init__(self, vocab_size: int, hidden: int, tp: TPInfo) -> None:
        super().__init__()
        self.rows = -(-vocab_size // tp.size)
        self.start, self.tp = tp.rank * self.rows, tp
        self.weight = nn.Parameter(torch.empty(self.rows, hidden))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return self.lookup(input_ids)
        local = input_ids - self.start
        inside = (local >= 0) & (local < self.rows)
        x = self.lookup(local.clamp(0, self.rows - 1))
        return all_reduce(x * inside[:, None].to(x.dtype), self.tp)

    def lookup(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` of this rank's slice: (T, hidden). A quantized model reads them out
        of its packed weights instead (minisgl.models.loader.QuantEmbedding)."""
        return F.embedding(ids, self.weight)


class DecoderModel(nn.Module):
    def __init__(self, config: ModelConfig, tp: TPInfo) -> None:
        super().__init__()
        self.embed_tokens = VocabEmbedding(config.vocab_size, config.hidden_size, tp)
        self.rotary = RotaryEmbedding(config.head_dim, config.max_position_embeddings, config.rope)
        self.layers = nn.ModuleList(DecoderLayer(config, i, tp) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionContext
    ) -> torch.Tensor:
        x = self.embed_tokens(input_ids)  # (T, hidden)
        rope = self.rotary.tables(positions, x.dtype)  # looked up once, used by every layer
        for layer in self.layers:
            x = layer(x, rope, attn)
        return self.norm(x)


# Hugging Face parameter name fragment -> (our fused parameter, shard index)
_FUSED = {
    ".q_proj.": (".qkv_proj.", 0),
    ".k_proj.": (".qkv_proj.", 1),
    ".v_proj.": (".qkv_proj.", 2),
    ".gate_proj.": (".gate_up_proj.", 0),
    ".up_proj.": (".gate_up_proj.", 1),
}


class CausalLM(nn.Module):
    def __init__(self, config: ModelConfig, tp: TPInfo | None = None) -> None:
        super().__init__()
        self.config = config
        self.tp = tp = tp or TPInfo()
        self.model = DecoderModel(config, tp)
        self.vocab_rows = self.model.embed_tokens.rows  # of the vocabulary, on this rank
        self.lm_head = Linear(config.hidden_size, self.vocab_rows, bias=False)
        # this rank's slices: query heads, KV heads (first, count), MLP columns
        self.q_start, self.num_heads = shard(config.num_heads, tp)
        self.kv_start, self.num_kv_heads = kv_heads(config.num_kv_heads, tp)
        self.mlp_start, self.mlp_size = shard(config.intermediate_size, tp)
        self.tie_weights()

    def tie_weights(self) -> None:
        """Share the embedding with the LM head; moving a model off "meta" unties them."""
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionContext
    ) -> torch.Tensor:
        return self.model(input_ids, positions, attn)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(hidden).float()  # (B, vocab rows of this rank)
        if hasattr(self.lm_head, "rows"):  # quantized (models/quant.py): an exact top
            logits = exact_top_logits(self.lm_head, hidden, logits)
        if self.tp.size == 1:
            return logits
        return all_gather(logits, self.tp)[:, : self.config.vocab_size]  # (B, vocab)

    def _shard_sizes(self, fused_name: str) -> list[int]:
        D = self.config.head_dim
        if "qkv_proj" in fused_name:
            return [self.num_heads * D, self.num_kv_heads * D, self.num_kv_heads * D]
        return [self.mlp_size, self.mlp_size]

    def _rank_slice(self, name: str, tensor):
        """This rank's part of the checkpoint tensor `name` (a tensor, or a safetensors
        slice that reads only what is indexed)."""
        if self.tp.size == 1:
            return tensor[:]
        D = self.config.head_dim
        if ".q_proj." in name:
            return tensor[self.q_start * D : (self.q_start + self.num_heads) * D]
        if ".k_proj." in name or ".v_proj." in name:
            return tensor[self.kv_start * D : (self.kv_start + self.num_kv_heads) * D]
        if ".gate_proj." in name or ".up_proj." in name:
            return tensor[self.mlp_start : self.mlp_start + self.mlp_size]
        if ".o_proj.weight" in name:
            return tensor[:, self.q_start * D : (self.q_start + self.num_heads) * D]
        if ".down_proj.weight" in name:
            return tensor[:, self.mlp_start : self.mlp_start + self.mlp_size]
        if name.endswith(("embed_tokens.weight", "lm_head.weight")):
            start = self.model.embed_tokens.start
            return tensor[start : min(start + self.vocab_rows, self.config.vocab_size)]
        return tensor[:]

    def _expected_keys(self) -> set[str]:
        """One key per plain parameter, one per shard of a fused parameter."""
        keys = set()
        for name, _ in self.named_parameters():  # a tied lm_head shares the embedding
            if ".qkv_proj." in name or ".gate_up_proj." in name:
                keys.update(f"{name}#{s}" for s in range(len(self._shard_sizes(name))))
            else:
                keys.add(name)
        return keys

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy Hugging Face-named tensors into our parameters; every parameter must be set."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, tensor in weights:
            if "rotary_emb" in name or (
                name == "lm_head.weight" and self.config.tie_word_embeddings
            ):
                continue
            tensor = self._rank_slice(name, tensor)
            fused = next(((f, t) for f, t in _FUSED.items() if f in name), None)
            if fused is None:
                param = _lookup(params, name, name)
                view, key = param, name
                if name.endswith(("embed_tokens.weight", "lm_head.weight")):
                    view[tensor.shape[0] :].zero_()  # rows past the vocabulary (padding)
                    view = view[: tensor.shape[0]]
            else:
                fragment, (fused_fragment, shard) = fused
                target = name.replace(fragment, fused_fragment)
                sizes = self._shard_sizes(target)
                offset = sum(sizes[:shard])
                view = _lookup(params, target, name)[offset : offset + sizes[shard]]
                key = f"{target}#{shard}"
            if view.shape != tensor.shape:
                raise ValueError(
                    f"{name}: checkpoint shape {tuple(tensor.shape)} != model {tuple(view.shape)}"
                )
            view.copy_(tensor)
            loaded.add(key)
        missing = self._expected_keys() - loaded
        if missing:
            raise ValueError(f"checkpoint is missing weights: {sorted(missing)[:8]}")


def _lookup(params: dict[str, nn.Parameter], target: str, source: str) -> nn.Parameter:
    try:
        return params[target]
    except KeyError:
        raise ValueError(f"checkpoint weight {source!r} has no place in the model") from None
