"""The search space a search walks: tensor/expert-parallel degrees the model's code cannot
run at are left out before any trial, each with its reason, and a failing (tp, ep) pair
takes out only the pair."""

from __future__ import annotations

from cost_models import CATALOG
from piper.model_file import load_model_file
from piper.sharding import ModelSharding
from planner.search.evaluate import Evaluator
from planner.search.space import search_space
from search_spaces import Infeasible
from tests.conftest import GPT, ROOT

MOE = str(ROOT / "examples" / "moe.py")


def degrees(space) -> set[tuple[int, int]]:
    return {(p.get("tp", 1), p.get("ep", 1)) for p in space.points()}


def test_degrees_the_model_cannot_run_are_left_out_with_a_reason():
    # tiny MoE: 2 attention heads, so tp=4 or 8 cannot split them; 4 experts, so ep=4 can
    ev = Evaluator(load_model_file(MOE, (("size", "tiny"),)), 8, 16, CATALOG["h100-80gb"])
    space, why = search_space(ev, 8)
    assert space.tps == (1, 2) and space.eps == (1, 2, 4)
    # its attention reads the sequence length from its input, so it cannot run with the
    # sequence split: sequence parallelism is left out, with the reason
    assert [w.split(":")[0] for w in why] == ["tp=4", "tp=8", "sequence parallelism"]
    assert "tp=2 sp ep=1" in why[2] and space.sps == (False,)
    assert {(2, 2), (2, 4)} <= degrees(space), "TP and EP compose"
    assert space.bad_shardings == ()


def test_sequence_parallelism_is_a_variant_of_tensor_parallel_points():
    ev = Evaluator(load_model_file(GPT, (("size", "tiny"),)), 4, 8, CATALOG["h100-80gb"])
    space, why = search_space(ev, 8)
    assert space.sps == (False, True) and not [w for w in why if "sequence" in w]
    point = next(p for p in space.points() if p.get("tp") == 2 and p.get("zero", 0) == 0)
    sps = [v.get("sp", False) for v in space.variants(point)]
    assert sps.count(True) == sps.count(False) >= 1
    assert space.program(**{**point, "sp": True}).summary()["sp"]
    no_tp = next(p for p in space.points() if p.get("tp", 1) == 1)
    assert not any(v.get("sp") for v in space.variants(no_tp))


class PairFails(Evaluator):
    """The tiny MoE as if its code ran tp=2 and ep=2 each alone but not together."""

    def sharded_costs(self, sharding: ModelSharding):
        if (sharding.tp, sharding.ep) == (2, 2):
            raise Infeasible(f"{sharding.describe()}: the model does not run split this way")
        return super().sharded_costs(sharding)


def test_a_pair_that_fails_together_takes_out_only_the_pair():
    ev = PairFails(load_model_file(MOE, (("size", "tiny"),)), 8, 16, CATALOG["h100-80gb"])
    space, why = search_space(ev, 8)
    assert 2 in space.tps and 2 in space.eps
    assert (2, 2) not in degrees(space) and {(1, 2), (2, 1), (2, 4)} <= degrees(space)
    assert space.bad_shardings == ((2, 2),)
    assert "tp=2 with ep=2: tp=2 ep=2: the model does not run split this way" in why


def test_context_parallel_degrees_leave_each_rank_balanced_chunks_of_enough_tokens():
    from planner.search.space import context_degrees

    assert context_degrees(8192, 8) == (1, 2, 4, 8)
    assert context_degrees(4096, 8) == (1, 2, 4), "8 ranks would keep 512 tokens"
    assert context_degrees(2050, 2) == (1,), "2050 tokens make no 4 equal chunks"
    assert context_degrees(16, 4) == (1,)


def test_context_parallelism_is_a_degree_of_the_space_beside_dp_tp_and_pp():
    llama = load_model_file(str(ROOT / "examples" / "llama.py"),
                            (("size", "tiny"), ("seq", 2048)))
    ev = Evaluator(llama, 4, 8, CATALOG["h100-80gb"])
    space, why = search_space(ev, 8)
    assert space.cps == (1, 2) and not [w for w in why if "context" in w]
    cps = {p.get("cp", 1) for p in space.points()}
    assert cps == {1, 2}
    # ZeRO over the context-parallel ranks needs no replicas; expert parallelism is refused
    assert space.violation(pp=1, microbatches=1, schedule="none", zero=3, cp=2, tp=2) is None
    assert "expert" in space.violation(pp=1, microbatches=1, schedule="none", cp=2, ep=2)
    prog = space.program(pp=1, microbatches=1, schedule="none", zero=3, cp=4)
    assert prog.summary()["cp"] == 4 and prog.summary()["dp"] == 1
    assert ev.evaluate(prog).plan.world_size == 4
