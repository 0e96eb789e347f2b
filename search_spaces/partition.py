"""Stage boundaries: split a chain of regions into k contiguous stages of balanced cost."""

from __future__ import annotations

from collections.abc import Sequence
from itertools import accumulate


def balanced_stages(costs: Sequence[float], k: int) -> list[range]:
    """Contiguous ranges of region indices minimising the most expensive stage (exact DP).

    O(k·n²) — n is the number of regions (tens to a few hundred), so this is instant.
    """
    n = len(costs)
    if not 1 <= k <= n:
        raise ValueError(f"cannot cut {n} regions into {k} non-empty stages")
    pre = [0.0, *accumulate(costs)]
    inf = float("inf")
    # best[j][i]: minimal max-stage cost of the first i regions in j stages; cut[j][i]: last cut
    best = [[inf] * (n + 1) for _ in range(k + 1)]
    cut = [[0] * (n + 1) for _ in range(k + 1)]
    best[0][0] = 0.0
    for j in range(1, k + 1):
        for i in range(j, n - (k - j) + 1):
            for c in range(j - 1, i):
                v = max(best[j - 1][c], pre[i] - pre[c])
                if v < best[j][i]:
                    best[j][i], cut[j][i] = v, c
    bounds, i = [], n
    for j in range(k, 0, -1):
        bounds.append(range(cut[j][i], i))
        i = cut[j][i]
    return bounds[::-1]
