"""Region tags and capture: numbering, annotate_modules, glue ops, flows, parameter ownership."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import piper
from piper.model_file import ModelSpec, load_model_file

TINY = (("size", "tiny"),)
GPT_REGIONS = ("embed", "layer.0", "layer.1", "layer.2", "layer.3", "head")


@pytest.fixture(scope="module")
def gpt() -> piper.Captured:
    return piper.capture(load_model_file("examples/gpt.py", TINY), 2)


def inline_spec(cls: type[nn.Module], features: int = 4) -> ModelSpec:
    return ModelSpec(path="inline", build_model=cls,
                     example_batch=lambda b: (torch.randn(b, features), torch.zeros(b)))


def capture_inline(cls: type[nn.Module]) -> piper.Captured:
    return piper.capture(inline_spec(cls), 2)


def op_regions(cap: piper.Captured, target: object) -> list[int]:
    """Regions of the call_function nodes with this aten target, in graph order."""
    return [cap.node_region[n.name] for n in cap.program.graph.nodes
            if n.op == "call_function" and n.target is target]


class StemTwoBlocksOut(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem, self.b0, self.b1, self.out = (nn.Linear(4, 4) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with piper.annotate("stem"):
            x = self.stem(x)
        for blk in (self.b0, self.b1):
            with piper.annotate("block"):
                x = blk(x)
        with piper.annotate("out"):
            return self.out(x)


class Untagged(nn.Module):
    """A model written without piper in mind: tagged from outside by annotate_modules."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Linear(4, 8)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(8, 8), nn.ReLU()) for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.emb(x)
        for b in self.blocks:
            x = b(x)
        return x


class ManuallyTagged(Untagged):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with piper.annotate("embed"):
            x = self.emb(x)
        for b in self.blocks:
            with piper.annotate("layer"):
                x = b(x)
        return x


class Glue(nn.Module):
    """Untagged ops: one fed only by the input, one after a region, one joining two regions."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = (nn.Linear(4, 4) for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x * 3  # input-only glue: joins its first consumer (stem)
        with piper.annotate("stem"):
            h = self.a(y)
        h = torch.relu(h)  # glue after stem: joins stem, its latest input
        with piper.annotate("block"):
            b = self.b(h)
        z = h + b  # inputs from stem and block.0: joins the later, block.0
        with piper.annotate("block"):
            return self.c(z)


class TiedWeight(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with piper.annotate("first"):
            x = self.a(x)
        with piper.annotate("second"):
            return self.b(x) @ self.a.weight


class NoRegions(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.a(x)


class TwoOutputRegions(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        with piper.annotate("first"):
            y = self.a(x)
        with piper.annotate("second"):
            z = self.b(y)
        return y, z


class NestedRegions(nn.Module):
    """`inner` starts after `outer`, yet `outer` consumes it: a flow to an earlier region."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with piper.annotate("outer"):
            h = self.a(x)
            with piper.annotate("inner"):
                h = self.b(h)
            return h * 2


