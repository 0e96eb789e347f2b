"""ZeRO's memory claim, measured on real workers: under pp=2 x dp=2 ZeRO-3 each rank's peak
of parameter + gradient + optimizer bytes is the paper's 16·Ψ/N_d for its stage."""

from __future__ import annotations

import pytest

from piper import schedules
from piper.model_file import load_model_file
from runtime.cluster.launcher import run
from runtime.lowering.lower import lower
from tests.conftest import GPT

STAGES = [["embed", "layer.0", "layer.1"], ["layer.2", "layer.3", "head"]]


@pytest.mark.parametrize(("zero", "bytes_per_param", "bucket_mb"),
                         [(0, 16.0, None), (1, 4 + 4 + 8 / 2, None), (2, 4 + 12 / 2, None),
                          (3, 16 / 2, None), (3, 16 / 2, 0.001)])  # ZeRO-3 in 1 KiB units
def test_model_state_matches_zero_formula(ray_session, zero, bytes_per_param, bucket_mb):
    spec = load_model_file(GPT, (("size", "tiny"),))
    prog = schedules.with_buckets(
        schedules.one_f_one_b(STAGES, microbatches=4, dp=2, zero=zero), bucket_mb)
    plan = lower(spec, prog, 4, 32)
    result = run(spec, plan, batch_size=32, steps=2, seed=0)
    for rp in plan.ranks:
        psi = sum(plan.model.region(r).param_numel for s in rp.stages
                  for r in plan.stage_regions[s])
        measured = result.model_state_bytes[rp.rank]
        assert measured == pytest.approx(bytes_per_param * psi, rel=0.10), (rp.rank, measured)
