"""Execute one rank's share of a Plan for real: stage forward/backward, P2P, all-reduce, update.

This is the body of a worker process (`runtime.worker` wraps it in a Ray actor). Process
groups must already be initialised; everything it sends or receives is a real
`torch.distributed` call.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from piper.capture import Captured
from piper.dag import Kind
from piper.model_file import ModelSpec
from runtime.memory import MemoryLedger
from runtime.plan import COMPUTE_STREAM, Plan, RankPlan, Task
from runtime.stage_module import StageModule, build_stage
from runtime.zero import ShardedStage


@dataclass
class _Saved:
    acts: list[tuple[str, torch.Tensor]]  # activation inputs (leaves) by value name
    outputs: dict[str, torch.Tensor]
    loss: torch.Tensor | None = None
    roots: list[torch.Tensor] = field(default_factory=list)  # backward from these...
    seeds: list[torch.Tensor] = field(default_factory=list)  # ...with these gradients


@dataclass
class _StepState:
    """What the streams of one step share (dict and list updates are atomic under the GIL)."""

    events: dict[str, threading.Event]
    acts: dict[tuple[str, int], torch.Tensor] = field(default_factory=dict)
    grads: dict[tuple[str, int], torch.Tensor] = field(default_factory=dict)
    saved: dict[tuple, _Saved] = field(default_factory=dict)
    pending: list[Any] = field(default_factory=list)  # (isend work, tensor kept alive)
    posted: dict[int, list[tuple[Any, torch.Tensor]]] = field(default_factory=dict)
    spans: list[tuple[str, Task, float, float]] = field(default_factory=list)  # stream, ...
    loss_sum: float = 0.0
    t0: float = 0.0
    error: BaseException | None = None


@dataclass
class StepOutcome:
    loss_sum: float | None  # sum of this rank's scaled microbatch losses (output stage only)
    time_s: float
    peak_memory_bytes: int
    model_state_bytes: int  # peak of parameters + gradients + optimizer state so far
    spans: list[tuple[str, Task, float, float]] = field(default_factory=list)  # stream, ...


class RankExecutor:
    """State of one rank across steps: its stage modules, parameters and optimizers."""

    def __init__(self, plan: Plan, rank: int, spec: ModelSpec, captured: Captured,
                 batch_size: int, seed: int, device: torch.device,
                 groups: dict[tuple[int, ...], Any]) -> None:
        self.plan = plan
        self.rp: RankPlan = plan.ranks[rank]
        self.device = device
        self.groups = groups
        self.spec = spec
        if captured.graph != plan.model:
            raise RuntimeError(f"rank {rank}: captured model differs from the plan's model")
        torch.manual_seed(seed)
        model = spec.build().to(device)
        params = dict(model.named_parameters(remove_duplicate=False))  # tied: every name
        buffers = dict(model.named_buffers())
        self.stages: dict[int, StageModule] = {}
        self.params: dict[int, list[torch.nn.Parameter]] = {}
        self.inputs: dict[int, list[torch.Tensor | None]] = {}
        self.slot: dict[int, list[int]] = {}  # input position -> index into params[s] or -1
        self.optim: dict[int, torch.optim.Optimizer] = {}
        self.sharded: dict[int, ShardedStage] = {}
        names = plan.model.names
        tied = {p for ps, stages in plan.ties for p in ps if set(stages) & set(self.rp.stages)}
        self.tied_in: dict[int, list[torch.nn.Parameter]] = {}
        self.tied_named = {p: params[p] for p in tied}
        for ps, stages in plan.ties:
            mine = [s for s in stages if s in self.rp.stages]
            if mine:  # the first of our stages in the group owns their optimizer step
                key = ("tied", mine[0])
                self.params.setdefault(key, []).extend(params[p] for p in ps)  # type: ignore
        for s in self.rp.stages:
            regions = {names.index(r) for r in plan.stage_regions[s]}
            sm = build_stage(captured, regions, device)
            self.stages[s] = sm
            fixed: list[torch.Tensor | None] = []
            ps: list[torch.nn.Parameter] = []
            self.tied_in[s] = []
            for kind, key in sm.inputs:
                if kind == "param" and key in tied:
                    self.tied_in[s].append(params[key])  # type: ignore[index]
                    fixed.append(params[key])  # type: ignore[index]
                elif kind == "param":
                    ps.append(params[key])  # type: ignore[index]
                    fixed.append(params[key])  # type: ignore[index]
                elif kind == "buffer":
                    fixed.append(buffers[key])  # type: ignore[index]
                else:
                    fixed.append(None)
            self.params[s] = list(dict.fromkeys(ps))  # a param used twice is updated once
            index = {id(p): i for i, p in enumerate(self.params[s])}
            self.slot[s] = [index[id(params[key])]  # type: ignore[index]
                            if kind == "param" and key not in tied else -1
                            for kind, key in sm.inputs]
            self.inputs[s] = fixed
            if not self.params[s]:
                continue  # nothing to update (or communicate) for a parameter-free stage
            if plan.zero:
                first = self.rp.device * plan.dp
                ranks = tuple(range(first, first + plan.dp))
                self.sharded[s] = ShardedStage(self.params[s], plan.zero, groups[ranks],
                                               rank - first, plan.dp)
                self.params[s] = []  # the full copies are released; the flat buffer rules
                self.optim[s] = spec.make_optimizer([self.sharded[s].shard])
            else:
                self.optim[s] = spec.make_optimizer(self.params[s])
        for key, ps in self.params.items():
            if isinstance(key, tuple):
                self.optim[key] = spec.make_optimizer(ps)  # type: ignore[index]
        del model  # parameters not on this rank are released here
        torch.manual_seed(seed)
        inputs, targets = spec.batch(batch_size)
        per_replica = batch_size // plan.dp
        self.mb_size = per_replica // plan.microbatches
        lo = self.rp.replica * per_replica
        self.batch = tuple(t[lo:lo + per_replica].to(device) for t in inputs)
        self.targets = _slice(targets, lo, lo + per_replica, device)
        self.loss_scale = 1.0 / (plan.dp * plan.microbatches)
        self.ledger = MemoryLedger(device)
        # for each chunk task: the receives that feed the next two chunks (lookahead)
        tasks = self.rp.stream(COMPUTE_STREAM)
        chunks = [i for i, t in enumerate(tasks) if t.kind.is_chunk]
        self.next_recvs: dict[int, list[Task]] = {}
        for a, b in zip(chunks, chunks[1:] + [len(tasks)]):
            nxt = next((c for c in chunks if c > b), len(tasks))
            self.next_recvs[a] = [t for t in tasks[a + 1:nxt] if t.kind is Kind.RECV]

    # ---- one step -----------------------------------------------------------------------
    def step(self) -> StepOutcome:
        """One training step: each logical stream of this rank in its own thread (the
        compute stream in this one), synchronised by one event per task."""
        st = _StepState({t.name: threading.Event() for t in self.rp.tasks})
        self.ledger.start_step()
        dist.barrier()  # every rank starts the step together, so step times are comparable
        st.t0 = time.perf_counter()
        others = [threading.Thread(target=self._run_stream, args=(name, ts, st, False),
                                   daemon=True)
                  for name, ts in self.rp.streams if name != COMPUTE_STREAM]
        for th in others:
            th.start()
        try:
            self._run_stream(COMPUTE_STREAM, self.rp.stream(COMPUTE_STREAM), st, True)
        finally:
            for th in others:
                th.join()
        if st.error is not None:
            raise st.error
        for work, _ in st.pending:
            work.wait()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        elapsed = time.perf_counter() - st.t0
        has_loss = self.plan.output_stage in self.rp.stages
        return StepOutcome(st.loss_sum if has_loss else None, elapsed, self.ledger.peak(),
                           self.ledger.model_state_peak(), st.spans)

    def _run_stream(self, stream: str, tasks: tuple[Task, ...], st: _StepState,
                    compute: bool) -> None:
        try:
            for i, task in enumerate(tasks):
                for name in task.after:  # a task of another stream this one depends on
                    while not st.events[name].wait(0.05):
                        if st.error is not None:
                            return
                if st.error is not None:
                    return
                ts = time.perf_counter()
                if compute and task.kind.is_chunk:
                    # post the next chunks' receives now, so their inputs travel meanwhile
                    for r in self.next_recvs[i]:
                        if r.tag not in st.posted:
                            st.posted[r.tag] = self._post_recv(r)
                self._run_task(task, st)
                st.spans.append((stream, task, ts - st.t0, time.perf_counter() - st.t0))
                st.events[task.name].set()
                if compute:
                    self.ledger.observe(self.params, self.optim, self.sharded, st.saved)
        except BaseException as e:  # noqa: BLE001 - handed to the step's caller
            st.error = st.error or e

    def _run_task(self, task: Task, st: _StepState) -> None:
        acts, grads, saved = st.acts, st.grads, st.saved
        if task.kind is Kind.FWD:
            saved[(task.stage, task.mb)] = self._forward(task, acts)
            loss = saved[(task.stage, task.mb)].loss
            if loss is not None:
                st.loss_sum += float(loss.detach())
        elif task.kind in (Kind.BWD, Kind.BWD_I):
            sv = saved.pop((task.stage, task.mb))
            self._backward(task, sv, grads)
            if task.kind is Kind.BWD_I:  # W still needs the graph
                saved[(task.stage, task.mb, "W")] = sv
        elif task.kind is Kind.BWD_W:
            self._backward(task, saved.pop((task.stage, task.mb, "W")), grads)
        elif task.kind is Kind.SEND:
            store = grads if task.grad else acts
            for k, v in enumerate(task.values):
                t = store[(v, task.mb)].detach().contiguous()
                st.pending.append((dist.isend(t, dst=task.peer, tag=task.tag + k), t))
        elif task.kind is Kind.RECV:
            works = st.posted.pop(task.tag, None) or self._post_recv(task)
            for v, (work, buf) in zip(task.values, works):
                work.wait()
                key = (v, task.mb)
                if task.grad and key in grads:  # a value several stages consume
                    grads[key] = grads[key] + buf
                else:
                    (grads if task.grad else acts)[key] = buf
        elif task.kind is Kind.ALL_REDUCE and task.values:
            self._all_reduce_tied(task)
        elif task.kind.is_collective and task.stage not in self.optim:
            pass  # a parameter-free stage: every replica skips alike
        elif task.kind is Kind.ALL_REDUCE:
            self._all_reduce(task)
        elif task.kind is Kind.ALL_GATHER:
            self.sharded[task.stage].materialize()
        elif task.kind is Kind.REDUCE_SCATTER:
            self.sharded[task.stage].reduce_scatter(task.mb)
        elif task.kind is Kind.UPDATE:
            if ("tied", task.stage) in self.optim:
                self._step(("tied", task.stage))
            if task.stage in self.optim:
                self._update(task.stage)

    def _post_recv(self, task: Task) -> list[tuple[Any, torch.Tensor]]:
        out = []
        for k, v in enumerate(task.values):
            info = self.plan.model.value(v)
            buf = torch.empty(info.shape, dtype=getattr(torch, info.dtype), device=self.device)
            out.append((dist.irecv(buf, src=task.peer, tag=task.tag + k), buf))
        return out

    def _update(self, stage: int) -> None:
        if stage in self.sharded:
            self.sharded[stage].step(self.optim[stage])
        else:
            self._step(stage)

    def _step(self, key: Any) -> None:
        self.optim[key].step()
        self.optim[key].zero_grad(set_to_none=True)

    def _forward(self, task: Task, acts: dict[tuple[str, int], torch.Tensor]) -> _Saved:
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
        outs = dict(zip(sm.outputs, sm.module(*args)))
        del views
        if shard is not None and shard.zero == 3:
            shard.free()  # reshard after every chunk; backward gathers again
        for name, t in outs.items():
            acts[(name, task.mb)] = t
        saved = _Saved(leaves, outs)
        if sm.model_outputs:
            out = [outs[n] for n in sm.model_outputs]
            pred = out[0] if len(out) == 1 else tuple(out)
            tgt = _slice(self.targets, lo, hi, self.device)
            saved.loss = self.spec.loss_fn(pred, tgt) * self.loss_scale
        return saved

    def _backward(self, task: Task, saved: _Saved,
                  grads: dict[tuple[str, int], torch.Tensor]) -> None:
        """B, or with SplitBackward its halves: I (input gradients, keeping the autograd
        graph) and W (weight gradients from the same roots, freeing it)."""
        if task.kind is not Kind.BWD_W:
            saved.roots, saved.seeds = [], []
            if saved.loss is not None:
                saved.roots.append(saved.loss)
                saved.seeds.append(torch.ones_like(saved.loss))
            for name, t in saved.outputs.items():
                g = grads.pop((name, task.mb), None)
                if g is not None and t.requires_grad:
                    saved.roots.append(t)
                    saved.seeds.append(g)
        shard = self.sharded.get(task.stage)
        leaves = [x for _, x in saved.acts] if task.kind is not Kind.BWD_W else []
        weights: list[torch.Tensor] = []
        if task.kind is not Kind.BWD_I:
            weights = self.tied_in[task.stage] + (
                [shard.flat] if shard is not None else self.params[task.stage])
        if not leaves + weights or not saved.roots:
            return
        # backward(inputs=...) accumulates into .grad in place, as eager training does
        torch.autograd.backward(saved.roots, saved.seeds, inputs=leaves + weights,
                                retain_graph=task.kind is Kind.BWD_I)
        for name, x in saved.acts if leaves else ():
            g = torch.zeros_like(x) if x.grad is None else x.grad
            x.grad = None
            key = (name, task.mb)
            grads[key] = grads[key] + g if key in grads else g
        if shard is not None and task.kind is not Kind.BWD_I:
            g = shard.flat.grad
            shard.flat.grad = None
            shard.add_grad(task.mb, torch.zeros_like(shard.flat.data) if g is None else g)
            if shard.zero == 3:
                shard.free()

    def _all_reduce_tied(self, task: Task) -> None:
        """Sum the gradients of tied parameters over every copy (stages x replicas)."""
        self._reduce([self.tied_named[n] for n in task.values], task.group)

    def _all_reduce(self, task: Task) -> None:
        self._reduce(self.params[task.stage], task.group)

    def _reduce(self, params: list[torch.nn.Parameter], group: tuple[int, ...]) -> None:
        gs = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
        flat = _flatten_dense_tensors(gs)
        dist.all_reduce(flat, group=self.groups[group])
        for p, g in zip(params, _unflatten_dense_tensors(flat, gs)):
            p.grad = g


def _slice(x: Any, lo: int, hi: int, device: torch.device) -> Any:
    if isinstance(x, torch.Tensor):
        return x[lo:hi].to(device)
    if isinstance(x, (tuple, list)):
        return type(x)(_slice(t, lo, hi, device) for t in x)
    return x
