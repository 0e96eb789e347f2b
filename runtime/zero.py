"""ZeRO for one stage on one rank: the stage's parameters as one flat buffer, sharded over
the stage's data-parallel group.

The flat buffer is an autograd leaf; the stage module gets views of it, so backward yields
one flat gradient to reduce-scatter. ZeRO-3 frees the buffer's storage after every chunk and
all-gathers it back before the next (per microbatch): views and tensors autograd saved keep
pointing at the same storage, which holds the same values whenever it is alive.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist


def _nbytes(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.numel() * t.element_size()


class _FlatViews(torch.autograd.Function):
    """flat -> every parameter's view of it, with one backward for all of them.

    Plain slicing gives each view its own backward, and each of those makes a zero-filled
    gradient the size of the whole buffer to put its slice in, which autograd then sums:
    several stage-sized temporaries per backward. Here the parameters' gradients are
    copied into one flat gradient, the only stage-sized allocation.
    """

    @staticmethod
    def forward(ctx: Any, flat: torch.Tensor, stage: ShardedStage) -> tuple[torch.Tensor, ...]:
        ctx.stage = stage
        return tuple(stage.view(flat, i) for i in range(len(stage.shapes)))

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[torch.Tensor, None]:
        stage: ShardedStage = ctx.stage
        out = torch.empty(stage.chunk * stage.size, dtype=stage.flat.dtype,
                          device=stage.flat.device)
        out[stage.offsets[-1] + stage.numels[-1]:].zero_()  # the padding past the last
        for i, g in enumerate(grads):
            if g is None:  # unused here, or left to a split backward's W
                stage.view(out, i).zero_()
            else:
                stage.view(out, i).copy_(g)
        return out, None


class ShardedStage:
    """Flat parameters of one stage, this rank's shard of them, and its gradient shard."""

    def __init__(self, params: list[torch.nn.Parameter], zero: int, group: Any,
                 group_rank: int, group_size: int) -> None:
        self.zero, self.group, self.size = zero, group, group_size
        self.shapes = [p.shape for p in params]
        self.numels = [p.numel() for p in params]
        self.offsets = [sum(self.numels[:i]) for i in range(len(params))]
        n = sum(self.numels)
        self.chunk = math.ceil(n / group_size)
        full = torch.zeros(self.chunk * group_size, dtype=params[0].dtype,
                           device=params[0].device)
        with torch.no_grad():
            torch.cat([p.detach().reshape(-1) for p in params], out=full[:n])
        lo = group_rank * self.chunk
        self.flat = full.requires_grad_(True)
        # ZeRO-1/2 keep the full parameters, so the shard the optimizer owns is a view of
        # them; ZeRO-3 frees the full buffer, so its shard is separate memory.
        owned = full.data[lo:lo + self.chunk]
        self.shard = torch.nn.Parameter(owned.clone() if zero == 3 else owned)
        self.grad_shard: torch.Tensor | None = None
        self.full_grad: torch.Tensor | None = None  # ZeRO-1 accumulates unsharded
        self.pending: dict[int, torch.Tensor] = {}  # microbatch -> its flat gradient
        self._nbytes = _nbytes(self.flat)
        if zero == 3:
            self.free()

    # ---- parameters -------------------------------------------------------------------
    def views(self) -> list[torch.Tensor]:
        """Per-parameter views of the flat buffer, made inside each forward's graph; their
        gradients meet in one flat gradient (`_FlatViews`)."""
        return list(_FlatViews.apply(self.flat, self))

    def view(self, flat: torch.Tensor, i: int) -> torch.Tensor:
        """Parameter i's part of a flat tensor laid out like the buffer (it or a gradient)."""
        off = self.offsets[i]
        return flat[off:off + self.numels[i]].view(self.shapes[i])

    def materialize(self) -> None:
        """All-gather the shards into the flat buffer (its `.data` alias, so autograd's
        version counter does not see the refill)."""
        storage = self.flat.untyped_storage()
        if storage.nbytes() == 0:
            storage.resize_(self._nbytes)
        src = self.shard.data if self.zero == 3 else self.shard.data.clone()  # no aliasing
        dist.all_gather_into_tensor(self.flat.data, src, group=self.group)

    def free(self) -> None:
        self.flat.untyped_storage().resize_(0)

    # ---- gradients --------------------------------------------------------------------
    def add_grad(self, mb: int, flat_grad: torch.Tensor) -> None:
        if self.zero == 1:
            self.full_grad = flat_grad if self.full_grad is None else self.full_grad + flat_grad
        else:
            self.pending[mb] = flat_grad

    def reduce_scatter(self, mb: int) -> None:
        """Sum this microbatch's (ZeRO-2/3) or the step's (ZeRO-1) gradients over the group;
        keep only this rank's shard of the sum."""
        g = self.full_grad if mb < 0 else self.pending.pop(mb)
        self.full_grad = None
        out = torch.empty(self.chunk, dtype=g.dtype, device=g.device)
        dist.reduce_scatter_tensor(out, g.contiguous(), group=self.group)
        self.grad_shard = out if self.grad_shard is None else self.grad_shard + out

    def step(self, optim: torch.optim.Optimizer) -> None:
        self.shard.grad = self.grad_shard
        optim.step()
        optim.zero_grad(set_to_none=True)
        self.grad_shard = None

    def model_state_bytes(self) -> int:
        """Parameters (full for ZeRO-1/2, the shard for ZeRO-3) and gradients (full for
        ZeRO-1, the shard for ZeRO-2/3). Optimizer state is counted by the ledger."""
        params = _nbytes(self.shard) if self.zero == 3 else self._nbytes
        return params + _nbytes(self.grad_shard) + _nbytes(self.full_grad)

    def transient_bytes(self) -> int:
        """Working buffers: ZeRO-3's gathered parameters (when alive) and per-microbatch
        flat gradients waiting for their reduce-scatter."""
        pending = sum(_nbytes(g) for g in self.pending.values())
        gathered = self.flat.untyped_storage().nbytes() if self.zero == 3 else 0
        return gathered + pending
