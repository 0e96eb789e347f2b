"""End to end: strategies run on real worker processes (Ray actors, gloo) and reproduce the
losses of plain single-device PyTorch training to fp32 tolerance."""

from __future__ import annotations

import json

import pytest

from piper.model_file import load_model_file, parse_model_args
from planner.cli import main
from runtime.train.reference import max_rel_diff, reference_run
from runtime.train.training import TrainConfig
from tests.conftest import GPT, ROOT, TINY

CASES = {
    "pp2_dp2_1f1b": ["--gpus", "4", "--pp", "2", "--dp", "2", "--schedule", "1f1b",
                     "--microbatches", "4"],
    "pp2_gpipe": ["--gpus", "2", "--pp", "2", "--schedule", "gpipe", "--microbatches", "4"],
    "pp4_1f1b": ["--gpus", "4", "--pp", "4", "--schedule", "1f1b", "--microbatches", "8"],
    "dp4": ["--gpus", "4", "--dp", "4", "--microbatches", "2"],
    "pp2_dp2_zero3_interleaved": ["--gpus", "4", "--pp", "2", "--dp", "2", "--zero", "3",
                                  "--schedule", "interleaved-1f1b", "--virtual-stages", "2",
                                  "--microbatches", "2"],
    "pp2_dp2_zero2_zb1p": ["--gpus", "4", "--pp", "2", "--dp", "2", "--zero", "2",
                           "--schedule", "zb1p", "--microbatches", "4"],
    # ZeRO-3 with a split backward: gathered for F and I, W needs no parameters
    "pp2_dp2_zero3_dualpipev": ["--gpus", "4", "--pp", "2", "--dp", "2", "--zero", "3",
                                "--schedule", "dualpipev", "--microbatches", "4"],
    "tied_pp2_dp2_zero3_dualpipev": ["--gpus", "4", "--pp", "2", "--dp", "2", "--zero", "3",
                                     "--schedule", "dualpipev", "--microbatches", "4"],
    "pp2_dp2_zero2_comm_stream": ["--gpus", "4", "--pp", "2", "--dp", "2", "--zero", "2",
                                  "--microbatches", "4", "--comm-stream"],
    # DDP-style buckets (1 KiB: several per stage), started inside the last backward; on a
    # comm stream or with a split backward they start at the all-reduce instead
    "pp2_dp2_buckets_comm_stream": ["--gpus", "4", "--pp", "2", "--dp", "2",
                                    "--microbatches", "4", "--bucket-mb", "0.001",
                                    "--comm-stream"],
    "pp2_dp2_buckets_interleaved": ["--gpus", "4", "--pp", "2", "--dp", "2", "--schedule",
                                    "interleaved-1f1b", "--virtual-stages", "2",
                                    "--microbatches", "2", "--bucket-mb", "0.001"],
    "tied_pp2_dp2_buckets_zb1p": ["--gpus", "4", "--pp", "2", "--dp", "2", "--schedule",
                                  "zb1p", "--microbatches", "4", "--bucket-mb", "0.001"],
    # ZeRO in units (FSDP's, 1 KiB: several per stage): reduce-scatters started inside
    # every backward (compute stream, backward not split, no pairs), or at the task
    "dp2_zero3_buckets": ["--gpus", "2", "--dp", "2", "--zero", "3", "--microbatches", "2",
                          "--bucket-mb", "0.001"],
    "recompute_pp2_dp2_zero3_buckets": ["--gpus", "4", "--pp", "2", "--dp", "2", "--zero",
                                        "3", "--microbatches", "4", "--bucket-mb", "0.001",
                                        "--recompute"],
    "pp2_dp2_zero3_buckets_zb1p": ["--gpus", "4", "--pp", "2", "--dp", "2", "--zero", "3",
                                   "--schedule", "zb1p", "--microbatches", "4",
                                   "--bucket-mb", "0.001"],
    "tied_pp2_dp2_zero1_buckets_dualpipev": ["--gpus", "4", "--pp", "2", "--dp", "2",
                                             "--zero", "1", "--schedule", "dualpipev",
                                             "--microbatches", "4", "--bucket-mb", "0.001"],
    "tied_pp2_dp2_zero3": ["--gpus", "4", "--pp", "2", "--dp", "2", "--zero", "3",
                           "--microbatches", "2"],
    "tied_pp2_interleaved": ["--gpus", "2", "--pp", "2", "--schedule", "interleaved-1f1b",
                             "--virtual-stages", "2", "--microbatches", "2"],
    "skip_pp4": ["--gpus", "4", "--pp", "4", "--microbatches", "4"],
    "pp2_interleaved_v3_dp2": ["--gpus", "4", "--pp", "2", "--dp", "2", "--schedule",
                               "interleaved-1f1b", "--virtual-stages", "3",
                               "--microbatches", "2"],
    # activation recompute: each region rebuilt in B (or I); ZeRO-3 gathers before the
    # rebuild; the tensor-parallel f/g all-reduces run again inside it
    "recompute_pp2_zb1p": ["--gpus", "2", "--pp", "2", "--schedule", "zb1p",
                           "--microbatches", "4", "--recompute"],
    "recompute_pp2_dp2_zero3": ["--gpus", "4", "--pp", "2", "--dp", "2", "--zero", "3",
                                "--microbatches", "2", "--recompute"],
    "recompute_tp2_sp": ["--gpus", "2", "--tp", "2", "--sp", "--microbatches", "2",
                         "--recompute"],
    # selective recompute (the Llama: RMSNorm, rotary embeddings, SwiGLU): runs of cheap
    # ops, or each attention op, checkpointed on their own
    "llama_recompute_op_pp2_dp2_zero3": ["--gpus", "4", "--pp", "2", "--dp", "2", "--zero",
                                         "3", "--microbatches", "2", "--recompute", "op"],
    "llama_recompute_attention_tp2_sp": ["--gpus", "2", "--tp", "2", "--sp",
                                         "--microbatches", "2", "--recompute", "attention"],
    # tensor parallelism (examples/gpt.py's TP_PLAN: Megatron column/row pairs)
    # + sequence parallelism: a learned position table split by the sequence
    "tp2_sp_pp2_1f1b": ["--gpus", "4", "--tp", "2", "--sp", "--pp", "2", "--microbatches",
                        "4"],
    "tp2_dp2_zero3": ["--gpus", "4", "--tp", "2", "--dp", "2", "--zero", "3",
                      "--microbatches", "2"],
    # with sequence parallelism each linear keeps its input's slice and gathers it again
    # in backward (`runtime.execute.regather`), also when its weight product is deferred to W
    "tp2_sp_pp2_zb1p": ["--gpus", "4", "--tp", "2", "--sp", "--pp", "2", "--schedule",
                        "zb1p", "--microbatches", "4"],
    # expert parallelism (examples/moe.py: top-2 of 4 routed experts per layer)
    "moe_ep2_dp2": ["--gpus", "2", "--dp", "2", "--ep", "2"],
    "moe_ep2_dp4_zero2": ["--gpus", "4", "--dp", "4", "--ep", "2", "--zero", "2"],
    "moe_ep2_pp2_dp2_zero3_interleaved": ["--gpus", "4", "--pp", "2", "--dp", "2", "--ep", "2",
                                          "--zero", "3", "--schedule", "interleaved-1f1b",
                                          "--virtual-stages", "2", "--microbatches", "2"],
    "moe_ep2_pp2_dp2_dualpipev": ["--gpus", "4", "--pp", "2", "--dp", "2", "--ep", "2",
                                  "--schedule", "dualpipev", "--microbatches", "4"],
    # both at once: TP splits attention inside each replica, EP splits the experts over
    # replicas of equal TP index (each TP rank runs its replica's experts whole)
    # ... or, with expert tensor parallelism, half of each expert's hidden features (the
    # experts' rows summed over the TP group as a row-parallel layer's are)
    "moe_tp2_ep2_etp2_dp2_zero3": ["--gpus", "4", "--tp", "2", "--dp", "2", "--ep", "2",
                                   "--etp", "2", "--zero", "3", "--microbatches", "2"],
    # ... or Megatron's expert mesh: EP over both replicas' TP ranks; without sequence
    # parallelism each TP rank routes its half of the tokens and the outputs are gathered
    "moe_tp2_ep4_over_tp_dp2_zero2": ["--gpus", "4", "--tp", "2", "--dp", "2", "--ep", "4",
                                      "--ep-over-tp", "--zero", "2", "--microbatches", "2"],
    "moe_tp2_ep2_pp2_dp2_zero2_dualpipev": ["--gpus", "8", "--tp", "2", "--pp", "2", "--dp",
                                            "2", "--ep", "2", "--zero", "2", "--schedule",
                                            "dualpipev", "--microbatches", "4"],
    "moe_pp2_dp2_zero3_zb1p": ["--gpus", "4", "--pp", "2", "--dp", "2", "--zero", "3",
                               "--schedule", "zb1p", "--microbatches", "4"],
    # Llama: RoPE, grouped-query attention (4 query / 2 key-value heads), SwiGLU; with
    # sequence parallelism (stages send 1/tp of the sequence; norms' gradients summed)
    "llama_tp2_sp_pp2": ["--gpus", "4", "--tp", "2", "--sp", "--pp", "2",
                         "--microbatches", "2"],
    "qwen3_tied_tp2_sp_dp2_zero3": ["--gpus", "4", "--tp", "2", "--sp", "--dp", "2",
                                    "--zero", "3", "--microbatches", "2"],
    # Qwen3-style: q/k RMSNorm per head, embedding tied to the output head across stages
    "qwen3_tied_tp2_pp2": ["--gpus", "4", "--tp", "2", "--pp", "2", "--microbatches", "2"],
    # context parallelism: each rank holds two chunks of every sequence (head and tail),
    # RoPE at its tokens' positions; keys and values passed round a ring or all-gathered;
    # gradients summed (and ZeRO-sharded) over dp x cp
    "llama_cp4": ["--gpus", "4", "--cp", "4", "--microbatches", "2"],
    "llama_cp2_all_gather_dp2_zero1_recompute": ["--gpus", "4", "--cp", "2", "--cp-attention",
                                                 "all_gather", "--dp", "2", "--zero", "1",
                                                 "--microbatches", "2", "--recompute"],
    "llama_cp2_tp2_sp_recompute_op": ["--gpus", "4", "--cp", "2", "--tp", "2", "--sp",
                                      "--microbatches", "2", "--recompute", "op"],
    "llama_cp2_pp2_dp2_zero3": ["--gpus", "8", "--cp", "2", "--pp", "2", "--dp", "2",
                                "--zero", "3", "--microbatches", "2"],
    "llama_cp2_pp2_dp2_zero3_zb1p": ["--gpus", "8", "--cp", "2", "--pp", "2", "--dp", "2",
                                     "--zero", "3", "--schedule", "zb1p", "--microbatches",
                                     "2"],
    # a learned position table read at the rank's positions; a V of two stages per rank
    "cp2_pp2_dualpipev": ["--gpus", "4", "--cp", "2", "--pp", "2", "--schedule", "dualpipev",
                          "--microbatches", "4"],
}

