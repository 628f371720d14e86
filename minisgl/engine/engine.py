"""Engine: the model, its KV cache and one forward step.

Contract: the engine knows nothing about uids, messages or tokenization. It owns device
memory: the weights, the KV page pool and, through its input builder (inputs.py), the page
table (one row of page ids per request slot, on the device). The scheduler's cache manager
only records the entries that change; `write_pages(edits)` writes them on the device, once
per step before the launch. `launch(batch)` starts one step for requests whose pages and
slots the scheduler has already set up and returns at once with a `StepHandle`; on a GPU
the step runs while the host goes on (overlap scheduling). `handle.result()` waits for it
and returns the sampled token of every request that samples this step, in batch order.

No host sync inside a step: the sampled tokens stay on the device for the next step (see
inputs.py) and travel to the host in one non-blocking copy that `result()` waits for.

`Engine(config)` only loads, sizes and allocates; an engine is built by engine/build.py,
which also vets its fast paths (the start-up self-check: selfcheck.py; the native decode
step) and chooses the path each step takes (`runner`: runner.py). `degraded` names each
part it fell back from, with the reason.

`set_observer(observer)` hands it the scheduler's observers (minisgl/observe.py): a step
marks where its time starts to count toward "prepare", "forward" and "sample" there (a
no-op unless a benchmark measures).
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from minisgl.attention import create_attention_backend
from minisgl.core import Batch
from minisgl.distributed import STARTUP_TIMEOUT_S, barrier, min_over_ranks, tp
from minisgl.kvcache import KVCachePool
from minisgl.message import TokenLogprob
from minisgl.models.config import ModelConfig
from minisgl.models.decoder import CausalLM
from minisgl.models.loader import load_model, resolve_quantization
from minisgl.models.quant import prefill_rows
from minisgl.models.source import resolve_model_dir
from minisgl.observe import RequestObserver
from minisgl.utils.process import available_ram

from .config import EngineConfig
from .grammar import Grammars
from .graph import BUCKETS, DecodeGraphRunner
from .inputs import StepInputBuilder
from .runner import StepRunner
from .sample import Sampler
from .selfcheck import SelfCheck

logger = logging.getLogger(__name__)


class Engine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.tp = tp()  # this process's rank: its shard of the model and of the KV cache
        self.device = config.resolve_device()
        self.dtype = config.resolve_dtype(self.device)
        self.model_dir: Path = resolve_model_dir(config.model)
        self.model_config = ModelConfig.from_dir(self.model_dir)
        self._check_tp()
        self.model = self._load_model()
        barrier("loaded", STARTUP_TIMEOUT_S)  # ranks load at their own pace; then in step
        # every rank must hold the same pages: the scheduler decides for all of them
        self.page_size = config.page_size
        self.num_pages = config.num_pages or min_over_ranks(self._pages_from_memory())
        c = self.model_config
        # (layers, pages, tokens per page, this rank's KV heads, head dim)
        shape = (c.num_layers, self.num_pages, self.page_size, self.model.num_kv_heads, c.head_dim)
        self.pool = KVCachePool(*shape, self.dtype, self.device)
        # a request can never outgrow the pool, so one request alone always fits
        context = min(config.max_seq_len or c.max_position_embeddings, c.max_position_embeddings)
        self.max_seq_len = min(context, self.num_pages * self.page_size)
        heads = self.model.num_heads  # this rank's
        self.attn_backend = create_attention_backend(
            config.attention_backend, self.pool, heads, c.head_dim, self.device
        )
        slots = config.max_running_requests
        graph_bs = min(slots, BUCKETS[-1]) if self.attn_backend.capturable else 0
        pages_per_req = -(-self.max_seq_len // self.page_size)
        self.inputs = StepInputBuilder(
            slots, pages_per_req, self.page_size, self.pool.scratch_page, self.device, graph_bs
        )
        self.sampler = Sampler(c.vocab_size, self.device, slots, self.tp)
        self.grammars = Grammars(self.model_dir, c.vocab_size)  # constrained requests' matchers
        self.graph_runner: DecodeGraphRunner | None = None
        if self.inputs.decode_buffers is not None:
            self.graph_runner = DecodeGraphRunner(
                self.model, self.attn_backend, self.inputs.decode_buffers, c.vocab_size
            )
        self.degraded: dict[str, str] = {}  # part -> reason, for each part fallen back from
        self.self_check = SelfCheck(self)  # run by engine/build.py before the engine serves
        self.runner = StepRunner(self)  # the torch path; build.py chooses the fastest
        self.observer = RequestObserver()  # the scheduler's, once it has one (set_observer)

    # ------------------------------------------------------------------ set-up
    def _check_tp(self) -> None:
        c, n = self.model_config, self.tp.size
        kv_ok = c.num_kv_heads % n == 0 or n % c.num_kv_heads == 0
        if c.num_heads % n or c.intermediate_size % n or not kv_ok:
            raise ValueError(
                f"--tp-size {n}: {self.model_dir.name} has {c.num_heads} attention heads, "
                f"{c.num_kv_heads} KV heads and an MLP of {c.intermediate_size}; each must "
                f"split evenly over {n} ranks (or the KV heads be shared by them)"
            )

    def _load_model(self) -> CausalLM:
        # "gguf": the GGUF's own quantized blocks; "none": float weights; "int8": rounded
        self.quantization = resolve_quantization(
            self.config.quantization, self.model_dir, self.device
        )
        return load_model(
            self.model_config,
            self.tp,
            self.model_dir,
            self.device,
            self.dtype,
            quantization=self.quantization,
            dummy_weights=self.config.dummy_weights,
            seed=self.config.seed,
        )

    def _pages_from_memory(self) -> int:
        c = self.model_config
        per_token = KVCachePool.bytes_per_token(
            c.num_layers, self.model.num_kv_heads, c.head_dim, self.dtype
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

    @functools.cached_property
    def prefill_rows(self) -> int:
        """The rows a step carrying a prompt chunk beside decodes should reach: on int4
        weights, where the step's one dequantization is shared by enough prompt tokens
        (models/quant.py); 1 otherwise."""
        return prefill_rows(self.model)

    def capture_graphs(self) -> None:
        """Record the decode CUDA graphs (on CUDA unless --disable-cuda-graph; on a CPU the
        runner records nothing and its buffers run eagerly)."""
        if self.graph_runner is not None and self.config.cuda_graph:
            self.graph_runner.capture()

    def set_observer(self, observer: RequestObserver) -> None:
        """Mark the phases of each step in `observer` (the graph runner's replay too)."""
        self.observer = observer
        if self.graph_runner is not None:
            self.graph_runner.observer = observer

    def use_attention_backend(self, backend) -> None:
        """Serve with `backend` instead (the self-check's fallback); decode steps run
        eagerly unless it can be captured too."""
        self.attn_backend = backend
        self.graph_runner = None

    def check_overlap(self) -> bool:
        """Whether steps may overlap: the scheduler asks before it overlaps, and the
        self-check compares overlapped steps' tokens with synchronous ones (once)."""
        return self.self_check.overlap_ok()

    @property
    def page_table(self) -> torch.Tensor:
        """(slots + 1, max_pages) int32 on the device; the last row is the dummy slot's."""
        return self.inputs.page_table

    def write_pages(self, edits: list[int]) -> None:
        """Write the scheduler's page-table edits, flat (row, column, page) triples, on the
        device before the step that reads them is launched."""
        self.inputs.write_pages(edits)

    # ------------------------------------------------------------------ step
    @torch.inference_mode()
    def logits(self, batch: Batch) -> torch.Tensor | None:
        """Run the step; (B_s, vocab) float32 logits of the requests that sample (None when
        none does: every request's chunk ends inside its prompt)."""
        return self.runner.run(batch)[1]

    # --8<-- [start:launch]
    @torch.inference_mode()
    def launch(self, batch: Batch) -> StepHandle:
        """Start the step; its sampled tokens are read with `.result()`."""
        inputs, logits, scores = self.runner.run(batch)
        sampling = batch.sampling_reqs
        if not sampling:
            return StepHandle(None, None, None, scores)
        self.observer.phase("prepare")
        args = self.sampler.prepare(sampling)
        self.observer.phase("sample")
        tokens = self.sampler.sample(logits, args)
        self.inputs.record_sampled(inputs, tokens)  # the next step may read them here
        logprobs = self.sampler.logprobs_device(logits, tokens, args)  # read in result()
        if self.device.type != "cuda":
            return StepHandle(tokens, None, logprobs, scores)
        host = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True)
        host.copy_(tokens, non_blocking=True)
        done = torch.cuda.Event()
        done.record()
        return StepHandle(host, done, logprobs, scores)

    # --8<-- [end:launch]


@dataclass
class StepOutput:
    tokens: list[int]
    logprobs: list[TokenLogprob | None] | None  # None when no sequence asked for them
    # per entry of the batch's `scoring`: the prompt logprobs of its positions
    prompt_logprobs: list[list[TokenLogprob]] | None = None


class StepHandle:
    """A launched step. Its tokens are copied to `tokens` (host memory) when `done` fires;
    the logprobs asked for are still on the device (`DeviceLogprobs`, and
    `DevicePromptScores` for prompt logprobs)."""

    __slots__ = ("tokens", "done", "logprobs", "scores")

    def __init__(self, tokens: torch.Tensor | None, done, logprobs, scores=None) -> None:
        self.tokens, self.done, self.logprobs = tokens, done, logprobs
        self.scores = scores

    def result(self) -> StepOutput:
        scores = self.scores.to_host() if self.scores is not None else None
        if self.tokens is None:
            return StepOutput([], None, scores)
        if self.done is not None:
            self.done.synchronize()
        logprobs = self.logprobs.to_host() if self.logprobs is not None else None
        return StepOutput(self.tokens.tolist(), logprobs, scores)
