"""A fused attention's time: its FLOPs at the rate its kernel reaches for its key length
and mask (`ClusterSpec.attention_curve`), forward and backward.

Where the keys come from:
- ATen's scaled-dot-product ops: the key tensor's length, one kernel.
- `piper.context_parallel.attention` in ring form: one kernel per step over the rank's own
  t queries and one rank's t keys. Load-balanced (head-tail), the step on the diagonal is
  causal and the others each run half a block unmasked (a half of the queries against all
  t keys, or all queries against half of them); in all-gather form, one causal kernel
  over the gathered cp t keys.
"""

from __future__ import annotations

import math

from torch import fx

from cost_models.spec import ClusterSpec

ATTENTION_BACKWARD_RATIO = 2.5
"""A fused attention's backward recomputes the scores and probabilities it did not keep:
five matmuls (S = QK^T again, dV, dP, dQ, dK) against the forward's two (S, PV)."""

CAUSAL_WORK = 0.5
"""Share of a causal attention's counted FLOPs its fused kernel runs: the blocks above the
diagonal are skipped, (s + 1) / 2s of the s x s scores, about half at training lengths."""


def attention_extent(n: fx.Node) -> tuple[int, int]:
    """(keys per kernel, ring steps) of a fused attention node (see the module docstring)."""
    if getattr(n.target, "_piper_cp", False):
        t, degree = int(n.args[0].meta["val"].shape[-2]), int(n.args[5])  # type: ignore
        return (t, degree) if n.args[6] == "ring" else (t * degree, 1)
    return int(n.args[1].meta["val"].shape[-2]), 1  # type: ignore[union-attr]


def attention_seconds(cluster: ClusterSpec, flops: float, work: float,
                      extent: tuple[int, ...], nbytes: float, low_precision: bool
                      ) -> tuple[float, float]:
    """(forward, backward) seconds of one fused attention of `flops` counted FLOPs, `work`
    of them run (`CAUSAL_WORK`: causal), over `extent` (`attention_extent`; empty: long
    enough for the kernel's best rate), moving `nbytes` forward. Its backward runs
    `ATTENTION_BACKWARD_RATIO` times the FLOPs and bytes at the backward rate (each of its
    five matmuls the size of one of the forward's two)."""
    keys, steps = extent if extent else (math.inf, 1)
    causal = work < 1
    if steps > 1 and causal:  # the diagonal step causal, the others half blocks unmasked
        off = (1 - 1 / steps) / 2
        parts = ((1 / steps, keys, True), (off, keys / 2, False), (off, keys, False))
    else:
        parts = ((1.0, keys, causal),)
    run = flops * work
    times = []
    for backward, ratio in ((False, 1.0), (True, ATTENTION_BACKWARD_RATIO)):
        times.append(ratio * sum(cluster.attention_seconds(run * share, nbytes * share, k, c,
                                                           backward, low_precision)
                                 for share, k, c in parts))
    return times[0], times[1]
