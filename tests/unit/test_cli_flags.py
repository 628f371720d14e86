"""The command line is generated from the configuration fields' declarations: every flag of
the fixed interface is there with its name, default, help and choices, bounds are checked
from the same declaration, and the benchmarks take their engine flags from it."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pytest

from minisgl.engine.config import EngineConfig
from minisgl.scheduler.config import SchedulerConfig
from minisgl.server.args import ServerArgs, build_parser, parse_args
from minisgl.utils.flags import flag_name, flagged

# the flags outside tests rely on (the project's fixed interface), and the rest
FIXED = {
    "--model", "--host", "--port", "--device", "--dtype", "--dummy-weights",
    "--max-running-requests", "--max-seq-len", "--page-size", "--api-key",
    "--max-concurrent-requests", "--max-pending-bytes", "--client-stall-timeout",
    "--attention-backend", "--shell", "--disable-overlap-schedule", "--prefix-cache",
    "--tp-size", "--nnodes", "--node-rank", "--debug-history", "--reasoning-parser",
    "--strict-self-check", "--skip-self-check", "--quantization",
}  # fmt: skip
OTHERS = {
    "--num-pages", "--max-prefill-tokens", "--prefill-step-seconds", "--dist-timeout",
    "--disable-cuda-graph", "--cache-salt-per-key", "--hide-cached-tokens",
    "--max-response-bytes", "--max-body-bytes", "--shutdown-timeout",
    "--request-read-timeout", "--max-connections", "--worker-heartbeat-timeout",
    "--grammar-compile-timeout", "--grammar-max-bytes", "--escape-special-tokens",
    "--chat-template", "--prompt", "--max-tokens", "--log-level", "--disable-native-decode",
    "--tool-call-parser", "--admin-key", "--max-body-bytes-total",
}  # fmt: skip
CHOICES = {
    "--device": ["auto", "cpu", "cuda"],
    "--dtype": ["auto", "float32", "bfloat16", "float16"],
    "--attention-backend": ["auto", "torch", "triton"],
    "--prefix-cache": ["radix", "none"],
    "--reasoning-parser": ["qwen3", "deepseek-r1"],
    "--tool-call-parser": ["hermes"],
    "--quantization": ["gguf", "none", "int8"],
    "--log-level": ["debug", "info", "warning"],
}


def _actions() -> dict[str, argparse.Action]:
    return {s: a for a in build_parser()._actions for s in a.option_strings if s != "-h"}


def test_every_documented_flag_is_generated_with_help_and_its_field_default(monkeypatch):
    monkeypatch.delenv("MINISGL_API_KEY", raising=False)
    actions = _actions()
    assert set(actions) - {"--help"} == FIXED | OTHERS
    defaults = {**vars(EngineConfig()), **vars(SchedulerConfig()), **vars(ServerArgs())}
    for flag, action in actions.items():
        if flag == "--help":
            continue
        assert action.help, flag
        if flag != "--skip-self-check":  # it shares --strict-self-check's dest
            assert action.default == defaults[action.dest], flag
    for flag, choices in CHOICES.items():
        assert list(actions[flag].choices) == choices, flag
    # the help shows a default where there is one to show
    assert "(default: 16)" in actions["--page-size"].help
    assert "(default: 1919)" in actions["--port"].help


def test_each_flag_comes_from_one_declared_field():
    declared = [
        flag_name(f) for cls in (EngineConfig, SchedulerConfig, ServerArgs) for f in flagged(cls)
    ]
    assert len(declared) == len(set(declared))
    assert set(declared) == (FIXED | OTHERS) - {"--strict-self-check", "--skip-self-check"}
    page_size = next(f for f in flagged(EngineConfig) if f.name == "page_size")
    assert _actions()["--page-size"].help.startswith(page_size.metadata["flag"].help)


def test_a_few_flags_parse_into_the_configurations():
    args = parse_args(
        ["--device", "cpu", "--dtype", "float32", "--page-size", "8", "--num-pages", "100"]
        + ["--disable-overlap-schedule", "--prefix-cache", "none", "--prefill-step-seconds", "0"]
        + ["--host", "0.0.0.0", "--max-connections", "5", "--reasoning-parser", "qwen3"]
        + ["--skip-self-check", "--hide-cached-tokens", "--log-level", "debug"]
    )
    e, s = args.engine_config, args.scheduler_config
    assert (e.device, e.dtype, e.page_size, e.num_pages, e.self_check) == (
        "cpu", "float32", 8, 100, "skip",
    )  # fmt: skip
    assert (s.overlap_schedule, s.prefix_cache, s.prefill_step_seconds) == (False, "none", 0.0)
    assert (args.host, args.max_connections, args.reasoning_parser) == ("0.0.0.0", 5, "qwen3")
    assert args.hide_cached_tokens and args.log_level == "debug"


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--max-connections", "0"], "--max-connections must be positive"),
        (["--debug-history", "-1"], "--debug-history must not be negative"),
        (["--shutdown-timeout", "-1"], "--shutdown-timeout must not be negative"),
        (["--prefill-step-seconds", "-0.5"], "--prefill-step-seconds must not be negative"),
        (["--dist-timeout", "0"], "--dist-timeout must be positive"),
        (["--device", "tpu"], "invalid choice: 'tpu'"),
    ],
)
def test_bounds_and_choices_declared_on_the_field_are_refused(argv, message, capsys):
    with pytest.raises(SystemExit):
        parse_args(argv)
    assert message in capsys.readouterr().err


def test_the_benchmarks_engine_flags_are_minisgls_own(monkeypatch):
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[2] / "benchmarks"))
    import common

    p = argparse.ArgumentParser()
    common.add_engine_flags(p, "device", "page_size", "cuda_graph", "max_prefill_tokens")
    mine = {s: a for a in p._actions for s in a.option_strings if s != "-h"}
    server = _actions()
    for flag in ("--device", "--page-size", "--disable-cuda-graph", "--max-prefill-tokens"):
        assert (mine[flag].help, mine[flag].default, mine[flag].choices) == (
            server[flag].help, server[flag].default, server[flag].choices,
        ), flag  # fmt: skip
    args = p.parse_args(["--device", "cpu", "--page-size", "4", "--disable-cuda-graph"])
    assert common.engine_options(args, "device", "page_size", "cuda_graph") == {
        "device": "cpu", "page_size": 4, "cuda_graph": False,
    }  # fmt: skip
    online = argparse.ArgumentParser()
    common.add_engine_flags(online, "device", device="cpu")  # a script's own default
    assert online.parse_args([]).device == "cpu"
    sys.modules.pop("common", None)
