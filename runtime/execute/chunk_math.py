"""A rank's chunk math: a stage's forward on one microbatch (inputs from the batch, the
parameters or what earlier stages sent; the loss on the last stage), its backward (B, or the
I and W halves of a split backward), in the training precision. A part of `RankExecutor`
(`runtime.execute.executor`), which owns the state these methods read."""

from __future__ import annotations

from contextlib import ExitStack, nullcontext
from typing import Any

import torch

from piper.dag import Kind
from runtime.execute.memory import SavedTensors
from runtime.execute.step_state import Saved, StepState, accumulate
from runtime.execute.weight_grad import WeightGradStore, collecting, shared_casts
from runtime.execute.zero import ShardedStage, storage_key
from runtime.lowering.plan import Task
from runtime.train.data import slice_tree


class ChunkMath:
    """Forward, backward and weight-gradient passes of one chunk task."""

    def autocast(self) -> Any:
        """bf16-mixed: the stage's math in bf16 as `torch.autocast` casts it."""
        if self.train.precision != "bf16-mixed":
            return nullcontext()
        return torch.autocast(self.device.type, dtype=torch.bfloat16)

    def step_casts(self) -> Any:
        """bf16-mixed: one bf16 cast of each fp32 parameter per step, shared by every
        microbatch's forward on this thread, instead of one per microbatch kept until its
        backward. Autocast's cast cache lives while any autocast region encloses the
        forwards (cleared when the outermost exits), so a disabled region around the
        thread's tasks keeps it for the step; `weight_matmul` shares its casts likewise.
        (ZeRO's flat buffers are bf16 already and are not cast at all.)"""
        if self.train.precision != "bf16-mixed":
            return nullcontext()
        stack = ExitStack()
        stack.enter_context(torch.autocast(self.device.type, enabled=False))
        stack.enter_context(shared_casts())
        return stack

    def _wire_dtype(self, dtype: torch.dtype) -> torch.dtype:
        """What a value travels between stages as: bf16 when training in bf16."""
        if self.train.precision == "fp32" or not dtype.is_floating_point:
            return dtype
        return self.train.compute_dtype

    def _wire(self, t: torch.Tensor) -> torch.Tensor:
        return t.to(self._wire_dtype(t.dtype))

    def _forward(self, task: Task, acts: dict[tuple[str, int], torch.Tensor]) -> Saved:
        sm = self.stages[task.stage]
        lo, hi = task.mb * self.mb_size, (task.mb + 1) * self.mb_size
        args: list[torch.Tensor] = []
        leaves: list[tuple[str, torch.Tensor]] = []
        shard = self.sharded.get(task.stage)
        views = shard.views() if shard is not None else []
        for (kind, key), fixed, slot in zip(sm.inputs, self.inputs[task.stage],
                                             self.slot[task.stage]):
            if shard is not None and slot >= 0:
                args.append(views[slot])
            elif fixed is not None:
                args.append(fixed)
            elif kind == "input":
                args.append(self.batch[key][lo:hi])  # type: ignore[index]
            else:
                x = acts[(key, task.mb)].detach()  # type: ignore[index]
                if x.is_floating_point():
                    x.requires_grad_(True)
                    leaves.append((key, x))  # type: ignore[arg-type]
                args.append(x)
        deferred = None
        if task.stage in self.split:  # ZeRO-3 frees the gathered buffer before W
            freed = shard is not None and shard.zero == 3
            deferred = WeightGradStore(shard.storages() if freed else ())
        # what a chunk keeps has the same size for every microbatch (static shapes): it is
        # counted once per stage, through saved-tensor hooks that cost ~1% of a chunk
        counted = self.activation_bytes.get(task.stage)
        kept = SavedTensors(exclude={storage_key(t) for (k, _), t in
                                     zip(sm.inputs, args) if k in ("param", "buffer")}
                            ) if counted is None else None
        counting = kept.counting if kept is not None else nullcontext
        ug = self.unit_gathers.get(task.stage)
        if ug is not None:
            ug.backward = False
        with collecting(deferred), counting(), self.autocast():
            outs = dict(zip(sm.outputs, sm.module(*args)))
        if shard is not None and shard.zero == 3:
            shard.free()  # reshard after every chunk; backward gathers again
        for name, t in outs.items():
            acts[(name, task.mb)] = t
        saved = Saved(leaves, outs, deferred=deferred, views=views)
        if sm.model_outputs:
            pred = sm.model_output(outs)
            tgt = slice_tree(self.targets, lo, hi)
            with counting(), self.autocast():  # the loss keeps a log-softmax
                saved.loss = self.loss_fn(pred, tgt) * self.loss_scale
        if kept is not None:
            counted = self.activation_bytes[task.stage] = kept.bytes_with(
                [*outs.values(), *(x for _, x in leaves)])
        saved.activation_bytes = counted
        return saved

    def _backward(self, task: Task, saved: Saved, st: StepState) -> None:
        """B, or with SplitBackward its halves. B and I walk the autograd graph once (and
        free it): input gradients and every weight gradient the stage module computes in
        place; on a split stage the matmuls against parameters leave their weight products
        to W, which multiplies what I kept (`runtime.execute.weight_grad`) without the graph or the
        parameters."""
        shard = self.sharded.get(task.stage)
        if task.kind is Kind.BWD_W:
            self._weight_pass(task, saved, shard)
            return
        roots, seeds = [], []
        if saved.loss is not None:
            roots.append(saved.loss)
            seeds.append(torch.ones_like(saved.loss))
        for name, t in saved.outputs.items():
            g = st.grads.pop((name, task.mb), None)
            if g is not None and t.requires_grad:
                roots.append(t)
                seeds.append(g.to(t.dtype))  # from the wire (bf16) to the value's own
        leaves = [x for _, x in saved.acts]
        weights = self.apart[task.stage] + (
            saved.views if shard is not None else self.params[task.stage])
        armed = (task.stage, task.mb) in self.arm_at
        if armed:  # the step's last backward of the stage: buckets start as they fill
            self.buckets[task.stage].arm()
        early = shard is not None and task.stage in self.early_rs
        if early:  # ZeRO-2/3 units: each reduce-scatter starts once its gradient is final
            shard.arm(saved.views)
        ug = self.unit_gathers.get(task.stage)
        done = ug.free_when_done(saved.views) if ug is not None else []
        if ug is not None:
            ug.backward = True  # brackets a recompute re-runs gather and never free
        if roots and leaves + weights:
            # backward(inputs=...) accumulates into .grad in place, as eager training does
            torch.autograd.backward(roots, seeds, inputs=leaves + weights)
        for h in done:
            h.remove()
        if armed:
            self.buckets[task.stage].disarm()
        if early:
            shard.disarm()
        for name, x in saved.acts:
            g = torch.zeros_like(x) if x.grad is None else x.grad
            x.grad = None
            accumulate(st, (name, task.mb), g)
        saved.acts, saved.outputs, saved.loss = [], {}, None  # the graph is gone
        saved.activation_bytes = 0
        if shard is not None:
            gs, saved.views = shard.take_grads(saved.views), []
            if task.kind is Kind.BWD_I:
                saved.flat_grad = gs  # W adds its products, then hands them over
            else:
                shard.add_grad(task.mb, gs)
            if shard.zero == 3:
                shard.free()

    def _weight_pass(self, task: Task, saved: Saved, shard: ShardedStage | None) -> None:
        """W: the weight products I deferred, summed where autograd would have put them —
        a parameter's `.grad`, or its part of the microbatch's flat gradient under ZeRO."""
        slot, fixed = self.slot[task.stage], self.inputs[task.stage]

        def grad_of(key: int) -> torch.Tensor | None:
            if shard is not None and slot[key] >= 0:
                return shard.grad_view(saved.flat_grad, slot[key])  # type: ignore[arg-type]
            return fixed[key].grad  # type: ignore[union-attr]

        def set_grad(key: int, g: torch.Tensor) -> None:
            fixed[key].grad = g.to(fixed[key].dtype)  # type: ignore[union-attr]

        if saved.deferred is not None:
            with torch.no_grad():
                saved.deferred.add_to(grad_of, set_grad)
        if shard is not None:
            gs, saved.flat_grad = saved.flat_grad, None
            shard.add_grad(task.mb, shard.zero_grads() if gs is None else gs)
