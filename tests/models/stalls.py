"""examples/gpt.py, except that once the file named by `--model-arg stall_file=PATH` exists,
its loss blocks for a minute on every rank that computes it: a step in which no rank moves
on, while every process is alive and sends its heartbeats."""

import os
import sys
import time
from pathlib import Path

import torch
from torch._subclasses import FakeTensor

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
import gpt

BATCH_SIZE = gpt.BATCH_SIZE
TP_PLAN = gpt.TP_PLAN
example_batch = gpt.example_batch
STALL: list[str] = []  # the flag file, set where the model is built (on every rank)


def build_model(stall_file: str = "", **dims):
    if stall_file:
        STALL[:] = [stall_file]
    return gpt.build_model(**dims)


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    real = not (logits.is_meta or isinstance(logits, FakeTensor))
    if real and STALL and os.path.exists(STALL[0]):
        time.sleep(60)
    return gpt.loss_fn(logits, targets)
