"""P2P links: one two-rank communicator per direction and message kind.

Separate communicators keep opposite messages, and the two lanes of an overlapped pair,
off each other's queues. On NCCL each link is a `new_group`. On gloo each `new_group` also
brings a transport device of its own, whose I/O thread polls epoll with a 10 ms timeout, so
it wakes 100 times a second even with nothing to do: a 4-rank dualpipev made seven such
threads per rank, together about 0.1 of a core while idle on this 2-core machine (torch's
pipelining, on the default group alone, has one per rank). Here gloo links are contexts of
their own (own sockets, own tag space) that share one device: one I/O thread for them all.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroupGloo


@dataclass(frozen=True)
class Link:
    """Messages between two processes; `ranks` (sorted) are the backend's ranks 0 and 1."""

    backend: Any  # a gloo backend of our own, or the ProcessGroup of a new_group
    ranks: tuple[int, int]

    def isend(self, t: torch.Tensor, dst: int, tag: int) -> Any:
        return self.backend.send([t], self.ranks.index(dst), tag)

    def irecv(self, buf: torch.Tensor, src: int, tag: int) -> Any:
        return self.backend.recv([buf], self.ranks.index(src), tag)


Key = tuple[int, int, bool]  # (sender, receiver, grad): processes


def make_links(keys: list[Key], store: dist.Store | None,
               timeout: datetime.timedelta | None = None) -> dict[Key, Link]:
    """This process's links among `keys`, which every rank passes in one order (each link
    connects once both its ends reach it, so that order cannot deadlock). With a gloo
    default group and `store` (a client of the rendezvous store) they share one device;
    otherwise each is a `new_group`."""
    me = dist.get_rank()
    kw = {} if timeout is None else {"timeout": timeout}
    gloo = store is not None and dist.get_backend() == "gloo"
    if gloo:
        opts = ProcessGroupGloo._Options()
        opts._devices = [gloo_device()]
        if timeout is not None:
            opts._timeout = timeout
    out: dict[Key, Link] = {}
    for a, b, grad in keys:
        ranks = (min(a, b), max(a, b))
        if not gloo:  # every rank creates every group, in one order
            out[(a, b, grad)] = Link(dist.new_group(list(ranks), **kw), ranks)
        elif me in ranks:
            prefixed = dist.PrefixStore(f"piper/p2p/{a}-{b}-{int(grad)}", store)
            out[(a, b, grad)] = Link(ProcessGroupGloo(prefixed, ranks.index(me), 2, opts),
                                     ranks)
    return out


def gloo_device() -> Any:
    """A gloo transport device where the process groups have theirs: on the interface
    GLOO_SOCKET_IFNAME names (`runtime.cluster.worker.use_interface_of`), else gloo's default."""
    name = os.environ.get("GLOO_SOCKET_IFNAME", "").split(",")[0]
    if name:
        return ProcessGroupGloo.create_device(interface=name)
    return ProcessGroupGloo.create_default_device()
