"""The command line fills the engine's and the scheduler's configurations inside
`ServerArgs`, with the defaults those configurations define, and rejects bad values."""

from __future__ import annotations

import pytest

from minisgl.engine.config import EngineConfig
from minisgl.scheduler.config import SchedulerConfig
from minisgl.server.args import ServerArgs, parse_args
from minisgl.utils.flags import split_options


def test_no_flags_give_the_configurations_defaults(monkeypatch) -> None:
    monkeypatch.delenv("MINISGL_API_KEY", raising=False)
    assert parse_args([]) == ServerArgs()


def test_flags_fill_the_nested_configurations() -> None:
    args = parse_args(
        ["--model", "m", "--device", "cpu", "--page-size", "4", "--disable-cuda-graph"]
        + ["--max-prefill-tokens", "64", "--port", "2020"]
    )
    assert args.engine_config == EngineConfig(
        model="m", device="cpu", page_size=4, cuda_graph=False
    )
    assert args.scheduler_config == SchedulerConfig(max_prefill_tokens=64)
    assert args.port == 2020


@pytest.mark.parametrize("flag", ["--page-size", "--max-prefill-tokens", "--max-body-bytes"])
def test_non_positive_values_are_refused(flag, capsys) -> None:
    with pytest.raises(SystemExit):
        parse_args([flag, "0"])
    assert f"{flag} must be positive" in capsys.readouterr().err


def test_split_options_sorts_by_owner() -> None:
    options = {"page_size": 4, "max_prefill_tokens": 8, "port": 1}
    engine, scheduler, rest = split_options(options, EngineConfig, SchedulerConfig)
    assert (engine, scheduler, rest) == ({"page_size": 4}, {"max_prefill_tokens": 8}, {"port": 1})


@pytest.mark.parametrize("where", ["flag", "env"])
def test_an_empty_api_key_is_refused_rather_than_turning_authentication_off(
    where, monkeypatch, capsys
) -> None:
    monkeypatch.delenv("MINISGL_API_KEY", raising=False)
    if where == "env":
        monkeypatch.setenv("MINISGL_API_KEY", "")
    with pytest.raises(SystemExit):
        parse_args(["--api-key", " "] if where == "flag" else [])
    name = "--api-key" if where == "flag" else "$MINISGL_API_KEY"
    assert f"{name} is empty" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "said"),
    [
        (["--api-key", "a,b", "--admin-key", "b"], "--admin-key must be a key of its own"),
        (["--admin-key", " "], "--admin-key must be a key of its own"),
        (["--max-body-bytes", "100", "--max-body-bytes-total", "99"], "at least one"),
    ],
)
def test_an_admin_key_or_body_budget_that_cannot_work_is_refused(argv, said, capsys) -> None:
    with pytest.raises(SystemExit):
        parse_args(argv)
    assert said in capsys.readouterr().err
