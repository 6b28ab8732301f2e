"""The order in which a parameter server serves its clients' requests.

Three rules, all enforced on the server, so that a trainer's schedule (blocking, ``async_rpc``, prefetch)
never changes what a lookup sees, nor what a lookup does to a dynamic table:

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
3. **Across the trainers of a group, the lookups of dynamic tables in** ``(count, index, rank)`` **order**
   (:meth:`StepBarrier.lookup_turn`): rule 2 fixes what a step-``k`` lookup sees, not the order in which the ``W``
   trainers' step-``k`` lookups are served. Fixed tables do not care (a lookup changes nothing), but a lookup of a
   dynamic table is a step of it (:mod:`scheduling.ps.dynamic`: admission, LRU refresh, eviction, slot
   assignment), so in arrival order two runs with several trainers differed. A lookup request also carries its
   *index*, the client's lookups to this server since its last push (a push+lookup's lookup: index 0 of the next
   count), and a server whose tables of that client include a dynamic one serves it once every lower rank's
   lookup of the same ``(count, index)`` and every higher rank's of ``(count, index - 1)`` is served. With
   rules 1 and 2 the dynamic tables then take every trainer's lookups in one order, the same on every run and
   under every schedule (blocking, ``async_rpc``, prefetch): ``(count, index, rank)``. (With ``max_staleness``
   the next step's lookup leaves before this step's push, as index 1 of this count, on every trainer alike:
   deterministic too, though not the exact schedule's rows.)

   *Contract*: every trainer of the group makes the same lookups of such a server per step (the same number,
   in the same order across its servers), or the group waits until ``timeout_s`` (the error names the rank
   and lookup it waited for). Read-only peeks (:mod:`scheduling.ps.peek`) change nothing: they carry no index,
   count in no index and follow rules 1 and 2 only (an evaluation on rank 0 alone is fine); so do lookups of a
   server that holds no dynamic table of that client (the server drops their index: no new wait).
   *Cost*: one more number per request; per barrier, each rank's position ``(count, index + 1)`` of its last
   ordered lookup; a third wait. With prefetch (the step-``k + 1`` lookups ride on the pushes of step ``k``, all
   of which have arrived before any is applied) nothing beyond serialisation, which a dynamic table's lock
   imposed already. With blocking lookups a trainer's lookup waits for the lower ranks' lookups of the step to
   arrive: the skew between the trainers' forward starts, so a slow rank 0 delays every other rank's lookups
   of dynamic tables. A restarted group (a job's Ray Train restart) draws a new group key, hence fresh barriers
   counting from 0; the old group's parked requests fail after their ``timeout_s``.

Without rule 2 (``world_size = 1`` clients sharing a name, as before) a lookup sees the other trainers'
pushes as they happen to arrive; with prefetch it is then served earlier, so it sees fewer of them, and
training differs from the blocking schedule.

**A waiting request holds no thread** (:func:`submit`): a request that must wait (for an earlier request of
its client, or for other trainers) is parked here, and the thread that brought it returns at once. Its work
(the push, the lookup) runs later on the thread whose request released it (that thread's own answer is sent
first), and ``done(value, error)`` reports the result; the transports turn that into the answer
(``torch.distributed.rpc`` ``async_execution`` functions returning a ``torch.futures.Future``; Ray asyncio
actor methods). So a server with ``num_worker_threads`` threads serves any number of waiting requests: with
blocking waits, ``num_worker_threads`` requests waiting at the step barrier held every thread and the push
that would release them was never served (a deadlock with more embedding modules than threads).
Each wait is bounded by the request's ``timeout_s`` (one watchdog thread per process fails requests whose wait
ran out, with the error saying what they waited for).

Source: the bulk-synchronous parameter server (Li et al., "Scaling Distributed Machine Learning with the
Parameter Server", OSDI 2014, §3: consistency models; here the sequential model per step).
"""

from __future__ import annotations

import heapq
import itertools
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any, cast

__all__ = ["Sequencer", "StepBarrier", "Order", "Sync", "Done", "in_order", "submit", "parked_requests",
           "without_index"]

logger = logging.getLogger(__name__)

Sync = tuple  # (group key, trainer rank, world size, count[, lookup index or None])
"""``(group key, trainer rank, world size, count[, index])``: the step-order part of a request (rule 2); ``index``
(rule 3), given for a lookup that steps a dynamic table: the client's lookups to this server since its last
push (None or absent: not ordered across the group)."""
Order = tuple  # (client key, sequence number, timeout in seconds[, Sync])
Done = Callable[[Any, "BaseException | None"], None]
"""``done(value, error)``: called once when a request finished (``error`` None) or failed."""