class CollidingNames(nn.Module):
    """`layer` twice numbers to layer.0/layer.1, and a region literally named `layer.1`."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = (nn.Linear(4, 4) for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with piper.annotate("layer"):
            x = self.a(x)
        with piper.annotate("layer"):
            x = self.b(x)
        with piper.annotate("layer.1"):
            return self.c(x)


# --- region numbering ---------------------------------------------------------------------

def test_tiny_gpt_regions_are_embed_four_numbered_layers_and_head(gpt: piper.Captured) -> None:
    assert gpt.graph.names == GPT_REGIONS
    assert [r.index for r in gpt.graph.regions] == list(range(6))


def test_single_use_name_stays_plain_and_repeated_name_is_numbered_in_call_order() -> None:
    cap = capture_inline(StemTwoBlocksOut)
    assert cap.graph.names == ("stem", "block.0", "block.1", "out")
    linear = torch.ops.aten.linear.default
    # the four linears run in call order, one per region
    assert op_regions(cap, linear) == [0, 1, 2, 3]
    assert cap.graph.region("block.1").params == ("b1.weight", "b1.bias")


@pytest.mark.parametrize("bad", ["", "a#b", "a/b"])
def test_annotate_rejects_empty_names_and_reserved_characters(bad: str) -> None:
    with pytest.raises(ValueError, match="bad region name"), piper.annotate(bad):
        pass


def test_numbered_name_colliding_with_a_plain_name_is_an_error() -> None:
    with pytest.raises(piper.PiperError, match="region name 'layer.1' is given twice"):
        capture_inline(CollidingNames)


# --- annotate_modules ---------------------------------------------------------------------

def test_annotate_modules_gives_the_same_regions_as_manual_tags() -> None:
    def build() -> nn.Module:
        return piper.annotate_modules(Untagged(), {"blocks.*": "layer", "emb": "embed"})

    by_pattern = piper.capture(inline_spec(build), 2)
    manual = capture_inline(ManuallyTagged)
    assert by_pattern.graph.names == ("embed", "layer.0", "layer.1")
    assert by_pattern.graph.names == manual.graph.names
    assert by_pattern.node_region == manual.node_region
    # nested submodules (blocks.0.0, blocks.0.1) are not tagged a second time
    assert by_pattern.graph.region("layer.0").params == ("blocks.0.0.weight", "blocks.0.0.bias")


def test_annotate_modules_returns_the_model_it_tagged() -> None:
    model = Untagged()
    assert piper.annotate_modules(model, {"emb": "embed"}) is model


def test_annotate_modules_pattern_matching_nothing_raises_value_error() -> None:
    with pytest.raises(ValueError, match="no submodule matches"):
        piper.annotate_modules(Untagged(), {"decoder.*": "layer"})


# --- capture: glue, flows, parameters, output ---------------------------------------------

def test_every_op_of_the_tiny_gpt_is_assigned_a_region(gpt: piper.Captured) -> None:
    ops = [n.name for n in gpt.program.graph.nodes if n.op == "call_function"]
    assert ops
    assert set(ops) <= set(gpt.node_region)
    assert set(gpt.node_region.values()) == set(range(len(GPT_REGIONS)))


def test_untagged_glue_joins_its_latest_input_or_else_its_first_consumer() -> None:
    cap = capture_inline(Glue)
    assert cap.graph.names == ("stem", "block.0", "block.1")
    ops = [n.name for n in cap.program.graph.nodes if n.op == "call_function"]
    assert set(ops) == set(cap.node_region)
    aten = torch.ops.aten
    assert op_regions(cap, aten.mul.Tensor) == [0]  # fed by the input only -> stem
    assert op_regions(cap, aten.relu.default) == [0]  # after stem -> stem
    assert op_regions(cap, aten.add.Tensor) == [1]  # stem + block.0 -> block.0


def test_flows_go_from_earlier_to_later_regions_in_a_chain(gpt: piper.Captured) -> None:
    flows = gpt.graph.flows
    assert [(f.src, f.dst) for f in flows] == [(i, i + 1) for i in range(5)]
    for f in flows:
        assert f.values
        for v in f.values:
            val = gpt.graph.value(v)
            assert val.region == f.src
            assert val.shape == (2, 16, 32)  # microbatch 2, seq 16, dim 32
            assert val.floating


def test_parameters_are_owned_by_the_region_that_uses_them(gpt: piper.Captured) -> None:
    g = gpt.graph
    assert "tok.weight" in g.region("embed").params
    assert "pos.weight" in g.region("embed").params
    assert "blocks.2.qkv.weight" in g.region("layer.2").params
    assert "lm_head.weight" in g.region("head").params
    owned = [p for r in g.regions for p in r.params]
    assert len(owned) == len(set(owned))  # each parameter has exactly one owner
    model = load_model_file("examples/gpt.py", TINY).build()
    assert sorted(owned) == sorted(n for n, _ in model.named_parameters())
    assert g.region("embed").param_numel == (128 + 16) * 32
    assert g.tied == ()


def test_parameter_used_by_two_regions_is_owned_by_the_first_and_listed_as_tied() -> None:
    cap = capture_inline(TiedWeight)
    g = cap.graph
    assert "a.weight" in g.region("first").params
    assert "a.weight" not in g.region("second").params
    assert g.tied == (("a.weight", (0, 1)),)


def test_output_region_of_the_tiny_gpt_is_head(gpt: piper.Captured) -> None:
    assert gpt.graph.output_region == gpt.graph.region("head").index
    assert gpt.graph.batch == 2


def test_model_without_annotate_raises_piper_error_pointing_at_annotate() -> None:
    with pytest.raises(piper.PiperError, match="annotate"):
        capture_inline(NoRegions)


def test_outputs_of_earlier_regions_pass_through_the_last() -> None:
    """A model returning a value of an earlier region (a MoE model's router logits) beside
    its output: that value is sent to the last region, which outputs it unchanged."""
    cap = capture_inline(TwoOutputRegions)
    g = cap.graph
    first, second = g.region("first").index, g.region("second").index
    assert g.output_region == second
    out = next(n for n in cap.program.graph.nodes if n.op == "output")
    assert {cap.node_region[a.name] for a in out.all_input_nodes} == {second}
    assert any(f.src == first and f.dst == second for f in g.flows)


def test_flow_into_an_earlier_region_is_rejected() -> None:
    with pytest.raises(piper.PiperError, match="call order"):
        capture_inline(NestedRegions)


def test_flow_into_an_earlier_region_error_names_producer_then_consumer() -> None:
    with pytest.raises(piper.PiperError, match="region inner feeds the earlier region outer"):
        capture_inline(NestedRegions)
