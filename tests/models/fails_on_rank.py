"""examples/gpt.py, except that its loss raises on the rank named by $PIPER_TEST_FAIL_RANK
(torchrun's $RANK) once training runs: the output stage fails mid-step while the other
ranks wait for it in a transfer."""

import os
import sys
from pathlib import Path

import torch
from torch._subclasses import FakeTensor

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
import gpt

BATCH_SIZE = gpt.BATCH_SIZE
TP_PLAN = gpt.TP_PLAN
build_model, example_batch = gpt.build_model, gpt.example_batch


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    fail = os.environ.get("PIPER_TEST_FAIL_RANK")
    real = not (logits.is_meta or isinstance(logits, FakeTensor))
    if real and fail is not None and os.environ.get("RANK") == fail:
        raise RuntimeError(f"injected failure on rank {fail}")
    return gpt.loss_fn(logits, targets)