_LOCK = threading.Lock()
"""Guards every sequencer, barrier and parked request of this process (work runs outside it)."""
_WAKE = threading.Condition(_LOCK)
_DEADLINES: list[tuple[float, int, "_Request"]] = []
_IDS = itertools.count()
_WATCHDOG: list[threading.Thread] = []


class _Request:
    """One request in flight: waiting for its ``stage`` (``turn``, ``push``, ``lookup``) or running."""

    __slots__ = ("seqr", "seq", "barrier", "rank", "count", "timeout_s", "what", "server", "push", "lookup",
                 "done", "stage", "deadline", "pushed", "arrived", "index")

    def __init__(self, seqr: Sequencer | None, seq: int, barrier: StepBarrier | None, rank: int, count: int,
                 timeout_s: float, what: str, server: str, push: Callable[[], Any] | None,
                 lookup: Callable[[], Any] | None, done: Done, index: int | None = None) -> None:
        self.seqr, self.seq, self.barrier, self.rank, self.count = seqr, seq, barrier, rank, count
        self.index = index  # the lookup's place among its client's lookups of the count (rule 3), or None
        self.timeout_s, self.what, self.server, self.push, self.lookup, self.done = (timeout_s, what, server, push,
                                                                                    lookup, done)
        self.stage = "turn" if seqr is not None else self._after_turn()
        self.deadline: float | None = None
        self.pushed: Any = None
        self.arrived = False  # its push counts as arrived at the barrier

    def _after_turn(self) -> str:
        return "plain" if self.barrier is None else ("push" if self.push is not None else "lookup")

    @property
    def step_barrier(self) -> StepBarrier:
        """The barrier of a ``push`` or ``lookup`` stage: only requests with one reach those (``_after_turn``)."""
        return cast(StepBarrier, self.barrier)

    @property
    def lookup_count(self) -> int:
        """The pushes of every trainer the lookup must see (one more when the request pushes first)."""
        return self.count + (self.push is not None)


class Sequencer:
    """Runs the requests of one client in the order the client issued them (by sequence number).

    ``next``: the sequence number allowed to run; ``parked``: requests waiting for their turn.
    """

    def __init__(self) -> None:
        self.next = 0
        self.parked: dict[int, _Request] = {}

    def run(self, seq: int, timeout_s: float, what: str, fn: Callable[[], Any], server: str) -> Any:
        """Run ``fn`` as request ``seq`` (blocking: waits for ``seq - 1`` and returns ``fn()``)."""
        return _blocking(lambda done: _start(_Request(self, seq, None, 0, 0, timeout_s, what, server, None, fn,
                                                      done)))


class StepBarrier:
    """Step order across the ``world_size`` trainers of one group on one server (rule 2 above).

    ``applied[r]`` counts trainer ``r``'s pushes applied; ``arrived[k]`` the trainers whose push number ``k``
    is waiting or applied; ``looked[r]`` is ``(count, index + 1)`` of trainer ``r``'s last lookup served in
    ``(count, index, rank)`` order (rule 3); ``parked`` the requests waiting here.
    """

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self.applied = [0] * world_size
        self.arrived: dict[int, set[int]] = {}
        self.looked: list[tuple[int, int]] = [(0, 0)] * world_size
        self.parked: list[_Request] = []

    def push_ready(self, rank: int, count: int) -> bool:
        """Every trainer's push ``count`` arrived and those of lower ranks are applied."""
        return (len(self.arrived.get(count, ())) == self.world_size
                and all(self.applied[r] > count for r in range(rank)))

    def lookup_ready(self, count: int) -> bool:
        """Every trainer's first ``count`` pushes are applied."""
        return min(self.applied) >= count

    def lookup_turn(self, rank: int, count: int, index: int) -> bool:
        """Rule 3: the lookups before ``(count, index, rank)`` are served: those of ``(count, index)`` of every
        lower rank and of ``(count, index - 1)`` of every higher one (earlier counts: :meth:`lookup_ready`)."""
        return not self._lookups_missing(rank, count, index)

    def _lookups_missing(self, rank: int, count: int, index: int) -> list[tuple[int, int]]:
        """``[(rank, index)]``: the lookups of count ``count`` that ``(count, index, rank)`` still waits for."""
        looked = self.looked
        return ([(r, index) for r in range(rank) if looked[r] < (count, index + 1)]
                + [(r, index - 1) for r in range(rank + 1, self.world_size) if index > 0 and looked[r] < (count, index)])

    def lookup(self, rank: int, count: int, timeout_s: float, what: str, fn: Callable[[], Any],
               server: str, index: int | None = None) -> Any:
        """Run ``fn`` (a lookup) once every trainer's first ``count`` pushes are applied and, with an ``index``,
        after the lookups before ``(count, index, rank)`` (:meth:`lookup_turn`) (blocking)."""
        return _blocking(lambda done: _start(_Request(None, 0, self, rank, count, timeout_s, what, server, None, fn,
                                                      done, index)))

    def push(self, rank: int, count: int, timeout_s: float, what: str, fn: Callable[[], Any],
             server: str) -> Any:
        """Run ``fn`` (applying trainer ``rank``'s push number ``count``) in ``(count, rank)`` order, once every
        trainer's push number ``count`` has arrived (blocking)."""
        return _blocking(lambda done: _start(_Request(None, 0, self, rank, count, timeout_s, what, server, fn, None,
                                                      done)))

    def _served(self, req: _Request) -> None:
        """Record ``req``'s lookup as served (rule 3; a lookup without an index is not ordered)."""
        if req.index is not None:
            self.looked[req.rank] = max(self.looked[req.rank], (req.lookup_count, req.index + 1))

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


