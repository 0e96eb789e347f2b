"""What piper's own ops cost: their FLOPs and op groups, which ATen's counters cannot see
(the ops run their data-dependent or distributed work inside one node).

- `piper.context_parallel.attention`: a rank's queries against the whole sequence's keys.
- `piper.moe.routed_experts`: dropless experts, GEMMs over the routed rows alone.
"""

from __future__ import annotations

from torch import fx

from piper.moe import RoutedShapes

OpKey = tuple[int, bool, float, int, bool, tuple[int, ...], bool]
"""(FLOPs, 16-bit, causal work share, bytes moved, attention, GEMM shape, fp32): what
`cost_models.analytical.OpGroup` groups ops by."""


def routed_keys(shapes: RoutedShapes, low_precision: bool, element_size: int
                ) -> list[tuple[OpKey, int]]:
    """Op groups of a dropless `routed_experts` node (`piper.moe`), router balanced: each
    local expert's two GEMMs over its T k / local rows (after the exchange a rank holds as
    many rows as it sent), up (dim -> up width) and down (down width -> dim), and the bytes
    its gathers, activation and gate-weighted sum stream."""
    t, k, d = shapes.tokens, shapes.k, shapes.dim
    m = max(1, round(t * k / shapes.local))
    out = []
    for n_, k_ in ((shapes.up, d), (d, shapes.down)):
        gemm = (2 * m * n_ * k_, low_precision, 1.0, element_size * (m * k_ + k_ * n_ + m * n_),
                False, (1, m, n_, k_), False)
        out.append((gemm, shapes.local))
    moved = element_size * (6 * t * k * d + t * k * (shapes.up + shapes.down) + t * d)
    out.append(((0, low_precision, 1.0, moved, False, (), False), 1))
    return out


def routed_saved_bytes(shapes: RoutedShapes, element_size: int) -> int:
    """Bytes a dropless `routed_experts` node keeps for backward beyond its output: the
    T k permuted rows in and out of the experts, the up projection's output and the
    activation's (the gate weighting keeps the experts' rows)."""
    rows = shapes.tokens * shapes.k
    return element_size * rows * (2 * shapes.dim + shapes.up + shapes.down)


def context_attention_flops(n: fx.Node) -> int:
    """Counted forward FLOPs of a context-parallel attention node
    (`piper.context_parallel.attention(q, k, v, scale, causal, degree, mode)`): the rank's
    queries against the whole sequence's keys, 4 b h t (t cp) d, as ATen counts
    scaled-dot-product attention. The head-tail split gives every rank the same share of
    the causal pairs, so the causal work share applies as it does on one device."""
    q = n.args[0].meta["val"]  # type: ignore[union-attr]
    b, h, t, d = (int(x) for x in q.shape[-4:])
    return 4 * b * h * t * (t * int(n.args[5])) * d  # type: ignore[arg-type]
