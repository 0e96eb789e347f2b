"""ZeRO's units: a stage's parameters in buckets, each its own flat buffer and shard, and
each unit's reduce-scatter started from inside the backward that finishes its gradient.

Multi-rank correctness (the units train like one device) is in test_equivalence.py's
`*zero*_buckets*` cases; here a one-process gloo group shows the layout and when each unit
starts."""

from __future__ import annotations

import pytest
import torch

from runtime.execute.zero import ShardedStage

LAYER = 8 * 8 * 4 + 8 * 4  # bytes of one Linear(8, 8): a unit each under this cap


def _mlp() -> tuple[list[torch.nn.Parameter], torch.Tensor]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 8),
                                torch.nn.Tanh(), torch.nn.Linear(8, 8))
    return list(model.parameters()), torch.randn(4, 8)


def _forward(views: list[torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    for i in range(0, len(views), 2):
        x = torch.nn.functional.linear(x, views[i], views[i + 1])
        x = torch.tanh(x) if i + 2 < len(views) else x
    return x.square().sum()


def test_units_are_consecutive_parameters_in_reverse_order(group):
    params, _ = _mlp()
    sh = ShardedStage(params, 3, group, 0, 1, bucket_bytes=LAYER)
    assert [u.first for u in sh.units] == [4, 2, 0]  # the last layer's unit first
    assert len(sh.shards) == 3
    whole = ShardedStage(params, 3, group, 0, 1)
    assert len(whole.units) == 1
    for s in (sh, whole):
        assert s.transient_bytes() == 0  # ZeRO-3: nothing gathered between chunks
        s.materialize()
        assert all(torch.equal(v, p) for v, p in zip(s.views(), params, strict=True))
        s.free()


@pytest.mark.parametrize("zero", [2, 3])
def test_armed_units_reduce_scatter_during_backward_two_at_most(group, zero):
    params, x = _mlp()
    sh = ShardedStage(params, zero, group, 0, 1, bucket_bytes=LAYER)
    if zero == 3:
        sh.materialize()
    started: list[int] = []
    alive: list[int] = []
    start = sh._start

    def spy_start(u, g):
        started.append(u.first)
        start(u, g)
        alive.append(len(sh._inflight))

    sh._start = spy_start  # type: ignore[method-assign]
    seen_during_backward: list[int] = []
    x.requires_grad_(True)
    x.register_hook(lambda _g: seen_during_backward.append(len(started)))
    views = sh.views()
    loss = _forward(views, x)
    sh.arm(views)
    torch.autograd.backward(loss, inputs=[x, *views])
    sh.disarm()
    assert started == [4, 2, 0]
    # x's gradient comes out of the first layer's backward, before that layer's unit is in
    assert seen_during_backward == [2], "the last layers' units started before backward ended"
    assert max(alive) == 1, "a unit's flat gradient goes once the next unit's starts"
    assert sh.take_grads(views) == [None, None, None]
    sh.reduce_scatter(0)
    # the same gradients as eager autograd (a sum over one rank)
    expect = torch.autograd.grad(_forward(params, x.detach()), params)
    got = torch.cat([u.grad_shard for u in reversed(sh.units)])
    assert torch.allclose(got, torch.cat([g.reshape(-1) for g in expect]))


def test_unarmed_units_reduce_scatter_at_the_task(group):
    params, x = _mlp()
    sh = ShardedStage(params, 2, group, 0, 1, bucket_bytes=LAYER)
    views = sh.views()
    torch.autograd.backward(_forward(views, x), inputs=views)
    grads = sh.take_grads(views)
    assert all(g is not None for g in grads)
    sh.add_grad(0, grads)
    assert sh.transient_bytes() == sum(u.nbytes for u in sh.units)  # held until the task
    sh.reduce_scatter(0)
    assert sh.transient_bytes() == 0
    expect = torch.autograd.grad(_forward(params, x), params)
    got = torch.cat([u.grad_shard for u in reversed(sh.units)])
    assert torch.allclose(got, torch.cat([g.reshape(-1) for g in expect]))


def test_a_bracketed_chunk_holds_two_units_at_most_and_trains_like_the_model(group):
    """FSDP's gathers inside a chunk (`runtime.execute.unit_gather`): forward gathers each unit at
    its first op (the next one ahead) and frees it after its last; backward gathers it
    again before its ops' backward and frees it when its gradients are in."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from runtime.execute.stage_module import StageModule
    from runtime.execute.unit_gather import bracketed

    params, x = _mlp()
    expected = torch.autograd.grad(_forward(params, x), params)
    sh = ShardedStage(params, 3, group, 0, 1, bucket_bytes=LAYER)
    gm = make_fx(lambda x, *ws: _forward(list(ws), x))(x, *(p.detach() for p in params))
    sm = StageModule(gm, (("act", "x"), *(("param", str(i)) for i in range(6))), ("out",), ())
    sm, ug, _ = bracketed(sm, {i + 1: sh.unit_of(i) for i in range(6)})
    assert ug.order == (2, 1, 0)  # by first use: the first layer's unit is the last built
    ug.shard = sh
    alive: list[int] = []
    gather, release, prefetch = sh.gather, sh.release, sh.prefetch

    def spy(fn):
        def call(k):
            fn(k)
            alive.append(sum(u.flat.untyped_storage().nbytes() > 0 for u in sh.units))
        return call
    sh.gather, sh.release, sh.prefetch = spy(gather), spy(release), spy(prefetch)
    sh.materialize([ug.first])
    views = sh.views()
    loss = sm.module(x, *views)
    assert sh.transient_bytes() == 0  # every unit freed after its last op
    ug.backward = True
    done = ug.free_when_done(views)
    loss.backward()
    for h in done:
        h.remove()
    assert sh.transient_bytes() == 0  # each freed once its gradients were in
    assert max(alive) == 2 and len(alive) > 6
    for v, g in zip(views, expected, strict=True):
        torch.testing.assert_close(v.grad, g)