def parked_requests() -> int:
    """How many requests wait in this process now (none of them holds a thread)."""
    with _LOCK:
        return (sum(len(s.parked) for s in _SEQUENCERS.values())
                + sum(len(b.parked) for b in _BARRIERS.values()))


def submit(order: Order | None, what: str, server: str, done: Done, *, push: Callable[[], Any] | None = None,
           lookup: Callable[[], Any] | None = None) -> None:
    """Start a request's ``push`` and/or ``lookup`` (a push+lookup request has both: the push first) under the
    ordering ``order`` asks for: issue order per client, and with a :data:`Sync` part step order across the
    group (the lookup of a push+lookup request then follows the whole group's pushes of the same count).

    Never waits: the work runs now on this thread when the order allows it, else later on the thread that
    releases it; ``done(value, None)`` then reports ``push()``, ``lookup()`` or ``(push(), lookup())`` (both
    given), and ``done(None, error)`` the work's exception or a ``RuntimeError`` when a wait ran past
    ``timeout_s`` (naming the request or trainers it waited for).
    """
    if order is None:
        _drain([_Request(None, 0, None, 0, 0, 0.0, what, server, push, lookup, done)])
        return
    key, seq, timeout_s, *rest = order
    sync: Sync | None = rest[0] if rest else None
    with _LOCK:
        seqr = _SEQUENCERS.get(key)
        if seqr is None:  # not setdefault: no Sequencer built per request
            seqr = _SEQUENCERS[key] = Sequencer()
        barrier, rank, count, index = None, 0, 0, None
        if sync is not None:
            _, rank, world_size, count, *more = sync
            index = more[0] if more and lookup is not None else None
            barrier = _BARRIERS.get(sync[0])
            if barrier is None or barrier.world_size != world_size:
                barrier = _BARRIERS[sync[0]] = StepBarrier(world_size)
    _start(_Request(seqr, seq, barrier, rank, count, timeout_s, what, server, push, lookup, done, index))


def without_index(order: Order | None) -> Order | None:
    """``order`` without its lookup index: a lookup that changes no table (a peek, a server holding no dynamic
    table of the client) follows rules 1 and 2 only, never waiting for the other trainers' lookups."""
    if order is None or len(order) < 4 or len(order[3]) < 5:
        return order
    return (*order[:3], tuple(order[3][:4]))


def in_order(order: Order | None, what: str, server: str, *, push: Callable[[], Any] | None = None,
             lookup: Callable[[], Any] | None = None) -> Any:
    """:func:`submit`, waiting for the result on this thread (in-process use and tests; the transports use
    :func:`submit`, so that no server thread waits).

    Returns:
        ``push()``, ``lookup()``, or ``(push(), lookup())`` when both are given.
    """
    return _blocking(lambda done: submit(order, what, server, done, push=push, lookup=lookup))


# ---- the state machine (under _LOCK) and the work (outside it) -----------------------------------------------
def _start(req: _Request) -> None:
    ready: list[_Request] = []
    with _LOCK:
        _try(req, ready)
    _drain(ready)


