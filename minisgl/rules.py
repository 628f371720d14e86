"""The rules a request's values follow, declared once where their field is defined.

Contract: `Rule` says what one field means and which values it takes: numeric bounds (of
the value, of each item of a list or of each value of a dict), how many items a list may
hold, how long a string (or each string of a list) may be, and whether `None` is allowed
(the field's default is None). `rule(...)` declares a dataclass field with its Rule as
metadata; `rules_of(cls)` reads them back. `Rule.problem(name, value)` is the one check
(the message a client sees, or None); values of another type pass (the type check is the
caller's: pydantic's over HTTP, Python's offline). `Rule.field_constraints()` is the same
bounds as pydantic `Field` keywords, so an HTTP schema shows exactly what is checked.
No dependency beyond the standard library.
"""

from __future__ import annotations

import math
from dataclasses import MISSING, dataclass, field, fields
from typing import Any


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _fmt(x: float) -> str:
    return f"{x:g}" if isinstance(x, float) else str(x)


@dataclass(frozen=True)
class Rule:
    meaning: str  # what the field does: documentation, the HTTP schema's description
    ge: float | None = None  # bounds of the value, or of each item / each dict value
    gt: float | None = None
    le: float | None = None
    lt: float | None = None
    max_items: int | None = None  # a list's length, or a dict's
    min_length: int | None = None  # a string's length, or each string's of a list
    max_length: int | None = None
    nullable: bool = False  # None is a value (it means the default behaviour)

    def bounds_text(self) -> str:
        """The numeric bounds in interval notation: `[0, 2]`, `(0, 1]`, `>= 0`."""
        low = high = None
        if self.ge is not None or self.gt is not None:
            low = f"[{_fmt(self.ge)}" if self.ge is not None else f"({_fmt(self.gt)}"
        if self.le is not None or self.lt is not None:
            high = f"{_fmt(self.le)}]" if self.le is not None else f"{_fmt(self.lt)})"
        if low and high:
            return f"{low}, {high}"
        if low:
            return (">= " if self.ge is not None else "> ") + low[1:]
        return ("<= " if self.le is not None else "< ") + (high or "")[:-1]

    @property
    def bounded(self) -> bool:
        return any(b is not None for b in (self.ge, self.gt, self.le, self.lt))

    def holds(self, x: float) -> bool:
        # comparisons with NaN are all false, so NaN never holds; nor does an infinity
        # outside finite bounds
        if isinstance(x, float) and math.isnan(x):
            return False
        return (
            (self.ge is None or x >= self.ge)
            and (self.gt is None or x > self.gt)
            and (self.le is None or x <= self.le)
            and (self.lt is None or x < self.lt)
        )

    def _string_problem(self, s: str, what: str) -> str | None:
        if self.min_length is not None and len(s) < self.min_length:
            return (
                f"{what} must not be empty"
                if self.min_length == 1
                else f"{what} must be at least {self.min_length} characters"
            )
        if self.max_length is not None and len(s) > self.max_length:
            return f"{what} must be at most {self.max_length} characters"
        return None

    def problem(self, name: str, value: Any) -> str | None:
        """Why `value` breaks this rule for the field called `name`, or None."""
        if value is None:
            return None if self.nullable else f"{name} must not be null"
        if _number(value):
            if self.bounded and not self.holds(value):
                return f"{name} must be in {self.bounds_text()}, got {value!r}"
            return None
        if isinstance(value, str):
            return self._string_problem(value, name)
        if isinstance(value, (list, tuple)):
            if self.max_items is not None and len(value) > self.max_items:
                return f"{name} takes at most {self.max_items} items, got {len(value)}"
            for item in value:
                if isinstance(item, str):
                    if (problem := self._string_problem(item, f"{name} strings")) is not None:
                        return problem
                elif _number(item) and self.bounded and not self.holds(item):
                    return f"{name} items must be in {self.bounds_text()}, got {item!r}"
            return None
        if isinstance(value, dict):
            if self.max_items is not None and len(value) > self.max_items:
                return f"{name} takes at most {self.max_items} entries, got {len(value)}"
            for v in value.values():
                if _number(v) and self.bounded and not self.holds(v):
                    return f"{name} values must be in {self.bounds_text()}, got {v!r}"
        return None

    def field_constraints(self, of: str = "value") -> dict[str, Any]:
        """pydantic `Field` keywords for these bounds: of the value itself ("value"), of
        each item ("item") or of a list's (or dict's) length ("list")."""
        if of == "list":
            return {"max_length": self.max_items} if self.max_items is not None else {}
        bounds = {k: getattr(self, k) for k in ("ge", "gt", "le", "lt")}
        lengths = {"min_length": self.min_length, "max_length": self.max_length}
        return {k: v for k, v in {**bounds, **lengths}.items() if v is not None}


def rule(
    meaning: str, *, default: Any = MISSING, default_factory: Any = MISSING, **bounds: Any
) -> Any:
    """A dataclass field whose metadata is its Rule (None allowed when the default is)."""
    r = Rule(meaning, nullable=default is None, **bounds)
    return field(default=default, default_factory=default_factory, metadata={"rule": r})


def rules_of(cls: type) -> dict[str, Rule]:
    """Each field of the dataclass `cls` declared with `rule`, by name."""
    return {f.name: f.metadata["rule"] for f in fields(cls) if "rule" in f.metadata}
