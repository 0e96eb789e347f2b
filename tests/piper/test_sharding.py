"""Tensor and expert parallelism at the IR level: the layer rewrites are exact slices of the
single-device layers, and ShardTensor / Shard check what they are given."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import piper
from piper import Experts, Place, Program, Replicate, Shard, ShardTensor, Split, schedules
from piper.dag import VerifyError
from piper.directives import ShardSequence
from piper.model_file import load_model_file
from piper.tensor_parallel import (
    ColwiseLinear,
    ColwiseRepLinear,
    RowwiseLinear,
    VocabEmbedding,
    parse_style,
    shard_linears,
)
from tests.conftest import GPT, ROOT

MOE = str(ROOT / "examples" / "moe.py")


@pytest.fixture(scope="module")
def gpt_dag() -> piper.TrainingDAG:
    return piper.single_device_dag(piper.capture(load_model_file(GPT, (("size", "tiny"),)),
                                                 2).graph)


@pytest.fixture(scope="module")
def moe_dag() -> piper.TrainingDAG:
    return piper.single_device_dag(piper.capture(load_model_file(MOE, (("size", "tiny"),)),
                                                 2).graph)


# ---- tensor parallel layers ------------------------------------------------------------
def test_parse_style() -> None:
    assert parse_style("colwise") == ("colwise", 1)
    assert parse_style("colwise:3") == ("colwise", 3)
    assert parse_style("rowwise") == ("rowwise", 1)
    assert parse_style("colwise_rep") == ("colwise_rep", 1)
    assert parse_style("vocab") == ("vocab", 1)
    assert parse_style("sequence") == ("sequence", 1)
    for bad in ("rowwise:2", "colwise:0", "colwise:x", "diagonal"):
        with pytest.raises(ValueError, match="unknown tensor-parallel style"):
            parse_style(bad)


def _slices(plan: dict[str, str], degree: int) -> list[nn.Module]:
    torch.manual_seed(0)
    full = nn.Sequential(nn.Linear(4, 12), nn.Linear(12, 4))
    out = [full]
    for rank in range(degree):
        m = copy.deepcopy(full)
        shard_linears(m, tuple(plan.items()), degree, rank)
        out.append(m)
    return out


def test_column_slices_keep_each_fused_part_and_row_slices_split_inputs() -> None:
    full, r0, r1 = _slices({"0": "colwise:3", "1": "rowwise"}, 2)
    assert isinstance(r0[0], ColwiseLinear) and isinstance(r1[1], RowwiseLinear)
    assert r0[0].weight.shape == (6, 4) and r0[1].weight.shape == (4, 6)
    # part k of rank r is rows [4k + 2r, 4k + 2r + 2) of the fused weight
    parts = [torch.cat([r[0].weight[2 * k:2 * k + 2] for r in (r0, r1)]) for k in range(3)]
    assert torch.equal(torch.cat(parts), full[0].weight)
    assert torch.equal(torch.cat([r0[1].weight, r1[1].weight], dim=1), full[1].weight)
    assert torch.equal(r0[1].bias, full[1].bias), "the row-parallel bias stays whole"


def test_plan_entry_matching_nothing_or_not_a_linear_is_an_error() -> None:
    m = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
    with pytest.raises(ValueError, match="'x.*' matches no module"):
        shard_linears(m, (("x.*", "colwise"),), 2, 0)
    with pytest.raises(ValueError, match="is a ReLU; style colwise splits an nn.Linear"):
        shard_linears(m, (("1", "colwise"),), 2, 0)
    with pytest.raises(ValueError, match="is a Linear; style vocab splits an nn.Embedding"):
        shard_linears(m, (("0", "vocab"),), 2, 0)


class _Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.tok = nn.Embedding(8, 4)
        self.out = nn.Linear(4, 8, bias=False)
        self.out.weight = self.tok.weight


def test_vocab_embedding_and_gathered_output_split_rows_and_keep_a_tie() -> None:
    torch.manual_seed(0)
    full = _Tied()
    ranks = []
    for rank in range(2):
        m = copy.deepcopy(full)
        shard_linears(m, (("tok", "vocab"), ("out", "colwise_rep")), 2, rank)
        ranks.append(m)
    for rank, m in enumerate(ranks):
        assert isinstance(m.tok, VocabEmbedding) and isinstance(m.out, ColwiseRepLinear)
        assert m.tok.weight is m.out.weight, "the tied slice stays one parameter"
        assert torch.equal(m.tok.weight, full.tok.weight[4 * rank:4 * rank + 4])
        assert int(m.tok.vocab_start) == 4 * rank and m.tok.num_embeddings == 4
        assert "tok.vocab_start" not in m.state_dict(), "rank-local, never saved"
        assert len(list(m.parameters())) == 1
    untied = copy.deepcopy(full)
    with pytest.raises(ValueError, match="out.weight is tied to a tensor-parallel layer"):
        shard_linears(untied, (("tok", "vocab"),), 2, 0)


def test_a_vocab_that_does_not_divide_is_refused() -> None:
    m = nn.Sequential(nn.Embedding(9, 4))
    with pytest.raises(ValueError, match="9 vocabulary rows are not 1 part"):
        shard_linears(m, (("0", "vocab"),), 2, 0)


# ---- experts -------------------------------------------------------------------------------
def test_experts_match_a_per_token_loop() -> None:
    torch.manual_seed(0)
    e = Experts(4, 8, 16)
    x, gate = torch.randn(10, 8), torch.rand(10, 2)
    idx = torch.stack([torch.randperm(4)[:2] for _ in range(10)])
    y = e(x, idx, gate)
    ffn = [lambda v, i=i: torch.nn.functional.gelu(v @ e.w1[i]) @ e.w2[i] for i in range(4)]
    ref = torch.stack([sum(gate[t, j] * ffn[int(idx[t, j])](x[t]) for j in range(2))
                       for t in range(10)])
    torch.testing.assert_close(y, ref)


# ---- directives ------------------------------------------------------------------------
def test_shard_tensor_uses_the_model_files_plan_and_multiplies_the_world(gpt_dag) -> None:
    prog = schedules.shard(schedules.build("1f1b", [["embed", "layer.0", "layer.1"],
                                                    ["layer.2", "layer.3", "head"]],
                                           microbatches=2, dp=2), tp=2)
    dag = prog.apply(gpt_dag)
    assert (dag.pp, dag.dp, dag.sharding.tp, dag.world_size, dag.ranks) == (2, 2, 2, 8, 4)
    assert dict(dag.sharding.tp_plan)["blocks.*.qkv"] == "colwise:3"
    assert prog.summary()["tp"] == 2
    assert Program.from_json(prog.to_json()) == prog


def test_sequence_parallel_is_a_field_of_shard_tensor(gpt_dag) -> None:
    prog = schedules.shard(schedules.build("1f1b", [list(gpt_dag.model.names)],
                                           microbatches=2), tp=2, sp=True)
    dag = prog.apply(gpt_dag)
    assert dag.sharding.sp and dag.sharding.describe() == "tp=2 sp ep=1"
    assert prog.summary()["sp"] is True
    assert Program.from_json(prog.to_json()) == prog
    assert "sequence_parallel=True" in prog.to_python()


def test_a_position_table_keeps_its_rows_whole_and_changes_only_with_sp() -> None:
    plain = nn.Sequential(nn.Embedding(8, 4))
    shard_linears(plain, (("0", "sequence"),), 2, 1)
    assert type(plain[0]) is nn.Embedding and plain[0].weight.shape == (8, 4)
    sp = nn.Sequential(nn.Embedding(8, 4))
    shard_linears(sp, (("0", "sequence"),), 2, 1, sequence_parallel=True)
    assert type(sp[0]).__name__ == "SequenceEmbedding" and int(sp[0].sp_rank) == 1
    assert sp[0].weight.shape == (8, 4), "the table stays whole"


def test_sequence_parallel_layers_gather_and_scatter_and_sum_the_other_gradients() -> None:
    torch.manual_seed(0)
    m = nn.Sequential(nn.LayerNorm(4), nn.Linear(4, 8), nn.Linear(8, 4))
    shard_linears(m, (("1", "colwise"), ("2", "rowwise")), 2, 0, sequence_parallel=True)
    assert m[1].sequence_parallel and m[2].sequence_parallel
    assert type(m[0]).__name__ == "ReplicatedLayerNorm", "a norm sees 1/tp of the tokens"


@pytest.mark.parametrize("directive, msg", [
    (ShardTensor(3), r"blocks.0.qkv: 96 output features are not 3 part\(s\) divisible by tp=3"),
    (ShardTensor(2, plan=(("mlp.*", "colwise"),)), "'mlp.\\*' matches no module"),
    (ShardTensor(0), "degree must be an int >= 1"),
    (ShardTensor(1, sequence_parallel=True), "sequence_parallel needs degree > 1"),
])
def test_shard_tensor_errors(gpt_dag, directive, msg) -> None:
    with pytest.raises(piper.DirectiveError, match=msg) as e:
        Program([Split(2), directive]).apply(gpt_dag)
    assert e.value.index == 1


def test_shard_tensor_without_a_plan_or_on_a_tied_weight(gpt_dag) -> None:
    skip = piper.single_device_dag(piper.capture(
        load_model_file(ROOT / "tests" / "models" / "skip_mlp.py"), 2).graph)
    with pytest.raises(piper.DirectiveError, match="defines no TP_PLAN"):
        Program([ShardTensor(2)]).apply(skip)
    tied = piper.single_device_dag(piper.capture(
        load_model_file(GPT, (("size", "tiny"), ("tie", True))), 2).graph)
    with pytest.raises(piper.DirectiveError, match="lm_head.weight is tied"):
        Program([ShardTensor(2, plan=(("lm_head", "rowwise"),))]).apply(tied)
    # split by rows everywhere it is used, a tied weight shards (Megatron's tied vocab)
    dag = Program([ShardTensor(2, plan=(("tok", "vocab"), ("lm_head", "colwise_rep")))]
                  ).apply(tied)
    assert dag.sharding.tp == 2


def test_shard_splits_the_experts_of_matched_regions(moe_dag) -> None:
    prog = Program([Replicate(4), Shard("experts.*", degree=2)])
    dag = prog.apply(moe_dag)
    assert dag.sharding.experts == ("moe.0.experts", "moe.1.experts")
    assert (dag.sharding.ep, dag.world_size) == (2, 4)
    assert prog.summary()["ep"] == 2
    assert "Shard('experts.*', degree=2)" in prog.to_python()
    assert Program.from_json(prog.to_json()) == prog
    capped = Program([Replicate(4), Shard("experts.*", degree=1, capacity=1.25, group=16)])
    sh = capped.apply(moe_dag).sharding
    assert (sh.ep, sh.capacity, sh.capacity_group, sh.trivial) == (1, 1.25, 16, False)
    assert capped.summary()["capacity"] == 1.25
    assert Program.from_json(capped.to_json()) == capped


@pytest.mark.parametrize("directives, msg", [
    ([Replicate(2), Shard("attn.*", degree=2)],
     "'attn.\\*' matches no region holding routed experts; those are experts.0, experts.1"),
    ([Replicate(3), Shard("experts.*", degree=3)],
     "moe.0.experts has 4 experts, not divisible by ep=3"),
    ([Replicate(2), Shard("experts.*", degree=2, capacity=1.0)],
     "capacity needs group, the tokens of one sequence"),
    ([Replicate(2), Shard("experts.*", degree=2), Shard("experts.*", degree=1)],
     "Shard must come once"),
    ([Replicate(2), Shard("experts.*", degree=1, capacity=1.0, group=16), ShardSequence(2)],
     "an expert capacity is counted per sequence"),
])
def test_shard_errors(moe_dag, directives, msg) -> None:
    with pytest.raises(piper.DirectiveError, match=msg):
        Program(directives).apply(moe_dag)


def test_expert_parallelism_needs_replicas_to_split_over(moe_dag) -> None:
    with pytest.raises(VerifyError, match="ep=2 splits data-parallel replicas"):
        Program([Place(moe_dag.model.names, stage=0, device=0),
                 Shard("experts.*", degree=2)]).apply(moe_dag)
