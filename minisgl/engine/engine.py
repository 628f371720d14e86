"""Engine: the model, its KV cache and one forward step.

Contract: the engine knows nothing about uids, messages or tokenization. It owns device
memory: the weights, the KV page pool and the page table (one row of page ids per request
slot, kept on the host and copied per step). `forward(batch)` runs one step for requests
whose pages and slots the scheduler has already set up, and returns the sampled token of
every request that samples this step, in batch order.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from minisgl.attention import ForwardInfo, create_attention_backend
from minisgl.core import Batch
from minisgl.kvcache import KVCachePool
from minisgl.message import TokenLogprob
from minisgl.models.config import ModelConfig
from minisgl.models.decoder import CausalLM
from minisgl.models.source import resolve_model_dir
from minisgl.models.weight import init_dummy_weights, iter_checkpoint
from minisgl.utils.process import available_ram

from .config import EngineConfig
from .sample import Sampler

logger = logging.getLogger(__name__)


class Engine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.device = config.resolve_device()
        self.dtype = config.resolve_dtype(self.device)
        self.model_dir: Path = resolve_model_dir(config.model)
        self.model_config = ModelConfig.from_dir(self.model_dir)
        self.model = self._load_model()
        self.page_size = config.page_size

        self.num_pages = config.num_pages or self._pages_from_memory()
        self.pool = KVCachePool(
            self.model_config.num_layers,
            self.num_pages,
            self.page_size,
            self.model_config.num_kv_heads,
            self.model_config.head_dim,
            self.dtype,
            self.device,
        )
        # a request can never outgrow the pool, so one request alone always fits
        self.max_seq_len = min(
            config.max_seq_len or self.model_config.max_position_embeddings,
            self.model_config.max_position_embeddings,
            self.num_pages * self.page_size,
        )
        self.max_pages_per_req = -(-self.max_seq_len // self.page_size)
        # host page table; the extra last row is the dummy slot padding rows point at
        self.page_table = torch.full(
            (config.max_running_requests + 1, self.max_pages_per_req),
            self.pool.scratch_page,
            dtype=torch.int32,
        )
        self.attn_backend = create_attention_backend(
            config.attention_backend,
            self.pool,
            self.model_config.num_heads,
            self.model_config.head_dim,
            self.device,
        )
        self.sampler = Sampler(self.model_config.vocab_size, self.device)
        self.graph_runner = None
        if self.attn_backend.graphable:
            from .graph import BUCKETS, DecodeGraphRunner

            capture = self.device.type == "cuda" and config.cuda_graph
            max_bs = min(config.max_running_requests, BUCKETS[-1])
            self.graph_runner = DecodeGraphRunner(self, max_bs, capture)
        logger.info(
            "engine ready: %s on %s (%s), %d KV pages of %d tokens, max_seq_len %d",
            self.model_dir.name,
            self.device,
            self.dtype,
            self.num_pages,
            self.page_size,
            self.max_seq_len,
        )

    # ------------------------------------------------------------------ set-up
    def _load_model(self) -> CausalLM:
        with torch.device("meta"):
            model = CausalLM(self.model_config)
        model = model.to(self.dtype).to_empty(device=self.device)
        model.tie_weights()
        model.model.rotary.build(self.device)
        if self.config.dummy_weights:
            init_dummy_weights(model, self.config.seed)
        else:
            model.load_weights(iter_checkpoint(self.model_dir))
        return model.eval()

    def _pages_from_memory(self) -> int:
        c = self.model_config
        per_token = KVCachePool.bytes_per_token(
            c.num_layers, c.num_kv_heads, c.head_dim, self.dtype
        )
        if self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
            budget = int(free * self.config.mem_fraction)
        else:
            needed = self.config.max_running_requests * (
                self.config.max_seq_len or c.max_position_embeddings
            )
            budget = min(int(available_ram() * self.config.cpu_mem_fraction), needed * per_token)
        pages = budget // (per_token * self.config.page_size)
        if pages < 1:
            raise RuntimeError("not enough free memory for a single KV page")
        return pages

    # ------------------------------------------------------------------ step
    def _forward_info(self, batch: Batch) -> tuple[torch.Tensor, ForwardInfo, torch.Tensor]:
        reqs, ps, dev = batch.reqs, self.page_size, self.device
        extend = [r.extend_len for r in reqs]
        cached = [r.cached_len for r in reqs]
        ids: list[int] = []
        for r in reqs:
            ids += r.token_ids[r.cached_len : r.cached_len + r.extend_len]

        n = torch.tensor(extend)
        c = torch.tensor(cached)
        slots = torch.tensor([r.table_idx for r in reqs])
        B, T = len(reqs), len(ids)
        req_of_tok = torch.repeat_interleave(torch.arange(B), n)  # (T,)
        first_tok = torch.cumsum(n, 0) - n  # (B,)
        positions = c[req_of_tok] + torch.arange(T) - first_tok[req_of_tok]
        pages = self.page_table[slots[req_of_tok], positions // ps].long()
        out_slots = pages * ps + positions % ps
        seq_lens = c + n
        P = int(-(-int(seq_lens.max()) // ps))
        last_tok = (first_tok + n - 1)[[r.samples_this_step for r in reqs]]

        info = ForwardInfo(
            positions=positions.to(dev, non_blocking=True),
            out_slots=out_slots.to(dev, non_blocking=True),
            block_table=self.page_table[slots, :P].to(dev, non_blocking=True),
            seq_lens=seq_lens.to(torch.int32).to(dev, non_blocking=True),
            extend_lens_cpu=extend,
            cached_lens_cpu=cached,
        )
        input_ids = torch.tensor(ids, dtype=torch.int64).to(dev, non_blocking=True)
        return input_ids, info, last_tok.to(dev, non_blocking=True)

    @torch.inference_mode()
    def logits(self, batch: Batch) -> torch.Tensor:
        """Run the step; (B_s, vocab) float32 logits of the requests that sample."""
        if self.graph_runner is not None and self.graph_runner.can_run(batch):
            return self.graph_runner.run(batch)
        input_ids, info, last_tok = self._forward_info(batch)
        meta = self.attn_backend.prepare(info)
        ctx = _StepContext(self.attn_backend, meta)
        hidden = self.model(input_ids, info.positions, ctx)  # (T, hidden)
        return self.model.logits(hidden[last_tok])

    @torch.inference_mode()
    def forward(self, batch: Batch) -> StepOutput:
        """Run the step; the sampled token (and logprobs where asked) of each sequence that
        samples, in batch order."""
        logits = self.logits(batch)
        sampling = batch.sampling_reqs
        if not sampling:
            return StepOutput([], None)
        args = self.sampler.prepare(sampling)
        tokens = self.sampler.sample(logits, args)
        return StepOutput(tokens.tolist(), self.sampler.logprobs(logits, tokens, args))


@dataclass
class StepOutput:
    tokens: list[int]
    logprobs: list[TokenLogprob | None] | None  # None when no sequence asked for them


class _StepContext:
    """What the model's layers call for attention during one step."""

    __slots__ = ("backend", "meta")

    def __init__(self, backend, meta) -> None:
        self.backend, self.meta = backend, meta

    def attention(self, layer_id, q, k, v):
        return self.backend.attention(layer_id, q, k, v, self.meta)
