"""The runtime's fused norm and gated activation: the same values and gradients as the ATen
ops they replace (fp32 and under bf16 autocast), keeping only their inputs for backward."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import fx

from runtime.execute.fused import fuse_elementwise


class _Layer(torch.nn.Module):
    def __init__(self, act: str) -> None:
        super().__init__()
        self.norm = torch.nn.RMSNorm(16)
        self.gate, self.up = torch.nn.Linear(16, 32), torch.nn.Linear(16, 32)
        self.down = torch.nn.Linear(32, 16)
        self.act = act

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x)
        g = F.silu(self.gate(h)) if self.act == "silu" else F.gelu(self.gate(h), approximate="tanh")
        return x + self.down(self.up(h) * g)


def _graphs(act: str) -> tuple[fx.GraphModule, fx.GraphModule, dict[str, torch.Tensor]]:
    torch.manual_seed(0)
    layer = _Layer(act)
    x = torch.randn(2, 8, 16)
    ep = torch.export.export(layer, (x,))
    plain = ep.module()
    fused = ep.module()
    assert fuse_elementwise(fused) == 2, "the norm and the gated product"
    return plain, fused, dict(layer.named_parameters())


def _run(gm: fx.GraphModule, x: torch.Tensor, bf16: bool) -> tuple[torch.Tensor, list, int]:
    """Output, gradients (input and parameters) and bytes packed for backward."""
    packed: dict[int, int] = {}
    params = {p.untyped_storage()._cdata for p in gm.parameters()}

    def pack(t: torch.Tensor) -> torch.Tensor:
        key = t.untyped_storage()._cdata
        if key not in params:
            packed[key] = t.untyped_storage().nbytes()
        return t

    for p in gm.parameters():
        p.grad = None
    x = x.clone().requires_grad_(True)
    with (torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t),
          torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16)):
        y = gm(x)
    y.float().pow(2).sum().backward()
    return y, [x.grad, *(p.grad for p in gm.parameters())], sum(packed.values())


@pytest.mark.parametrize("act", ["silu", "gelu"])
@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16-autocast"])
def test_fused_ops_compute_the_same_and_keep_less(act: str, bf16: bool) -> None:
    plain, fused, _ = _graphs(act)
    x = torch.randn(2, 8, 16)
    y0, g0, kept0 = _run(plain, x, bf16)
    y1, g1, kept1 = _run(fused, x, bf16)
    assert y1.dtype == y0.dtype and torch.equal(y0, y1)
    for a, b in zip(g0, g1, strict=True):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)  # summation order only
    # the norm's normalised copy (2·8·16) and the activation's output (2·8·32) are gone
    size = 2 if bf16 else 4
    assert kept0 - kept1 >= 2 * 8 * 32 * size + 2 * 8 * 16 * 4


def test_an_activation_read_twice_is_left_alone() -> None:
    def f(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        s = F.silu(a)
        return s * b + s

    ep = torch.export.export(_Wrap(f), (torch.randn(4), torch.randn(4)))
    gm = ep.module()
    assert fuse_elementwise(gm) == 0


class _Wrap(torch.nn.Module):
    def __init__(self, f) -> None:
        super().__init__()
        self.f = f

    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return self.f(a, b)


@pytest.mark.parametrize("mask", [None, "bool", "float"])
@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16-autocast"])
def test_attention_keeps_its_output_in_the_projection_layout(bf16: bool, mask: str | None
                                                             ) -> None:
    """CPU attention through `attention`: SDPA's values and gradients (GQA; causal, or a
    boolean or additive mask as Hugging Face passes), an output whose [b, s, h·d] reshape is
    a view, so the projection keeps no copy of it."""
    from runtime.execute.fused import attention

    torch.manual_seed(0)
    q0, k0, v0 = torch.randn(2, 8, 32, 16), torch.randn(2, 2, 32, 16), torch.randn(2, 2, 32, 16)
    causal = torch.ones(32, 32, dtype=torch.bool).tril()
    m = {None: None, "bool": causal,
         "float": torch.zeros(2, 1, 32, 32).masked_fill(~causal, float("-inf"))}[mask]
    runs = []
    for f in (F.scaled_dot_product_attention, attention):
        q, k, v = (t.clone().requires_grad_(True) for t in (q0, k0, v0))
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            y = f(q, k, v, attn_mask=m, is_causal=m is None, enable_gqa=True)
        flat = y.transpose(1, 2).reshape(2, 32, -1)
        flat.float().pow(2).sum().backward()
        runs.append((y, flat, q.grad, k.grad, v.grad))
    (y0, *_, ), (y1, flat1, *_) = runs
    assert y1.dtype == y0.dtype and torch.equal(y0, y1)
    assert flat1.untyped_storage().data_ptr() == y1.untyped_storage().data_ptr()
    for a, b in zip(runs[0][2:], runs[1][2:], strict=True):
        torch.testing.assert_close(b, a, rtol=0, atol=0)


class _RepeatKV(torch.nn.Module):
    """Attention over key/value heads copied to the query heads first (`repeat_kv`), laid out
    as Hugging Face copies them ([b, kv_heads, s, d]) or as torchtitan does ([b, s, kv_heads,
    d], transposed after)."""

    def __init__(self, layout: str) -> None:
        super().__init__()
        self.layout = layout

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        b, s, kv, d = k.shape
        rep = q.shape[2] // kv
        if self.layout == "hf":
            k, v = (x.transpose(1, 2)[:, :, None].expand(b, kv, rep, s, d)
                    .reshape(b, kv * rep, s, d) for x in (k, v))
        else:
            k, v = (x[:, :, :, None].expand(b, s, kv, rep, d).reshape(b, s, kv * rep, d)
                    .transpose(1, 2) for x in (k, v))
        return F.scaled_dot_product_attention(q.transpose(1, 2), k, v, is_causal=True)


@pytest.mark.parametrize("layout", ["hf", "torchtitan"])
def test_attention_reads_grouped_heads_instead_of_their_copies(layout: str) -> None:
    """Keys and values copied head by head for attention are read as grouped heads: the same
    values and gradients, and the copies are neither made nor kept (4 of each head here)."""
    torch.manual_seed(0)
    q0, k0, v0 = torch.randn(2, 16, 8, 4), torch.randn(2, 16, 2, 4), torch.randn(2, 16, 2, 4)
    plain = torch.export.export(_RepeatKV(layout), (q0, k0, v0)).module()
    fused = torch.export.export(_RepeatKV(layout), (q0, k0, v0)).module()
    assert fuse_elementwise(fused, torch.device("cpu")) == 2, "grouped, then CPU flash"
    assert not any(n.target is torch.ops.aten.expand.default for n in fused.graph.nodes)
    runs = []
    for gm in (plain, fused):
        packed: dict[int, int] = {}

        def pack(t: torch.Tensor, packed: dict[int, int] = packed) -> torch.Tensor:
            packed[t.untyped_storage()._cdata] = t.untyped_storage().nbytes()
            return t

        q, k, v = (t.clone().requires_grad_(True) for t in (q0, k0, v0))
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            y = gm(q, k, v)
        y.pow(2).sum().backward()
        runs.append((y, q.grad, k.grad, v.grad, sum(packed.values())))
    for a, b in zip(runs[0][:4], runs[1][:4], strict=True):
        torch.testing.assert_close(b, a, rtol=0, atol=0)
    copies = 2 * k0.numel() * 4 * 4  # keys and values, 4 heads per head, fp32
    assert runs[0][4] - runs[1][4] >= copies - 2 * k0.numel() * 4
