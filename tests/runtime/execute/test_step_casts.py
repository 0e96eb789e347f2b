"""bf16-mixed keeps one bf16 cast of each fp32 weight per step, not one per microbatch in
flight: autocast's cache and `weight_matmul`'s casts live while `ChunkMath.step_casts`
encloses the forwards. Values and gradients are those of separate casts."""

from __future__ import annotations

from contextlib import nullcontext
from types import SimpleNamespace

import pytest
import torch

import piper
from piper.model_file import load_model_file
from runtime.execute.chunk_math import ChunkMath
from runtime.execute.stage_module import build_stage
from runtime.execute.weight_grad import defer_weight_grads
from tests.conftest import GPT


def _forwards(deferred: bool, shared: bool) -> tuple[list[torch.Tensor], int, int]:
    """Three microbatches' forwards of the tiny GPT's middle layers under bf16 autocast,
    then their backwards: (parameter gradients, distinct bf16 weight-sized storages kept,
    matmul weights)."""
    spec = load_model_file(GPT, (("size", "tiny"),))
    cap = piper.capture(spec, 3)  # 48 rows: no activation has a weight's shape
    torch.manual_seed(0)
    params = dict(spec.build().named_parameters())
    sm = build_stage(cap, {1, 2}, torch.device("cpu"))
    if deferred:  # the runtime's own matmul against parameters (split backward, SP)
        index = {i for i, (kind, _) in enumerate(sm.inputs) if kind == "param"}
        sm = type(sm)(defer_weight_grads(sm.module, index)[0], *list(vars(sm).values())[1:])
    args = [params[k] if kind == "param" else None for kind, k in sm.inputs]
    weights = {tuple(p.shape) for (kind, _), p in zip(sm.inputs, args) if kind == "param"
               and p.dim() == 2}
    kept: set[int] = set()

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.dtype == torch.bfloat16 and tuple(t.shape) in weights:
            kept.add(t.untyped_storage()._cdata)
        return t

    owner = SimpleNamespace(train=SimpleNamespace(precision="bf16-mixed"),
                            device=torch.device("cpu"))
    outs = []
    with ChunkMath.step_casts(owner) if shared else nullcontext():
        for mb in range(3):
            torch.manual_seed(mb)
            x = torch.randn(3, 16, 32, requires_grad=True)
            xs = [x if a is None else a for a in args]
            with (torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t),
                  torch.autocast("cpu", dtype=torch.bfloat16)):
                outs.append(sm.module(*xs)[0])
        for o in outs:
            o.float().pow(2).mean().backward()
    grads = [p.grad for (kind, _), p in zip(sm.inputs, args) if kind == "param"]
    return grads, len(kept), sum(1 for (kind, _), p in zip(sm.inputs, args)
                                 if kind == "param" and p.dim() == 2)


@pytest.mark.parametrize("deferred", [False, True], ids=["aten", "weight_matmul"])
def test_microbatches_share_one_cast_per_weight(deferred: bool) -> None:
    separate, kept_each, n = _forwards(deferred, shared=False)
    shared, kept_once, _ = _forwards(deferred, shared=True)
    assert kept_each == 3 * kept_once and 0 < kept_once <= n
    for a, b in zip(separate, shared, strict=True):
        torch.testing.assert_close(b, a, rtol=0, atol=0)
