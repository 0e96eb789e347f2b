"""Unmodified Hugging Face experts run as piper's routed experts: the same loss and gradients
as transformers' own eager experts (gated or not, transposed, biased, a gate of their own),
GEMMs over the routed rows alone, one routed node per layer in the capture; experts piper
cannot map keep the model's code and say why."""

from __future__ import annotations

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from piper.capture import capture
from piper.hf_experts import adopt_experts, experts_notes
from piper.moe import expert_modules, routed_shapes
from planner.cli import main
from tests.hf_models import FAMILIES, MORE_FAMILIES, SEQ, write_config

transformers = pytest.importorskip("transformers")


def _model(family: str, seed: int = 0):
    cls, kwargs = {**FAMILIES, **MORE_FAMILIES}[family]
    config = getattr(transformers, cls)(**{**kwargs, "num_hidden_layers": 2})
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config).double()
    with torch.no_grad():  # some families initialise biases to zero: make them count
        for name, p in model.named_parameters():
            if name.endswith("_bias"):
                p.normal_(0, 0.1)
    return model


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe", "olmoe", "gpt_oss"])
def test_routed_experts_reproduce_the_models_own_experts(family):
    model = _model(family)
    ids = torch.randint(0, 128, (2, SEQ), generator=torch.Generator().manual_seed(1))
    model.set_experts_implementation("eager")  # transformers' loop over the experts
    want = model(input_ids=ids, labels=ids).loss
    want.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    assert adopt_experts(model) == 2 and experts_notes(model) == []
    got = model(input_ids=ids, labels=ids).loss
    got.backward()
    torch.testing.assert_close(got, want, rtol=1e-10, atol=0)
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, grads[n], rtol=1e-8, atol=1e-12, msg=n)


def test_flops_are_those_of_the_routed_rows():
    model = _model("qwen3_moe")
    adopt_experts(model)
    name, experts = next(iter(expert_modules(model).items()))
    t, k = 64, model.config.num_experts_per_tok
    d, inner = model.config.hidden_size, model.config.moe_intermediate_size
    x = torch.randn(t, d, dtype=torch.float64)
    idx = torch.stack([torch.randperm(experts.num_experts)[:k] for _ in range(t)])
    with FlopCounterMode(display=False) as counter:
        experts(x, idx, torch.rand(t, k, dtype=torch.float64))
    routed = 2 * t * k * d * (2 * inner + inner)  # gate_up (2I) and down (I) per row
    assert routed <= counter.get_total_flops() <= 1.05 * routed, name


def test_capture_holds_one_routed_node_per_layer_with_swiglu_widths(tmp_path):
    from piper.loading import load_model

    spec = load_model(write_config(tmp_path / "q", "qwen3_moe"), (), (("seq_len", SEQ),))
    cap = capture(spec, 2)
    shapes = [s for n in cap.program.graph.nodes if (s := routed_shapes(n)) is not None]
    cfg = MORE_FAMILIES["qwen3_moe"][1]
    assert len(shapes) == cfg["num_hidden_layers"]
    assert {(s.tokens, s.k, s.dim, s.up, s.down, s.local) for s in shapes} == {
        (2 * SEQ, 2, 32, 2 * 16, 16, 4)}
    assert {e[2] for e in cap.graph.experts} == {f"layer.{i}" for i in range(4)}
    assert cap.graph.expert_regions == ("layer.*",)


def test_experts_outside_the_interface_run_unsharded_and_ep_says_why(tmp_path, capsys):
    model = _model("llama4")
    assert adopt_experts(model) == 0
    note = experts_notes(model)
    assert note and "Llama4TextExperts is not built on transformers' experts interface" in note[0]
    folder = write_config(tmp_path / "l4", "llama4")
    rc = main(["run", str(folder), "--gpus", "2", "--dp", "2", "--ep", "2", "--seq-len",
               str(SEQ), "--batch-size", "4", "--device", "cpu"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2
    assert any("expert parallelism: off (model.layers.0.feed_forward.experts" in line
               for line in err)
    assert err[-1].startswith("error: --ep 2: the model has no routed experts")


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
def test_grouped_gemm_runs_the_models_experts_as_the_loop_does(family):
    from piper.moe import grouped_ffn

    model = _model(family).float()
    adopt_experts(model)
    experts = next(iter(expert_modules(model).values()))
    ffn = experts.piper_ffn
    weights = [getattr(experts, n) for n in ffn.weights]
    counts = [5, 0, 3, 8][:experts.num_experts]  # an expert no row was routed to
    rows = torch.randn(sum(counts), model.config.hidden_size)
    fast = grouped_ffn(rows, weights, counts, ffn, grouped=True)
    slow = grouped_ffn(rows, weights, counts, ffn, grouped=False)
    torch.testing.assert_close(fast, slow, rtol=1e-4, atol=1e-5)


def test_expert_tensor_parallelism_keeps_each_half_of_the_hidden_features(tmp_path):
    """etp=2: TP rank r keeps rows r of the gate half and of the up half of gate_up_proj,
    columns r of down_proj; traced, the experts enter through f and leave through g."""
    from piper.loading import load_model
    from piper.sharding import ModelSharding

    spec = load_model(write_config(tmp_path / "q", "qwen3_moe"), (), (("seq_len", SEQ),))
    torch.manual_seed(0)
    whole = spec.build()
    name = next(iter(expert_modules(whole)))
    full = {p: getattr(expert_modules(whole)[name], p).detach() for p in
            ("gate_up_proj", "down_proj")}  # [E, 2I, d], [E, d, I]: I = 16
    cap = capture(spec, 2)
    cuts = tuple((p, d, h) for p, d, h, _ in cap.graph.expert_cuts)
    sh = ModelSharding(tp=2, tp_plan=spec.tp_plan, etp=2, expert_cuts=cuts,
                       experts=tuple(n for n, _, _ in cap.graph.experts))
    torch.manual_seed(0)
    model = sh.apply(spec.build(), tp_rank=1, ep_rank=0)
    mine = expert_modules(model)[name]
    gate, up = full["gate_up_proj"].chunk(2, dim=1)
    assert torch.equal(mine.gate_up_proj, torch.cat([gate[:, 8:], up[:, 8:]], dim=1))
    assert torch.equal(mine.down_proj, full["down_proj"][:, :, 8:])
    traced = capture(spec, 2, sh)
    routed = [s for n in traced.program.graph.nodes if (s := routed_shapes(n)) is not None]
    assert {(s.up, s.down) for s in routed} == {(16, 8)}  # half of 2I and of I
    ops = [str(n.target) for n in traced.program.graph.nodes if n.op == "call_function"]
    layers = len(routed)
    assert ops.count("piper.tp_reduce.default") >= 2 * layers  # o_proj's g, the experts' g
