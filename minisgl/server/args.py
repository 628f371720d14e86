"""Command-line arguments of `python -m minisgl`, parsed into one `ServerArgs`.

The flag names are a fixed interface (see DESIGN.md): tests, notebooks and the chapter use
them. Defaults are chosen for a laptop without a GPU running the embedded default model.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass, fields

from minisgl.engine.config import EngineConfig


@dataclass
class ServerArgs:
    model: str | None = None
    host: str = "127.0.0.1"
    port: int = 1919
    device: str = "auto"
    dtype: str = "auto"
    dummy_weights: bool = False
    max_running_requests: int = 256
    max_seq_len: int | None = None
    page_size: int = 16
    num_pages: int | None = None
    max_prefill_tokens: int = 8192
    attention_backend: str = "auto"
    cuda_graph: bool = True
    api_key: str | None = None
    max_concurrent_requests: int = 1024
    max_pending_bytes: int = 1 << 20  # 1 MiB of unread output per request
    client_stall_timeout: float = 30.0  # seconds a streaming client may read nothing
    max_body_bytes: int = 4 << 20  # larger request bodies are refused with 413
    shutdown_timeout: float = 30.0  # SIGTERM: seconds in-flight requests may take to finish
    shell: bool = False
    prompt: str | None = None  # offline one-shot generation instead of a server
    max_tokens: int | None = None  # for --prompt
    log_level: str = "info"

    def engine_config(self) -> EngineConfig:
        names = {f.name for f in fields(EngineConfig)}
        return EngineConfig(**{k: v for k, v in vars(self).items() if k in names})


def build_parser() -> argparse.ArgumentParser:
    d = ServerArgs()
    p = argparse.ArgumentParser(
        prog="python -m minisgl",
        description="minisgl: an OpenAI-compatible LLM server (API server, tokenizer worker "
        "and scheduler over ZMQ). Without --model it serves the embedded SmolLM2-135M-Instruct.",
    )
    p.add_argument("--model", help="Hugging Face hub id or local model folder")
    p.add_argument("--host", default=d.host, help="address to bind (default: %(default)s)")
    p.add_argument("--port", type=int, default=d.port, help="port (default: %(default)s)")
    p.add_argument("--device", default=d.device, choices=["auto", "cpu", "cuda"])
    p.add_argument("--dtype", default=d.dtype, choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--dummy-weights", action="store_true", help="random weights, real shapes")
    p.add_argument("--max-running-requests", type=int, default=d.max_running_requests)
    p.add_argument("--max-seq-len", type=int, help="context length (default: the model's)")
    p.add_argument("--page-size", type=int, default=d.page_size, help="tokens per KV page")
    p.add_argument("--num-pages", type=int, help="KV pages (default: sized from free memory)")
    p.add_argument(
        "--max-prefill-tokens",
        type=int,
        default=d.max_prefill_tokens,
        help="prefill token budget per step; longer prompts are prefilled in chunks",
    )
    p.add_argument(
        "--attention-backend", default=d.attention_backend, choices=["auto", "torch", "triton"]
    )
    p.add_argument(
        "--disable-cuda-graph",
        dest="cuda_graph",
        action="store_false",
        help="run decode steps eagerly instead of replaying CUDA graphs",
    )
    p.add_argument(
        "--api-key",
        default=os.environ.get("MINISGL_API_KEY"),
        help="require 'Authorization: Bearer KEY' on /v1/* (default: $MINISGL_API_KEY)",
    )
    p.add_argument(
        "--max-concurrent-requests",
        type=int,
        default=d.max_concurrent_requests,
        help="more requests in flight are answered 503 with Retry-After",
    )
    p.add_argument(
        "--max-pending-bytes",
        type=int,
        default=d.max_pending_bytes,
        help="abort a request whose unread output grows past this many bytes",
    )
    p.add_argument(
        "--client-stall-timeout",
        type=float,
        default=d.client_stall_timeout,
        help="abort a stream whose client reads nothing for this long while output waits",
    )
    p.add_argument("--max-body-bytes", type=int, default=d.max_body_bytes)
    p.add_argument(
        "--shutdown-timeout",
        type=float,
        default=d.shutdown_timeout,
        help="on SIGTERM, how long in-flight requests may take to finish before abort",
    )
    p.add_argument("--shell", action="store_true", help="interactive chat in the terminal")
    p.add_argument("--prompt", help="generate once for this prompt, streaming to the terminal")
    p.add_argument("--max-tokens", type=int, help="with --prompt: most tokens to generate")
    p.add_argument("--log-level", default=d.log_level, choices=["debug", "info", "warning"])
    return p


def parse_args(argv: list[str] | None = None) -> ServerArgs:
    ns = build_parser().parse_args(argv)
    args = ServerArgs(**vars(ns))
    positive = (
        "page_size",
        "max_running_requests",
        "max_prefill_tokens",
        "max_concurrent_requests",
        "max_pending_bytes",
        "max_body_bytes",
        "client_stall_timeout",
    )
    for name in positive:
        if getattr(args, name) <= 0:
            build_parser().error(f"--{name.replace('_', '-')} must be positive")
    if args.shutdown_timeout < 0:
        build_parser().error("--shutdown-timeout must not be negative")
    return args
