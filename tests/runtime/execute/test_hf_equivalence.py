"""Unmodified Hugging Face models under every kind of strategy, on real worker processes:
each reproduces single-device eager training of the same model (rtol 1e-4, 3 steps)."""

from __future__ import annotations

import json

import pytest

from planner.cli import main
from tests.hf_models import BATCH, FAMILIES, SEQ, write_config

pytest.importorskip("transformers")

STRATEGIES = {
    "1f1b": ["--gpus", "2", "--pp", "2", "--schedule", "1f1b", "--microbatches", "4"],
    "interleaved": ["--gpus", "2", "--pp", "2", "--schedule", "interleaved-1f1b",
                    "--virtual-stages", "2", "--microbatches", "2"],
    "zb1p": ["--gpus", "2", "--pp", "2", "--schedule", "zb1p", "--microbatches", "4"],
    "dualpipev": ["--gpus", "2", "--pp", "2", "--schedule", "dualpipev", "--microbatches", "4"],
    "dp2_zero1": ["--gpus", "2", "--dp", "2", "--zero", "1", "--microbatches", "2"],
    "dp2_zero2": ["--gpus", "2", "--dp", "2", "--zero", "2", "--microbatches", "2"],
    "dp2_zero3": ["--gpus", "2", "--dp", "2", "--zero", "3", "--microbatches", "2"],
    "pp2_dp2_zero3": ["--gpus", "4", "--pp", "2", "--dp", "2", "--zero", "3",
                      "--microbatches", "2"],
    "tp2": ["--gpus", "2", "--tp", "2", "--microbatches", "2"],
}
# what the search adds to the points above (recompute, buckets, a comm stream): once
MORE = {
    "recompute_pp2_tp2": ["--gpus", "4", "--pp", "2", "--tp", "2", "--microbatches", "2",
                          "--recompute"],
    "dp2_buckets_comm_stream": ["--gpus", "2", "--dp", "2", "--microbatches", "2",
                                "--bucket-mb", "0.001", "--comm-stream"],
    # sequence parallelism on unmodified attention: gathered at the attention and MLP
    # modules, split at the first layer, whole again at the final norm
    "tp2_sp_pp2": ["--gpus", "4", "--tp", "2", "--sp", "--pp", "2", "--microbatches", "2"],
    # context parallelism on unmodified attention: the decoder's position ids become the
    # rank's own, its causal mask (proved causal at capture) gives way to ring attention
    "cp2_dp2": ["--gpus", "4", "--cp", "2", "--dp", "2", "--microbatches", "2"],
    # pure bf16: the model traced in bf16, so its own casts (RMSNorm's, RoPE's) keep it
    "dp2_bf16": ["--gpus", "2", "--dp", "2", "--precision", "bf16"],
}
# expert parallelism on the models' own experts modules (piper.hf_experts): each group of
# 2 replicas splits every layer's experts; beside ZeRO, a DualPipeV V, tensor parallelism
EXPERTS = {
    "ep2": ["--gpus", "2", "--dp", "2", "--ep", "2"],
    "ep2_dp2_zero2": ["--gpus", "4", "--dp", "4", "--ep", "2", "--zero", "2"],
    "ep2_pp2_dualpipev": ["--gpus", "4", "--pp", "2", "--dp", "2", "--ep", "2", "--schedule",
                          "dualpipev", "--microbatches", "4"],
    "ep2_tp2": ["--gpus", "4", "--tp", "2", "--dp", "2", "--ep", "2", "--microbatches", "2"],
    # expert tensor parallelism: each TP rank holds half of every expert's hidden features;
    # with sequence parallelism the ranks' tokens are gathered in and reduce-scattered out
    "ep2_etp2_tp2_sp": ["--gpus", "4", "--tp", "2", "--sp", "--dp", "2", "--ep", "2", "--etp",
                        "2", "--microbatches", "2"],
    "ep2_bf16_mixed": ["--gpus", "2", "--dp", "2", "--ep", "2", "--precision", "bf16-mixed"],
    # the load-balancing loss the model adds (its router logits, returned by every layer,
    # reach the last stage), per microbatch as Megatron computes it: within rtol of the
    # single-device batch's (its statistics differ at second order)
    "ep2_pp2_dualpipev_aux_loss": ["--gpus", "4", "--pp", "2", "--dp", "2", "--ep", "2",
                                   "--schedule", "dualpipev", "--microbatches", "4",
                                   "--model-arg", "output_router_logits=true"],
    # Megatron's expert mesh: 4 processes (2 replicas x tp 2) hold a quarter of the experts
    # each; with sequence parallelism each TP rank routes its own tokens
    "ep4_over_tp2_sp": ["--gpus", "4", "--tp", "2", "--sp", "--dp", "2", "--ep", "4",
                        "--ep-over-tp", "--microbatches", "2"],
}
# tensor parallelism from the config's own base_model_tp_plan: GPT-2 declares none; the
# MoE family's schedules without EP are the other families' (two of them run once)
CASES = [(f, s) for f in sorted(FAMILIES) for s in STRATEGIES
         if not (s == "tp2" and f == "gpt2")
         and not (f == "mixtral" and s in ("interleaved", "dp2_zero1"))] + [
    ("qwen3", s) for s in MORE if s != "dp2_bf16"] + [
    ("llama", "tp2_sp"), ("llama", "cp2_dp2"), ("llama", "dp2_bf16")] + [
    ("mixtral", s) for s in EXPERTS if s not in (
        "ep2_bf16_mixed", "ep2_etp2_tp2_sp", "ep4_over_tp2_sp", "ep2_pp2_dualpipev_aux_loss")
] + [("qwen3_moe", s) for s in ("ep4_over_tp2_sp", "ep2_pp2_dualpipev_aux_loss",
                                 "ep2_etp2_tp2_sp", "ep2_bf16_mixed")] + [
    ("olmoe", "ep2_dp2_zero2"), ("olmoe", "ep2_tp2")]
