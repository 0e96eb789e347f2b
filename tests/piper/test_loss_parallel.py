"""Loss parallelism: which losses are plain cross-entropy, the vocabulary-parallel loss on
real gloo ranks against `F.cross_entropy` on the whole logits, and the capture that keeps
the logits' slice."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from piper.collectives import TP_GROUP, bind_group
from piper.loss_parallel import CrossEntropy, VocabParallelLoss, cross_entropy_of
from tests.gloo_ranks import run_ranks

LOGITS, TARGETS = torch.empty(2, 4, 10), torch.zeros(2, 4, dtype=torch.long)


def _flat(o: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(o.reshape(-1, o.shape[-1]), t.reshape(-1))


def _pair(o: tuple, t: dict) -> torch.Tensor:
    return F.cross_entropy(o[1].flatten(0, 1), t["y"].view(-1), ignore_index=3,
                           reduction="sum")


def test_plain_cross_entropy_is_recognised_through_views_and_pytrees():
    assert cross_entropy_of(_flat, LOGITS, TARGETS) == CrossEntropy(0, 0, -100, "mean")
    assert (cross_entropy_of(_pair, (torch.empty(3), LOGITS), {"y": TARGETS})
            == CrossEntropy(1, 0, 3, "sum"))


@pytest.mark.parametrize("loss", [
    lambda o, t: F.cross_entropy(o.reshape(-1, 10), t.reshape(-1), label_smoothing=0.1),
    lambda o, t: F.cross_entropy(o.reshape(-1, 10), t.reshape(-1), weight=torch.ones(10)),
    lambda o, t: F.cross_entropy(o.reshape(-1, 10), t.reshape(-1), reduction="none").sum(),
    lambda o, t: _flat(o, t) + 1e-4 * o.logsumexp(-1).pow(2).mean(),  # a z-loss
    lambda o, t: F.cross_entropy(o.transpose(1, 2), t),  # classes on dim 1
    lambda o, t: F.cross_entropy(o.transpose(0, 1).reshape(-1, 10), t.reshape(-1)),
], ids=["smoothing", "weights", "none", "z-loss", "dim1", "reordered"])
def test_other_losses_keep_the_gather(loss):
    assert cross_entropy_of(loss, LOGITS, TARGETS) is None


def _worker(rank: int, n: int, port: int, reduction: str, out: dict) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=n)
    try:
        bind_group(TP_GROUP, dist.group.WORLD)
        g = torch.Generator().manual_seed(0)
        logits = torch.randn(3, 5, 8 * n, generator=g, dtype=torch.float64) * 4
        targets = torch.randint(0, 8 * n, (3, 5), generator=g)
        targets[0, :2] = -100  # ignored positions
        whole = logits.clone().requires_grad_(True)
        ref = F.cross_entropy(whole.reshape(-1, 8 * n), targets.reshape(-1),
                              reduction=reduction)
        ref.backward()
        mine = logits.chunk(n, -1)[rank].clone().requires_grad_(True)
        loss = VocabParallelLoss(CrossEntropy(0, 0, -100, reduction), TP_GROUP, n)
        got = loss(mine, targets)
        got.backward()
        out[rank] = max(abs(float(got.detach()) - float(ref.detach())),
                        float((mine.grad - whole.grad.chunk(n, -1)[rank]).abs().max()))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_vocabulary_parallel_loss_matches_the_whole_logits_on_gloo_ranks(reduction):
    out = run_ranks(_worker, 2, reduction)
    assert max(out.values()) < 1e-6, out


def test_capture_outputs_the_slice_and_the_loss_keeps_a_tp_th():
    """Under tp the Llama example's output is the logits' slice (no all-gather), and the
    loss on it keeps 1/tp of the softmax the whole-logit loss keeps."""
    from cost_models.saved import saved_bytes
    from piper.capture import capture
    from piper.model_file import load_model_file
    from piper.sharding import ModelSharding

    spec = load_model_file("examples/llama.py", (("size", "tiny"),))
    whole = capture(spec, 2)
    part = capture(spec, 2, ModelSharding(tp=2, tp_plan=spec.tp_plan))
    assert isinstance(part.loss, VocabParallelLoss) and part.loss.degree == 2
    ops = {str(n.target) for n in part.program.graph.nodes}
    assert "piper.tp_gather.default" not in ops
    # the head keeps its logits and the loss's fp32 softmax: half of each under tp=2
    tail0, tail1 = saved_bytes(whole).tails[-1], saved_bytes(part).tails[-1]
    assert tail1 <= tail0 / 2 + 1024
