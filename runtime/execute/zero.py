"""ZeRO for one stage on one rank: the stage's parameters as flat buffers, sharded over the
stage's data-parallel group.

Each forward gives the stage module fresh leaf views of the flat buffers (`views`), so its
backward leaves every parameter's gradient on that view, to be copied into one flat
gradient per buffer and reduce-scattered. ZeRO-3 frees the buffers' storage after every
chunk and all-gathers it back before the next (per microbatch): views and tensors autograd
saved keep pointing at the same storage, which holds the same values whenever it is alive.

Without a bucket cap the whole stage is one buffer (one FSDP unit). With one
(`Replicate(zero=..., bucket_mb=...)`) consecutive parameters are grouped into units of at
most that many bytes, in reverse order as DDP's buckets, each its own buffer and shard and
each gathered and reduce-scattered on its own. Under ZeRO-3 a chunk then holds at most two
units at once, as FSDP does: the one its ops read and the next, prefetched
(`runtime.execute.unit_gather` gathers and frees them inside the chunk; `gather`, `prefetch`,
`release` here). Where backward may start collectives (`arm`),
a unit's reduce-scatter starts as soon as backward has finished its parameters' gradients
(a post-accumulate-grad hook per view), and its flat gradient is dropped once the next
unit's starts: a microbatch's unsharded gradient is then never whole.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist

from runtime.execute.buckets import bucket_indices


def _nbytes(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.numel() * t.element_size()


def storage_key(t: torch.Tensor) -> int:
    """A tensor's storage, the same while it is freed and gathered again (its address is
    not: a refill allocates anew)."""
    return t.untyped_storage()._cdata


class _Unit:
    """Consecutive parameters of a stage as one flat buffer, padded to a multiple of the
    group size; this rank's shard of it; the shard's gradient."""

    def __init__(self, params: list[torch.nn.Parameter], first: int, zero: int, size: int,
                 group_rank: int, param_dtype: torch.dtype | None = None) -> None:
        self.first, self.size = first, size
        self.shapes = [p.shape for p in params]
        self.numels = [p.numel() for p in params]
        self.offsets = [sum(self.numels[:i]) for i in range(len(params))]
        n = sum(self.numels)
        self.chunk = math.ceil(n / size)
        full = torch.zeros(self.chunk * size, dtype=params[0].dtype, device=params[0].device)
        with torch.no_grad():
            torch.cat([p.detach().reshape(-1) for p in params], out=full[:n])
        lo = group_rank * self.chunk
        # ZeRO-1/2 keep the full parameters, so the shard the optimizer owns is a view of
        # them; ZeRO-3 frees the full buffer, and bf16 training keeps it in bf16 (the
        # shard is the fp32 master): then the shard is separate memory.
        low = param_dtype not in (None, full.dtype)
        self.separate = zero == 3 or low
        owned = full.data[lo:lo + self.chunk]
        self.shard = torch.nn.Parameter(owned.clone() if self.separate else owned)
        if low:  # gathers low-precision copies, as `materialize` makes them
            full = full.to(param_dtype)
        self.flat = full
        # what a microbatch's flat gradient is made in: ZeRO-1/2 accumulate the master's
        # dtype (Megatron's fp32 main_grad), ZeRO-3 the gathered parameters' (FSDP2)
        self.grad_dtype = self.flat.dtype if zero == 3 else self.shard.dtype
        self.grad_shard: torch.Tensor | None = None
        self.full_grad: torch.Tensor | None = None  # ZeRO-1 accumulates unsharded
        self.pending: dict[int, torch.Tensor] = {}  # microbatch -> its flat gradient
        self.nbytes = _nbytes(self.flat)

    def view(self, flat: torch.Tensor, i: int) -> torch.Tensor:
        """Parameter i's part of a flat tensor laid out like the buffer (it or a gradient)."""
        off = self.offsets[i]
        return flat[off:off + self.numels[i]].view(self.shapes[i])

    def flat_grad(self, views: list[torch.Tensor]) -> torch.Tensor:
        """One flat gradient from the gradients backward left on this unit's `views`
        (zeros where it left none: an unused parameter, or one W will add), which it
        takes off them."""
        out = torch.empty(self.chunk * self.size, dtype=self.grad_dtype,
                          device=self.flat.device)
        out[self.offsets[-1] + self.numels[-1]:].zero_()  # the padding past the last
        for i, v in enumerate(views):
            if v.grad is None:
                self.view(out, i).zero_()
            else:
                self.view(out, i).copy_(v.grad)
                v.grad = None
        return out

    def add_to_shard(self, out: torch.Tensor) -> None:
        out = out.to(self.shard.dtype)  # reduced in another dtype: the master's
        self.grad_shard = out if self.grad_shard is None else self.grad_shard + out