def _try(req: _Request, ready: list[_Request]) -> None:
    """Under ``_LOCK``: append ``req`` to ``ready`` when its next piece of work may run now, else park it."""
    if req.stage == "turn":
        seqr = req.seqr
        assert seqr is not None
        if seqr.next < req.seq:
            seqr.parked[req.seq] = req
            _arm(req)
            return
        req.stage, req.deadline = req._after_turn(), None
    barrier = req.step_barrier  # used in the push and lookup stages only
    if req.stage == "push" and not req.arrived:
        req.arrived = True
        barrier.arrived.setdefault(req.count, set()).add(req.rank)
        _recheck(barrier, ready)  # its arrival may complete another trainer's wait
    if (req.stage == "plain" or (req.stage == "push" and barrier.push_ready(req.rank, req.count))
            or (req.stage == "lookup" and barrier.lookup_ready(req.lookup_count)
                and (req.index is None or barrier.lookup_turn(req.rank, req.lookup_count, req.index)))):
        req.deadline = None  # its wait (if any) is over: the deadline entry is stale (_drop_stale)
        ready.append(req)
        return
    barrier.parked.append(req)
    _arm(req)


def _recheck(barrier: StepBarrier, ready: list[_Request]) -> None:
    waiting, barrier.parked = barrier.parked, []
    for other in waiting:
        _try(other, ready)


def _drain(ready: list[_Request]) -> None:
    """Run the work of ``ready`` requests and of every request their completion releases, on this thread."""
    queue = deque(ready)
    while queue:
        req = queue.popleft()
        stage, value, error = req.stage, None, None
        try:
            if stage == "plain":
                value = req.push() if req.push is not None else None
                lookup = cast(Callable[[], Any], req.lookup)  # without a push, a request has a lookup (submit)
                value = lookup() if req.push is None else (value if req.lookup is None else (value, lookup()))
            else:
                # the push stage has a push, the lookup stage a lookup (_after_turn, _after_work)
                value = cast(Callable[[], Any], req.push if stage == "push" else req.lookup)()
        except BaseException as e:  # reported to the client, like a raise in a blocking handler
            error = e
        released: list[_Request] = []
        with _LOCK:
            finished = _after_work(req, stage, value, error, released)
        if finished is not None:
            _report(req, *finished)
        queue.extend(released)


def _after_work(req: _Request, stage: str, value: Any, error: BaseException | None,
                ready: list[_Request]) -> tuple[Any, BaseException | None] | None:
    """Under ``_LOCK``: record the work done; returns ``(value, error)`` when the request finished."""
    if stage == "push":
        barrier, count = req.step_barrier, req.count
        barrier.applied[req.rank] = max(barrier.applied[req.rank], count + 1)
        if all(a > count for a in barrier.applied):
            barrier.arrived.pop(count, None)
        if error is not None and req.lookup is not None:
            barrier._served(req)  # its lookup will not run: the next one in rule 3's order may
        _recheck(barrier, ready)
        if error is None and req.lookup is not None:
            req.pushed, req.stage, req.deadline = value, "lookup", None
            _try(req, ready)
            return None
    elif stage == "lookup":
        if req.index is not None:  # rule 3: the next lookup in (count, index, rank) order may run
            req.step_barrier._served(req)
            _recheck(req.step_barrier, ready)
        if req.push is not None and error is None:
            value = (req.pushed, value)
    _finish(req, ready)
    return value, error


def _finish(req: _Request, ready: list[_Request]) -> None:
    """Under ``_LOCK``: the client's next request may run (a request that failed counts as done)."""
    req.stage, req.push, req.lookup = "done", None, None  # drop the batches: a deadline entry may outlive it
    req.deadline = None
    _drop_stale()
    seqr = req.seqr
    if seqr is not None:
        seqr.next = max(seqr.next, req.seq + 1)
        nxt = seqr.parked.pop(seqr.next, None)
        if nxt is not None:
            _try(nxt, ready)


def _report(req: _Request, value: Any, error: BaseException | None) -> None:
    done, req.done = req.done, _reported  # the answer is not kept alive by a deadline entry
    try:
        done(value, error)
    except Exception:  # a transport's callback: never let it stop the requests it released
        logger.exception("server %s: reporting the result of a %s failed", req.server, req.what)


def _reported(value: Any, error: BaseException | None) -> None:
    raise AssertionError("a request reported twice")


