"""balanced_stages: exact min-max contiguous partition, checked against brute force."""

from __future__ import annotations

import random
from itertools import combinations, pairwise

import pytest

from search_spaces import balanced_stages


def brute_force_best(costs: list[float], k: int) -> float:
    """The smallest most-expensive-stage cost over every way to cut costs into k pieces."""
    n = len(costs)
    best = float("inf")
    for cuts in combinations(range(1, n), k - 1):
        bounds = (0, *cuts, n)
        best = min(best, max(sum(costs[a:b]) for a, b in pairwise(bounds)))
    return best


def assert_contiguous_cover(ranges: list[range], n: int, k: int) -> None:
    assert len(ranges) == k
    assert all(isinstance(r, range) and len(r) > 0 and r.step == 1 for r in ranges)
    assert ranges[0].start == 0 and ranges[-1].stop == n
    assert all(a.stop == b.start for a, b in pairwise(ranges))


def random_cases(seed: int, count: int) -> list[tuple[list[float], int]]:
    rng = random.Random(seed)
    cases = []
    for _ in range(count):
        n = rng.randint(1, 8)
        k = rng.randint(1, n)
        if rng.random() < 0.5:
            costs = [float(rng.randint(0, 9)) for _ in range(n)]  # ties and zero-cost regions
        else:
            costs = [rng.uniform(0.1, 10.0) for _ in range(n)]
        cases.append((costs, k))
    return cases


@pytest.mark.parametrize("costs, k", random_cases(seed=1234, count=200))
def test_balanced_stages_matches_brute_force_optimum(costs: list[float], k: int) -> None:
    ranges = balanced_stages(costs, k)
    assert_contiguous_cover(ranges, len(costs), k)
    got = max(sum(costs[i] for i in r) for r in ranges)
    assert got == pytest.approx(brute_force_best(costs, k), rel=1e-12, abs=1e-12)


def test_every_k_from_one_to_n_covers_all_regions() -> None:
    costs = [3.0, 1.0, 4.0, 1.0, 5.0, 9.0, 2.0, 6.0]
    for k in range(1, len(costs) + 1):
        assert_contiguous_cover(balanced_stages(costs, k), len(costs), k)
    assert balanced_stages(costs, 1) == [range(8)]
    assert balanced_stages(costs, 8) == [range(i, i + 1) for i in range(8)]


def test_one_heavy_region_gets_a_stage_of_its_own() -> None:
    assert balanced_stages([1.0, 1.0, 10.0, 1.0, 1.0], 3) == [range(2), range(2, 3),
                                                             range(3, 5)]


@pytest.mark.parametrize("n, k", [(3, 4), (0, 1), (5, 0), (5, -1)])
def test_impossible_stage_counts_raise_value_error(n: int, k: int) -> None:
    with pytest.raises(ValueError, match=f"cannot cut {n} regions into {k}"):
        balanced_stages([1.0] * n, k)
