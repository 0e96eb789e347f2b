"""A rank's share of the model: its parameters (seeded, or read from saved weights) and
its stage modules, named as the Plan names them."""

from __future__ import annotations

from dataclasses import replace

import torch
from torch import nn

from piper.capture import ModelGraph
from piper.model_file import ModelSpec
from runtime.execute.stage_module import StageModule
from runtime.execute.weight_grad import defer_weight_grads
from runtime.lowering.plan import Plan, RankPlan
from runtime.train.weights import load_rank_model


def rank_model(spec: ModelSpec, graph: ModelGraph, plan: Plan, rp: RankPlan, tp_rank: int,
               seed: int, device: torch.device) -> nn.Module:
    """The model cut to this rank's tensor/expert-parallel slice: with saved weights, only
    the tensors of its own stages are read (the rest stay on meta); else the whole seeded
    model is built, as single-device training builds it, and the rest released later."""
    sh = plan.sharding
    if spec.weights:
        return load_rank_model(spec, device, sh, tp_rank, sh.ep_rank(rp.replica, tp_rank),
                               own_params(graph, plan, rp))
    torch.manual_seed(seed)
    model = spec.build().to(device)
    return sh.apply(model, tp_rank, sh.ep_rank(rp.replica, tp_rank))


def full_model_names(spec: ModelSpec) -> tuple[list[str], dict[str, tuple[int, ...]]]:
    """The whole model's module names and parameter shapes by name (a tied weight by its
    first name), built on meta: no memory."""
    with torch.device("meta"):
        model = spec.build()
    return ([n for n, _ in model.named_modules()],
            {n: tuple(p.shape) for n, p in model.named_parameters()})


def own_params(graph: ModelGraph, plan: Plan, rp: RankPlan) -> set[str]:
    """Names of the parameters this rank's stages use (tied ones included)."""
    mine = {r for s in rp.stages for r in plan.stage_regions[s]}
    index = {graph.names.index(r) for r in mine}
    return ({p for r in mine for p in graph.region(r).params}
            | {p for p, users in graph.tied if set(users) & index})


def align(got: ModelGraph, plan: ModelGraph, rank: int, sp: int = 1) -> dict[str, str]:
    """This rank's capture's value names -> the plan's. A tensor/expert-parallel capture
    has other parameter shapes and op names, but the same regions and the same tensors
    crossing between them, in the same order; with sequence (or context) parallelism over
    `sp` ranks those tensors may hold a 1/f share of the sequence (dim 1), f dividing sp."""
    same = (got.names, got.output_region, [(f.src, f.dst, len(f.values)) for f in got.flows]
            ) == (plan.names, plan.output_region,
                  [(f.src, f.dst, len(f.values)) for f in plan.flows])
    rename = {a: b for fa, fb in zip(got.flows, plan.flows) for a, b in zip(fa.values, fb.values)}

    def fits(mine: tuple[int, ...], whole: tuple[int, ...]) -> bool:
        # split by a factor of `sp`: sequence and context parallelism together split the
        # hidden states both ways, what only one of them splits (a Hugging Face decoder's
        # rotary tables under CP) one way
        return mine == whole or (sp > 1 and len(mine) >= 2 and len(mine) == len(whole)
                                 and mine[1] > 0 and whole[1] % mine[1] == 0
                                 and sp % (whole[1] // mine[1]) == 0
                                 and mine[:1] + mine[2:] == whole[:1] + whole[2:])

    if not same or any(not fits(tuple(got.value(a).shape), tuple(plan.value(b).shape))
                       for a, b in rename.items()):
        raise RuntimeError(f"rank {rank}: captured model differs from the plan's model (a "
                           "tensor-parallel plan must not split tensors that cross regions)")
    return rename


def renamed(sm: StageModule, rename: dict[str, str]) -> StageModule:
    """`sm` with its values named as the Plan names them (`align`)."""
    def name(v: str) -> str:
        return rename.get(v, v)

    return replace(sm, inputs=tuple((k, name(v)) if k == "act" else (k, v)  # type: ignore
                                    for k, v in sm.inputs),
                   outputs=tuple(map(name, sm.outputs)),
                   model_outputs=tuple(map(name, sm.model_outputs)),
                   out_leaves=tuple((k, name(x)) if k == "value" else (k, x)
                                    for k, x in sm.out_leaves))


def deferring(sm: StageModule) -> StageModule:
    """`sm` with its matmuls against parameters deferring their weight products to W."""
    params = {i for i, (kind, _) in enumerate(sm.inputs) if kind == "param"}
    return replace(sm, module=defer_weight_grads(sm.module, params)[0])
