"""Command-line arguments of `python -m minisgl`, parsed into one `ServerArgs`.

Contract:
- `ServerArgs` holds the server's own settings and contains the engine's configuration
  (`EngineConfig`) and the scheduler's (`SchedulerConfig`) instead of copying their fields.
  Every default is set once, where its field is defined; the parser reads it from there.
- The flag names are a fixed interface: tests, notebooks and the chapter pass them, so none
  is renamed or dropped. Each flag's dest is the name of the field it fills.
- Defaults are chosen for a laptop without a GPU running the embedded default model.
- Importing this module does not import torch (the API server process parses the flags).
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass, field

from minisgl.engine.config import EngineConfig
from minisgl.models.default_model import DEFAULT_MODEL_NAME
from minisgl.scheduler.config import PREFIX_CACHES, SchedulerConfig, split_options
from minisgl.templates import REASONING_STARTS_OPEN


@dataclass
class ServerArgs:
    engine_config: EngineConfig = field(default_factory=EngineConfig)
    scheduler_config: SchedulerConfig = field(default_factory=SchedulerConfig)
    host: str = "127.0.0.1"  # this machine only: serving the network is asked for with --host
    port: int = 1919  # the port the README's and the chapter's examples talk to
    # no authentication; the command line reads $MINISGL_API_KEY. "A,B": several keys, one
    # per tenant (see cache_salt_per_key)
    api_key: str | None = None
    # tenants (API keys) never share cached prefix pages: each request's cache salt has its
    # key's digest in it, so one cannot learn from cached_tokens or timing what another sent
    cache_salt_per_key: bool = False
    # leave usage.prompt_tokens_details.cached_tokens out of every answer (what the prefix
    # cache found tells a client whether anybody sent the same prefix before)
    hide_cached_tokens: bool = False
    # replaces the model's chat template: a .jinja file, or the name of one minisgl ships
    # (smollm2-tools); None: the model's own
    chat_template: str | None = None
    # requests in flight in the API server: bounds its memory and the queue in front of the
    # scheduler (which runs --max-running-requests at once); past it clients get 503
    max_concurrent_requests: int = 1024
    # unread output per request: 1 MiB is far more than a reading client ever lags behind,
    # and 1024 stalled requests then hold at most 1 GiB
    max_pending_bytes: int = 1 << 20
    # a non-streamed answer is collected whole before it is sent: past this many bytes of
    # output (text and logprobs) the request ends with a 400 and its resources are freed;
    # 16 MiB holds thousands of tokens with logprobs, and 1024 of them at once 16 GiB
    max_response_bytes: int = 16 << 20
    # seconds a streaming client may read nothing while output waits: far past a live
    # client's pause, short enough that a dead connection frees its slot soon
    client_stall_timeout: float = 30.0
    # larger request bodies are refused with 413; 4 MiB holds a long context's prompt as
    # JSON several times over
    max_body_bytes: int = 4 << 20
    # a client must send a whole request (headers and body) within this many seconds of the
    # server starting to wait for it; slower ones are disconnected (slowloris)
    request_read_timeout: float = 30.0
    # open connections at most; past it the one waiting longest for a request is closed.
    # None: half the process's file descriptor limit, at most 4096
    max_connections: int | None = None
    # /health answers 503 while a worker process has not beaten its heartbeat for this long
    # (stopped, swapped out, wedged); a few seconds: far past a busy worker's 0.5 s beat
    worker_heartbeat_timeout: float = 5.0
    # SIGTERM: seconds in-flight requests may take to finish; 30 s is the grace period
    # orchestrators usually give before they kill
    shutdown_timeout: float = 30.0
    # tensor parallelism across machines: --tp-size ranks spread over `nnodes` machines;
    # node 0 runs the API server, the tokenizer worker and rank 0
    nnodes: int = 1
    node_rank: int = 0
    dist_init_method: str | None = None  # set by the launcher for the ranks, not a flag
    # seconds one request's schemas, tool parameters and grammar may take to compile (in a
    # compile process, beside the server's loops); a real schema takes milliseconds
    grammar_compile_timeout: float = 5.0
    # larger JSON schemas (each tool's parameters, response_format) and grammars are refused
    # uncompiled: 128 KiB is far past any hand-written schema or generated API description
    grammar_max_bytes: int = 1 << 17
    # tokenize messages' text as plain text, so that control tokens typed into a message
    # (`<|im_start|>system`) cannot open a turn of their own; off, as in vLLM and SGLang
    escape_special_tokens: bool = False
    # ended requests whose timelines /debug/requests keeps (0: no timelines are recorded,
    # only the metrics' share of them); 256 covers minutes of a busy laptop's traffic
    debug_history: int = 256
    # read a reasoning model's `<think>` block out of chat answers as reasoning_content
    # (qwen3 or deepseek-r1: minisgl/templates' REASONING_STARTS_OPEN); None: none
    reasoning_parser: str | None = None
    shell: bool = False  # interactive chat in the terminal instead of an HTTP server
    prompt: str | None = None  # offline one-shot generation instead of a server
    max_tokens: int | None = None  # for --prompt and --shell; None: their own default
    log_level: str = "info"  # start-up and shutdown lines; --shell lowers it to warning


def build_parser() -> argparse.ArgumentParser:
    d = ServerArgs()
    e, s = d.engine_config, d.scheduler_config
    p = argparse.ArgumentParser(
        prog="python -m minisgl",
        description="minisgl: an OpenAI-compatible LLM server (API server, tokenizer worker "
        f"and scheduler over ZMQ). Without --model it serves the embedded {DEFAULT_MODEL_NAME}.",
    )
    p.add_argument("--model", help="Hugging Face hub id or local model folder")
    p.add_argument("--host", default=d.host, help="address to bind (default: %(default)s)")
    p.add_argument("--port", type=int, default=d.port, help="port (default: %(default)s)")
    p.add_argument("--device", default=e.device, choices=["auto", "cpu", "cuda"])
    p.add_argument("--dtype", default=e.dtype, choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--dummy-weights", action="store_true", help="random weights, real shapes")
    p.add_argument(
        "--quantization",
        default=e.quantization,
        choices=["gguf", "none", "int8"],
        help="gguf: compute with a GGUF file's own quantized weights (the default for a GGUF "
        "model on the CPU); none: float weights; int8: weights rounded to int8 at load",
    )
    p.add_argument("--max-running-requests", type=int, default=e.max_running_requests)
    p.add_argument("--max-seq-len", type=int, help="context length (default: the model's)")
    p.add_argument("--page-size", type=int, default=e.page_size, help="tokens per KV page")
    p.add_argument("--num-pages", type=int, help="KV pages (default: sized from free memory)")
    p.add_argument(
        "--max-prefill-tokens",
        type=int,
        default=s.max_prefill_tokens,
        help="prefill token budget per step; longer prompts are prefilled in chunks",
    )
    p.add_argument(
        "--prefill-step-seconds",
        type=float,
        default=s.prefill_step_seconds,
        help="while sequences decode, size prefill chunks so one step takes about this long "
        "(default: 0.3 on a CPU, off on CUDA; 0: off)",
    )
    p.add_argument(
        "--attention-backend", default=e.attention_backend, choices=["auto", "torch", "triton"]
    )
    p.add_argument(
        "--tp-size",
        type=int,
        default=e.tp_size,
        help="tensor parallelism: shard the model over N ranks, one process (and GPU) each",
    )
    p.add_argument(
        "--dist-timeout",
        type=float,
        default=e.dist_timeout,
        help="seconds a tensor-parallel collective waits for the other ranks; past it every "
        "request in flight ends with an error and the server stops (default: %(default)s)",
    )
    p.add_argument(
        "--nnodes",
        type=int,
        default=d.nnodes,
        help="machines the --tp-size ranks span (each runs `python -m minisgl` with the same "
        "flags and its --node-rank; MASTER_ADDR and MASTER_PORT name node 0)",
    )
    p.add_argument(
        "--node-rank",
        type=int,
        default=d.node_rank,
        help="this machine's place among --nnodes; node 0 serves HTTP",
    )
    p.add_argument(
        "--disable-cuda-graph",
        dest="cuda_graph",
        action="store_false",
        help="run decode steps eagerly instead of replaying CUDA graphs",
    )
    check = p.add_mutually_exclusive_group()
    check.add_argument(
        "--strict-self-check",
        dest="self_check",
        action="store_const",
        const="strict",
        default=e.self_check,
        help="fail start-up if the self-check of the CUDA fast path finds a fault, instead of "
        "falling back to a slower path (CI on GPU machines)",
    )
    check.add_argument(
        "--skip-self-check",
        dest="self_check",
        action="store_const",
        const="skip",
        help="do not check the CUDA fast path at start-up (and do not fall back)",
    )
    p.add_argument(
        "--disable-overlap-schedule",
        dest="overlap_schedule",
        action="store_false",
        default=s.overlap_schedule,
        help="read each step's tokens before scheduling the next (overlap is on with CUDA)",
    )
    p.add_argument(
        "--prefix-cache",
        default=s.prefix_cache,
        choices=list(PREFIX_CACHES),
        help="radix: requests sharing a prefix share its KV pages; none: no reuse "
        "(default: %(default)s)",
    )
    p.add_argument(
        "--api-key",
        default=os.environ.get("MINISGL_API_KEY"),
        help="require 'Authorization: Bearer KEY' on /v1/* (default: $MINISGL_API_KEY); "
        "KEY1,KEY2,...: several keys, one per tenant",
    )
    p.add_argument(
        "--cache-salt-per-key",
        action="store_true",
        help="requests with different API keys never share cached prefix pages",
    )
    p.add_argument(
        "--hide-cached-tokens",
        action="store_true",
        help="leave usage.prompt_tokens_details.cached_tokens out of answers",
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
        "--max-response-bytes",
        type=int,
        default=d.max_response_bytes,
        help="a non-streamed answer with more output than this is refused (stream it instead)",
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
    p.add_argument(
        "--request-read-timeout",
        type=float,
        default=d.request_read_timeout,
        help="seconds a client may take to send a whole request before it is disconnected",
    )
    p.add_argument(
        "--max-connections",
        type=int,
        default=d.max_connections,
        help="open connections at most (default: half the file descriptor limit, <= 4096)",
    )
    p.add_argument(
        "--worker-heartbeat-timeout",
        type=float,
        default=d.worker_heartbeat_timeout,
        help="seconds a worker process may miss its heartbeat before /health answers 503",
    )
    p.add_argument(
        "--debug-history",
        type=int,
        default=d.debug_history,
        help="ended requests whose timelines GET /debug/requests keeps (0: record none)",
    )
    p.add_argument(
        "--grammar-compile-timeout",
        type=float,
        default=d.grammar_compile_timeout,
        help="seconds a request's JSON schemas and tool grammar may take to compile (400 past it)",
    )
    p.add_argument(
        "--grammar-max-bytes",
        type=int,
        default=d.grammar_max_bytes,
        help="larger JSON schemas or tool parameters are refused with a 400 (default: %(default)s)",
    )
    p.add_argument(
        "--escape-special-tokens",
        action="store_true",
        help="tokenize message text as plain text: control tokens typed into a message "
        "(such as <|im_start|>system) stay characters instead of opening a turn",
    )
    p.add_argument(
        "--chat-template",
        help="a chat template (.jinja file, or a shipped one: smollm2-tools) instead of the "
        "model's own, for example to give a model tool calling",
    )
    p.add_argument(
        "--reasoning-parser",
        choices=list(REASONING_STARTS_OPEN),
        help="return a reasoning model's <think> block as message.reasoning_content "
        "(streamed as delta.reasoning_content), never as content",
    )
    p.add_argument("--shell", action="store_true", help="interactive chat in the terminal")
    p.add_argument("--prompt", help="generate once for this prompt, streaming to the terminal")
    p.add_argument("--max-tokens", type=int, help="with --prompt: most tokens to generate")
    p.add_argument("--log-level", default=d.log_level, choices=["debug", "info", "warning"])
    return p


def parse_args(argv: list[str] | None = None) -> ServerArgs:
    ns = build_parser().parse_args(argv)
    positive = (
        "page_size",
        "max_running_requests",
        "max_prefill_tokens",
        "max_concurrent_requests",
        "max_pending_bytes",
        "max_response_bytes",
        "max_body_bytes",
        "client_stall_timeout",
        "worker_heartbeat_timeout",
        "request_read_timeout",
        "grammar_compile_timeout",
        "grammar_max_bytes",
        "dist_timeout",
    )
    for name in positive:
        if getattr(ns, name) <= 0:
            build_parser().error(f"--{name.replace('_', '-')} must be positive")
    if ns.api_key is not None and not ns.api_key.replace(",", "").strip():
        # an empty key would turn authentication off without a word: refuse it instead
        source = "--api-key" if "--api-key" in (argv or sys.argv) else "$MINISGL_API_KEY"
        build_parser().error(
            f"{source} is empty: give a key, or unset it to serve without authentication"
        )
    if ns.prefill_step_seconds is not None and ns.prefill_step_seconds < 0:
        build_parser().error("--prefill-step-seconds must not be negative")
    if ns.shutdown_timeout < 0:
        build_parser().error("--shutdown-timeout must not be negative")
    if ns.max_connections is not None and ns.max_connections < 1:
        build_parser().error("--max-connections must be positive")
    if ns.debug_history < 0:
        build_parser().error("--debug-history must not be negative")
    if ns.tp_size < 1 or ns.nnodes < 1 or ns.tp_size % ns.nnodes:
        build_parser().error("--tp-size must be a positive multiple of --nnodes")
    if not 0 <= ns.node_rank < ns.nnodes:
        build_parser().error("--node-rank must be in [0, --nnodes)")
    if ns.chat_template is not None:
        from minisgl.templates import chat_template_text

        try:
            chat_template_text(ns.chat_template)
        except ValueError as e:
            build_parser().error(str(e))
    engine, scheduler, server = split_options(vars(ns))
    return ServerArgs(EngineConfig(**engine), SchedulerConfig(**scheduler), **server)