MORE["tp2_sp"] = ["--gpus", "2", "--tp", "2", "--sp", "--microbatches", "2"]
STRATEGIES.update(MORE)
STRATEGIES.update(EXPERTS)


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("hf_models")
    return {f: write_config(root / f, f) for f in {*FAMILIES, "qwen3_moe", "olmoe"}}


def run_json(capsys, argv: list[str]) -> tuple[int, dict]:
    rc = main(argv)
    said = capsys.readouterr()
    out = said.out.strip().splitlines()
    assert len(out) == 1, f"--json prints exactly one line on stdout (rc {rc}): {said.err}"
    return rc, json.loads(out[0])


@pytest.mark.parametrize(("family", "strategy"), CASES)
def test_hf_model_reproduces_eager_training(ray_session, capsys, folders, family, strategy):
    rc, out = run_json(capsys, ["run", str(folders[family]), *STRATEGIES[strategy],
                                "--seq-len", str(SEQ), "--batch-size", str(BATCH),
                                "--device", "cpu", "--steps", "3", "--seed", "0", "--check",
                                "--json"])
    assert rc == 0
    # bf16-mixed: against single-device autocast; bf16: against a bf16 model
    rtol = 2e-2 if "bf16_mixed" in strategy else 5e-2 if "bf16" in strategy else 1e-4
    assert out["check"]["passed"] and out["check"]["max_rel_diff"] <= rtol
    losses = [s["loss"] for s in out["steps"]]
    assert losses[2] < losses[0], "training makes progress, so equal losses are not trivial"


UNTAGGED = '''
import torch
import transformers

def build_model():
    config = transformers.LlamaConfig(**{tiny!r})
    return transformers.LlamaForCausalLM(config)

def example_batch(batch_size):
    ids = torch.randint(0, 128, (batch_size, {seq}))
    return {{"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}}, None
'''


