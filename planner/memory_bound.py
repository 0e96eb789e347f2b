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
from cost_models.memory import recompute_bytes, zero_bytes_per_param
from piper.dag import parse_task
from piper.directives import Order


def device_peaks(stage_regions: Sequence[Sequence[str]], stage_device: Sequence[int],
                 orders: Sequence[Order], *, dp: int, zero: int, costs: ModelCosts,
                 microbatch_size: int, recompute: Collection[int] = ()) -> list[int]:
    """Per pipeline device: model state at its ZeRO stage, plus the most activations its
    Order keeps alive at once (plus ZeRO-3's gathered parameters and ZeRO-2/3's full
    gradient while a chunk or backward runs), in bytes. Stages in `recompute` keep their
    regions' inputs and rebuild one region at a time, as in `peak_memory`."""
    params = [costs.params_of(rs) for rs in stage_regions]
    act = [round(costs.activation_bytes_of(rs, microbatch_size, s in recompute))
           for s, rs in enumerate(stage_regions)]
    extra = [recompute_bytes(costs, rs, microbatch_size) if s in recompute else (0, 0)
             for s, rs in enumerate(stage_regions)]
    rebuilt, held = [r for r, _ in extra], [h for _, h in extra]
    full = [costs.element_size * p for p in params]
    gathered = full if zero == 3 else [0] * len(full)
    grad_buf = full if zero >= 2 else [0] * len(full)
    per_param = zero_bytes_per_param(costs.element_size, zero, dp)
    order_of = {o.device: o.tasks.split() for o in orders}
    peaks = []
    for device in range(max(stage_device) + 1):
        mine = [s for s, d in enumerate(stage_device) if d == device]
        static = round(per_param * sum(params[s] for s in mine))
        tasks = order_of.get(device)
        if tasks is None:  # no Order: at least one microbatch is held on some stage
            peaks.append(static + max(act[s] + gathered[s] for s in mine))
            continue
        live = peak = static
        for name in tasks:
            kind, stage, _ = parse_task(name)
            if kind.value == "F":
                live += act[stage]
                peak = max(peak, live + gathered[stage])
            elif kind.value == "I" and stage in recompute:
                peak = max(peak, live + gathered[stage] + rebuilt[stage])
                live += held[stage]
            elif kind.ends_backward:
                work = rebuilt[stage] if kind.value == "B" else 0
                peak = max(peak, live + gathered[stage] + grad_buf[stage] + work)
                live -= act[stage] + (held[stage] if kind.value == "W" else 0)
        peaks.append(peak)
    return peaks
