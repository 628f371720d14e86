"""Command-line arguments of `python -m minisgl`, parsed into one `ServerArgs`.

Contract:
- `ServerArgs` holds the server's own settings and contains the engine's configuration
  (`EngineConfig`) and the scheduler's (`SchedulerConfig`) instead of copying their fields.
  Every default is set once, where its field is defined; the parser reads it from there.
- The flag names are a fixed interface: tests, notebooks and the chapter pass them, so none
  is renamed or dropped. Each flag's dest is the name of the field it fills.
- The flags are generated (minisgl/utils/flags.py) from the fields declared with
  `option` in the three dataclasses: help, choices and bounds are written there once.
  Benchmarks take their engine flags from the same declarations (`add_flags`).
- Defaults are chosen for a laptop without a GPU running the embedded default model.
- Importing this module does not import torch (the API server process parses the flags).
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass, field

from minisgl.engine.config import EngineConfig
from minisgl.models.default_model import DEFAULT_MODEL_NAME
from minisgl.parsers import REASONING_PARSERS, TOOL_CALL_PARSERS
from minisgl.scheduler.config import SchedulerConfig
from minisgl.server.tenants import api_keys
from minisgl.utils.flags import add_flags, check_flags, option, split_options


@dataclass
class ServerArgs:
    engine_config: EngineConfig = field(default_factory=EngineConfig)
    scheduler_config: SchedulerConfig = field(default_factory=SchedulerConfig)
    # this machine only: serving the network is asked for with --host
    host: str = option("127.0.0.1", "address to bind")
    port: int = option(1919, "port")  # the one the README's and the chapter's examples use
    # "A,B": several keys, one per tenant (see cache_salt_per_key)
    api_key: str | None = option(
        None,
        "require 'Authorization: Bearer KEY' on /v1/* (default: $MINISGL_API_KEY); "
        "KEY1,KEY2,...: several keys, one per tenant",
        env="MINISGL_API_KEY",
    )
    # the operator's key: flushes the cache, scrapes /metrics, reads every tenant's timelines
    admin_key: str | None = option(
        None,
        "the key for the operator's routes (POST /debug/flush_cache, GET /metrics) and for "
        "every tenant's timelines (default: $MINISGL_ADMIN_KEY); without it, a single "
        "--api-key is the operator's",
        env="MINISGL_ADMIN_KEY",
    )
    # each request's cache salt has its key's digest in it, so one tenant cannot learn from
    # cached_tokens or timing what another sent
    cache_salt_per_key: bool = option(
        False, "requests with different API keys never share cached prefix pages"
    )
    # what the prefix cache found tells a client whether anybody sent the same prefix before
    hide_cached_tokens: bool = option(
        False, "leave usage.prompt_tokens_details.cached_tokens out of answers"
    )
    chat_template: str | None = option(
        None,
        "a chat template (.jinja file, or a shipped one: smollm2-tools) instead of the "
        "model's own, for example to give a model tool calling",
    )
    # bounds the API server's memory and the queue in front of the scheduler (which runs
    # --max-running-requests at once)
    max_concurrent_requests: int = option(
        1024, "more requests in flight are answered 503 with Retry-After", gt=0
    )
    # 1 MiB is far more than a reading client ever lags behind, and 1024 stalled requests
    # then hold at most 1 GiB
    max_pending_bytes: int = option(
        1 << 20,
        "abort a request whose unread output holds more than this many bytes of memory",
        gt=0,
    )
    # a non-streamed answer is collected whole before it is sent (output text and logprobs,
    # counted as the memory they hold: server/memory.py); 16 MiB holds thousands of tokens
    # with logprobs, and 1024 of them at once 16 GiB
    max_response_bytes: int = option(
        16 << 20,
        "a non-streamed answer whose output holds more memory than this is refused (stream "
        "it instead)",
        gt=0,
    )
    # far past a live client's pause, short enough that a dead connection frees its slot soon
    client_stall_timeout: float = option(
        30.0,
        "abort a stream whose client reads nothing for this long (seconds) while output waits",
        gt=0,
    )
    # 4 MiB holds a long context's prompt as JSON several times over
    max_body_bytes: int = option(4 << 20, "larger request bodies are refused with 413", gt=0)
    # the bodies of all requests being read or served at once: 64 full bodies
    max_body_bytes_total: int = option(
        256 << 20,
        "request bodies held in memory at once, all clients together; a request past it is "
        "answered 503 with Retry-After",
        gt=0,
    )
    # against slowloris: the whole request (headers and body) within this many seconds
    request_read_timeout: float = option(
        30.0,
        "seconds a client may take to send a whole request before it is disconnected",
        gt=0,
    )
    # past it the one waiting longest for a request is closed
    max_connections: int | None = option(
        None, "open connections at most (default: half the file descriptor limit, <= 4096)", ge=1
    )
    # stopped, swapped out, wedged; a few seconds: far past a busy worker's 0.5 s beat
    worker_heartbeat_timeout: float = option(
        5.0,
        "seconds a worker process may miss its heartbeat before /health answers 503",
        gt=0,
    )
    # 30 s is the grace period orchestrators usually give before they kill
    shutdown_timeout: float = option(
        30.0, "on SIGTERM, how long in-flight requests may take to finish before abort", ge=0
    )
    # tensor parallelism across machines: --tp-size ranks spread over `nnodes` machines;
    # node 0 runs the API server, the tokenizer worker and rank 0
    nnodes: int = option(
        1,
        "machines the --tp-size ranks span (each runs `python -m minisgl` with the same "
        "flags and its --node-rank; MASTER_ADDR and MASTER_PORT name node 0)",
    )
    node_rank: int = option(0, "this machine's place among --nnodes; node 0 serves HTTP")
    dist_init_method: str | None = None  # set by the launcher for the ranks, not a flag
    # compiled in a compile process, beside the server's loops; a real schema takes ms
    grammar_compile_timeout: float = option(
        5.0,
        "seconds a request's JSON schemas and tool grammar may take to compile (400 past it)",
        gt=0,
    )
    # 128 KiB is far past any hand-written schema or generated API description
    grammar_max_bytes: int = option(
        1 << 17, "larger JSON schemas or tool parameters are refused with a 400", gt=0
    )
    # off, as in vLLM and SGLang
    escape_special_tokens: bool = option(
        False,
        "tokenize message text as plain text: control tokens typed into a message "
        "(such as <|im_start|>system) stay characters instead of opening a turn",
    )
    # 0: no timelines are recorded, only the metrics' share of them; 256 covers minutes of
    # a busy laptop's traffic
    debug_history: int = option(
        256, "ended requests whose timelines GET /debug/requests keeps (0: record none)", ge=0
    )
    # qwen3 or deepseek-r1 (minisgl/parsers/): both read a <think> block
    reasoning_parser: str | None = option(
        None,
        "return a reasoning model's <think> block as message.reasoning (and "
        "reasoning_content, its older name; streamed as delta.reasoning), never as content",
        choices=tuple(REASONING_PARSERS),
    )
    # minisgl/parsers/: how a chat answer's tool calls are written (and forced); hermes:
    # `<tool_call>` blocks, as Qwen2.5's, Qwen3's and the embedded model's templates write them
    tool_call_parser: str = option(
        "hermes",
        "the format of tool calls in the model's output: parsed into tool_calls, and the "
        "grammar that forces them",
        choices=tuple(TOOL_CALL_PARSERS),
    )
    shell: bool = option(False, "interactive chat in the terminal")
    prompt: str | None = option(None, "generate once for this prompt, streaming to the terminal")
    # None: --prompt's and --shell's own default
    max_tokens: int | None = option(None, "with --prompt: most tokens to generate")
    # --shell lowers it to warning
    log_level: str = option(
        "info", "start-up and shutdown lines", choices=("debug", "info", "warning")
    )


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m minisgl",
        description="minisgl: an OpenAI-compatible LLM server (API server, tokenizer worker "
        f"and scheduler over ZMQ). Without --model it serves the embedded {DEFAULT_MODEL_NAME}.",
    )
    for cls in (EngineConfig, SchedulerConfig, ServerArgs):
        add_flags(p.add_argument_group(cls.__name__), cls)
    # one field, two flags: the start-up self-check of the CUDA fast path
    check = p.add_mutually_exclusive_group()
    check.add_argument(
        "--strict-self-check",
        dest="self_check",
        action="store_const",
        const="strict",
        default=EngineConfig.self_check,
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
    return p


def parse_args(argv: list[str] | None = None) -> ServerArgs:
    parser = build_parser()
    ns = parser.parse_args(argv)
    for cls in (EngineConfig, SchedulerConfig, ServerArgs):
        check_flags(parser, ns, cls)
    if ns.api_key is not None and not ns.api_key.replace(",", "").strip():
        # an empty key would turn authentication off without a word: refuse it instead
        source = "--api-key" if "--api-key" in (argv or sys.argv) else "$MINISGL_API_KEY"
        parser.error(f"{source} is empty: give a key, or unset it to serve without authentication")
    if ns.admin_key is not None and (
        not ns.admin_key.strip() or ns.admin_key.strip() in api_keys(ns.api_key)
    ):
        parser.error("--admin-key must be a key of its own: not empty, and not an --api-key")
    if ns.max_body_bytes_total < ns.max_body_bytes:
        parser.error("--max-body-bytes-total must hold at least one --max-body-bytes body")
    if ns.tp_size < 1 or ns.nnodes < 1 or ns.tp_size % ns.nnodes:
        parser.error("--tp-size must be a positive multiple of --nnodes")
    if not 0 <= ns.node_rank < ns.nnodes:
        parser.error("--node-rank must be in [0, --nnodes)")
    if ns.chat_template is not None:
        from minisgl.templates import chat_template_text

        try:
            chat_template_text(ns.chat_template)
        except ValueError as e:
            parser.error(str(e))
    engine, scheduler, server = split_options(vars(ns), EngineConfig, SchedulerConfig)
    return ServerArgs(EngineConfig(**engine), SchedulerConfig(**scheduler), **server)