MOE = [str(ROOT / "examples" / "moe.py"), *TINY]
# cases on another model: [model file, --model-arg, KEY=VALUE, ...]
OTHER_MODEL = {
    **{case: MOE for case in CASES if case.startswith("moe_")},
    **{case: [str(ROOT / "examples" / "llama.py"), *TINY] for case in CASES
       if case.startswith("llama_")},
    "qwen3_tied_tp2_sp_dp2_zero3": [str(ROOT / "examples" / "llama.py"), "--model-arg",
                                    "size=qwen3-tiny"],
    "qwen3_tied_tp2_pp2": [str(ROOT / "examples" / "llama.py"), "--model-arg",
                           "size=qwen3-tiny"],
    "tied_pp2_dp2_zero3": [GPT, *TINY, "--model-arg", "tie=true"],
    "tied_pp2_interleaved": [GPT, *TINY, "--model-arg", "tie=true"],
    "tied_pp2_dp2_zero3_dualpipev": [GPT, *TINY, "--model-arg", "tie=true"],
    "tied_pp2_dp2_buckets_zb1p": [GPT, *TINY, "--model-arg", "tie=true"],
    "tied_pp2_dp2_zero1_buckets_dualpipev": [GPT, *TINY, "--model-arg", "tie=true"],
    "skip_pp4": [str(ROOT / "tests" / "models" / "skip_mlp.py")],
}


