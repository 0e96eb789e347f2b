"""Context parallelism: each of `cp` ranks keeps 1/cp of a sequence's tokens through the
whole model, and attention exchanges keys and values (Liu et al. 2023, ring attention;
Llama 3 paper sec. 3.3.2, all-gather CP).

Causal load balance: the sequence is cut into 2cp chunks and rank c holds chunks c and
2cp-1-c (head-tail, as Megatron-LM and torchtitan), so every rank attends over the same
number of key/query pairs. `positions` says which tokens a rank holds; the data, the
model's position code and attention all use it.

The two attention forms, both exact (online-softmax merge of per-block partial results):

- ring: K/V blocks go round the ring, cp-1 hops, each hop's send/receive issued before the
  block in hand is computed (so it overlaps that compute); backward sends K/V round again
  with their gradient accumulators, and a last hop brings each rank its own K/V gradients.
- all_gather: K/V of the group gathered once, attended with local queries; backward
  reduce-scatters their gradients (Llama 3's form).

`attention` and `positions` are plain functions a captured graph calls (`piper.sequence_split`
puts them where `scaled_dot_product_attention` and the positional `arange`s were); on meta
tensors (capture, cost models) they only make shapes, keeping for backward what the real
op keeps.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist

from piper import lanes
from piper.collectives import CP_GROUP, bound_group

MODES = ("ring", "all_gather")


def positions(rank: int, degree: int, length: int) -> torch.Tensor:
    """Sequence positions of the `length` tokens rank `rank` of `degree` holds (head-tail)."""
    h = length // 2
    first = torch.arange(rank * h, rank * h + h)
    return torch.cat([first, torch.arange((2 * degree - 1 - rank) * h,
                                          (2 * degree - rank) * h)])


def check_length(seq: int, degree: int) -> str | None:
    """Why a sequence of `seq` tokens cannot be split `degree` ways (None: it can)."""
    if seq % (2 * degree):
        return (f"a sequence of {seq} tokens does not split into 2 x {degree} equal chunks "
                f"(context parallelism gives each rank one chunk from each end)")
    return None


def rank_positions(start: int, length: int, degree: int, dtype: torch.dtype,
                   device: torch.device) -> torch.Tensor:
    """What the model's `arange(start, start + length)` over its (local) sequence becomes:
    the positions of this rank's own tokens, offset by `start`."""
    if device.type == "meta":
        return torch.empty(length, dtype=dtype, device=device)
    rank = dist.get_rank(bound_group(CP_GROUP))
    return (positions(rank, degree, length) + start).to(dtype=dtype, device=device)


rank_positions._piper_positions = True  # type: ignore[attr-defined]


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None,
              causal: bool, degree: int, mode: str) -> torch.Tensor:
    """`scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale)` over the whole
    sequence, each rank holding its own tokens of q, k and v ([b, heads, t, d]; k and v may
    have fewer heads, grouped-query attention)."""
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])
    return _Attention.apply(q, k, v, scale, causal, degree, mode)


attention._piper_attention = True  # type: ignore[attr-defined]  # selective recompute
attention._piper_cp = True  # type: ignore[attr-defined]  # cost models


