"""Execute one rank's share of a Plan for real: stage forward/backward, P2P, all-reduce, update.

This is the body of a worker process (`runtime.cluster.worker` wraps it in a Ray actor). Process
groups must already be initialised; everything it sends or receives is a real
`torch.distributed` call.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping
from contextlib import nullcontext
from typing import Any

import torch
import torch.distributed as dist

from piper.capture import Captured
from piper.collectives import set_wire_dtype
from piper.context_parallel import local_tokens, sequence_of
from piper.dag import Kind
from piper.lanes import ComputeToken, computing, lane
from piper.model_file import ModelSpec
from piper.moe import expert_params
from runtime.execute.buckets import early_reduce_scatters, reduce_grads, stage_buckets
from runtime.execute.chunk_math import ChunkMath
from runtime.execute.evaluation import forward_order
from runtime.execute.holdings import holdings
from runtime.execute.memory import MemoryLedger
from runtime.execute.rank_checkpoint import Checkpointing
from runtime.execute.rank_stages import align, deferring, full_model_names, rank_model, renamed
from runtime.execute.recompute import recomputing
from runtime.execute.stage_module import StageModule, build_stage
from runtime.execute.step_state import StepOutcome, StepState, accumulate, to_device
from runtime.execute.streams import DeviceStreams
from runtime.execute.task_lanes import lookahead_receives, pair_units
from runtime.execute.unit_gather import UnitGathers, bracketed, unit_gathers
from runtime.execute.zero import ShardedStage
from runtime.lowering.plan import COMPUTE_STREAM, PAIR_STREAM, Plan, RankPlan, Task
from runtime.train.data import BatchSource
from runtime.train.layout import Slicing
from runtime.train.training import TrainConfig, make_optimizer
from runtime.train.updates import Updater


class RankExecutor(ChunkMath, Checkpointing):
    """State of one rank across steps: its stage modules, parameters and optimizers."""

    report: Callable[[str, str], None] | None = None  # told (stream, task) before each task

    def __init__(self, plan: Plan, rank: int, spec: ModelSpec, captured: Captured,
                 batch_size: int, seed: int, device: torch.device,
                 groups: dict[tuple[int, ...], Any], train: TrainConfig | None = None,
                 done: int = 0) -> None:
        """`done`: steps trained before (a resumed run: the schedule and data go on)."""
        train = train or TrainConfig()
        self.train = train
        # bf16 training: TP/EP collectives inside chunks carry bf16
        set_wire_dtype(None if train.precision == "fp32" else train.compute_dtype)
        self.plan = plan
        self.rank = rank
        self.mesh = plan.mesh
        # the process's place among its logical rank's: context- and tensor-parallel index
        logical, self.inner = self.mesh.split(rank)
        self.cp_rank, self.tp_rank = divmod(self.inner, self.mesh.tp)
        self.rp: RankPlan = plan.ranks[logical]
        self.device = device
        self.groups = groups
        self.spec = spec
        # the capture's loss: the model file's, or its cross-entropy on this rank's slice of
        # vocabulary-parallel logits (`piper.loss_parallel`)
        self.loss_fn = captured.loss or spec.loss_fn
        sh = plan.sharding
        rename = align(captured.graph, plan.model, rank, (sh.tp if sh.sp else 1) * sh.cp)
        # what crosses stages, as this rank holds it (1/tp of the sequence with sp)
        self.shapes = {b: tuple(captured.graph.value(a).shape) for a, b in rename.items()}
        model = rank_model(spec, captured.graph, plan, self.rp, self.tp_rank, seed, device)
        if train.precision == "bf16":  # parameters, gradients and optimizer state in bf16
            model = model.to(torch.bfloat16)
        # with expert parallelism the experts follow their own data-parallel group
        experts = expert_params(sh.experts, dict(model.named_parameters())) if sh.ep > 1 \
            else set()
        self.expert_group = self.mesh.lift(self.mesh.expert_dp_group(logical), self.inner)
        params = dict(model.named_parameters(remove_duplicate=False))  # tied: every name
        canon = {id(p): n for n, p in model.named_parameters()}  # a tied weight: first name
        buffers = dict(model.named_buffers())
        self.stages: dict[int, StageModule] = {}
        self.params: dict[int, list[torch.nn.Parameter]] = {}
        self.inputs: dict[int, list[torch.Tensor | None]] = {}
        self.slot: dict[int, list[int]] = {}  # input position -> index into params[s] or -1
        self.optim: dict[int, torch.optim.Optimizer] = {}
        self.sharded: dict[int, ShardedStage] = {}
        self.unit_gathers: dict[int, UnitGathers] = {}  # ZeRO-3 stages in several units
        self.names: dict[Any, list[str]] = {}  # per optimizer: its parameters' model names
        names = plan.model.names
        # stages whose backward is split: their matmuls against parameters defer the weight
        # products from I to W (runtime.execute.weight_grad)
        self.split = {t.stage for t in self.rp.tasks if t.kind is Kind.BWD_I}
        tied = {p for ps, stages in plan.ties for p in ps if set(stages) & set(self.rp.stages)}
        # a tied weight's copy that counts (norm, checkpoint): its group's first stage's
        self.tie_owner = {canon[id(params[p])] for ps, stages in plan.ties for p in ps
                          if stages[0] in self.rp.stages}
        # per stage: parameters whose gradients are summed apart from the stage's own (tied
        # ones across stages, experts over their expert group), so never ZeRO-sharded
        self.apart: dict[int, list[torch.nn.Parameter]] = {}
        self.tied_named = {p: params[p] for p in tied}
        for ps, stages in plan.ties:
            mine = [s for s in stages if s in self.rp.stages]
            if mine:  # the first of our stages in the group owns their optimizer step
                key = ("tied", mine[0])
                self.params.setdefault(key, []).extend(params[p] for p in ps)  # type: ignore
        for s in self.rp.stages:
            regions = {names.index(r) for r in plan.stage_regions[s]}
            sm = renamed(build_stage(captured, regions, device), rename)
            node_region: Mapping[str, int] = captured.node_region
            fixed: list[torch.Tensor | None] = []
            ps: list[torch.nn.Parameter] = []
            self.apart[s] = []
            for kind, key in sm.inputs:
                if kind == "param" and (key in tied or key in experts):
                    self.apart[s].append(params[key])  # type: ignore[index]
                    fixed.append(params[key])  # type: ignore[index]
                    if key in experts:
                        self.params.setdefault(("experts", s), []).append(  # type: ignore
                            params[key])  # type: ignore[index]
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
                            if kind == "param" and key not in tied | experts else -1
                            for kind, key in sm.inputs]
            self.inputs[s] = fixed
            if self.params[s] and plan.zero:
                first = self.rp.device * plan.dp
                ranks = self.mesh.dp_lift(tuple(range(first, first + plan.dp)), self.inner)
                cp = self.mesh.cp  # sharded over dp x cp, as the gradients are summed
                shard = self.sharded[s] = ShardedStage(
                    self.params[s], plan.zero, groups[ranks],
                    self.rp.replica * cp + self.cp_rank, plan.dp * cp,
                    plan.bucket_bytes, train.grad_reduce_dtype, train.compute_dtype)
                if unit_gathers(plan) and len(shard.units) > 1:  # FSDP: two units at most
                    sm, self.unit_gathers[s], inserted = bracketed(sm, {
                        i: shard.unit_of(k) for i, k in enumerate(self.slot[s]) if k >= 0},
                        captured.node_region)
                    self.unit_gathers[s].shard = shard
                    node_region = {**captured.node_region, **inserted}
                self.names[s] = [canon[id(p)] for p in self.params[s]]
                self.params[s] = []  # the full copies are released; the flat buffer rules
                self.inputs[s] = [None if k >= 0 else t for t, k in zip(fixed, self.slot[s])]
                self.optim[s] = make_optimizer(spec, shard.shards, train)
            elif self.params[s]:
                self.optim[s] = make_optimizer(spec, self.params[s], train)
            if s in self.split:
                sm = deferring(sm)
            if s in plan.recompute:  # keep less (by the policy), rebuild in backward
                sm = recomputing(sm, node_region, plan.recompute_policy)
            self.stages[s] = sm
        for key, ps in self.params.items():
            if isinstance(key, tuple):
                self.optim[key] = make_optimizer(spec, ps, train)  # type: ignore[index]
            if key not in self.sharded:
                self.names[key] = [canon[id(p)] for p in ps]
        self.slicing = Slicing(sh, *full_model_names(spec), self.tp_rank,
                               sh.ep_rank(self.rp.replica, self.tp_rank))
        self.held = holdings(self.optim, self.names, self.params, self.sharded, self.slicing,
                             self._owner)
        self.buffers = {n: b for n, b in model.named_buffers()
                        if n in set(model.state_dict())}  # persistent ones, for checkpoints
        del model  # parameters not on this rank are released here
        self.buckets, self.arm_at = stage_buckets(
            plan, self.rp.tasks, self.rp.stream(COMPUTE_STREAM), self.params,
            lambda t: groups[self.mesh.dp_lift(t.group, self.inner)], train.grad_reduce_dtype)
        self.early_rs = early_reduce_scatters(plan)
        self.source = BatchSource(spec, batch_size, seed, train.data, train.data_dtype)
        self.eval_source: BatchSource | None = None  # built at the first evaluation
        self.batch_size, self.seed = batch_size, seed
        per_replica = batch_size // plan.dp
        self.mb_size = per_replica // plan.microbatches
        self.rows = (self.rp.replica * per_replica, (self.rp.replica + 1) * per_replica)
        self.step_index = done
        # each replica's and context-parallel rank's loss is a mean over its own tokens
        self.loss_scale = 1.0 / (plan.dp * self.mesh.cp * plan.microbatches)
        self.ledger = MemoryLedger(device)
        self.activation_bytes: dict[int, int] = {}  # per stage: what one chunk keeps
        self.streams = DeviceStreams(device, [n for n, _ in self.rp.streams], COMPUTE_STREAM)
        self.updater = Updater(self.optim, self.held, train, device, done,
                               keep=self.streams.keep)
        self.scheduled_lr = self.updater.lr
        # CPU: the lanes of overlapped pairs take turns computing (threads would only
        # compete for the rank's cores); communication of one overlaps the other's math
        paired = any(name == PAIR_STREAM for name, _ in self.rp.streams)
        self.token = ComputeToken() if paired and device.type == "cpu" else None
        self.units = pair_units(self.rp)
        self.next_recvs = lookahead_receives(self.rp)

    # ---- one step -----------------------------------------------------------------------
    def step(self) -> StepOutcome:
        """One training step: each logical stream of this rank in its own thread (the
        compute stream in this one), synchronised by one event per task."""
        inputs, targets = self._own_tokens(self.source.rows(self.step_index, *self.rows))
        self.batch = tuple(t.to(self.device) for t in inputs)
        self.targets = to_device(targets, self.device)
        st = StepState({t.name: threading.Event() for t in self.rp.tasks})
        self.ledger.start_step()
        self.streams.start_step()
        if self.token is not None:
            self.token.reset()
        dist.barrier()  # every rank starts the step together, so step times are comparable
        st.t0 = time.perf_counter()
        others = [threading.Thread(target=self._run_stream, args=(name, ts, st),
                                   daemon=True)
                  for name, ts in self.rp.streams if name != COMPUTE_STREAM]
        for th in others:
            th.start()
        try:
            self._run_stream(COMPUTE_STREAM, self.rp.stream(COMPUTE_STREAM), st)
        finally:
            if self.token is not None:
                self.token.wake()
            for th in others:
                th.join()
        if st.error is not None:
            raise st.error
        for work, _ in st.pending:
            work.wait()
        grad_norm = self.updater.finish()
        for stage in st.gathers:
            self.sharded[stage].materialize()
        lr = self.scheduled_lr
        self.scheduled_lr = self.updater.lr
        self.step_index += 1
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        elapsed = time.perf_counter() - st.t0
        # tensor-parallel ranks compute the same loss: one of them reports it
        has_loss = self.plan.output_stage in self.rp.stages and self.tp_rank == 0
        return StepOutcome(st.loss_sum if has_loss else None, elapsed, self.ledger.peak(),
                           self.ledger.model_state_peak(), st.spans, grad_norm, lr)

    def evaluate(self, batches: int) -> float | None:
        """The mean loss of the first `batches` global batches of the evaluation data,
        through this strategy's forwards alone (`runtime.execute.evaluation`); None on a rank
        without the loss (summed over ranks, as a step's)."""
        if self.eval_source is None:
            self.eval_source = BatchSource(self.spec, self.batch_size, self.seed,
                                           self.train.eval_data, self.train.data_dtype,
                                           shuffle=False, flag="--eval-data")
        order = forward_order(self.rp)
        total = 0.0
        with torch.no_grad(), self.streams.on(COMPUTE_STREAM), lane(0):
            for b in range(batches):
                inputs, targets = self._own_tokens(self.eval_source.rows(b, *self.rows))
                self.batch = tuple(t.to(self.device) for t in inputs)
                self.targets = to_device(targets, self.device)
                st = StepState({})
                for task in order:
                    self._run_task(task, st)
                    if task.kind is Kind.FWD:
                        st.saved.pop((task.stage, task.mb))
                for work, _ in st.pending:
                    work.wait()
                total += st.loss_sum
        has_loss = self.plan.output_stage in self.rp.stages and self.tp_rank == 0
        return total / batches if has_loss else None

    def _own_tokens(self, rows: Any) -> Any:
        """This rank's share of every sequence under context parallelism (head-tail)."""
        if self.mesh.cp == 1:
            return rows
        return local_tokens(rows, sequence_of(rows), self.cp_rank, self.mesh.cp)

    def _run_stream(self, stream: str, tasks: tuple[Task, ...], st: StepState) -> None:
        try:  # the pair lane's in-graph collectives have communicators of their own
            with (self.streams.on(stream), lane(1 if stream == PAIR_STREAM else 0),
                  self.step_casts()):
                self._issue(stream, tasks, st)
        except BaseException as e:  # noqa: BLE001 - handed to the step's caller
            st.error = st.error or e

    def _issue(self, stream: str, tasks: tuple[Task, ...], st: StepState) -> None:
        token = self.token
        if stream == PAIR_STREAM and token is not None:
            self._steal(st, token)
            return
        for i, task in enumerate(tasks):
            if not self._one(stream, i, task, st):
                return
            unit = self.units.get(task.name)
            if unit is not None and token is not None and token.claim(task.name):
                with lane(1):  # the pair's backward, right here: no hand-over between threads
                    for j, t in unit:
                        if not self._one(PAIR_STREAM, j, t, st, shown=COMPUTE_STREAM):
                            return

    def _steal(self, st: StepState, token: ComputeToken) -> None:
        """The pair lane on CPU: a pair's backward runs in its forward's thread, after it,
        unless the forward lane blocks on communication first; then this thread takes it,
        so that communication overlaps the backward's compute."""
        for forward, unit in self.units.items():
            while (mine := token.steal(forward, 0.05)) is None:
                if st.error is not None:
                    return
            if mine:
                for j, t in unit:
                    if not self._one(PAIR_STREAM, j, t, st):
                        return

    def _one(self, stream: str, i: int, task: Task, st: StepState, shown: str = "") -> bool:
        """Run task `i` of `stream` once its waits are over; False when the step failed.
        `shown`: the lane whose thread runs it, for the timeline (default `stream`)."""
        token = self.token
        # the forward lane, while it waits rather than computes, lets the pair lane go
        idle = token.idle if token is not None and stream == COMPUTE_STREAM else nullcontext
        waits = [st.events[n] for n in task.after if not st.events[n].is_set()]
        if waits:  # tasks of another stream this one depends on, not done yet
            with idle():
                for ev in waits:
                    while not ev.wait(0.05):
                        if st.error is not None:
                            return False
        if st.error is not None:
            return False
        self.streams.wait_for(task.after)
        ts = time.perf_counter()
        chunk = task.kind.is_chunk
        if chunk:
            # post the next chunks' receives now, so their inputs travel meanwhile
            for r in self.next_recvs[stream][i]:
                if r.tag not in st.posted:
                    st.posted[r.tag] = self._post_recv(r)
        if self.report is not None:
            self.report(stream, task.name)
        with computing(token) if chunk else (
                idle() if task.kind.is_collective else nullcontext()):
            self._run_task(task, st)
        st.spans.append((shown or stream, task, ts - st.t0, time.perf_counter() - st.t0))
        self.streams.finished(task.name)
        st.events[task.name].set()
        if stream in (COMPUTE_STREAM, PAIR_STREAM) and not task.kind.is_p2p:
            # runs chunks: the ledger looks (messages change no state it counts)
            grads = task.kind in (Kind.BWD, Kind.BWD_I, Kind.BWD_W, Kind.UPDATE,
                                  Kind.ALL_REDUCE)
            self.ledger.observe(self.params, self.optim, self.sharded, st.saved,
                                (-1 if task.values else task.stage) if grads else None,
                                task.kind is Kind.UPDATE)
        return True

    def _run_task(self, task: Task, st: StepState) -> None:
        acts, grads, saved = st.acts, st.grads, st.saved
        if task.kind is Kind.FWD:
            saved[(task.stage, task.mb)] = self._forward(task, acts)
            loss = saved[(task.stage, task.mb)].loss
            if loss is not None:
                st.loss_sum += float(loss.detach())
        elif task.kind in (Kind.BWD, Kind.BWD_I):
            sv = saved.pop((task.stage, task.mb))
            self._backward(task, sv, st)
            if task.kind is Kind.BWD_I:  # W needs what I deferred
                saved[(task.stage, task.mb, "W")] = sv
        elif task.kind is Kind.BWD_W:
            self._backward(task, saved.pop((task.stage, task.mb, "W")), st)
        elif task.kind is Kind.SEND:
            store = grads if task.grad else acts
            for k, v in enumerate(task.values):
                t = self._wire(store[(v, task.mb)].detach()).contiguous()
                peer = self.mesh.physical(task.peer, self.inner)
                link = self.groups[("p2p", self.rank, peer, task.grad)]
                st.pending.append((link.isend(t, peer, task.tag + k), t))
        elif task.kind is Kind.RECV:
            works = st.posted.pop(task.tag, None) or self._post_recv(task)
            for v, (work, buf) in zip(task.values, works):
                work.wait()
                key = (v, task.mb)
                if task.grad:  # a value several stages consume: gradients add up
                    accumulate(st, key, buf)
                else:
                    acts[key] = buf
        elif task.kind is Kind.ALL_REDUCE and task.values:
            self._all_reduce_tied(task)
        elif task.kind.is_collective and task.stage not in self.optim:
            pass  # a parameter-free stage: every replica skips alike
        elif task.kind is Kind.ALL_REDUCE:
            self._all_reduce(task)
        elif task.kind is Kind.ALL_GATHER and self.updater.waiting(task.stage):
            st.gathers.append(task.stage)  # gathers the step's update: after it (clipping)
        elif task.kind is Kind.ALL_GATHER:
            ug = self.unit_gathers.get(task.stage)  # FSDP: the unit the chunk reads first
            self.sharded[task.stage].materialize(
                None if ug is None else [ug.last if task.grad else ug.first])
        elif task.kind is Kind.REDUCE_SCATTER:
            sh = self.sharded[task.stage]
            self.streams.keep(sh.pending_grads())
            sh.reduce_scatter(task.mb)
        elif task.kind is Kind.UPDATE:
            if ("tied", task.stage) in self.optim:
                self.updater.ready(("tied", task.stage))
            if ("experts", task.stage) in self.optim:
                if len(self.expert_group) > 1:
                    self._reduce(self.params[("experts", task.stage)], self.expert_group,
                                 lifted=True)
                self.updater.ready(("experts", task.stage))
            if task.stage in self.optim:
                if task.stage in self.sharded:
                    self.streams.keep(self.sharded[task.stage].grad_shards())
                    self.sharded[task.stage].attach_grads()
                self.updater.ready(task.stage)

    def _post_recv(self, task: Task) -> list[tuple[Any, torch.Tensor]]:
        out = []
        for k, v in enumerate(task.values):
            info = self.plan.model.value(v)
            buf = torch.empty(self.shapes.get(v, info.shape), device=self.device,
                              dtype=self._wire_dtype(getattr(torch, info.dtype)))
            peer = self.mesh.physical(task.peer, self.inner)
            link = self.groups[("p2p", peer, self.rank, task.grad)]
            out.append((link.irecv(buf, peer, task.tag + k), buf))
        return out

    def _all_reduce_tied(self, task: Task) -> None:
        """Sum the gradients of tied parameters over every copy (stages x replicas)."""
        self._reduce([self.tied_named[n] for n in task.values], task.group)

    def _all_reduce(self, task: Task) -> None:
        buckets = self.buckets.get(task.stage)
        if buckets is None:
            self._reduce(self.params[task.stage], task.group)
            return
        self.streams.keep(p.grad for p in self.params[task.stage] if p.grad is not None)
        self.streams.keep(buckets.finish())

    def _reduce(self, params: list[torch.nn.Parameter], group: tuple[int, ...],
                lifted: bool = False) -> None:
        """Sum gradients over `group` (logical ranks unless `lifted` to processes already)."""
        ranks = group if lifted else self.mesh.dp_lift(group, self.inner)
        # the gradients backward made on the compute stream live until this use ends
        self.streams.keep(reduce_grads(params, self.groups[ranks], self.train.grad_reduce_dtype))