def run_json(capsys, argv: list[str]) -> tuple[int, dict]:
    rc = main(argv)
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 1, "--json prints exactly one line on stdout"
    return rc, json.loads(out[0])


# every case trains as a real run does: global gradient clipping (set low, so that it
# clips every step) and a warmed-up cosine schedule, which must match single-device
# `clip_grad_norm_` and the same schedule
TRAIN = ["--clip-grad", "0.05", "--lr-schedule", "cosine", "--warmup", "2", "--steps", "5"]
TRAIN_CONFIG = TrainConfig(clip_grad=0.05, lr_schedule="cosine", warmup=2, decay_steps=5)


@pytest.mark.parametrize("case", sorted(CASES))
def test_strategy_reproduces_single_device_losses(ray_session, capsys, case):
    argv = ["run", GPT, *TINY, *CASES[case], "--device", "cpu", *TRAIN, "--seed", "0",
            "--check", "--json"]
    argv = argv[:1] + OTHER_MODEL.get(case, argv[1:4]) + argv[4:]
    rc, out = run_json(capsys, argv)
    assert rc == 0
    assert out["check"]["passed"] and out["check"]["max_rel_diff"] <= 1e-4
    model = OTHER_MODEL.get(case, [GPT, *TINY])
    spec = load_model_file(model[0], parse_model_args(model[2::2]))
    ref = reference_run(spec, batch_size=spec.batch_size, steps=5, seed=0, train=TRAIN_CONFIG)
    assert max_rel_diff([s["loss"] for s in out["steps"]], [r.loss for r in ref]) <= 1e-4
    assert max_rel_diff([s["grad_norm"] for s in out["steps"]],
                        [r.grad_norm for r in ref]) <= 5e-4, "the norm over every shard"
    assert [s["lr"] for s in out["steps"]] == pytest.approx([r.lr for r in ref], rel=1e-9)
    assert all(r.grad_norm > 0.05 for r in ref), "clipping is active at every step"
    assert ref[4].loss < ref[0].loss, "training makes progress, so equal losses are not trivial"
    world = int(CASES[case][1])
    assert len(out["peak_memory_bytes"]) == world
    assert all(b > 0 for b in out["peak_memory_bytes"])


