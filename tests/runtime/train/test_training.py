"""`piper-plan run` trains for real: bf16-mixed against a single-device autocast run on a
token file, checkpoints that resume under the same or another strategy (and export to one
state dict), TensorBoard metrics, a driver killed while saving, and a SIGTERM that stops
after the step in flight, saved, for `--resume auto`. Real workers, real DCP
files; the ground truth is plain PyTorch (`runtime.train.reference`)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest
import torch

from piper.model_file import load_model_file, parse_model_args
from planner.cli import main
from runtime.train.data import write_synthetic_tokens
from runtime.train.reference import max_rel_diff, reference_run
from runtime.train.training import TrainConfig
from tests.conftest import GPT, ROOT, TINY, StderrLines

MOE = str(ROOT / "examples" / "moe.py")
TRAIN = ["--clip-grad", "0.05", "--lr-schedule", "cosine", "--warmup", "2",
         "--lr-decay-steps", "6", "--device", "cpu", "--seed", "0"]
TRAIN_CONFIG = TrainConfig(clip_grad=0.05, lr_schedule="cosine", warmup=2, decay_steps=6)


def run_json(capsys, argv: list[str]) -> tuple[int, dict]:
    rc = main([*argv, "--json"])
    out = capsys.readouterr().out.strip().splitlines()
    return rc, json.loads(out[-1]) if out else {}


@pytest.fixture(scope="module")
def tokens(tmp_path_factory) -> str:
    return write_synthetic_tokens(str(tmp_path_factory.mktemp("data") / "tokens.bin"),
                                  60_000, vocab=128)


@pytest.mark.parametrize("strategy", [
    ["--gpus", "4", "--pp", "2", "--dp", "2", "--zero", "2", "--schedule", "zb1p",
     "--microbatches", "4"],
    ["--gpus", "2", "--dp", "2", "--zero", "3", "--microbatches", "2", "--reduce-dtype",
     "bf16"],  # ZeRO-3 gathers bf16 copies, reduce-scatters in bf16
    # f/g all-reduces in bf16; DDP-style buckets reduced in bf16
    ["--gpus", "4", "--tp", "2", "--dp", "2", "--microbatches", "2", "--bucket-mb", "0.001",
     "--reduce-dtype", "bf16"],
    ["--gpus", "2", "--cp", "2", "--microbatches", "2"],
], ids=["pp2_dp2_zero2_zb1p", "dp2_zero3_bf16_reduce", "tp2_dp2_buckets_bf16_reduce", "cp2"])
def test_bf16_mixed_matches_single_device_autocast(ray_session, capsys, tokens, strategy):
    rc, out = run_json(capsys, ["run", GPT, *TINY, *strategy, "--steps", "20", "--data",
                                tokens, "--precision", "bf16-mixed", "--lr", "3e-3",
                                "--device", "cpu", "--check"])
    assert rc == 0 and out["check"]["passed"], out.get("check")
    spec = load_model_file(GPT, parse_model_args(["size=tiny"]))
    train = TrainConfig(precision="bf16-mixed", lr=3e-3, data=tokens, decay_steps=20)
    ref = reference_run(spec, batch_size=spec.batch_size, steps=20, seed=0, train=train)
    assert max_rel_diff([s["loss"] for s in out["steps"]], [r.loss for r in ref]) <= 2e-2
    fp32 = reference_run(spec, batch_size=spec.batch_size, steps=1, seed=0,
                         train=TrainConfig(lr=3e-3, data=tokens))
    assert ref[0].loss != fp32[0].loss, "the reference really computes in bf16"
    # --data: each step is a new batch (a fixed batch would repeat the same first loss)
    assert len({round(r.loss, 6) for r in ref}) == 20


def test_bf16_mixed_zero1_resumes_from_its_fp32_master(ray_session, capsys, tmp_path, tokens):
    """bf16-mixed ZeRO-1 keeps bf16 weights beside an fp32 master shard: a checkpoint holds
    the master, and a resume gathers the bf16 weights from it, so 3 + 3 steps are 6."""
    common = ["run", GPT, *TINY, "--gpus", "2", "--dp", "2", "--zero", "1", "--microbatches",
              "2", "--precision", "bf16-mixed", "--lr", "3e-3", "--data", tokens,
              "--device", "cpu"]
    ckpt = str(tmp_path / "ckpt")
    rc, whole = run_json(capsys, [*common, "--steps", "6"])
    assert rc == 0
    rc, _ = run_json(capsys, [*common, "--steps", "3", "--checkpoint-dir", ckpt])
    assert rc == 0
    rc, resumed = run_json(capsys, [*common, "--steps", "6", "--checkpoint-dir", ckpt,
                                    "--resume"])
    assert rc == 0 and [s["step"] for s in resumed["steps"]] == [4, 5, 6]
    assert [s["loss"] for s in resumed["steps"]] == pytest.approx(
        [s["loss"] for s in whole["steps"][3:]], rel=1e-6)


# (first strategy, the strategy resumed under, model)
RESUMES = {
    "same": (["--gpus", "2", "--pp", "2", "--schedule", "zb1p", "--microbatches", "4"],
             ["--gpus", "2", "--pp", "2", "--schedule", "zb1p", "--microbatches", "4"],
             [GPT, *TINY]),
    "pp2_dp2_zero3_to_tp2_dp2_zero1": (
        ["--gpus", "4", "--pp", "2", "--dp", "2", "--zero", "3", "--microbatches", "4"],
        ["--gpus", "4", "--tp", "2", "--dp", "2", "--zero", "1", "--microbatches", "2"],
        [GPT, *TINY, "--model-arg", "tie=true"]),
    # ZeRO-3 shards over dp x cp resumed as tensor parallelism (a Llama: RoPE positions)
    "llama_cp2_dp2_zero3_to_tp2_sp": (
        ["--gpus", "4", "--cp", "2", "--dp", "2", "--zero", "3", "--microbatches", "2"],
        ["--gpus", "2", "--tp", "2", "--sp", "--microbatches", "2"],
        [str(ROOT / "examples" / "llama.py"), *TINY]),
    # experts cut by EP and expert tensor parallelism, resumed whole on each rank
    "moe_tp2_ep2_etp2_dp2_zero2_to_pp2_dualpipev": (
        ["--gpus", "4", "--tp", "2", "--dp", "2", "--ep", "2", "--etp", "2", "--zero", "2",
         "--microbatches", "2"],
        ["--gpus", "2", "--pp", "2", "--schedule", "dualpipev", "--microbatches", "4"],
        [MOE, *TINY]),
}


@pytest.mark.parametrize("case", sorted(RESUMES))
def test_three_steps_then_resume_equals_six_uninterrupted(ray_session, capsys, tmp_path,
                                                          case):
    first, then, model = RESUMES[case]
    ckpt, logs = tmp_path / "ckpt", tmp_path / "logs"
    rc, out = run_json(capsys, ["run", *model, *first, *TRAIN, "--steps", "3",
                                "--checkpoint-dir", str(ckpt), "--log-dir", str(logs)])
    assert rc == 0 and [s["step"] for s in out["steps"]] == [1, 2, 3]
    assert sorted(p.name for p in ckpt.iterdir()) == ["step-0000003"]
    rc, out = run_json(capsys, ["run", *model, *then, *TRAIN, "--steps", "6",
                                "--checkpoint-dir", str(ckpt), "--resume", "--check"])
    assert rc == 0
    assert [s["step"] for s in out["steps"]] == [4, 5, 6], "no step lost or repeated"
    assert out["check"]["passed"] and out["check"]["max_rel_diff"] <= 1e-4
    spec = load_model_file(model[0], parse_model_args(model[2::2]))
    state: dict = {}
    ref = reference_run(spec, batch_size=spec.batch_size, steps=6, seed=0,
                        train=TRAIN_CONFIG, state=state)
    assert max_rel_diff([s["grad_norm"] for s in out["steps"]],
                        [r.grad_norm for r in ref[3:]]) <= 5e-4
    # the final checkpoint as one single-device state dict (tied names included)
    weights = tmp_path / "model.safetensors"
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        assert main(["export-weights", str(ckpt), "--out", str(weights)]) == 0
    assert not [w for w in said if "torch.distributed" in str(w.message)], "nothing to act on"
    from safetensors.torch import load_file

    plain = spec.build()
    plain.load_state_dict(load_file(str(weights)), strict=True)
    for name, t in plain.state_dict().items():
        torch.testing.assert_close(t, state[name], rtol=1e-4, atol=1e-5, msg=name)
    if case == "same":
        _check_metrics(logs, steps=3, ranks=2)
        # a checkpoint of another model is refused on the driver: exit 2, one line
        rc = main(["run", GPT, "--model-arg", "size=mini", *then, "--steps", "8",
                   "--device", "cpu", "--checkpoint-dir", str(ckpt), "--resume"])
        err = capsys.readouterr().err.strip().splitlines()
        assert rc == 2 and err[-1].startswith("error: "), err
        assert "has shape" in err[-1] and "step-0000006" in err[-1]


def _check_metrics(logs: Path, steps: int, ranks: int) -> None:
    """TensorBoard's own reader finds every metric at every step; metrics.jsonl too."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(logs))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    want = {f"train/{k}" for k in ("loss", "grad_norm", "lr", "time_s", "tokens_per_s", "mfu")}
    want |= {f"memory/peak_bytes_rank{r}" for r in range(ranks)}
    assert want <= tags, want - tags
    for tag in want:
        assert [e.step for e in acc.Scalars(tag)] == list(range(1, steps + 1)), tag
    rows = [json.loads(line) for line in (logs / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    assert all(r["loss"] > 0 and r["grad_norm"] > 0 and r["tokens_per_s"] > 0 for r in rows)
    loss = [e.value for e in acc.Scalars("train/loss")]
    assert loss == pytest.approx([r["loss"] for r in rows], rel=1e-6)


def test_driver_killed_while_saving_leaves_the_previous_checkpoint(ray_session, capsys,
                                                                     tmp_path):
    """kill -9 of the driver while the ranks write a checkpoint: the one before stays whole
    and the run resumes from it to the same losses as single-device training."""
    ckpt = tmp_path / "ckpt"
    address = ray_session.get_runtime_context().gcs_address
    argv = ["run", GPT, *TINY, "--gpus", "2", "--dp", "2", "--zero", "3", "--microbatches",
            "2", *TRAIN, "--steps", "60", "--checkpoint-dir", str(ckpt),
            "--checkpoint-every", "1", "--address", address]
    p = subprocess.Popen([sys.executable, "-m", "planner.cli", *argv], cwd=ROOT,
                         stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    caught = None
    try:
        end = time.monotonic() + 180
        while time.monotonic() < end and p.poll() is None and caught is None:
            done = [d for d in ckpt.glob("step-*")] if ckpt.is_dir() else []
            saving = list(ckpt.glob(".tmp-step-*")) if ckpt.is_dir() else []
            if len(done) >= 2 and saving:
                os.kill(p.pid, signal.SIGKILL)
                caught = saving[0].name
            time.sleep(0.002)
    finally:
        if p.poll() is None and caught is None:
            p.kill()
        p.wait(timeout=30)
    assert caught is not None, f"the run ended before a save was caught: {p.stderr.read()}"
    complete = sorted(d.name for d in ckpt.glob("step-*"))
    assert all((ckpt / d / "piper.json").is_file() for d in complete)
    step = int(complete[-1].split("-")[1])
    rc, out = run_json(capsys, [*argv[:-2], "--steps", str(step + 2), "--resume", "--check"])
    assert rc == 0 and out["steps"][0]["step"] == step + 1
    assert out["check"]["passed"]


def test_sigterm_finishes_the_step_saves_it_and_resume_auto_goes_on(capsys, tmp_path):
    """A scheduler's SIGTERM: the step in flight finishes and is saved, the run exits 143
    naming it; the same command with --resume auto trains on from there to the losses of
    uninterrupted single-device training, and on an empty folder starts at step 1."""
    ckpt = tmp_path / "ckpt"
    argv = ["run", GPT, *TINY, "--gpus", "2", "--pp", "2", "--microbatches", "2", *TRAIN,
            "--launcher", "local", "--checkpoint-dir", str(ckpt), "--checkpoint-every", "4"]
    p = subprocess.Popen([sys.executable, "-m", "planner.cli", *argv, "--steps", "3000",
                          "--json"], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True)
    said = StderrLines(p)
    try:
        assert said.wait_for("step 5/", 180), str(said)
        p.send_signal(signal.SIGTERM)
        p.wait(timeout=120)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait(timeout=30)
    lines = said.all()
    assert p.returncode == 143, "".join(lines)
    m = re.match(r"stopped by SIGTERM after step (\d+): the same command with --resume auto",
                 lines[-1])
    assert m, "".join(lines)
    step = int(m.group(1))
    assert step >= 5 and (ckpt / f"step-{step:07d}" / "piper.json").is_file()
    out = json.loads(p.stdout.read().strip().splitlines()[-1])
    assert out["stopped"] == {"signal": "SIGTERM", "after_step": step}
    rc, out = run_json(capsys, [*argv, "--steps", str(step + 2), "--resume", "auto",
                                "--check"])
    assert rc == 0 and [s["step"] for s in out["steps"]] == [step + 1, step + 2]
    assert out["check"]["passed"]
    empty = tmp_path / "empty"
    rc = main([*argv[:-4], "--checkpoint-dir", str(empty), "--steps", "1", "--resume",
               "auto", "--json"])
    got = capsys.readouterr()
    assert rc == 0 and [s["step"] for s in json.loads(got.out)["steps"]] == [1]
    assert "--resume auto: no complete checkpoint" in got.err
