"""Planning captures trace two copies of a repeated layer and grow the rest back: the result
must be the full capture's graph and costs, and anything not provably a chain of identical
layers must be traced whole."""

from __future__ import annotations

import pytest

from piper.model_file import load_model_file
from piper.sharding import ModelSharding
from planner.search.repeats import planning_capture
from tests.conftest import GPT, ROOT

LLAMA = str(ROOT / "examples" / "llama.py")

LAYERED = '''import torch, piper
from torch import nn

BATCH_SIZE = 4


class L(nn.Module):
    def __init__(self, i):
        super().__init__()
        self.lin = nn.Linear(8, 8)
        {attr}

    def forward(self, x):
        return torch.tanh(self.lin(x))


class M(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(8, 8)
        self.layers = nn.ModuleList(L(i) for i in range(5))
        self.out = nn.Linear(8, 3)

    def forward(self, x):
        with piper.annotate("embed"):
            x = self.inp(x)
        outs = []
        for i, layer in enumerate(self.layers):
            with piper.annotate("layer"):
                x = layer(x)
                {extra}
            outs.append(x)
        with piper.annotate("head"):
            return self.out({head_in})


def build_model():
    return M()


def example_batch(b):
    return torch.randn(b, 8), torch.randint(0, 3, (b,))
'''
CASES = {  # name: (template fields, folded?)
    "identical layers": ({"attr": "pass", "extra": "pass", "head_in": "x"}, True),
    "a layer index on the module": ({"attr": "self.idx = i", "extra": "pass",
                                     "head_in": "x"}, False),
    "compute that depends on the index": ({"attr": "pass", "extra": "x = x * 2 if i % 2 else x",
                                           "head_in": "x"}, False),
    "every layer feeds the head": ({"attr": "pass", "extra": "pass", "head_in": "sum(outs)"},
                                   False),
}


def same(a, b) -> None:
    """Equal up to the names of values crossing regions (the full trace numbers its nodes)."""
    ga, gb = a.graph, b.graph
    assert ga.names == gb.names
    assert [(r.params, r.param_numel) for r in ga.regions] == \
        [(r.params, r.param_numel) for r in gb.regions]
    assert [(f.src, f.dst, [ga.value(v).nbytes for v in f.values]) for f in ga.flows] == \
        [(f.src, f.dst, [gb.value(v).nbytes for v in f.values]) for f in gb.flows]
    assert (ga.output_region, ga.tied, sorted(ga.linears), sorted(ga.experts)) == \
        (gb.output_region, gb.tied, sorted(gb.linears), sorted(gb.experts))
    assert a.costs == b.costs and a.traffic == b.traffic


@pytest.mark.parametrize("path, tp", [(GPT, 1), (LLAMA, 1), (LLAMA, 2)])
def test_folded_capture_is_the_full_capture(path, tp):
    spec = load_model_file(path, (("size", "tiny"),))
    sharding = ModelSharding(tp=tp, tp_plan=spec.tp_plan) if tp > 1 else None
    folded = planning_capture(spec, 1, sharding)
    assert folded.folded and folded.folded[0].length == 4
    same(folded, planning_capture(spec, 1, sharding, fold=False))


@pytest.mark.parametrize("case", sorted(CASES))
def test_only_a_chain_of_identical_layers_is_folded(case, tmp_path):
    fields, folds = CASES[case]
    model = tmp_path / "m.py"
    model.write_text(LAYERED.format(**fields))
    spec = load_model_file(model)
    got = planning_capture(spec, 1)
    assert bool(got.folded) == folds
    same(got, planning_capture(spec, 1, fold=False))


def test_a_hugging_face_decoder_with_sequence_parallelism_is_folded(tmp_path):
    """Sequence parallelism enters a Hugging Face decoder at its first layer (a split on
    entry): copy 0 keeps the split as captured, the copies after it are plain."""
    from piper.loading import load_model
    from tests.hf_models import write_config

    spec = load_model(str(write_config(tmp_path / "llama", "llama")), (), (("seq_len", 16),))
    sharding = ModelSharding(tp=2, tp_plan=spec.tp_plan, sp=True)
    assert any(style == "sequence_split" for _, style in sharding.tp_plan)
    folded = planning_capture(spec, 1, sharding)
    assert folded.folded
    same(folded, planning_capture(spec, 1, sharding, fold=False))