def test_hand_written_strategy_file_runs(ray_session, capsys, tmp_path):
    strategy = ROOT / "examples" / "strategies" / "gpt_tiny_1f1b.py"
    trace = tmp_path / "trace.json"
    rc, out = run_json(capsys, ["run", GPT, *TINY, "--gpus", "2", "--device", "cpu",
                                "--strategy", str(strategy), "--steps", "2", "--check",
                                "--json", "--trace", str(trace)])
    assert rc == 0 and out["check"]["passed"]
    assert out["summary"]["pp"] == 2 and out["summary"]["microbatches"] == 4
    events = json.loads(trace.read_text())["traceEvents"]
    names = {e["name"] for e in events if e["ph"] == "X"}
    assert {"F0.0", "B1.3", "U0", "U1"} <= names
    assert any(e.get("flow_out") for e in events), "flow arrows from sends to receives"
    assert any(e.get("flow_in") for e in events)


def test_different_seed_changes_losses(ray_session, capsys):
    argv = ["run", GPT, *TINY, "--gpus", "2", "--pp", "2", "--steps", "1", "--json"]
    _, a = run_json(capsys, [*argv, "--seed", "0"])
    _, b = run_json(capsys, [*argv, "--seed", "1"])
    assert a["steps"][0]["loss"] != b["steps"][0]["loss"]


def test_a_capacity_factor_drops_the_same_rows_under_every_strategy(ray_session, capsys):
    """--capacity-factor 0.5 drops routed rows (the losses are not dropless training's),
    and every strategy trains as single-device training with that capacity does, whether
    replicas, EP ranks or microbatches split the batch."""
    spec = load_model_file(MOE[0], parse_model_args(MOE[2::2]))
    dropless = reference_run(spec, batch_size=spec.batch_size, steps=3, seed=0)
    for flags in (["--gpus", "4", "--dp", "2", "--pp", "2", "--ep", "2", "--microbatches",
                   "2"], ["--gpus", "2", "--dp", "2", "--microbatches", "2"]):
        rc, out = run_json(capsys, ["run", *MOE, *flags, "--capacity-factor", "0.5",
                                    "--device", "cpu", "--steps", "3", "--seed", "0",
                                    "--check", "--json"])
        assert rc == 0 and out["check"]["passed"], out.get("check")
        assert out["summary"]["capacity"] == 0.5
        losses = [s["loss"] for s in out["steps"]]
        assert max_rel_diff(losses, [r.loss for r in dropless]) > 1e-3, "nothing dropped"
