"""Training data and schedules: step k's global batch is a function of k alone, each rank's
rows are its slice of it; LR schedules have the documented shape."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from piper.model_file import load_model_file, parse_model_args
from planner.cli import main
from runtime.train.data import BatchSource, TokenFile, write_synthetic_tokens
from runtime.train.training import TrainConfig, lr_factor
from tests.conftest import GPT


@pytest.fixture(scope="module")
def spec():
    return load_model_file(GPT, parse_model_args(["size=tiny"]))


def test_token_windows_visit_every_window_once_per_epoch(tmp_path):
    path = str(tmp_path / "t.bin")
    np.arange(10 * 17, dtype=np.uint16).tofile(path)
    f = TokenFile(path, seq_len=16, seed=3)
    assert f.count == 10
    w = f.windows(0, 10)
    assert sorted(int(x) for x in w[:, 0]) == [17 * i for i in range(10)]
    assert torch.equal(w[:, 1:] - w[:, :-1], torch.ones(10, 16, dtype=torch.long))
    assert not torch.equal(f.windows(10, 10), w), "a new order each epoch"


def test_rank_rows_are_slices_of_the_global_batch(spec, tmp_path):
    path = write_synthetic_tokens(str(tmp_path / "t.bin"), 20_000, vocab=128)
    src = BatchSource(spec, 8, seed=0, data=path)
    for step in (0, 5):
        inputs, targets = src.rows(step, 0, 8)
        assert inputs[0].shape == (8, 16) and targets.shape == (8, 16)
        assert torch.equal(inputs[0][:, 1:], targets[:, :-1]), "next-token targets"
        for lo, hi in ((0, 4), (4, 8), (2, 6)):
            part_in, part_t = BatchSource(spec, 8, seed=0, data=path).rows(step, lo, hi)
            assert torch.equal(part_in[0], inputs[0][lo:hi])
            assert torch.equal(part_t, targets[lo:hi])
    assert not torch.equal(src.rows(0, 0, 8)[0][0], src.rows(1, 0, 8)[0][0])


def test_token_ids_beyond_the_vocabulary_are_bad_input_before_any_worker(capsys, tmp_path):
    path = write_synthetic_tokens(str(tmp_path / "t.bin"), 5_000, vocab=300)  # tiny: 128
    assert main(["run", GPT, "--model-arg", "size=tiny", "--gpus", "2", "--dp", "2",
                 "--data", path]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"error: --data {path}: token id 299 is "
                                               "outside the model's vocabulary of 128")


def test_train_batches_step_k_is_the_kth_batch(spec):
    def batches(batch_size, seed):
        for k in range(100):
            x = torch.full((batch_size, 16), k)
            yield x, x

    from dataclasses import replace

    src = BatchSource(replace(spec, train_batches=batches), 4, seed=0)
    assert int(src.rows(3, 0, 4)[0][0][0, 0]) == 3
    assert int(src.rows(7, 2, 4)[0][0][0, 0]) == 7
    assert int(src.rows(1, 0, 4)[0][0][0, 0]) == 1, "an earlier step restarts the generator"


@pytest.mark.parametrize("schedule", ["constant", "cosine", "linear", "wsd"])
def test_lr_schedules(schedule):
    cfg = TrainConfig(lr_schedule=schedule, warmup=10, decay_steps=110, min_lr=1e-4)
    f = [lr_factor(cfg, s, 1e-3) for s in range(120)]
    assert f[:10] == pytest.approx([(s + 1) / 10 for s in range(10)])
    assert f[10] == pytest.approx(1.0)
    end = 1.0 if schedule == "constant" else 0.1  # min_lr / base
    assert f[110] == pytest.approx(end) and f[119] == pytest.approx(end)
    if schedule == "cosine":
        assert f[60] == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))
    if schedule == "wsd":
        assert f[85] == pytest.approx(1.0) and f[100] < 1.0


def _two_sources(tmp_path):
    """Token files whose ids tell them apart: a.bin holds ids < 64, b.bin ids >= 64."""
    a, b = tmp_path / "a.bin", tmp_path / "b.bin"
    rng = np.random.default_rng(0)
    rng.integers(0, 64, 40_000).astype(np.uint16).tofile(a)
    rng.integers(64, 128, 40_000).astype(np.uint16).tofile(b)
    return str(a), str(b)


def test_a_blend_follows_its_weights_and_every_strategy_sees_the_same_batches(spec, tmp_path):
    a, b = _two_sources(tmp_path)
    blend = [f"0.7:{a}", f"0.3:{b}"]
    src = BatchSource(spec, 8, seed=0, data=blend)
    from_a = []
    for step in range(100):
        inputs, _ = src.rows(step, 0, 8)
        from_a += [bool((row < 64).all()) for row in inputs[0]]
        assert all(bool((row < 64).all() or (row >= 64).all()) for row in inputs[0])
        # a rank of any strategy reads its rows of the same global batch
        for rows in ((0, 4), (4, 8), (2, 6)):
            assert torch.equal(BatchSource(spec, 8, seed=0, data=blend).rows(step, *rows)[0][0],
                               inputs[0][rows[0]:rows[1]])
    share = sum(from_a) / len(from_a)
    assert abs(share - 0.7) <= 3 * math.sqrt(0.7 * 0.3 / len(from_a)), share
    # each file's samples are its own windows in its own order: none repeats within an epoch
    seen = [tuple(r.tolist()) for s in range(20) for r in src.rows(s, 0, 8)[0][0]]
    assert len(set(seen)) == len(seen)


@pytest.mark.parametrize("items, needle", [
    (["0.7:{a}", "{b}"], "each with its weight"),
    (["0:{a}", "1:{b}"], "weights must be finite and > 0"),
])
def test_a_bad_blend_is_one_error_line(capsys, tmp_path, items, needle):
    a, b = _two_sources(tmp_path)
    argv = ["run", GPT, "--model-arg", "size=tiny", "--gpus", "2", "--dp", "2", "--data",
            *(i.format(a=a, b=b) for i in items)]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: --data") and needle in err[0], err
