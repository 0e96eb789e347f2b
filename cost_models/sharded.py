"""Costs of tensor and expert parallelism: the collectives inside chunks.

With `ShardTensor` / `Shard` a chunk's math is the rank's slice (costed from a capture of the
sharded model, whose matmuls have local shapes), and the chunk also waits for the in-graph
collectives of `piper.collectives`: Megatron's g all-reduces the activation in forward, f
all-reduces its gradient in backward, and expert all-to-alls run in both directions. Those
are synchronous inside the chunk, so their time adds to its forward or backward (a
recomputed stage's backward runs its forward's collectives again).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch.utils._pytree as pytree

from cost_models import comm
from cost_models.analytical import ModelCosts
from cost_models.attention import CAUSAL_WORK, attention_seconds
from cost_models.cluster import ClusterSpec
from cost_models.piper_ops import context_attention_flops
from cost_models.task_costs import TaskCosts
from piper.capture import Captured
from piper.loss_parallel import VocabParallelLoss
from piper.moe import routed_shapes
from runtime.execute.regather import is_sequence_gather, regathering_users
from runtime.lowering.plan import Plan


@dataclass(frozen=True)
class InGraphComm:
    """Per region: bytes (at the capture batch) of each in-graph collective, by direction."""

    forward_all_reduce: tuple[tuple[int, ...], ...]
    backward_all_reduce: tuple[tuple[int, ...], ...]
    all_to_all: tuple[tuple[int, ...], ...]
    """Expert parallelism (`piper.moe`): the routed rows' exchanges (and the row counts
    before them), each run once forward and once backward."""
    forward_all_gather: tuple[tuple[int, ...], ...] = ()
    """Gathered output bytes (a vocabulary-parallel output layer); backward keeps a slice."""
    sequence_scatter: tuple[tuple[int, ...], ...] = ()
    """Sequence parallelism: whole tensors reduce-scattered forward, gathered backward."""
    sequence_gather: tuple[tuple[int, ...], ...] = ()
    """Sequence parallelism: gathered tensors forward, reduce-scattered backward."""
    sequence_regather: tuple[tuple[int, ...], ...] = ()
    """Sequence parallelism: gathered again in backward by a linear that kept only its
    slice (`runtime.execute.regather`, Megatron's)."""
    sequence_split: tuple[tuple[int, ...], ...] = ()
    """Sequence parallelism entered from replicated code (`piper.collectives.sp_split`):
    split for free forward, the whole gradient gathered backward."""
    context_kv: tuple[tuple[int, ...], ...] = ()
    """Context parallelism: per attention, the bytes of the rank's own key and value blocks
    (what each ring hop sends, what an all-gather collects from each rank)."""
    context_acc: tuple[tuple[int, ...], ...] = ()
    """The same blocks' gradient accumulators (fp32 in any precision, as the runtime
    sums them)."""
    context_flops: tuple[tuple[float, ...], ...] = ()
    """The same attentions' forward FLOPs, times the causal work share: the compute a
    ring hop hides behind."""
    context_keys: tuple[tuple[int, ...], ...] = ()
    """The same attentions' keys per ring step (the rank's own tokens): the length its
    kernels run at (`ClusterSpec.attention_curve`)."""
    low_precision: bool = False  # attention runs in 16-bit (bf16 training)

    def in_precision(self, costs: ModelCosts) -> InGraphComm:
        """These collectives' bytes when training in `costs.precision`: bf16 training
        sends the (fp32-captured) tensors in bf16 (`piper.collectives.set_wire_dtype`)."""
        if not costs.wire_element_size:
            return self

        def scaled(t: tuple[tuple[int, ...], ...]) -> tuple[tuple[int, ...], ...]:
            return tuple(tuple(b * costs.wire_element_size // 4 for b in r) for r in t)

        return InGraphComm(scaled(self.forward_all_reduce), scaled(self.backward_all_reduce),
                           scaled(self.all_to_all), scaled(self.forward_all_gather),
                           scaled(self.sequence_scatter), scaled(self.sequence_gather),
                           scaled(self.sequence_regather), scaled(self.sequence_split),
                           scaled(self.context_kv), self.context_acc, self.context_flops,
                           self.context_keys, True)


def in_graph_comm(captured: Captured) -> InGraphComm:
    n = len(captured.graph.regions)
    fwd: list[list[int]] = [[] for _ in range(n)]
    bwd: list[list[int]] = [[] for _ in range(n)]
    a2a: list[list[int]] = [[] for _ in range(n)]
    gather: list[list[int]] = [[] for _ in range(n)]
    scatter: list[list[int]] = [[] for _ in range(n)]
    sp_gathers: list[list[int]] = [[] for _ in range(n)]
    regathers: list[list[int]] = [[] for _ in range(n)]
    splits: list[list[int]] = [[] for _ in range(n)]
    # leaving sequence parallelism for replicated code gathers as a vocabulary-parallel
    # output layer does (forward, a slice backward)
    into = {"tp_reduce": fwd, "tp_copy": bwd, "tp_gather": gather,
            "sp_scatter": scatter, "sp_gather": sp_gathers, "sp_gather_whole": gather,
            "sp_split": splits, "tp_split": splits}
    kv: list[list[int]] = [[] for _ in range(n)]
    acc: list[list[int]] = [[] for _ in range(n)]
    keys: list[list[int]] = [[] for _ in range(n)]
    flops: list[list[float]] = [[] for _ in range(n)]
    for node in captured.program.graph.nodes:
        routed = routed_shapes(node) if node.op == "call_function" else None
        if routed is not None and routed.ep > 1:  # dropless experts over an EP group
            t, k, d, local, ep = routed.tokens, routed.k, routed.dim, routed.local, routed.ep
            size = node.args[0].meta["val"].element_size()  # type: ignore[union-attr]
            region = captured.node_region[node.name]
            # the per-expert row counts, then the routed rows there and back
            a2a[region] += [8 * local * ep, size * t * k * d, size * t * k * d]
            continue
        if node.op == "call_function" and getattr(node.target, "_piper_cp", False):
            region = captured.node_region[node.name]
            k, v = (node.args[i].meta["val"] for i in (1, 2))  # type: ignore[union-attr]
            kv[region].append(k.numel() * k.element_size() + v.numel() * v.element_size())
            acc[region].append(4 * (k.numel() + v.numel()))
            flops[region].append(context_attention_flops(node)
                                 * (CAUSAL_WORK if node.args[4] else 1.0))
            keys[region].append(int(k.shape[-2]))
            continue
        op = getattr(node.target, "_schema", None)
        if node.op != "call_function" or op is None or not op.name.startswith("piper::"):
            continue
        name = op.name.removeprefix("piper::")
        val = node.meta["val"]
        if name in ("sp_scatter", "sp_split", "tp_split"):  # the whole tensor is what moves
            val = node.args[0].meta["val"]
        region, nbytes = captured.node_region[node.name], val.numel() * val.element_size()
        into[name][region].append(nbytes)
        if is_sequence_gather(node) and regathering_users(node):  # one for its linears
            regathers[region].append(nbytes)
    if isinstance(captured.loss, VocabParallelLoss):  # the row max, sum of exponentials and
        # the target's logit, one fp32 number per token each, all-reduced after the output
        out = next(x for x in captured.program.graph.nodes if x.op == "output")
        leaf = pytree.tree_leaves(out.args[0])[captured.loss.ce.logits]
        val = leaf.meta["val"]
        fwd[captured.node_region[leaf.name]] += [4 * (val.numel() // val.shape[-1])] * 3
    # sequence parallelism: a gather forward is a reduce-scatter backward and vice versa
    return InGraphComm(*(tuple(tuple(r) for r in lists)
                         for lists in (fwd, bwd, a2a, gather, scatter, sp_gathers, regathers,
                                       splits, kv, acc, flops, keys)))


def context_seconds(traffic: InGraphComm, regions: list[int], plan: Plan,
                    cluster: ClusterSpec, scale: float) -> tuple[float, float]:
    """(forward, backward) seconds context-parallel attention adds to a chunk of `regions`,
    as `piper.context_parallel` runs it.

    ring: cp - 1 hops of the key/value block, each started before the block in hand is
    computed, so a hop shows only past that block's 1/cp of the attention; backward sends
    the blocks again and their gradient accumulators (fp32) behind the next block's math,
    plus a last hop home. all_gather: one all-gather of the blocks forward, one
    reduce-scatter of their gradients backward, in line (Llama 3's form)."""
    cp = plan.sharding.cp
    if cp <= 1 or not traffic.context_kv:
        return 0.0, 0.0
    group = plan.mesh.cp_group(0)
    fwd = bwd = 0.0
    for r in regions:
        for kv, acc, flops, keys in zip(traffic.context_kv[r], traffic.context_acc[r],
                                        traffic.context_flops[r], traffic.context_keys[r],
                                        strict=True):
            kv, acc = kv * scale, acc * scale
            if plan.sharding.cp_mode == "all_gather":
                fwd += comm.collective_time(comm.ALL_GATHER, kv * cp, group, cluster)
                bwd += comm.collective_time(comm.REDUCE_SCATTER, acc * cp, group, cluster)
                continue
            # a step's kernel: an unmasked block over the rank's keys (`cost_models.attention`)
            block, back = (t / cp for t in attention_seconds(
                cluster, flops * scale, 1.0, (keys, 1), 0, traffic.low_precision))
            hop = max(comm.p2p_message_time(cluster, a, b, kv)
                      for a, b in zip(group, group[1:] + group[:1]))
            home = max(comm.p2p_message_time(cluster, a, b, acc)
                       for a, b in zip(group, group[1:] + group[:1]))
            fwd += (cp - 1) * max(0.0, hop - block)
            bwd += (cp - 1) * (max(0.0, hop - back) + max(0.0, home - back)) + home
    return fwd, bwd


def all_to_all_time(nbytes: float, group: tuple[int, ...], cluster: ClusterSpec) -> float:
    """`all_to_all_single` of `nbytes` per rank over `group`: each rank keeps 1/p and sends
    n/p to every other rank, all at once (NCCL posts the sends and receives together).

    Peers on the rank's node are reached over NVLink at a collective's bus bandwidth,
    busbw = algbw (p-1)/p as nccl-tests define it for all-to-all (non-all-reduce
    collectives reach about 370 GB/s on NVLink4, the NCCL maintainers in nccl-tests#212;
    335-358 GB/s measured for all-to-all on 4 H100s, NVIDIA/nccl#2169): the measured curve
    where the cluster has one. Peers on other nodes are reached through the rank's own NIC
    (`inter_node_bandwidth` is per device: all-to-all does not aggregate NICs,
    nccl-tests#267) while the NVLink part runs: the slower of the two is the time."""
    p = len(group)
    if p <= 1:
        return 0.0
    nodes, per_node = comm.layout(cluster, group)
    # the exchange among node-mates is an all-to-all of their m/p share over m ranks
    inside = comm.in_node_time(comm.ALL_GATHER, nbytes * per_node / p, per_node, cluster)
    if nodes == 1:
        return inside
    outside = (cluster.inter_node_latency
               + (p - per_node) / p * nbytes / cluster.inter_node_bandwidth)
    return max(inside, outside)


def overlapped(comm_s: float, compute_s: float, contention: float) -> float:
    """What tensor-parallel collectives add to a chunk when they run beside its GEMMs
    (Megatron's --tp-comm-overlap, torchtitan's async TP): the part the chunk's math does
    not cover, plus the math slowed by `contention` while they run (Calculon)."""
    return max(0.0, comm_s - compute_s) + contention * min(comm_s, compute_s)


def with_expert_skew(tc: TaskCosts, plan: Plan, costs: ModelCosts, skew: float) -> TaskCosts:
    """`tc` as the busiest rank of each EP group runs it when a router sends that rank
    `skew` times the mean share of the routed rows (1: balanced, the default; a measured
    router's max/mean load otherwise): its experts' GEMMs, the `routed_flops` share of
    each chunk's math, take `skew` times as long. Step time is the busiest rank's: the
    all-to-alls wait for it."""
    if skew == 1.0 or plan.sharding.ep == 1 or not costs.routed_flops:
        return tc
    index = {r: i for i, r in enumerate(costs.regions)}

    def factor(regions: tuple[str, ...]) -> float:
        total = sum(costs.forward_flops[index[r]] for r in regions)
        routed = sum(costs.routed_flops[index[r]] for r in regions)
        return 1 + (skew - 1) * routed / total if total else 1.0

    f = [factor(regions) for regions in plan.stage_regions]
    return replace(tc, forward_s=tuple(x * k for x, k in zip(tc.forward_s, f)),
                   backward_s=tuple(x * k for x, k in zip(tc.backward_s, f)),
                   recompute_s=tuple(x * k for x, k in zip(tc.recompute_s, f)))


def with_in_graph_comm(tc: TaskCosts, plan: Plan, traffic: InGraphComm, cluster: ClusterSpec,
                       microbatch_size: int, tp_overlap: bool = False,
                       expert_skew: float = 1.0, ep_overlap: bool = False) -> TaskCosts:
    """`tc` with every chunk's in-graph collectives added, at `microbatch_size` samples.

    `tp_overlap`: the tensor-parallel ones are overlapped with the chunk's GEMMs
    (`overlapped`), as published Megatron and torchtitan runs did; piper's runtime runs
    them in line, so the planner prices them so (False). Expert all-to-alls stay in line,
    unless `ep_overlap` (Megatron's --overlap-moe-expert-parallel-comm, which pairs one
    microbatch's forward with another's backward): a forward's exchanges then run under
    the paired backward's math and a backward's under the forward's, adding only what
    that math does not cover. `expert_skew` (`with_expert_skew`): the busiest rank
    receives that many times the mean rows, and every rank waits for it."""
    mesh = plan.mesh
    tp_group, ep_group = mesh.tp_group(0), mesh.ep_processes(0, 0)
    scale = microbatch_size / plan.model.batch
    index = {r: i for i, r in enumerate(plan.model.names)}

    def seconds(lists: tuple[tuple[int, ...], ...], regions: tuple[str, ...], kind: str) -> float:
        sizes = [b * scale for r in regions for b in lists[index[r]]]
        if kind == "a2a":
            return sum(all_to_all_time(b, ep_group, cluster) for b in sizes)
        if kind == "ag":
            return sum(comm.collective_time(comm.ALL_GATHER, b, tp_group, cluster)
                       for b in sizes)
        if kind == "rs":
            return sum(comm.collective_time(comm.REDUCE_SCATTER, b, tp_group, cluster)
                       for b in sizes)
        return sum(comm.collective_time(comm.ALL_REDUCE, b, tp_group, cluster) for b in sizes)

    contention = comm.contention(cluster, tp_group)
    ep_contention = comm.contention(cluster, ep_group)
    fwd, bwd, again = [], [], []
    for s, regions in enumerate(plan.stage_regions):
        a2a = seconds(traffic.all_to_all, regions, "a2a") * expert_skew
        forward = seconds(traffic.forward_all_reduce, regions, "ar")
        backward = seconds(traffic.backward_all_reduce, regions, "ar")
        if traffic.forward_all_gather:
            forward += seconds(traffic.forward_all_gather, regions, "ag")
        if traffic.sequence_scatter or traffic.sequence_gather:
            forward += (seconds(traffic.sequence_scatter, regions, "rs")
                        + seconds(traffic.sequence_gather, regions, "ag"))
            backward += (seconds(traffic.sequence_scatter, regions, "ag")
                         + seconds(traffic.sequence_gather, regions, "rs")
                         + seconds(traffic.sequence_regather, regions, "ag"))
        if traffic.sequence_split:
            backward += seconds(traffic.sequence_split, regions, "ag")
        if tp_overlap:
            forward = overlapped(forward, tc.forward_s[s], contention)
            backward = overlapped(backward, tc.backward_s[s], contention)
        cp_f, cp_b = context_seconds(traffic, [index[r] for r in regions], plan, cluster,
                                     scale)
        a2a_f = a2a_b = a2a
        if ep_overlap:
            a2a_f = overlapped(a2a, tc.backward_s[s], ep_contention)
            a2a_b = overlapped(a2a, tc.forward_s[s], ep_contention)
        forward, backward = forward + a2a_f + cp_f, backward + a2a_b + cp_b
        # a full recompute re-runs the forward's collectives inside the backward (a
        # selective one recomputes no collective)
        rebuilt = forward if s in plan.recompute and plan.recompute_policy == "full" else 0.0
        fwd.append(tc.forward_s[s] + forward)
        bwd.append(tc.backward_s[s] + backward + rebuilt)
        again.append((tc.recompute_s[s] if tc.recompute_s else 0.0) + rebuilt)
    return replace(tc, forward_s=tuple(fwd), backward_s=tuple(bwd),
                   recompute_s=tuple(again) if any(again) else ())
