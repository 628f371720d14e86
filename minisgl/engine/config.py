"""EngineConfig: everything the engine needs to be built, with defaults explained.

Contract: no torch import at module level (the API server process reads it through
`ServerArgs`); each default is set here once, and the command line, `ServerArgs` and
`LLM(...)` take it from here. A field declared with `option` has a flag, whose help,
choices and bounds are written here (minisgl/utils/flags.py generates the flags).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from minisgl.utils.flags import option

if TYPE_CHECKING:
    import torch

DEVICES = ("auto", "cpu", "cuda")
DTYPES = ("auto", "float32", "bfloat16", "float16")
ATTENTION_BACKENDS = ("auto", "torch", "triton")
QUANTIZATIONS = ("gguf", "none", "int8")


@dataclass
class EngineConfig:
    model: str | None = option(
        None, "Hugging Face hub id or local model folder (default: the embedded model)"
    )
    device: str = option("auto", "auto: CUDA when present, else CPU", choices=DEVICES)
    dtype: str = option("auto", "auto: bfloat16 on CUDA, float32 on CPU", choices=DTYPES)
    dummy_weights: bool = option(False, "random weights of the real shapes (benchmarks)")
    # 16 trades the slots a sequence's last page leaves unused (at most 15) against the
    # size of the page table (one entry per page)
    page_size: int = option(16, "tokens per KV page", gt=0)
    num_pages: int | None = option(None, "KV pages (default: sized from free memory)", gt=0)
    # share of free device memory (after weights) given to the KV cache on CUDA; the rest
    # is headroom for activations, logits and CUDA graphs
    mem_fraction: float = 0.85
    # on CPU the pool never needs more than max_running_requests * max_seq_len tokens and
    # never takes more than this share of available RAM
    cpu_mem_fraction: float = 0.25
    # the page table's rows, the largest decode batch and, on CPU, a bound on the KV pool;
    # 256 is the top CUDA graph bucket (graph.BUCKETS), so every decode batch replays a
    # graph. The scheduler reads it back from here
    max_running_requests: int = option(256, "sequences running at once", gt=0)
    max_seq_len: int | None = option(None, "context length (default: the model's)", gt=0)
    attention_backend: str = option(
        "auto", "auto: triton on CUDA, torch elsewhere", choices=ATTENTION_BACKENDS
    )
    cuda_graph: bool = option(
        True,
        "run decode steps eagerly instead of replaying CUDA graphs",
        name="--disable-cuda-graph",
        negate=True,
    )  # replay decode steps from CUDA graphs (CUDA + triton only)
    # the start-up self-check of the CUDA fast path (engine/selfcheck.py): "auto" checks
    # on CUDA and falls back from a failing part; "strict" makes a failure fatal (CI on GPU
    # machines); "skip" checks nothing (a start-up a little faster, and no safety net).
    # Two flags set it (server/args.py): --strict-self-check, --skip-self-check
    self_check: str = "auto"
    seed: int = 0  # seed of --dummy-weights
    tp_size: int = option(
        1, "tensor parallelism: shard the model over N ranks, one process (and GPU) each"
    )
    # a rank that died or stopped ends every request in flight with an error within this
    # bound, not a hang
    dist_timeout: float = option(
        60.0,
        "seconds a tensor-parallel collective waits for the other ranks; past it every "
        "request in flight ends with an error and the server stops",
        gt=0,
    )
    # weights as the engine computes with them (minisgl.models.loader). None: gguf for a
    # model that comes from a GGUF file on the CPU, else none
    quantization: str | None = option(
        None,
        "gguf: compute with a GGUF file's own quantized weights (the default for a GGUF "
        "model on the CPU); none: float weights; int8: weights rounded to int8 at load",
        choices=QUANTIZATIONS,
    )

    # a CPU decode step (up to 64 requests, one token each) as one call into C
    # (minisgl/models/native.py) where the weights are int4-packed and a C compiler is there
    native_decode: bool = option(
        True,
        "run CPU decode steps on torch operators instead of the native C step",
        name="--disable-native-decode",
        negate=True,
    )

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
