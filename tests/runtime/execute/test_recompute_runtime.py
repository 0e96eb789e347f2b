"""Recompute in the runtime: a checkpointed stage module computes what the plain one does
(also with deferred weight gradients), keeps only its regions' inputs, and on real workers
the memory ledger's peak falls while the losses stay those of the plain plan."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

import piper
from cost_models.saved import saved_bytes
from piper import schedules
from piper.model_file import load_model_file
from runtime.cluster.launcher import run
from runtime.execute.memory import SavedTensors
from runtime.execute.recompute import recomputing
from runtime.execute.stage_module import StageModule, build_stage
from runtime.execute.weight_grad import WeightGradStore, collecting, defer_weight_grads
from runtime.execute.zero import storage_key
from runtime.lowering.lower import lower
from tests.conftest import GPT, ROOT

STAGES = [["embed", "layer.0", "layer.1"], ["layer.2", "layer.3", "head"]]


def _first_stage(model: str) -> tuple[piper.Captured, StageModule, list[torch.Tensor]]:
    """`model`'s tiny config, its first stage (embed, layer.0, layer.1) with real parameters
    and tokens."""
    spec = load_model_file(model, (("size", "tiny"),))
    cap = piper.capture(spec, 2)
    torch.manual_seed(0)
    params = dict(spec.build().named_parameters(remove_duplicate=False))
    inputs, _ = spec.batch(2)
    sm = build_stage(cap, {0, 1, 2}, torch.device("cpu"))
    args = [params[key] if kind == "param" else inputs[key] for kind, key in sm.inputs]
    return cap, sm, args


@pytest.fixture(scope="module")
def first_stage() -> tuple[piper.Captured, StageModule, list[torch.Tensor]]:
    """The tiny GPT's first stage."""
    return _first_stage(GPT)


def _step(sm: StageModule, args: list[torch.Tensor], deferred: bool
          ) -> tuple[int, list[torch.Tensor], dict[int, torch.Tensor]]:
    """Forward under the ledger's count, backward of a fixed loss, deferred products added:
    (bytes kept for backward, outputs, gradient per parameter input)."""
    params = {i for i, (kind, _) in enumerate(sm.inputs) if kind == "param"}
    for i in params:
        args[i].grad = None
    store = WeightGradStore() if deferred else None
    kept = SavedTensors(exclude={storage_key(args[i]) for i in params})
    with collecting(store), kept.counting():
        outs = list(sm.module(*args))
    held = kept.bytes_with(outs)
    sum(o.pow(2).mean() for o in outs).backward()
    grads = {i: args[i].grad.clone() for i in params if args[i].grad is not None}
    if store is not None:
        store.add_to(grads.get, grads.__setitem__)
    return held, outs, grads


@pytest.mark.parametrize("deferred", [False, True], ids=["B", "I+W"])
def test_checkpointed_stage_gives_the_same_outputs_and_gradients_keeping_less(
        first_stage, deferred: bool) -> None:
    cap, sm, args = first_stage
    if deferred:  # a split backward's stage: matmuls leave their weight products to W
        params = {i for i, (kind, _) in enumerate(sm.inputs) if kind == "param"}
        sm = replace(sm, module=defer_weight_grads(sm.module, params)[0])
    rc = recomputing(sm, cap.node_region)
    assert len(list(rc.module.children())) == 3, "one checkpoint per region"
    full, outs, grads = _step(sm, args, deferred)
    kept, outs_rc, grads_rc = _step(rc, args, deferred)
    assert all(torch.equal(a, b) for a, b in zip(outs, outs_rc, strict=True))
    assert grads.keys() == grads_rc.keys() and len(grads) == len(
        [k for k, _ in sm.inputs if k == "param"])
    for i, g in grads.items():
        torch.testing.assert_close(grads_rc[i], g, rtol=0, atol=0)
    # kept: the tokens, each region's input activation and the stage's output
    hidden = outs[0].numel() * outs[0].element_size()
    tokens = args[[k for k, _ in sm.inputs].index("input")]
    assert kept == tokens.untyped_storage().nbytes() + 3 * hidden
    assert kept < full / 5


def test_recompute_lowers_the_measured_activation_peak_of_the_same_plan(ray_session) -> None:
    spec = load_model_file(GPT, (("size", "tiny"),))
    plain = schedules.one_f_one_b(STAGES, microbatches=4)
    peaks, states, losses = [], [], []
    for prog in (plain, schedules.with_recompute(plain)):
        plan = lower(spec, prog, 2, 32)
        # two steps: the second starts with the optimizer state the first created, so its
        # peak is model state (the same for both) plus the activations
        result = run(spec, plan, batch_size=32, steps=2, seed=0)
        peaks.append(result.peak_memory_bytes)
        states.append(result.model_state_bytes)
        losses.append([s.loss for s in result.steps])
    assert states[0] == states[1], "recompute changes activations only"
    assert losses[0] == pytest.approx(losses[1], rel=1e-6)
    for rank, (without, with_) in enumerate(zip(*peaks, strict=True)):
        act_without, act_with = without - states[0][rank], with_ - states[1][rank]
        assert 0 < act_with < act_without / 2, (rank, act_with, act_without)


@pytest.fixture(scope="module")
def llama_stages() -> dict[str, tuple[piper.Captured, StageModule, list[torch.Tensor], object]]:
    """Per policy, a tiny Llama's first stage (embed, layer.0, layer.1: RMSNorm, rotary
    embeddings, SwiGLU) with real parameters and tokens, and the memory model's figures for
    it: `examples/llama.py` for `attention`; for `op`, the same model with norms written out
    op by op (the runtime fuses `rms_norm` and SwiGLU already, leaving `op` nothing there)."""
    out = {}
    for policy, model in (("attention", ROOT / "examples" / "llama.py"),
                          ("op", ROOT / "tests" / "models" / "hand_norm_llama.py")):
        cap, sm, args = _first_stage(str(model))
        out[policy] = (cap, sm, args, saved_bytes(cap))
    return out


@pytest.mark.parametrize("policy", ["attention", "op"])
@pytest.mark.parametrize("deferred", [False, True], ids=["B", "I+W"])
def test_selective_recompute_computes_the_same_and_keeps_what_the_memory_model_says(
        llama_stages, policy: str, deferred: bool) -> None:
    cap, sm, args, figures = llama_stages[policy]
    if deferred:
        params = {i for i, (kind, _) in enumerate(sm.inputs) if kind == "param"}
        sm = replace(sm, module=defer_weight_grads(sm.module, params)[0])
    rc = recomputing(sm, cap.node_region, policy)
    assert list(rc.module.children()), "some segments are checkpointed"
    full, outs, grads = _step(sm, args, deferred)
    kept, outs_rc, grads_rc = _step(rc, args, deferred)
    assert all(torch.equal(a, b) for a, b in zip(outs, outs_rc, strict=True))
    assert grads.keys() == grads_rc.keys()
    for i, g in grads.items():
        torch.testing.assert_close(grads_rc[i], g, rtol=0, atol=0)
    assert kept < full
    # the memory model measures the same rewrite region by region, on meta tensors
    stage = [cap.graph.names.index(r) for r in ("embed", "layer.0", "layer.1")]
    hidden = outs[0].numel() * outs[0].element_size()  # the stage's output, held to send
    plain = sum(figures.saved[i] for i in stage) + hidden
    predicted = sum(figures.selective[policy][i] for i in stage) + hidden
    assert full == pytest.approx(plain, rel=1e-3)  # a scalar or two aside
    assert kept == pytest.approx(predicted, rel=1e-3)
