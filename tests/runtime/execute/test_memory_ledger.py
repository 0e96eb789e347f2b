"""The ledger's activation count: every storage autograd keeps, once, parameters aside."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from runtime.execute.memory import SavedTensors
from runtime.execute.zero import storage_key


def test_saved_storages_are_counted_once_and_parameters_are_not() -> None:
    w = torch.randn(8, 4, requires_grad=True)
    x = torch.randn(3, 4, requires_grad=True)
    kept = SavedTensors(exclude={storage_key(w)})
    with torch.autograd.graph.saved_tensors_hooks(kept.pack, kept.unpack):
        z = F.linear(x, w).relu()  # saves x and w for the matmul, z for relu
    # x (3x4) and z (3x8) in fp32; z again as the chunk's output adds nothing
    assert kept.bytes_with([z]) == (3 * 4 + 3 * 8) * 4
    assert kept.bytes_with([z, torch.empty(5)]) == (3 * 4 + 3 * 8 + 5) * 4
