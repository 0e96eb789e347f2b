"""Program: an ordered list of directives; applies to a DAG and round-trips to JSON and Python."""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import KW_ONLY, dataclass
from pathlib import Path
from typing import Any

from piper.dag import TrainingDAG, verify
from piper.directives import (
    Directive,
    Order,
    Place,
    Recompute,
    Replicate,
    Shard,
    ShardSequence,
    ShardTensor,
    Split,
    SplitBackward,
    Stream,
    from_dict,
)
from piper.directives.order import apply_orders
from piper.directives.place import apply_places
from piper.directives.recompute import recompute_value
from piper.errors import DirectiveError, PiperError
from piper.pyfile import import_user_file

JSON_VERSION = 1


@dataclass(frozen=True)
class Program:
    """A distributed training strategy as directives. `name` labels the schedule it encodes."""

    directives: tuple[Directive, ...]
    _: KW_ONLY
    name: str = "custom"

    def __post_init__(self) -> None:
        ds = tuple(self.directives)
        for i, d in enumerate(ds):
            if not isinstance(d, Directive):
                raise PiperError(f"directive {i}: {d!r} is not a directive")
        object.__setattr__(self, "directives", ds)

    def apply(self, dag: TrainingDAG) -> TrainingDAG:
        """Apply every directive in turn, then check the result with `verify`."""
        phase = 0
        orders: list[tuple[int, Order]] = []  # a run of Orders is applied as one rewrite
        places: list[tuple[int, Place]] = []  # and a run of Places builds one DAG
        for i, d in enumerate(self.directives):
            if d.phase < phase:
                raise DirectiveError(i, d, "directives go in the order Place, Split, "
                                     "SplitBackward, Replicate/Shard/ShardTensor/Recompute, "
                                     "Order/Stream")
            phase = d.phase
            if isinstance(d, Order):
                orders.append((i, d))
                continue
            if isinstance(d, Place):
                places.append((i, d))
                continue
            if places:
                dag, places = apply_places(dag, places), []
            if orders:
                dag, orders = apply_orders(dag, orders), []
            dag = d.apply(dag, i)
        if places:
            dag = apply_places(dag, places)
        if orders:
            dag = apply_orders(dag, orders)
        placed = {r for r, _, _ in dag.placement}
        if placed and placed != set(dag.model.names):
            missing = [r for r in dag.model.names if r not in placed]
            raise PiperError(f"regions {', '.join(missing)} are not placed by any Place")
        verify(dag)
        return dag

    # --- summary -------------------------------------------------------------------------
    def summary(self) -> dict[str, Any]:
        """The shorthand figures a person thinks in (DESIGN.md's `summary` object)."""
        devices = {d.device for d in self.directives if isinstance(d, Place)}
        split = [d.microbatches for d in self.directives if isinstance(d, Split)]
        rep = [d for d in self.directives if isinstance(d, Replicate)]
        stages = {d.stage for d in self.directives if isinstance(d, Place)}
        pp = max(devices, default=0) + 1
        return {
            "dp": rep[0].degree if rep else 1,
            "pp": pp,
            "tp": next((d.degree for d in self.directives if isinstance(d, ShardTensor)), 1),
            "sp": any(isinstance(d, ShardTensor) and d.sequence_parallel
                      for d in self.directives),
            "ep": next((d.degree for d in self.directives if isinstance(d, Shard)), 1),
            # expert tensor parallelism: 1 or tp
            "etp": next((d.tensor for d in self.directives if isinstance(d, Shard)), 1),
            # Megatron's expert mesh: EP groups spread over the tensor-parallel ranks too
            "ep_over_tp": any(isinstance(d, Shard) and d.over_tp for d in self.directives),
            # an expert capacity factor per sequence (0: dropless)
            "capacity": next((d.capacity for d in self.directives if isinstance(d, Shard)),
                             0.0),
            "cp": next((d.degree for d in self.directives if isinstance(d, ShardSequence)), 1),
            "zero": rep[0].zero if rep else 0,
            "schedule": self.name,
            "virtual_stages": max(1, len(stages) // pp),
            "microbatches": split[0] if split else 1,
            # False, True (full recompute) or the selective policy's name
            "recompute": recompute_value(next((d.policy for d in self.directives
                                               if isinstance(d, Recompute)), None)),
            # gradient collectives on a stream of their own (they overlap later compute)
            "comm_stream": any(isinstance(d, Stream) and set(d.kinds.split()) & {"AR", "RS"}
                               for d in self.directives),
            # all-reduce bucket cap in MiB (DDP's bucket_cap_mb); None: one per stage
            "bucket_mb": rep[0].bucket_mb if rep else None,
        }

    # --- serialisation -------------------------------------------------------------------
    def to_json(self) -> str:
        return json.dumps({"version": JSON_VERSION, "name": self.name,
                           "directives": [d.to_dict() for d in self.directives]}, indent=1)

    @staticmethod
    def from_json(text: str) -> Program:
        data = json.loads(text)
        if not isinstance(data, dict) or "directives" not in data:
            raise ValueError("not a piper Program: missing 'directives'")
        return Program([from_dict(d) for d in data["directives"]], name=data.get("name", "custom"))

    def to_python(self, header: Iterable[str] = ()) -> str:
        """A directive script: `strategy()` returns this Program; `header` lines become comments."""
        kinds = sorted({type(d).__name__ for d in self.directives})
        lines = [f"# {h}".rstrip() for h in header]
        lines += ["import piper", f"from piper import {', '.join(kinds)}" if kinds else "", "",
                  "", "def strategy() -> piper.Program:", "    return piper.Program(", "        ["]
        lines += [f"            {d.to_python()}," for d in self.directives]
        lines += ["        ],", f"        name={self.name!r},", "    )", ""]
        return "\n".join(lines)

    @staticmethod
    def load(path: str | Path) -> Program:
        """Read a strategy: a `.json` file, or a `.py` file that defines `strategy()`."""
        p = Path(path)
        if not p.is_file():
            raise PiperError(f"strategy file {str(path)!r} not found")
        if p.suffix == ".json":
            try:
                return Program.from_json(p.read_text())
            except (ValueError, TypeError, KeyError) as e:
                raise PiperError(f"{path}: not a valid strategy JSON: {e}") from None
        module = import_user_file(p, "strategy file")
        fn = getattr(module, "strategy", None)
        if not callable(fn):
            raise PiperError(f"{path}: strategy file must define strategy()")
        try:
            prog = fn()
        except PiperError as e:
            raise PiperError(f"{path}: {e}") from None
        except Exception as e:  # noqa: BLE001 - user code
            raise PiperError(f"{path}: strategy() failed: {type(e).__name__}: {e}") from None
        if not isinstance(prog, Program):
            raise PiperError(f"{path}: strategy() must return a piper.Program")
        return prog


__all__ = ["Order", "Place", "Program", "Recompute", "Replicate", "Shard", "ShardTensor",
           "Split", "SplitBackward", "Stream"]

