"""Deferred weight gradients: I then W give exactly the gradients of one ordinary backward,
and the W half needs neither the autograd graph nor the parameters."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.export.graph_signature import InputKind

from runtime.execute.weight_grad import WeightGradStore, collecting, defer_weight_grads
from runtime.execute.zero import storage_key


class Net(nn.Module):
    """linear with and without bias, x @ W, a weight used by two matmuls, experts' bmm."""

    def __init__(self) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(8)
        self.fc = nn.Linear(8, 16)
        self.out = nn.Linear(16, 8, bias=False)
        self.w = nn.Parameter(torch.randn(8, 8) / 3)
        self.experts = nn.Parameter(torch.randn(3, 8, 8) / 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.out(F.gelu(self.fc(self.ln(x))))
        h = F.linear(h @ self.w, self.w)
        return torch.bmm(h, self.experts)


def exported(net: Net, x: torch.Tensor) -> tuple[torch.fx.GraphModule, list[torch.Tensor],
                                                   set[int]]:
    """The graph with parameters as inputs (as stage modules have them), its parameter
    arguments in input order, and their positions."""
    ep = torch.export.export(net, (x,))
    named = dict(net.named_parameters())
    args, params = [], set()
    for i, s in enumerate(ep.graph_signature.input_specs):
        if s.kind == InputKind.PARAMETER:
            args.append(named[s.target])
            params.add(i)
    return ep.graph_module, args, params


def reference(net: Net, x: torch.Tensor) -> dict[str, torch.Tensor]:
    x = x.clone().requires_grad_(True)
    net.zero_grad(set_to_none=True)
    net(x).square().sum().backward()
    out = {n: p.grad.clone() for n, p in net.named_parameters()}
    out["x"] = x.grad
    net.zero_grad(set_to_none=True)
    return out


def weight_pass(store: WeightGradStore, by_position: dict[int, torch.Tensor]) -> None:
    """W into the parameters' `.grad`, as the executor runs it."""
    store.add_to(lambda key: by_position[key].grad,
                 lambda key, g: setattr(by_position[key], "grad", g))


def setup() -> tuple[Net, torch.Tensor]:
    torch.manual_seed(0)
    return Net(), torch.randn(3, 5, 8)


def test_rewrites_every_matmul_against_a_parameter_and_nothing_else():
    net, x = setup()
    gm, _, params = exported(net, x)
    new, n = defer_weight_grads(gm, params)
    assert n == 5  # fc, out, h @ w, linear(., w), bmm
    targets = [str(t.target) for t in new.graph.nodes if t.op == "call_function"]
    assert not any("linear" in t or "matmul" in t or "bmm" in t for t in targets if "aten" in t)
    assert any("layer_norm" in t for t in targets)
    assert n == defer_weight_grads(gm, params)[1], "the input module is left as it was"


def test_input_pass_then_weight_pass_equals_one_backward():
    net, x = setup()
    ref = reference(net, x)
    gm, args, params = exported(net, x)
    new, _ = defer_weight_grads(gm, params)
    xin = x.clone().requires_grad_(True)
    store = WeightGradStore()
    with collecting(store):
        (y,) = new(*args, xin)
    torch.autograd.backward([y.square().sum()], inputs=[xin, *args])
    torch.testing.assert_close(xin.grad, ref["x"])
    # I: the layer norm's gradients are done, every deferred weight still has none
    torch.testing.assert_close(net.ln.weight.grad, ref["ln.weight"])
    assert all(p.grad is None for p in (net.fc.weight, net.fc.bias, net.out.weight, net.w,
                                        net.experts))
    assert len(store.entries) == 5 and store.nbytes() > 0
    by_position = dict(zip(sorted(params), args))
    # W: products only, summed into the gradients (net.w twice: a first product, then one
    # added by its GEMM), as autograd sums them
    weight_pass(store, by_position)
    assert not store.entries, "W releases what I kept"
    for name, p in net.named_parameters():
        torch.testing.assert_close(p.grad, ref[name], msg=name)


def test_a_second_microbatch_adds_into_the_gradients_inside_its_gemms():
    """Every kind (linear with its bias, x @ W, bmm) summed into an existing gradient."""
    net, x = setup()
    ref = reference(net, x)
    gm, args, params = exported(net, x)
    new, _ = defer_weight_grads(gm, params)
    by_position = dict(zip(sorted(params), args))
    for _ in range(2):
        store = WeightGradStore()
        with collecting(store):
            (y,) = new(*args, x)
        torch.autograd.backward([y.square().sum()], inputs=args)
        weight_pass(store, by_position)
    for name, p in net.named_parameters():
        torch.testing.assert_close(p.grad, 2 * ref[name], msg=name)


def test_without_a_store_the_rewritten_module_is_plain_autograd():
    net, x = setup()
    ref = reference(net, x)
    gm, args, params = exported(net, x)
    new, _ = defer_weight_grads(gm, params)
    with collecting(None):
        (y,) = new(*args, x)
    y.square().sum().backward()
    for name, p in net.named_parameters():
        torch.testing.assert_close(p.grad, ref[name], msg=name)


def test_an_input_in_volatile_storage_is_not_deferred():
    """ZeRO-3 frees the gathered parameters after I: a matmul whose input lives there must
    take its weight gradient in I."""
    torch.manual_seed(0)
    lin = nn.Linear(4, 4)
    src = nn.Parameter(torch.randn(4, 4))
    gm = torch.fx.symbolic_trace(lambda s, w, b: torch.ops.aten.linear.default(s, w, b))
    for node, val in zip([n for n in gm.graph.nodes if n.op == "placeholder"],
                         (src, lin.weight, lin.bias)):
        node.meta["val"] = val
    new, n = defer_weight_grads(gm, {0, 1, 2})
    assert n == 1
    store = WeightGradStore(volatile=(storage_key(src),))
    with collecting(store):
        y = new(src, lin.weight, lin.bias)
    y.sum().backward()
    assert not store.entries and lin.weight.grad is not None and src.grad is not None
    torch.testing.assert_close(lin.weight.grad, torch.ones(4, 1) * src.detach().sum(0))
