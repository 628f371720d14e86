"""EngineConfig: everything the engine needs to be built, with defaults explained.

Contract: no torch import at module level (the API server process reads it through
`ServerArgs`); each default is set here once, and the command line, `ServerArgs` and
`LLM(...)` take it from here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


@dataclass
class EngineConfig:
    model: str | None = None  # hub id or local folder; None: the embedded default model
    device: str = "auto"  # auto: CUDA when present, else CPU
    dtype: str = "auto"  # auto: bfloat16 on CUDA, float32 on CPU
    dummy_weights: bool = False  # random weights of the real shapes (benchmarks)
    # tokens per KV page: 16 trades the slots a sequence's last page leaves unused (at
    # most 15) against the size of the page table (one entry per page)
    page_size: int = 16
    num_pages: int | None = None  # None: sized from free memory
    # share of free device memory (after weights) given to the KV cache on CUDA; the rest
    # is headroom for activations, logits and CUDA graphs
    mem_fraction: float = 0.85
    # on CPU the pool never needs more than max_running_requests * max_seq_len tokens and
    # never takes more than this share of available RAM
    cpu_mem_fraction: float = 0.25
    # sequences running at once: the page table's rows, the largest decode batch and, on
    # CPU, a bound on the KV pool; 256 is the top CUDA graph bucket (graph.BUCKETS), so
    # every decode batch replays a graph. The scheduler reads it back from here
    max_running_requests: int = 256
    max_seq_len: int | None = None  # None: the model's max_position_embeddings
    attention_backend: str = "auto"  # auto: triton on CUDA, torch elsewhere
    cuda_graph: bool = True  # replay decode steps from CUDA graphs (CUDA + triton only)
    # the start-up self-check of the CUDA fast path (engine/selfcheck.py): "auto" checks
    # on CUDA and falls back from a failing part; "strict" makes a failure fatal (CI on GPU
    # machines); "skip" checks nothing (a start-up a little faster, and no safety net)
    self_check: str = "auto"
    seed: int = 0  # seed of --dummy-weights
    tp_size: int = 1  # tensor parallelism: ranks (one process and device each) per model
    # seconds a collective waits for the other ranks before it fails: a rank that died or
    # stopped ends every request in flight with an error within this bound, not a hang
    dist_timeout: float = 60.0
    # weights as the engine computes with them (minisgl.models.loader): "gguf" keeps a GGUF
    # file's own quantized blocks (int4/int8 weight-only matmuls on the CPU), "none" the
    # float weights, "int8" rounds float weights to int8 per channel at load. None: gguf for
    # a model that comes from a GGUF file on the CPU, else none
    quantization: str | None = None

    def resolve_device(self) -> torch.device:
        import torch

        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        device = torch.device(self.device)
        if device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError("--device cuda was asked for but torch sees no CUDA device")
        return device

    def resolve_dtype(self, device: torch.device) -> torch.dtype:
        import torch

        if self.dtype == "auto":
            return torch.bfloat16 if device.type == "cuda" else torch.float32
        dtypes = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
        if self.dtype not in dtypes:
            raise ValueError(f"unknown dtype {self.dtype!r}; choose auto, {', '.join(dtypes)}")
        return dtypes[self.dtype]
