"""Command-line flags generated from the configuration dataclasses' field metadata.

Contract: `option(default, help, ...)` declares a dataclass field together with its flag:
help text, choices and bounds are written there once. `add_flags(parser, cls)` adds one
flag per such field of `cls` (dest: the field's name; default: the field's; `--field-name`
unless the field names another), `check_flags(parser, ns, cls)` refuses a parsed value
outside its bounds with `parser.error` (`--page-size must be positive`). A bool field is a
switch: `--name` turns it on, or, declared with `negate=True` and its own flag name
(`--disable-cuda-graph`), off. `env` names an environment variable read for the default.
Standard library only: the API server process parses flags without importing torch.
"""

from __future__ import annotations

import argparse
import os
import types
import typing
from dataclasses import MISSING, dataclass, field, fields
from typing import Any


@dataclass(frozen=True)
class Flag:
    help: str
    choices: tuple[str, ...] | None = None
    ge: float | None = None  # bounds of a value that is given (None stays allowed)
    gt: float | None = None
    name: str | None = None  # the flag, when it is not --field-name
    negate: bool = False  # a bool switch that sets the field to False
    env: str | None = None  # the default comes from this environment variable

    def problem(self, value: Any) -> str | None:
        """What is wrong with a parsed value, as the end of 'FLAG must ...'."""
        if value is None or isinstance(value, (bool, str)):
            return None
        if (self.gt is not None and not value > self.gt) or (
            self.ge is not None and not value >= self.ge
        ):
            if self.gt == 0 or self.ge == 1:
                return "must be positive"
            if self.ge == 0:
                return "must not be negative"
            low = f">= {self.ge:g}" if self.ge is not None else f"> {self.gt:g}"
            return f"must be {low}"
        return None


def option(default: Any = MISSING, help: str = "", **flag: Any) -> Any:
    """A dataclass field with a command-line flag (see `Flag`)."""
    return field(default=default, metadata={"flag": Flag(help, **flag)})


def flag_name(f) -> str:
    return f.metadata["flag"].name or "--" + f.name.replace("_", "-")


def flagged(cls: type) -> list:
    """The fields of `cls` that have a flag, in declaration order."""
    return [f for f in fields(cls) if "flag" in f.metadata]


def _value_type(cls: type, name: str) -> Any:
    """int, float or str: the field's type without its `| None`."""
    hint = typing.get_type_hints(cls)[name]
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        (hint,) = [a for a in typing.get_args(hint) if a is not type(None)]
    return hint


def add_flags(parser, cls: type, only: tuple[str, ...] | None = None, **defaults: Any) -> None:
    """One flag per flagged field of `cls` (or of those named in `only`); `defaults`
    override a field's default (a benchmark's own choice)."""
    for f in flagged(cls):
        if only is not None and f.name not in only:
            continue
        spec: Flag = f.metadata["flag"]
        default = defaults.get(f.name, f.default)
        if spec.env is not None:
            default = os.environ.get(spec.env, default)
        kind = _value_type(cls, f.name)
        # an environment variable's value may be a secret (an API key): never shown
        said = default is None or default is False or spec.env is not None or kind is bool
        shown = spec.help + ("" if said else f" (default: {default})")
        shown = shown.replace("%", "%%")
        if kind is bool:
            action = "store_false" if spec.negate else "store_true"
            parser.add_argument(
                flag_name(f), dest=f.name, action=action, default=default, help=shown
            )
            continue
        parser.add_argument(
            flag_name(f),
            dest=f.name,
            type=kind,
            default=default,
            choices=list(spec.choices) if spec.choices else None,
            help=shown,
        )


def check_flags(parser: argparse.ArgumentParser, ns: argparse.Namespace, cls: type) -> None:
    """`parser.error` for the first parsed value of `cls`' flags outside its bounds."""
    for f in flagged(cls):
        if hasattr(ns, f.name):
            problem = f.metadata["flag"].problem(getattr(ns, f.name))
            if problem is not None:
                parser.error(f"{flag_name(f)} {problem}")


def split_options(options: dict[str, Any], *configs: type) -> tuple[dict[str, Any], ...]:
    """`options` sorted by owner: the fields of each of `configs` (dataclasses), in order,
    then the rest."""
    owned = [{f.name for f in fields(c)} for c in configs]
    taken = set().union(*owned)
    return (
        *({k: v for k, v in options.items() if k in names} for names in owned),
        {k: v for k, v in options.items() if k not in taken},
    )
