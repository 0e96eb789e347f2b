"""Compute lanes of one rank: overlapped pairs run a forward and a backward on two threads.

Two things keep the lanes apart:

- In-graph collectives (tensor-parallel f/g, expert all-to-all) of each lane run on the lane's
  own communicators (`lane(1)` around the pair lane's work; `piper.collectives` looks the
  group up by `current()`), so the collectives of one communicator keep one order on every
  rank while both lanes issue them.
- On CPU the lanes pass one `ComputeToken`: a chunk computes only while it holds it, so the
  two threads never compete for the rank's cores. A pair's backward is *claimed* by one
  thread: the forward's, right after the forward (no hand-over between threads, which
  costs a scheduler slice on a busy machine), unless the forward lane first blocks on
  communication (an in-graph collective, which hands the token over while it waits, a
  ZeRO collective, a wait on the other lane); then the pair lane's thread takes it. That
  is DualPipe's overlap, one's communication behind the other's compute, at no cost when
  there is no communication to hide.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

_local = threading.local()


@contextlib.contextmanager
def lane(index: int) -> Iterator[None]:
    """Work of this thread belongs to lane `index` (0: compute, 1: pair)."""
    before = current()
    _local.index = index
    try:
        yield
    finally:
        _local.index = before


def current() -> int:
    return getattr(_local, "index", 0)


class ComputeToken:
    """The right to compute on one rank, passed between its two lanes."""

    def __init__(self) -> None:
        self._compute = threading.Lock()  # the token itself
        # claims and the forward lane's waits; only a wait wakes the pair thread, so a
        # dense model (nothing to wait for) never switches threads
        self._cond = threading.Condition()
        self._waiting = 0  # the forward lane is waiting for communication, not computing
        self._claimed: set[str] = set()  # pairs (by forward) whose backward has a thread

    def _acquire(self) -> None:
        self._compute.acquire()

    def _release(self) -> None:
        self._compute.release()

    @contextlib.contextmanager
    def idle(self) -> Iterator[None]:
        """The forward lane waits on communication in this block: the pair lane may go."""
        with self._cond:
            self._waiting += current() == 0
            self._cond.notify_all()
        try:
            yield
        finally:
            with self._cond:
                self._waiting -= current() == 0

    def claim(self, forward: str) -> bool:
        """The forward lane, after `forward`: whether its pair's backward is still free
        (then it is the caller's to run)."""
        with self._cond:
            if forward in self._claimed:
                return False
            self._claimed.add(forward)
            return True

    def steal(self, forward: str, timeout: float) -> bool | None:
        """The pair lane: wait (at most `timeout` s, then None) until the forward lane
        waits on communication — then claim the pair of `forward` (True) — or has claimed
        it itself (False; seen at the next wait or timeout, since claims wake no one)."""
        with self._cond:
            if not self._cond.wait_for(lambda: forward in self._claimed or self._waiting > 0,
                                       timeout):
                return None
            if forward in self._claimed:
                return False
            self._claimed.add(forward)
            return True

    def wake(self) -> None:
        """The forward lane is done with its step: the pair lane sees every claim now."""
        with self._cond:
            self._cond.notify_all()

    def reset(self) -> None:
        """A new step: every pair is free again."""
        with self._cond:
            self._claimed.clear()


@contextlib.contextmanager
def computing(token: ComputeToken | None) -> Iterator[None]:
    """Hold the rank's compute `token` (if any) while a chunk computes."""
    if token is None:
        yield
        return
    token._acquire()
    _local.token = token
    try:
        yield
    finally:
        _local.token = None
        token._release()


@contextlib.contextmanager
def waiting() -> Iterator[None]:
    """A chunk waits on communication (an in-graph collective): the token is the other
    lane's meanwhile."""
    token: ComputeToken | None = getattr(_local, "token", None)
    if token is None:
        yield
        return
    token._release()
    try:
        with token.idle():
            yield
    finally:
        token._acquire()
