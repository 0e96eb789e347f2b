"""A GEMM's time by its shape: output tiles run in waves over the GPU's SMs.

cuBLAS splits a GEMM's M x N output into tiles, one thread block per tile, and runs them in
waves of one tile per SM (NVIDIA, "Matrix Multiplication Background User's Guide", Deep
Learning Performance docs: tile quantization and wave quantization). A GEMM whose last wave
fills few SMs, or whose edges fill few tile rows, runs at the share of the device its tiles
occupy: 2,048 x 2,048 outputs make 128 tiles of 256 x 128, two waves on an A100's 108 SMs of
which the second is 18% full (59% of the slots), or 256 tiles of 128 x 128 in three waves
(79%). The library picks among tile shapes; the largest ones (`TILES`) reach the best-shape
rate, smaller ones less, so this model takes the best of the large ones. With many waves the
loss vanishes, which is why it is the microbatch size and tp of small models that it changes.

A backward runs two GEMMs of the forward's operands in other roles: the input gradient
(M x K output, reducing over N) and the weight gradient (K x N output, reducing over M).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from cost_models.spec import ClusterSpec

TILES = ((256, 128), (128, 256), (128, 128))
"""Output tile shapes cuBLAS uses for large bf16 GEMMs (NVIDIA's guide lists 256x128,
128x256, 128x128, 64x128, 128x64 and 64x64; the smaller ones reuse less data per load)."""


@dataclass(frozen=True, slots=True)
class Gemm:
    """`batch` independent (m x k) @ (k x n) products."""

    batch: int
    m: int
    n: int
    k: int

    @property
    def flops(self) -> int:
        return 2 * self.batch * self.m * self.n * self.k

    def scaled(self, factor: float) -> Gemm:
        """The same GEMM on `factor` times the samples: a batched product has more batches,
        a linear layer more rows."""
        if factor == 1:
            return self
        if self.batch > 1:
            return Gemm(max(1, math.ceil(self.batch * factor)), self.m, self.n, self.k)
        return Gemm(1, max(1, math.ceil(self.m * factor)), self.n, self.k)

    def gradients(self) -> tuple[Gemm, Gemm]:
        """(input gradient, weight gradient) GEMMs of the backward."""
        return (Gemm(self.batch, self.m, self.k, self.n),
                Gemm(self.batch, self.k, self.n, self.m))


def wave_efficiency(gemm: Gemm, sms: int) -> float:
    """Share of the SMs' tile slots a GEMM's useful outputs fill (1: no waves modelled)."""
    if sms <= 0:
        return 1.0
    useful = gemm.batch * gemm.m * gemm.n
    best = 0.0
    for a, b in TILES:
        tiles = gemm.batch * math.ceil(gemm.m / a) * math.ceil(gemm.n / b)
        slots = math.ceil(tiles / sms) * sms * a * b
        best = max(best, useful / slots)
    return best


def gemm_seconds(cluster: ClusterSpec, gemm: Gemm, nbytes: float,
                 low_precision: bool) -> float:
    """One GEMM: its math at the rate its tiles reach (`wave_efficiency`), combined with
    the bytes it streams as `ClusterSpec.matmul_seconds` does."""
    slowed = gemm.flops / wave_efficiency(gemm, cluster.sms)
    return cluster.matmul_seconds(slowed, nbytes, low_precision)