def _blocking(start: Callable[[Done], None]) -> Any:
    box: list[Any] = []
    event = threading.Event()

    def done(value: Any, error: BaseException | None) -> None:
        box[:] = [value, error]
        event.set()

    start(done)
    event.wait()
    if box[1] is not None:
        raise box[1]
    return box[0]


# ---- timeouts: one watchdog thread per process -------------------------------------------------------------
def _arm(req: _Request) -> None:
    """Under ``_LOCK``: start the deadline of ``req``'s current wait (kept while it stays in that wait)."""
    if req.deadline is not None:
        return
    req.deadline = time.monotonic() + req.timeout_s
    heapq.heappush(_DEADLINES, (req.deadline, next(_IDS), req))
    if not _WATCHDOG or not _WATCHDOG[0].is_alive():
        _WATCHDOG[:] = [threading.Thread(target=_watch, name="fxdist-ps-order-watchdog", daemon=True)]
        _WATCHDOG[0].start()
    if _DEADLINES[0][2] is req:  # the watchdog sleeps until the earliest deadline: wake it only for a new earliest
        _WAKE.notify()


def _drop_stale() -> None:
    """Under ``_LOCK``: pop the deadline entries at the top of the heap whose wait is over (the request ran or moved
    on: its ``deadline`` is no longer the entry's). Requests leave their waits about in the order they entered them,
    so this keeps the heap about as long as the requests waiting now, instead of one entry per past wait for
    ``timeout_s`` (each a wake-up of the watchdog when it comes due, and objects the garbage collector walks)."""
    while _DEADLINES and _DEADLINES[0][2].deadline != _DEADLINES[0][0]:
        heapq.heappop(_DEADLINES)


def _watch() -> None:
    while True:
        with _LOCK:
            while True:
                _drop_stale()  # no wake-up for a wait that is over
                if _DEADLINES and _DEADLINES[0][0] <= time.monotonic():
                    break
                _WAKE.wait(None if not _DEADLINES else _DEADLINES[0][0] - time.monotonic())
            failed: list[tuple[_Request, BaseException]] = []
            released: list[_Request] = []
            now = time.monotonic()
            while _DEADLINES and _DEADLINES[0][0] <= now:
                deadline, _, req = heapq.heappop(_DEADLINES)
                if req.deadline == deadline and _unpark(req):
                    failed.append((req, RuntimeError(_timeout_message(req))))
                    if req.stage != "turn":  # as a raise inside its turn: the client's next request may run
                        _finish(req, released)
                    else:
                        req.stage, req.push, req.lookup = "done", None, None
        for req, error in failed:
            _report(req, None, error)
        _drain(released)


def _unpark(req: _Request) -> bool:
    """Under ``_LOCK``: take ``req`` out of the wait it is parked in; False when it is not parked."""
    if req.stage == "turn":
        if req.seqr is not None and req.seqr.parked.get(req.seq) is req:
            del req.seqr.parked[req.seq]
            return True
        return False
    if req.stage in ("push", "lookup") and req in req.step_barrier.parked:
        req.step_barrier.parked.remove(req)
        return True
    return False


def _timeout_message(req: _Request) -> str:
    head, t = f"server {req.server}: ", req.timeout_s
    if req.stage == "turn":
        seqr = cast(Sequencer, req.seqr)  # only requests with a sequencer wait for their turn
        return f"{head}{req.what} #{req.seq} waited {t} s for the client's request #{seqr.next}, which never arrived"
    barrier = req.step_barrier
    if req.stage == "push":
        what, missing = f"{req.what} #{req.count} of trainer {req.rank}", barrier._missing_pushes(req.count, req.rank)
    elif req.index is not None and barrier.lookup_ready(req.lookup_count):  # rule 3: the others' lookups
        waits = barrier._lookups_missing(req.rank, req.lookup_count, req.index)
        ranks = " and ".join(f"rank {r}'s lookup (count {req.lookup_count}, index {i})" for r, i in waits)
        return (f"{head}lookup (count {req.lookup_count}, index {req.index}) of rank {req.rank} waited {t} s for "
                f"{ranks}: every trainer of the group must make the same lookups of this server's dynamic tables "
                "per step; did a trainer stop, run fewer steps, or look up without read_only() on one rank only?")
    else:
        what = f"{req.what} of trainer {req.rank} (after {req.lookup_count} pushes)"
        missing = barrier._laggards(req.lookup_count)
    return (f"{head}{what} waited {t} s for {missing}; did a trainer of the group stop or run fewer steps than the "
            "others?")
