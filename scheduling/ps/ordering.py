"""The order in which a parameter server serves its clients' requests.

Two rules, both enforced on the server, so that a trainer's schedule (blocking, ``async_rpc``, prefetch)
never changes what a lookup sees:

1. **Per client, issue order** (:class:`Sequencer`): a client numbers its lookups and pushes to each server;
   the server runs them in that order, one at a time. A lookup sent while the same client's push is still in
   flight therefore sees that push.
2. **Across the trainers of a group, step order** (:class:`StepBarrier`, ``PSClient(world_size > 1)``): the
   ``W`` trainers sharing a client name form a group; each request carries how many pushes its client had
   issued to the server before it (its *count*). The server applies the group's pushes in ``(count, rank)``
   order, a push only once every trainer's push of the same count has arrived, and serves a lookup of count
   ``k`` only after every trainer's first ``k`` pushes are applied. A trainer's push ``k`` arrives after its
   own step-``k`` lookups were served (rule 1), so a step-``k`` lookup of any trainer sees exactly the pushes
   of steps ``0 .. k-1`` of every trainer: synchronous data-parallel SGD on the tables, deterministic (the
   same floating-point sums in the same order on every run) whatever the trainers' timing or schedule.

Without rule 2 (``world_size = 1`` clients sharing a name, as before) a lookup sees the other trainers'
pushes as they happen to arrive; with prefetch it is then served earlier, so it sees fewer of them, and
training differs from the blocking schedule.

Source: the bulk-synchronous parameter server (Li et al., "Scaling Distributed Machine Learning with the
Parameter Server", OSDI 2014, §3: consistency models; here the sequential model per step).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

__all__ = ["Sequencer", "StepBarrier", "Order", "Sync", "in_order"]

Sync = tuple[str, int, int, int]
"""``(group key, trainer rank, world size, count)``: the step-order part of a request (rule 2)."""
Order = tuple  # (client key, sequence number, timeout in seconds[, Sync])


class Sequencer:
    """Runs the requests of one client in the order the client issued them (by sequence number)."""

    def __init__(self) -> None:
        self.next = 0
        self.cond = threading.Condition()

    def run(self, seq: int, timeout_s: float, what: str, fn: Callable[[], Any], server: str) -> Any:
        with self.cond:
            if not self.cond.wait_for(lambda: self.next >= seq, timeout_s):
                raise RuntimeError(f"server {server}: {what} #{seq} waited {timeout_s} s for the "
                                   f"client's request #{self.next}, which never arrived")
        try:
            return fn()
        finally:
            with self.cond:
                self.next = max(self.next, seq + 1)
                self.cond.notify_all()


class StepBarrier:
    """Step order across the ``world_size`` trainers of one group on one server (rule 2 above).

    ``applied[r]`` counts trainer ``r``'s pushes applied; ``arrived[k]`` the trainers whose push number ``k``
    is waiting or applied.
    """

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self.applied = [0] * world_size
        self.arrived: dict[int, set[int]] = {}
        self.cond = threading.Condition()

    def _wait(self, ready: Callable[[], bool], timeout_s: float, what: str, server: str,
              missing: Callable[[], str]) -> None:
        with self.cond:
            if not self.cond.wait_for(ready, timeout_s):
                raise RuntimeError(f"server {server}: {what} waited {timeout_s} s for {missing()}; "
                                   "did a trainer of the group stop or run fewer steps than the others?")

    def lookup(self, rank: int, count: int, timeout_s: float, what: str, fn: Callable[[], Any],
               server: str) -> Any:
        """Run ``fn`` (a lookup) once every trainer's first ``count`` pushes are applied."""
        self._wait(lambda: min(self.applied) >= count, timeout_s, f"{what} of trainer {rank} (after {count} "
                   "pushes)", server, lambda: self._laggards(count))
        return fn()

    def push(self, rank: int, count: int, timeout_s: float, what: str, fn: Callable[[], Any],
             server: str) -> Any:
        """Run ``fn`` (applying trainer ``rank``'s push number ``count``) in ``(count, rank)`` order, once every
        trainer's push number ``count`` has arrived."""
        with self.cond:
            self.arrived.setdefault(count, set()).add(rank)
            self.cond.notify_all()

        def ready() -> bool:
            return (len(self.arrived.get(count, ())) == self.world_size
                    and all(self.applied[r] > count for r in range(rank)))

        self._wait(ready, timeout_s, f"{what} #{count} of trainer {rank}", server,
                   lambda: self._missing_pushes(count, rank))
        try:
            return fn()
        finally:
            with self.cond:
                self.applied[rank] = max(self.applied[rank], count + 1)
                if all(a > count for a in self.applied):
                    self.arrived.pop(count, None)
                self.cond.notify_all()

    def _laggards(self, count: int) -> str:
        late = [r for r, a in enumerate(self.applied) if a < count]
        return f"push #{count - 1} of trainer(s) {late}"

    def _missing_pushes(self, count: int, rank: int) -> str:
        here = self.arrived.get(count, set())
        late = [r for r in range(self.world_size) if r not in here]
        late += [r for r in range(rank) if r in here and self.applied[r] <= count]
        return f"push #{count} of trainer(s) {sorted(set(late))}"


_SEQUENCERS: dict[str, Sequencer] = {}
_BARRIERS: dict[str, StepBarrier] = {}
_LOCK = threading.Lock()


def in_order(order: Order | None, what: str, server: str, *, push: Callable[[], Any] | None = None,
             lookup: Callable[[], Any] | None = None) -> Any:
    """Run a request's ``push`` and/or ``lookup`` (a push+lookup request has both: the push first) under the
    ordering ``order`` asks for: issue order per client, and with a :data:`Sync` part step order across the
    group (the lookup of a push+lookup request then follows the whole group's pushes of the same count).

    Returns:
        ``push()``, ``lookup()``, or ``(push(), lookup())`` when both are given.
    """
    def plain() -> Any:
        first = push() if push is not None else None
        return lookup() if push is None else (first if lookup is None else (first, lookup()))

    if order is None:
        return plain()
    key, seq, timeout_s, *rest = order
    sync: Sync | None = rest[0] if rest else None
    with _LOCK:
        seqr = _SEQUENCERS.setdefault(key, Sequencer())
        barrier = None
        if sync is not None:
            barrier = _BARRIERS.get(sync[0])
            if barrier is None or barrier.world_size != sync[2]:
                barrier = _BARRIERS[sync[0]] = StepBarrier(sync[2])
    if barrier is None:
        return seqr.run(seq, timeout_s, what, plain, server)
    _, rank, _, count = sync

    def synced() -> Any:
        if push is None:
            return barrier.lookup(rank, count, timeout_s, what, lookup, server)
        done = barrier.push(rank, count, timeout_s, what, push, server)
        if lookup is None:
            return done
        return done, barrier.lookup(rank, count + 1, timeout_s, what, lookup, server)

    return seqr.run(seq, timeout_s, what, synced, server)
