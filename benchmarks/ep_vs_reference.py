"""Expert parallelism on CPU ranks: piper's dropless routed experts against a straightforward
reference written here (torch's differentiable `all_to_all_single` and a loop over the
local experts) and against a dense dispatch buffer ([E, T, dim], what piper ran before), at
the same routing. Forward + backward of one MoE layer, median of `--repeats`; each rank
times its own work and the slowest rank counts.

    python benchmarks/ep_vs_reference.py --ranks 2 --tokens 4096 --dim 256 --hidden 512 \
        --experts 8 --top-k 2 --repeats 20
"""

from __future__ import annotations

import argparse
import socket
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dist_nn
import torch.multiprocessing as mp
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from piper.collectives import EP_GROUP, bind_group
from piper.moe import routed_experts


def reference(x, idx, gate, w1, w2, experts: int, ep: int) -> torch.Tensor:
    """The textbook EP layer: sort by expert, exchange counts and rows, loop, return."""
    t, d = x.shape
    k = idx.shape[1]
    flat = idx.reshape(-1)
    order = flat.argsort(stable=True)
    counts = torch.bincount(flat, minlength=experts)
    local = experts // ep
    got = torch.empty_like(counts)
    dist.all_to_all_single(got, counts)
    send = counts.view(ep, local).sum(1).tolist()
    recv = got.view(ep, local).sum(1).tolist()
    rows = x[order // k]
    arrived = dist_nn.all_to_all_single(rows.new_empty(sum(recv), d), rows, recv, send)
    per = got.view(ep, local)
    outs, start = [], 0
    pieces = []
    for s in range(ep):  # source-major blocks, each by local expert
        for j in range(local):
            n = int(per[s, j])
            pieces.append((j, arrived[start:start + n]))
            start += n
    for j, p in pieces:
        outs.append(F.gelu(p @ w1[j]) @ w2[j])
    back = dist_nn.all_to_all_single(x.new_empty(sum(send), d), torch.cat(outs), send, recv)
    y = torch.empty_like(back).index_copy(0, order, back)
    return (y.view(t, k, d) * gate.unsqueeze(-1)).sum(1)


def dense(x, idx, gate, w1, w2, experts: int, ep: int) -> torch.Tensor:
    """A fixed [E, T, dim] dispatch buffer: every expert runs on T rows (zeros if unrouted),
    all of it exchanged (piper before dropless experts)."""
    t, d = x.shape
    k = idx.shape[1]
    chosen = idx.reshape(-1)
    onehot = F.one_hot(chosen, experts)
    slot = chosen * t + ((onehot.cumsum(0) - 1) * onehot).sum(-1)
    buf = x.new_zeros(experts * t, d).index_add(0, slot, x.repeat_interleave(k, 0))
    local = experts // ep
    got = dist_nn.all_to_all_single(torch.empty_like(buf), buf.contiguous())
    got = got.view(ep, local, t, d).transpose(0, 1).reshape(local, ep * t, d)
    out = torch.bmm(F.gelu(torch.bmm(got, w1)), w2)
    out = out.view(local, ep, t, d).transpose(0, 1).reshape(experts * t, d)
    back = dist_nn.all_to_all_single(torch.empty_like(out), out.contiguous())
    y = back.index_select(0, slot).view(t, k, d)
    return (y * gate.unsqueeze(-1)).sum(1)


def _worker(rank: int, args: argparse.Namespace, port: int, out: dict) -> None:
    # torch.distributed.nn's all_to_all_single is deprecated, but still what the textbook
    # layer uses: the reference keeps it
    warnings.filterwarnings("ignore", category=FutureWarning)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=args.ranks)
    bind_group(EP_GROUP, dist.group.WORLD)
    g = torch.Generator().manual_seed(rank)
    e, ep = args.experts, args.ranks
    x = torch.randn(args.tokens, args.dim, generator=g, requires_grad=True)
    logits = torch.randn(args.tokens, e, generator=g)
    gate, idx = logits.softmax(-1).topk(args.top_k, dim=-1)
    gate = gate.requires_grad_()
    w1 = (torch.randn(e // ep, args.dim, args.hidden, generator=g) * 0.05).requires_grad_()
    w2 = (torch.randn(e // ep, args.hidden, args.dim, generator=g) * 0.05).requires_grad_()
    times: dict[str, list[float]] = {}
    impls = {"piper": lambda x, idx, gate, w1, w2, e, ep: routed_experts(x, idx, gate,
                                                                         [w1, w2], e, ep),
             "reference": reference, "dense": dense}
    for _ in range(args.repeats + 2):
        for name, fn in impls.items():
            dist.barrier()
            t0 = time.perf_counter()
            y = fn(x, idx, gate, w1, w2, e, ep)
            y.sum().backward()
            times.setdefault(name, []).append(time.perf_counter() - t0)
    out[rank] = {n: statistics.median(v[2:]) for n, v in times.items()}
    dist.destroy_process_group()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--repeats", type=int, default=20)
    args = p.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with mp.Manager() as manager:
        out = manager.dict()
        mp.start_processes(_worker, args=(args, port, out), nprocs=args.ranks,
                           start_method="spawn", join=True)
        worst = {n: max(r[n] for r in out.values()) for n in out[0]}
    print(f"{args.ranks} ranks, {args.tokens} tokens x top-{args.top_k} of {args.experts} "
          f"experts, dim {args.dim}, hidden {args.hidden}; forward + backward, median of "
          f"{args.repeats}, slowest rank")
    for name, s in worst.items():
        print(f"  {name:<10} {s * 1e3:8.2f} ms   {s / worst['reference']:.3f}x the reference")
    return 0


if __name__ == "__main__":
    sys.exit(main())
