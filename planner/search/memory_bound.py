"""Peak memory of a Program from its directives alone, to reject a point before simulating.

A trial that cannot fit is the common case on big models, and it costs as much to schedule
and simulate as one that can. But the memory model (`cost_models.memory.peak_memory`) needs
only each device's compute order, which the Program's Order directives already state: a
forward holds its microbatch's activations until the backward that ends it. Walking each
Order with the same formulas gives the simulator's figure without building the Plan — a
lower bound in general (it leaves out nothing the simulator counts only when a device has no
Order), so rejecting on it never drops a point that fits.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

from cost_models.analytical import ModelCosts
from cost_models.memory import StageMemory, cast_bytes, state_split
from piper.dag import Kind, parse_task
from piper.directives import Order
from piper.directives.stream import MOVABLE


def early_reduce_scatter_stages(orders: Sequence[Order], *, dp: int, zero: int,
                                bucket_bytes: int, moved: Collection[str]) -> frozenset[int]:
    """The stages `runtime.execute.buckets.early_reduce_scatters` finds in the Plan, from the
    directives: ZeRO-2/3 units over dp > 1, no collective kind `moved` off the compute
    stream (Stream), no overlapped pair in any Order, and not the stages it splits (I)."""
    if not bucket_bytes or zero < 2 or dp == 1 or set(moved) & MOVABLE:
        return frozenset()
    if any(len(w) > 1 for o in orders for w in o.words):
        return frozenset()
    tasks = [parse_task(n)[:2] for o in orders for n in o.names]
    return frozenset(s for _, s in tasks) - {s for k, s in tasks if k is Kind.BWD_I}


def device_peaks(stage_regions: Sequence[Sequence[str]], stage_device: Sequence[int],
                 orders: Sequence[Order], *, dp: int, zero: int, costs: ModelCosts,
                 microbatch_size: int, recompute: Collection[int] = (),
                 bucket_bytes: int = 0, early: Collection[int] = (), policy: str = "full"
                 ) -> list[int]:
    """Per pipeline device: model state at its ZeRO stage, plus the most activations its
    Order keeps alive at once (plus ZeRO-3's gathered parameters and ZeRO-2/3's full
    gradient, or two units of it on `early` stages, while a chunk or backward runs), in
    bytes. Stages in `recompute` keep what `policy` keeps (full: their regions' inputs,
    one region rebuilt at a time): the account of `StageMemory`, which the simulated peak
    keeps too."""
    paired = any("+" in name for o in orders for name in o.names)
    mem = StageMemory.of(stage_regions, costs, microbatch_size, zero, recompute,
                         bucket_bytes, early, paired, policy)
    per_param = sum(state_split(costs, zero, dp))
    order_of = {o.device: o.names for o in orders}  # a pair: its forward first
    peaks = []
    for device in range(max(stage_device) + 1):
        mine = [s for s, d in enumerate(stage_device) if d == device]
        static = round(sum(per_param * costs.params_of(stage_regions[s])
                           + cast_bytes(costs, stage_regions[s], zero) for s in mine))
        tasks = order_of.get(device)
        if tasks is None:  # no Order: at least one microbatch is held on some stage
            peaks.append(static + max(mem.act[s] + mem.gathered[s] for s in mine))
            continue
        peaks.append(mem.peak(static, (parse_task(name)[:2] for name in tasks)))
    return peaks