class _Attention(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                causal: bool, degree: int, mode: str) -> torch.Tensor:
        ctx.scale, ctx.causal, ctx.degree, ctx.mode = scale, causal, degree, mode
        lse_shape = q.shape[:-1]
        if q.device.type == "meta":  # shapes, and what the real op keeps for backward
            out = _bshd(torch.empty_like(q, memory_format=torch.contiguous_format))
            lse = q.new_empty(lse_shape, dtype=_acc(q))
            if mode == "all_gather":
                k, v = _gathered_shape(k, degree), _gathered_shape(v, degree)
            ctx.save_for_backward(q, k, v, out, lse)
            return out
        group = bound_group(CP_GROUP)
        rank = dist.get_rank(group)
        qpos = positions(rank, degree, q.shape[-2]).to(q.device)
        if mode == "all_gather":
            k_all, v_all = _gather(k, group, degree), _gather(v, group, degree)
            kpos = torch.cat([positions(r, degree, k.shape[-2]) for r in range(degree)]
                             ).to(q.device)
            out, lse = _block(q, k_all, v_all, qpos, kpos, scale, causal)
            out = _bshd(out.to(q.dtype))
            ctx.save_for_backward(q, k_all, v_all, out, lse)
            return out
        out = lse = None
        kv = torch.stack([k, v])
        for i in range(degree):
            src = (rank - i) % degree
            nxt = _shift(kv, group, degree, _KV) if i < degree - 1 else None
            kpos = positions(src, degree, k.shape[-2]).to(q.device)
            if not (causal and bool(kpos.min() > qpos.max())):  # wholly in the future
                o, s = _block(q, kv[0], kv[1], qpos, kpos, scale, causal)
                out, lse = (o, s) if out is None else _merge(out, lse, o, s)
            if nxt is not None:
                kv = nxt()
        out = _bshd(out.to(q.dtype))
        ctx.save_for_backward(q, k, v, out, lse)
        return out

    @staticmethod
    def backward(ctx: Any, dout: torch.Tensor) -> tuple:
        q, k, v, out, lse = ctx.saved_tensors
        scale, causal, degree = ctx.scale, ctx.causal, ctx.degree
        none = (None,) * 4
        if q.device.type == "meta":
            return (torch.empty_like(q), torch.empty_like(k if ctx.mode == "ring" else
                                                           _local_shape(k, degree)),
                    torch.empty_like(v if ctx.mode == "ring" else _local_shape(v, degree)),
                    *none)
        group = bound_group(CP_GROUP)
        rank = dist.get_rank(group)
        dout32 = dout.to(_acc(q))
        delta = (dout32 * out).sum(-1)
        qpos = positions(rank, degree, q.shape[-2]).to(q.device)
        if ctx.mode == "all_gather":
            t = k.shape[-2] // degree
            kpos = torch.cat([positions(r, degree, t) for r in range(degree)]).to(q.device)
            dq, dk, dv = _block_grad(q, k, v, qpos, kpos, scale, causal, dout32, lse, delta)
            return (dq.to(q.dtype), _scatter(dk, group, degree).to(k.dtype),
                    _scatter(dv, group, degree).to(v.dtype), *none)
        dq = torch.zeros(q.shape, dtype=_acc(q), device=q.device)
        kv = torch.stack([k, v])
        acc = torch.zeros(kv.shape, dtype=_acc(q), device=q.device)
        arriving = None  # the accumulators of the next block, on their way
        for i in range(degree):
            src = (rank - i) % degree
            nxt = _shift(kv, group, degree, _KV) if i < degree - 1 else None
            kpos = positions(src, degree, k.shape[-2]).to(q.device)
            grads = None
            if not (causal and bool(kpos.min() > qpos.max())):
                grads = _block_grad(q, kv[0], kv[1], qpos, kpos, scale, causal, dout32, lse,
                                    delta)
            if arriving is not None:  # waited for only after this block's math
                acc = arriving()
            if grads is not None:
                dq += grads[0]
                acc[0] += grads[1]
                acc[1] += grads[2]
            if nxt is not None:
                kv = nxt()
            # the block's gradients travel with it; the last hop brings each rank its own
            arriving = _shift(acc, group, degree, _ACC)
        acc = arriving()
        return dq.to(q.dtype), acc[0].to(k.dtype), acc[1].to(v.dtype), *none


def _bshd(x: torch.Tensor) -> torch.Tensor:
    """`x` ([b, heads, t, d]) laid out [b, t, heads, d] in memory, as flash kernels return
    attention's output: the output projection's [b, t, heads·d] reshape then reads it in
    place, and one tensor is kept for both backwards (the one saved is the one returned, in
    the input's dtype, as flash keeps it)."""
    return x.transpose(1, 2).contiguous().transpose(1, 2)


def _acc(x: torch.Tensor) -> torch.dtype:
    """The dtype attention accumulates in: fp32, or the input's if wider."""
    return torch.promote_types(x.dtype, torch.float32)


