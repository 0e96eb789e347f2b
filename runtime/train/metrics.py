"""Training metrics of `piper-plan run`: TensorBoard events (the `tensorboard` package's
writer, through `torch.utils.tensorboard`) and `metrics.jsonl`, one JSON object per step,
both at the step's number (from 1). A resumed run first cuts both back to its checkpoint's
step, so steps trained again after it are not there twice (TensorBoard's `purge_step`)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from piper.errors import PiperError

SCALARS = ("loss", "grad_norm", "lr", "time_s", "tokens_per_s", "mfu")


class MetricsLog:
    def __init__(self, folder: str, ranks: int, after: int = 0) -> None:
        """`after`: the step a resumed run continues from (0: a new run)."""
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            raise PiperError('--log-dir writes TensorBoard events: pip install -e ".[train]" '
                             "(or tensorboard)") from None
        Path(folder).mkdir(parents=True, exist_ok=True)
        self.writer = SummaryWriter(log_dir=folder, purge_step=after + 1 if after else None)
        path = Path(folder) / "metrics.jsonl"
        if after and path.exists():  # rows of steps this run trains again go
            kept = [line for line in path.read_text().splitlines()
                    if line.strip() and json.loads(line).get("step", 0) <= after]
            path.write_text("".join(line + "\n" for line in kept))
        self.jsonl = path.open("a")
        self.ranks = ranks

    def write(self, row: dict[str, Any]) -> None:
        step = row["step"]
        for key in SCALARS:
            if row.get(key) is not None:
                self.writer.add_scalar(f"train/{key}", row[key], step)
        if row.get("eval_loss") is not None:  # as torchtitan and Megatron-LM name it
            self.writer.add_scalar("validation/loss", row["eval_loss"], step)
        for r, b in enumerate(row["peak_memory_bytes"]):
            self.writer.add_scalar(f"memory/peak_bytes_rank{r}", b, step)
        self.writer.flush()
        self.jsonl.write(json.dumps(row) + "\n")
        self.jsonl.flush()

    def event(self, record: dict[str, Any], text: str) -> None:
        """Something that happened to the run (an elastic re-plan): a record in
        metrics.jsonl and a TensorBoard text event, at the step it goes on from."""
        self.writer.add_text(f"run/{record.get('event', 'event')}", text, record["step"])
        self.writer.flush()
        self.jsonl.write(json.dumps(record) + "\n")
        self.jsonl.flush()

    def close(self) -> None:
        self.writer.close()
        self.jsonl.close()