class ShardedStage:
    """Flat parameters of one stage in units, this rank's shard of each, their gradients."""

    def __init__(self, params: list[torch.nn.Parameter], zero: int, group: Any,
                 group_rank: int, group_size: int, bucket_bytes: int = 0,
                 reduce_dtype: torch.dtype | None = None,
                 param_dtype: torch.dtype | None = None) -> None:
        """`reduce_dtype`: what gradients are reduce-scattered in (default: theirs);
        `param_dtype`: what the flat buffers hold and gather the fp32 shards as (bf16
        training: bf16, half the bytes, as FSDP2's `MixedPrecisionPolicy(param_dtype=...)`
        and Megatron-LM's distributed optimizer, whose bf16 parameters beside fp32 main
        gradients and a sharded fp32 master are what ZeRO-1/2 then keep). The forward reads
        them as they are, so autocast makes no per-microbatch copy of the weights."""
        self.reduce_dtype = reduce_dtype
        self.zero, self.group, self.size, self.rank = zero, group, group_size, group_rank
        nbytes = [p.numel() * p.element_size() for p in params]
        ranges = ([sorted(b) for b in bucket_indices(nbytes, bucket_bytes)] if bucket_bytes
                  else [list(range(len(params)))])
        self.units = [_Unit([params[i] for i in idx], idx[0], zero, group_size, group_rank,
                            param_dtype) for idx in ranges]  # backward's order: the last parameters first
        self._where = {u.first + j: (k, j) for k, u in enumerate(self.units)
                       for j in range(len(u.shapes))}
        self._inflight: list[tuple[_Unit, Any, torch.Tensor, torch.Tensor]] = []
        self._hooks: list[Any] = []
        self._early: set[int] = set()  # units whose reduce-scatter the backward started
        self._gathering: dict[int, tuple[Any, torch.Tensor]] = {}  # unit -> (work, source)
        if zero == 3:
            self.free()

    @property
    def shards(self) -> list[torch.nn.Parameter]:
        """What the optimizer updates: one shard per unit."""
        return [u.shard for u in self.units]

    # ---- parameters -------------------------------------------------------------------
    def views(self) -> list[torch.Tensor]:
        """Per-parameter views of the flat buffers for one forward, each a leaf of its own
        (its gradient collects on it, and its hook fires as soon as that gradient is
        final: a unit's reduce-scatter need not wait for the rest of the backward)."""
        out: list[torch.Tensor] = [None] * len(self._where)  # type: ignore[list-item]
        for u in self.units:
            storage = u.flat.untyped_storage()
            freed = storage.nbytes() == 0  # a unit gathered inside the chunk: a view
            if freed:                      # needs its storage's size, not its values
                storage.resize_(u.nbytes)
            base = u.flat.detach()  # its version counter: `materialize` writes past it
            for j in range(len(u.shapes)):
                out[u.first + j] = u.view(base, j).requires_grad_(True)
            if freed:
                storage.resize_(0)
        return out

    def _of(self, views: list[torch.Tensor], u: _Unit) -> list[torch.Tensor]:
        return views[u.first:u.first + len(u.shapes)]

    def grad_view(self, grads: list[torch.Tensor], i: int) -> torch.Tensor:
        """Parameter i's part of per-unit flat gradients (`take_grads`' list)."""
        k, j = self._where[i]
        return self.units[k].view(grads[k], j)

    def storages(self) -> tuple[int, ...]:
        """The gathered buffers' storages (`storage_key`: alive or freed; a split
        backward's W must not read them)."""
        return tuple(storage_key(u.flat) for u in self.units)

    def materialize(self, units: list[int] | None = None) -> None:
        """All-gather each unit's shards (or those of `units`) into its flat buffer (its
        `.data` alias, so autograd's version counter does not see the refill)."""
        for k in range(len(self.units)) if units is None else units:
            self._start_gather(k)
            self.gather(k)

    def _start_gather(self, k: int) -> None:
        u = self.units[k]
        storage = u.flat.untyped_storage()
        if storage.nbytes() == 0:
            storage.resize_(u.nbytes)
        src = (u.shard.data.to(u.flat.dtype) if u.separate
               else u.shard.data.clone())  # no aliasing
        self._gathering[k] = (dist.all_gather_single(u.flat.data, src, group=self.group,
                                                     async_op=True), src)

    def gathered(self, k: int) -> bool:
        return self.units[k].flat.untyped_storage().nbytes() > 0 and k not in self._gathering

    def prefetch(self, k: int) -> None:
        """Start unit k's all-gather unless it is gathered or on its way."""
        if k not in self._gathering and not self.gathered(k):
            self._start_gather(k)

    def gather(self, k: int) -> None:
        """Unit k gathered: wait for its prefetch, or gather it now."""
        self.prefetch(k)
        work = self._gathering.pop(k, None)
        if work is not None:
            work[0].wait()

    def release(self, k: int) -> None:
        """Free unit k's gathered buffer (a prefetch on its way is waited for first)."""
        if k in self._gathering:
            self.gather(k)
        self.units[k].flat.untyped_storage().resize_(0)

    def free(self) -> None:
        for k in range(len(self.units)):
            self.release(k)

    def unit_of(self, i: int) -> int:
        """The unit parameter i of the stage (a `views` slot) lives in."""
        return self._where[i][0]

    # ---- gradients --------------------------------------------------------------------
    def arm(self, views: list[torch.Tensor]) -> None:
        """Reduce-scatter each unit's gradient from inside the coming backward through
        `views`, as soon as all its parameters' gradients are in (ZeRO-2/3: one
        microbatch's gradient is final when its backward ends)."""
        missing = [len(u.shapes) for u in self.units]

        def hook(k: int) -> Any:
            def ready(_v: torch.Tensor) -> None:
                missing[k] -= 1
                if missing[k] == 0:
                    u = self.units[k]
                    self._early.add(k)
                    self._start(u, u.flat_grad(self._of(views, u)))
            return ready
        self._hooks = [v.register_post_accumulate_grad_hook(hook(k))
                       for k, u in enumerate(self.units) for v in self._of(views, u)]

    def disarm(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []

    def _scatter(self, u: _Unit, g: torch.Tensor, async_op: bool) -> tuple[Any, torch.Tensor]:
        """Start (or run) the reduce-scatter of unit `u`'s flat gradient `g`."""
        if self.reduce_dtype is not None and g.is_floating_point():
            g = g.to(self.reduce_dtype)
        out = torch.empty(u.chunk, dtype=g.dtype, device=g.device)
        return dist.reduce_scatter_single(out, g, group=self.group, async_op=async_op), out

    def _start(self, u: _Unit, g: torch.Tensor) -> None:
        work, out = self._scatter(u, g, async_op=True)
        done, self._inflight = self._inflight, [(u, work, out, g)]
        self._finish(done)  # the earlier units' flat gradients go once theirs are in

    @staticmethod
    def _finish(started: list[tuple[_Unit, Any, torch.Tensor, torch.Tensor]]) -> None:
        for u, work, out, _ in started:
            work.wait()
            u.add_to_shard(out)

    def take_grads(self, views: list[torch.Tensor]) -> list[torch.Tensor | None]:
        """Each unit's flat gradient from the backward just run through `views` (None
        where its reduce-scatter already started inside that backward)."""
        out = [None if k in self._early else u.flat_grad(self._of(views, u))
               for k, u in enumerate(self.units)]
        self._early = set()
        return out

    def zero_grads(self) -> list[torch.Tensor | None]:
        return [torch.zeros_like(u.flat.data, dtype=u.grad_dtype) for u in self.units]

    def add_grad(self, mb: int, grads: list[torch.Tensor | None]) -> None:
        for u, g in zip(self.units, grads, strict=True):
            if g is None:
                continue
            if self.zero == 1:
                u.full_grad = g if u.full_grad is None else u.full_grad + g
            else:
                u.pending[mb] = g

    def reduce_scatter(self, mb: int) -> None:
        """Sum this microbatch's (ZeRO-2/3) or the step's (ZeRO-1) gradients over the group;
        keep only this rank's shard of the sum. Units started inside backward finish here."""
        self._finish(self._inflight)
        self._inflight = []
        for u in self.units:
            g = u.full_grad if mb < 0 else u.pending.pop(mb, None)
            u.full_grad = None
            if g is None:
                continue  # started inside backward
            u.add_to_shard(self._scatter(u, g.contiguous(), async_op=False)[1])

    def pending_grads(self) -> list[torch.Tensor]:
        """Unsharded gradients waiting for their reduce-scatter (a CUDA caller keeps them
        for its streams)."""
        return [g for u in self.units for g in (*u.pending.values(), u.full_grad)
                if g is not None] + [g for *_, g in self._inflight]

    def attach_grads(self) -> None:
        """Hand each shard its summed gradient, for the optimizer."""
        for u in self.units:
            u.shard.grad = u.grad_shard
            u.grad_shard = None

    def spans(self) -> list[tuple[int, int, int]]:
        """Per parameter, in the stage's order: (its unit, its first flat
        element in the unit's buffer, its numel), with this rank's shard range known from
        `shard_range`."""
        return [(k, self.units[k].offsets[j], self.units[k].numels[j])
                for k, j in (self._where[i] for i in range(len(self._where)))]

    def shard_range(self, k: int) -> tuple[int, int]:
        u = self.units[k]
        return self.rank * u.chunk, (self.rank + 1) * u.chunk

    def grad_shards(self) -> list[torch.Tensor]:
        return [u.grad_shard for u in self.units if u.grad_shard is not None]

    def model_state_bytes(self) -> int:
        """Parameters (full for ZeRO-1/2, and the master shard where it is separate; the
        shard for ZeRO-3) and gradients (full for ZeRO-1, the shard for ZeRO-2/3).
        Optimizer state is counted by the ledger."""
        return sum((_nbytes(u.shard) if u.separate else 0) + (u.nbytes if self.zero < 3 else 0)
                   + _nbytes(u.grad_shard) + _nbytes(u.full_grad) for u in self.units)

    def transient_bytes(self) -> int:
        """Working buffers: ZeRO-3's gathered parameters (when alive) and per-microbatch
        flat gradients waiting for (or in) their reduce-scatter."""
        pending = sum(_nbytes(g) for u in self.units for g in u.pending.values())
        pending += sum(_nbytes(g) for *_, g in self._inflight)
        gathered = sum(u.flat.untyped_storage().nbytes() for u in self.units
                       ) if self.zero == 3 else 0
        return gathered + pending