def test_untagged_model_file_runs_with_automatic_regions(ray_session, capsys, tmp_path):
    from tests.hf_models import TINY

    path = tmp_path / "plain_llama.py"
    path.write_text(UNTAGGED.format(tiny=TINY, seq=SEQ))
    rc = main(["run", str(path), "--gpus", "4", "--pp", "2", "--dp", "2", "--zero", "2",
               "--schedule", "dualpipev", "--microbatches", "4", "--batch-size", str(BATCH),
               "--device", "cpu", "--steps", "3", "--check"])
    out, err = capsys.readouterr()
    assert rc == 0, err
    assert "regions: embed (1 module), layer.0-3, head (2 modules)" in err
    assert "check: passed" in out


def test_saved_weights_load_per_stage_and_match_eager(ray_session, capsys, tmp_path):
    import torch
    import transformers

    from piper.loading import load_model

    folder = write_config(tmp_path / "llama", "llama", weights=True, seed=3)
    rc, out = run_json(capsys, ["run", str(folder), "--gpus", "4", "--pp", "2", "--dp", "2",
                                "--microbatches", "2", "--seq-len", str(SEQ), "--batch-size",
                                str(BATCH), "--device", "cpu", "--steps", "2", "--seed", "0",
                                "--check", "--json"])
    assert rc == 0 and out["check"]["passed"]
    spec = load_model(folder, (), (("seq_len", SEQ),))
    torch.manual_seed(0)
    _, batch, _ = spec.example(BATCH)
    eager = transformers.AutoModelForCausalLM.from_pretrained(folder).train()
    first = float(eager(**batch).loss.detach())
    assert out["steps"][0]["loss"] == pytest.approx(first, rel=1e-5)
    torch.manual_seed(0)
    fresh = float(spec.build()(**batch).loss.detach())  # seeded init: another model
    assert abs(fresh - first) > 1e-3, "the run trained the saved weights, not a fresh init"


def test_saved_moe_experts_load_as_each_rank_holds_them(ray_session, capsys, tmp_path):
    """A Mixtral checkpoint as transformers saves it (each expert's w1/w2/w3 apart, under
    `block_sparse_moe`): under ep2 x etp2 each rank reads only its experts' halves and the
    first loss is `from_pretrained`'s."""
    import torch
    import transformers

    from piper.loading import load_model

    folder = write_config(tmp_path / "mixtral", "mixtral", weights=True, seed=3)
    from safetensors import safe_open

    with safe_open(str(folder / "model.safetensors"), framework="pt") as h:
        assert "model.layers.0.block_sparse_moe.experts.3.w3.weight" in h.keys()  # noqa: SIM118
    rc, out = run_json(capsys, ["run", str(folder), "--gpus", "4", "--tp", "2", "--dp", "2",
                                "--ep", "2", "--etp", "2", "--microbatches", "2",
                                "--seq-len", str(SEQ), "--batch-size", str(BATCH), "--device",
                                "cpu", "--steps", "2", "--seed", "0", "--check", "--json"])
    assert rc == 0 and out["check"]["passed"]
    spec = load_model(folder, (), (("seq_len", SEQ),))
    torch.manual_seed(0)
    _, batch, _ = spec.example(BATCH)
    eager = transformers.AutoModelForCausalLM.from_pretrained(folder).train()
    assert out["steps"][0]["loss"] == pytest.approx(float(eager(**batch).loss.detach()),
                                                    rel=1e-5)


def test_tp_that_splits_a_head_is_one_error_line(capsys, folders):
    rc = main(["run", str(folders["llama"]), "--gpus", "4", "--tp", "4", "--seq-len",
               str(SEQ), "--batch-size", str(BATCH), "--device", "cpu"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) >= 1
    assert err[-1].startswith("error: ") and "tp=4" in err[-1]


def test_weights_of_another_model_are_one_error_line(capsys, tmp_path):
    folder = write_config(tmp_path / "llama", "llama", weights=True)
    cfg = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**cfg, "intermediate_size": 96}))
    rc = main(["run", str(folder), "--gpus", "2", "--pp", "2", "--seq-len", str(SEQ),
               "--batch-size", str(BATCH), "--device", "cpu"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2
    assert err[-1].startswith("error: ") and "gate_proj.weight has shape (64, 32)" in err[-1]
