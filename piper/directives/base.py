"""What every directive is: a frozen value with `apply(dag, index) -> dag` and a Python form."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import Any, ClassVar

from piper.dag import TrainingDAG

REGISTRY: dict[str, type[Directive]] = {}


class Directive:
    """Base of all directives. Subclasses are frozen dataclasses registered by class name."""

    phase: ClassVar[int] = 0  # Program applies directives in non-decreasing phase order

    def __init_subclass__(cls, **kw: Any) -> None:
        super().__init_subclass__(**kw)
        REGISTRY[cls.__name__] = cls

    def apply(self, dag: TrainingDAG, index: int) -> TrainingDAG:
        """Return the rewritten DAG; raise `DirectiveError(index, self, why)` if not applicable."""
        raise NotImplementedError

    def to_dict(self) -> dict[str, Any]:
        d = {"type": type(self).__name__}
        for f in dataclasses.fields(self):  # type: ignore[arg-type]
            v = getattr(self, f.name)
            d[f.name] = list(v) if isinstance(v, tuple) else v
        return d

    def to_python(self) -> str:
        """A constructor call a person can read and edit; `eval` gives an equal directive."""
        fields = dataclasses.fields(self)  # type: ignore[arg-type]
        first, rest = fields[0], fields[1:]
        value = getattr(self, first.name)
        parts = [] if value == first.default else [self._fmt(first.name, value)]
        parts += [f"{f.name}={self._fmt(f.name, getattr(self, f.name))}" for f in rest
                  if getattr(self, f.name) != f.default]
        return f"{type(self).__name__}({', '.join(parts)})"

    def _fmt(self, name: str, value: Any) -> str:
        del name
        return repr(value)

    def __repr__(self) -> str:
        return self.to_python()


def words(value: str | Iterable[str]) -> str:
    """A space-separated string from a string or a sequence of words (Order, Stream)."""
    return " ".join(value.split() if isinstance(value, str) else value)


def from_dict(d: dict[str, Any]) -> Directive:
    if not isinstance(d, dict):
        raise TypeError(f"a directive must be a JSON object, got {d!r}")
    cls = REGISTRY.get(d.get("type", ""))
    if cls is None:
        raise ValueError(f"unknown directive type {d.get('type')!r}")
    kwargs = {k: tuple(v) if isinstance(v, list) else v for k, v in d.items() if k != "type"}
    first = dataclasses.fields(cls)[0].name  # type: ignore[arg-type]
    return cls(kwargs.pop(first), **kwargs)