def _expand(x: torch.Tensor, heads: int) -> torch.Tensor:
    """Grouped-query attention: each key/value head serves heads/kv_heads query heads."""
    return x if x.shape[-3] == heads else x.repeat_interleave(heads // x.shape[-3], dim=-3)


def _fold(g: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """Sum an expanded key/value gradient back onto the `kv_heads` heads it came from."""
    heads = g.shape[-3]
    if heads == kv_heads:
        return g
    return g.unflatten(-3, (kv_heads, heads // kv_heads)).sum(-3)


def _scores(q: torch.Tensor, k: torch.Tensor, qpos: torch.Tensor, kpos: torch.Tensor,
            scale: float, causal: bool) -> torch.Tensor:
    s = (q.to(_acc(q)) @ _expand(k, q.shape[-3]).to(_acc(q)).transpose(-1, -2)) * scale
    if causal:
        s = s.masked_fill(kpos[None, :] > qpos[:, None], float("-inf"))
    return s


def _probs(s: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    """exp(s - lse) with rows that see no key (lse = -inf) at zero, not NaN."""
    safe = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)
    return torch.exp(s - safe[..., None])


def _block(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, qpos: torch.Tensor,
           kpos: torch.Tensor, scale: float, causal: bool
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of q over one block of keys: (normalised output, log-sum-exp), fp32."""
    s = _scores(q, k, qpos, kpos, scale, causal)
    lse = torch.logsumexp(s, dim=-1)
    return _probs(s, lse) @ _expand(v, q.shape[-3]).to(_acc(q)), lse


def _merge(o1: torch.Tensor, l1: torch.Tensor, o2: torch.Tensor, l2: torch.Tensor
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """Two partial attentions over disjoint keys as one (the online-softmax rescale)."""
    lse = torch.logaddexp(l1, l2)
    safe = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)
    return (o1 * torch.exp(l1 - safe)[..., None] + o2 * torch.exp(l2 - safe)[..., None], lse)


def _block_grad(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, qpos: torch.Tensor,
                kpos: torch.Tensor, scale: float, causal: bool, dout: torch.Tensor,
                lse: torch.Tensor, delta: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of one block from the final log-sum-exp (flash attention's backward):
    p = exp(s - lse), dv = p^T dO, ds = p (dO v^T - rowsum(dO o)), dq = ds k, dk = ds^T q."""
    heads = q.shape[-3]
    p = _probs(_scores(q, k, qpos, kpos, scale, causal), lse)
    ve = _expand(v, heads).to(_acc(q))
    ds = p * (dout @ ve.transpose(-1, -2) - delta[..., None])
    dq = (ds @ _expand(k, heads).to(_acc(q))) * scale
    dk = (ds.transpose(-1, -2) @ q.to(_acc(q))) * scale
    dv = p.transpose(-1, -2) @ dout
    return dq, _fold(dk, k.shape[-3]), _fold(dv, v.shape[-3])


def _gathered_shape(x: torch.Tensor, degree: int) -> torch.Tensor:
    return x.new_empty((*x.shape[:-2], x.shape[-2] * degree, x.shape[-1]))


def _local_shape(x: torch.Tensor, degree: int) -> torch.Tensor:
    return x.new_empty((*x.shape[:-2], x.shape[-2] // degree, x.shape[-1]))


def _gather(x: torch.Tensor, group: Any, degree: int) -> torch.Tensor:
    """The group's blocks of `x` along the sequence (dim -2), rank order."""
    src = x.movedim(-2, 0).contiguous()
    out = src.new_empty((src.shape[0] * degree, *src.shape[1:]))
    with lanes.waiting():
        dist.all_gather_single(out, src, group=group)
    return out.movedim(0, -2)


def _scatter(g: torch.Tensor, group: Any, degree: int) -> torch.Tensor:
    """Sum of the group's gradients for this rank's block (the transpose of `_gather`)."""
    src = g.movedim(-2, 0).contiguous()
    out = src.new_empty((src.shape[0] // degree, *src.shape[1:]))
    with lanes.waiting():
        dist.reduce_scatter_single(out, src, group=group)
    return out.movedim(0, -2)


_KV, _ACC = 1, 2  # message tags: keys and values, and their gradient accumulators


def _shift(x: torch.Tensor, group: Any, degree: int, tag: int) -> Any:
    """Start sending `x` to the next rank of the ring and receiving the previous one's;
    returns a function that waits and gives what was received. Blocks and accumulators
    in flight at once carry their own `tag`, so neither is taken for the other."""
    rank = dist.get_rank(group)
    nxt = dist.get_global_rank(group, (rank + 1) % degree)
    prev = dist.get_global_rank(group, (rank - 1) % degree)
    x = x.contiguous()
    got = torch.empty_like(x)
    works = [dist.isend(x, nxt, group=group, tag=tag),
             dist.irecv(got, prev, group=group, tag=tag)]

    def wait() -> torch.Tensor:
        with lanes.waiting():
            for w in works:
                w.wait()
        return got

    return wait


def sequence_of(tree: Any) -> int:
    """Tokens per sequence of a batch: dim 1 of its first tensor (model-file convention)."""
    import torch.utils._pytree as pytree

    first = next((t for t in pytree.tree_leaves(tree) if isinstance(t, torch.Tensor)), None)
    if first is None or first.dim() < 2:
        raise ValueError("context parallelism needs token inputs [batch, seq, ...]; the "
                         "first input has shape "
                         f"{None if first is None else tuple(first.shape)}")
    return int(first.shape[1])


def local_tokens(tree: Any, seq: int, rank: int, degree: int) -> Any:
    """Rank `rank`'s tokens of every tensor in `tree` whose dim 1 is the sequence (`seq`
    long): inputs, targets, position ids alike."""
    import torch.utils._pytree as pytree

    pos = positions(rank, degree, seq // degree)

    def take(t: Any) -> Any:
        if isinstance(t, torch.Tensor) and t.dim() >= 2 and t.shape[1] == seq:
            return t.index_select(1, pos.to(t.device))
        return t

    return pytree.tree_map(take, tree)
