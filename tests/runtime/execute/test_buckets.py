"""Gradient buckets: the split into buckets, and buckets starting from inside backward.

Multi-rank correctness (the summed gradients train like one device) is in
test_equivalence.py's bucket cases; here a one-process gloo group shows when each bucket
starts."""

from __future__ import annotations

import torch

from runtime.execute.buckets import GradBuckets, bucket_indices


def test_buckets_take_parameters_in_reverse_order_up_to_the_cap():
    assert bucket_indices([4, 4, 4, 4], cap=8) == [[3, 2], [1, 0]]
    assert bucket_indices([4, 16, 4], cap=8) == [[2], [1], [0]]  # too big: alone
    assert bucket_indices([4, 4, 4], cap=100) == [[2, 1, 0]]
    assert bucket_indices([4, 4, 4], cap=1) == [[2], [1], [0]]


def _mlp() -> tuple[torch.nn.Sequential, torch.Tensor]:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 8),
                               torch.nn.Tanh(), torch.nn.Linear(8, 1)), torch.randn(4, 8)


def test_armed_buckets_start_during_backward_in_order(group):
    model, x = _mlp()
    params = list(model.parameters())
    buckets = GradBuckets(params, cap=8 * 8 * 4 + 8 * 4, group=group)  # one layer each
    assert len(buckets.buckets) == 3
    started: list[int] = []
    start = buckets._start
    buckets._start = lambda b: (started.append(b), start(b))  # type: ignore[method-assign]
    seen_during_backward: list[int] = []

    def spy(_g: torch.Tensor) -> None:  # runs before the first layer's gradients exist
        seen_during_backward.append(len(started))

    x.requires_grad_(True)
    x.register_hook(spy)
    buckets.arm()
    model(x).sum().backward()
    assert started == [0, 1, 2]
    assert seen_during_backward == [2], "the last layers' buckets started before backward ended"
    expect = [p.grad.clone() for p in params]
    buckets.finish()
    assert all(torch.equal(p.grad, g) for p, g in zip(params, expect))  # a sum over one rank


def test_unarmed_buckets_start_at_finish(group):
    model, x = _mlp()
    params = list(model.parameters())
    buckets = GradBuckets(params, cap=1, group=group)
    model(x).sum().backward()
    assert buckets._works == []
    expect = [p.grad.clone() for p in params]
    buckets.finish()
    assert all(torch.equal(p.grad, g) for p, g in zip(params, expect))
    # an unused parameter (no gradient) still gets a summed zero gradient
    params[0].grad = None
    buckets.finish()
    assert torch.equal(params[0].grad, torch.zeros_like(params[0]))
