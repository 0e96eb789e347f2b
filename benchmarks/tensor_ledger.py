"""One memory ruler for CPU processes: live bytes of every tensor storage, and their peak.

On CPU there is no allocator peak to read, and each system's own bookkeeping counts only what
it knows it owns. `TensorLedger` is a `TorchDispatchMode` that sees every tensor an op makes
or touches while it is active (autograd's backward included), keeps a weak reference to each
storage (so a storage counts until it is really freed, whoever holds it), and follows
`UntypedStorage.resize_`, which ZeRO-3 and FSDP2 use to free and refill gathered parameters.
The same approach as torch's `MemTracker`, without its per-module bookkeeping, which refuses
a module called once per microbatch.

A `classify` callback names tensors by category (parameter shards, gradients, optimizer
state, ...). The sizes are taken at the peak moment; the owners are looked up at the next
`checkpoint()` (a task boundary), because a tensor is made by one op and handed to its owner
(`.grad`, a buffer list) only afterwards. Storages that no category claims, or that died
before the checkpoint, are `other`: activations, received tensors, communication buffers,
temporaries.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable
from functools import partial
from typing import Any, Self

import torch
from torch.distributed._tools.common_utils import get_untyped_storages
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.weak import WeakIdKeyDictionary

Classify = Callable[[], dict[str, Iterable[torch.Tensor | None]]]


class TensorLedger(TorchDispatchMode):
    """Enter it before the model is built; `reset_peak()` at the start of a measured window,
    then read `peak` and `peak_split` (bytes by category, plus `other`)."""

    def __init__(self, classify: Classify | None = None) -> None:
        super().__init__()
        self.classify = classify
        self.total = 0
        self.peak = 0
        self._peak_split: dict[str, int] = {}
        self._top_other: list[int] = []
        self._peak_top_other: list[int] = []
        self._at_peak: dict[int, tuple[list[int], int]] = {}
        self._pending = False
        self._cell = WeakIdKeyDictionary()  # storage -> [bytes]
        self._hold: dict[int, tuple[list[int], weakref.ref]] = {}  # keeps callbacks alive
        self._orig_resize = torch.UntypedStorage.resize_

    # ---- counting -----------------------------------------------------------------------
    def _track(self, t: torch.Tensor) -> None:
        if t.device.type == "meta":
            return
        for st in get_untyped_storages(t):
            if st in self._cell:
                continue
            cell = [st.nbytes()]
            ref = weakref.ref(st, partial(self._gone, cell))
            self._cell[st] = cell
            self._hold[id(cell)] = (cell, ref)
            self._grow(cell[0])

    def _gone(self, cell: list[int], _ref: weakref.ref) -> None:
        self.total -= cell[0]
        self._hold.pop(id(cell), None)

    def _grow(self, n: int) -> None:
        self.total += n
        if n > 0 and self.total > self.peak:
            self.peak = self.total
            # sizes now; categories at the next `checkpoint` (a task boundary), when the
            # storages have their owners: a gradient is made by one op, put in `.grad` later
            self._at_peak = self._sizes()
            self._pending = True

    def checkpoint(self) -> None:
        """Call between tasks: classifies the storages of a peak reached since the last call
        by their owners now (those freed meanwhile count as `other`)."""
        self._settle()

    def _settle(self) -> None:
        if self._pending:
            self._pending = False
            self._peak_split = self._split(self._at_peak, self.peak)
            self._peak_top_other = self._top_other

    def _resize(self, st: torch.UntypedStorage, size: int) -> Any:
        out = self._orig_resize(st, size)
        cell = self._cell.get(st)
        if cell is not None and cell[0] != st.nbytes():
            old, cell[0] = cell[0], st.nbytes()
            self._grow(cell[0] - old)
        return out

    def bytes_of(self, tensors: Iterable[torch.Tensor | None]) -> int:
        """Live bytes of the distinct storages behind `tensors`."""
        seen: set[int] = set()
        n = 0
        for t in tensors:
            if t is None:
                continue
            for st in get_untyped_storages(t):
                cell = self._cell.get(st)
                if cell is not None and id(cell) not in seen:
                    seen.add(id(cell))
                    n += cell[0]
        return n

    def _split(self, sizes: dict[int, tuple[list[int], int]], total: int) -> dict[str, int]:
        """Bytes by category of the storages in `sizes` (id of cell -> (cell, bytes)); a
        storage counts once, in the first category naming it; the rest of `total` is
        `other`."""
        out: dict[str, int] = {}
        seen: set[int] = set()
        for name, tensors in (self.classify() if self.classify is not None else {}).items():
            n = 0
            for t in tensors:
                if t is None:
                    continue
                for st in get_untyped_storages(t):
                    cell = self._cell.get(st)
                    k = id(cell)
                    if cell is not None and k in sizes and k not in seen:
                        seen.add(k)
                        n += sizes[k][1]
            out[name] = n
        out["other"] = total - sum(out.values())
        self._top_other = sorted((n for k, (_, n) in sizes.items() if k not in seen),
                                 reverse=True)[:3]
        return out

    def split(self) -> dict[str, int]:
        """Current bytes by category."""
        return self._split(self._sizes(), self.total)

    @property
    def peak_split(self) -> dict[str, int]:
        """Bytes by category at the peak moment (since `reset_peak`)."""
        self._settle()
        return dict(self._peak_split)

    @property
    def peak_top_other(self) -> list[int]:
        """Sizes of the three largest storages in `other` at the peak moment."""
        self._settle()
        return list(self._peak_top_other)

    def reset_peak(self) -> None:
        self.peak = self.total
        self._at_peak = self._sizes()
        self._pending = True

    def _sizes(self) -> dict[int, tuple[list[int], int]]:
        # the cell itself is kept, so its id is not reused while this snapshot lives
        return {k: (cell, cell[0]) for k, (cell, _) in list(self._hold.items())}

    # ---- the mode -----------------------------------------------------------------------
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        if any(issubclass(t, DTensor) for t in types):
            return NotImplemented  # let DTensor run its local ops, which come back here
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten((out, args, kwargs))[0]:
            if isinstance(t, torch.Tensor):
                self._track(t)
        return out

    def __enter__(self) -> Self:
        def resize_(st: torch.UntypedStorage, size: int) -> Any:
            return self._resize(st, size)

        torch.UntypedStorage.resize_ = resize_  # type: ignore[method-assign]
        return super().__enter__()

    def __exit__(self, *exc: object) -> None:
        torch.UntypedStorage.resize_ = self._orig_resize  # type: ignore[method-assign]
        super().__exit__(*exc)
