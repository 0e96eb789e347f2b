"""A search straight from a real Hugging Face config.json (Llama-3.1-8B, no weights): planned
on fake tensors, with its repeated layers folded like a model file's."""

from __future__ import annotations

import json

import pytest

from planner.cli import main
from tests.hf_models import write_llama_31_8b

pytest.importorskip("transformers")


def test_search_plans_llama_31_8b_from_its_config(capsys, tmp_path):
    config = write_llama_31_8b(tmp_path / "Llama-3.1-8B")
    rc = main(["search", str(config), "--gpus", "16", "--trials", "6", "--seq-len", "4096",
               "--out", str(tmp_path / "out"), "--json"])
    out, err = capsys.readouterr()
    assert rc == 0, err
    res = json.loads(out)
    assert res["best"]["predicted"]["step_time_s"] > 0
    assert "8,030.3M parameters; traced 2 of 32 identical model.layers" in err
    assert "regions: embed (1 module), layer.0-31, head (2 modules)" in err
    script = (tmp_path / "out" / "best_strategy.py").read_text()
    assert script.count("layer.31") == 1 and f"run:      piper-plan run {config}" in script
    assert "--seq-len 4096" in script


def test_a_capture_after_a_search_still_tags_its_regions(capsys, tmp_path):
    """A search leaves torch's dynamo-disable tag in the process-wide node metadata (a
    failed split's export); a later capture in the same process must not inherit it (it
    turned a tied GPT-2's embedding into the head region: 'head feeds the earlier region
    embed')."""
    from cost_models import CATALOG
    from piper.loading import load_model
    from planner.search.evaluate import Evaluator
    from tests.hf_models import write_config

    config = write_llama_31_8b(tmp_path / "Llama-3.1-8B")
    assert main(["search", str(config), "--gpus", "16", "--trials", "6", "--seq-len",
                 "4096", "--out", str(tmp_path / "out"), "--json"]) == 0
    gpt2 = write_config(tmp_path / "gpt2", "gpt2")
    spec = load_model(str(gpt2), (), (("seq_len", 16),))
    names = Evaluator(spec, 2, 4, CATALOG["cpu"]).graph.names
    assert names[0] == "embed" and names[-1] == "head"
