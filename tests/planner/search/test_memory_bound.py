"""The memory bound that rejects points before simulation never exceeds the simulated peak
(so no point that fits is dropped), and is the simulated peak whenever every device has an
Order — which is every point the search proposes, with or without recompute."""

from __future__ import annotations

import dataclasses

import optuna
import pytest

from cost_models import CATALOG
from piper.model_file import load_model_file
from planner.search.evaluate import Evaluator
from planner.search.space import search_space
from tests.conftest import GPT, ROOT


@pytest.mark.parametrize("precision", ["fp32", "bf16-mixed"])
def test_bound_is_the_simulated_peak_across_schedules_zero_and_tp(precision):
    for path, gpus in ((GPT, 4), (str(ROOT / "examples" / "moe.py"), 4)):
        ev = Evaluator(load_model_file(path, (("size", "tiny"),)), gpus, 16, CATALOG["h100-80gb"],
                       precision=precision)
        space, _ = search_space(ev, 8)
        seen = set()
        for p in space.points():  # the first point of every kind of point
            kind = (p["schedule"], p["zero"], p.get("tp", 1) > 1, p.get("ep", 1) > 1,
                    p["recompute"], p.get("comm_stream", False))
            if kind in seen:
                continue
            for v in space.variants(p):  # bucket sizes: ZeRO's units hold less gradient
                prog = space.program(**v)
                bound = ev.peak_memory_bound(prog)
                peak = max(ev.evaluate(prog).prediction.peak_memory_bytes)
                if p["schedule"] == "dualpipev":
                    # an overlapped pair's forward is counted before its backward frees
                    # (`Order.names`); the simulated lanes may free first
                    assert peak <= bound <= peak * 1.01, v
                else:
                    assert bound == peak, v
            seen.add(kind)
        assert len({s for s, *_ in seen}) == 6 and len({z for _, z, *_ in seen}) == 4
        assert any(tp or ep for *_, tp, ep, _, _ in seen)
        # recomputed stages: inputs kept, one region rebuilt in B or I, W's products after I
        assert {(s, r) for s, *_, r, _ in seen} >= {(s, True) for s in ("1f1b", "zb1p")}
        assert any(c for *_, c in seen)


@pytest.mark.parametrize("sampler", ["tpe", "grid"])
def test_points_that_cannot_fit_are_never_simulated(sampler, tmp_path, capsys):
    from planner.search.loop import run_search

    ev = Evaluator(load_model_file(GPT, (("size", "tiny"),)), 4, 32, CATALOG["h100-80gb"])
    space, _ = search_space(ev, 8)
    peaks = sorted(ev.peak_memory_bound(space.program(**p)) for p in space.points())
    small = dataclasses.replace(CATALOG["h100-80gb"], memory_bytes=peaks[len(peaks) // 2])
    ev = Evaluator(ev.spec, 4, 32, small)
    simulated = []
    real = ev.evaluate
    ev.evaluate = lambda prog: simulated.append(prog) or real(prog)  # count the simulations
    res = run_search(ev, space, trials=30, timeout=None, sampler=sampler,
                     storage=f"sqlite:///{tmp_path}/s.db", study_name="s", seed=0,
                     progress=False)
    # each trial simulates its point's variants (bucket sizes) that fit, nothing else
    study = optuna.load_study(study_name="s", storage=f"sqlite:///{tmp_path}/s.db")
    points = [t.user_attrs["point"] for t in study.trials
              if t.state == optuna.trial.TrialState.COMPLETE]
    assert len(points) == res.trials and all(r.feasible for r in res.records)
    cap = small.memory_bytes
    assert len(simulated) == sum(ev.peak_memory_bound(space.program(**v)) <= cap
                                 for p in points for v in space.variants(p))
    if sampler == "grid":  # the grid walks every point: those that cannot fit are pruned
        assert res.pruned_trials > 0
    else:  # the sampler passes them over: every trial is spent on one that fits
        assert res.trials == 30 and "passed over" in capsys.readouterr().err
