"""What one parameter server measures about itself, kept cheaply and with no metrics library.

Each :class:`~scheduling.ps.server.PSServer` owns a :class:`ServerStats` (its ``stats``). The request handlers
(:class:`~scheduling.ps.endpoints.Endpoints`, shared by the ``torch_rpc`` and ``ray`` transports) update it:

- the seconds each lookup and each push spends being served (the work itself, not the wait for its turn in
  :mod:`scheduling.ps.ordering`), per request (never per row) and per namespace (the client's table set), in
  fixed-bucket histograms: two ``perf_counter`` calls, a ``bisect`` and a lock per request;
- the requests pending: received and not answered yet (waiting for their turn or running);
- the connections its socket listener refused, per reason (:data:`REJECT_REASONS`;
  :mod:`scheduling.ps.transport.socket_server` counts them here).

The rows, bytes and dynamic-table counters per table are not kept here: :func:`table_stats` reads them
from the server's shards when asked. An exporter reads :meth:`ServerStats.snapshot` and :func:`table_stats`
when it is scraped (``jobs.trainer.server_metrics`` turns them into Prometheus metrics), so exporting
costs nothing per request.

Source: the Prometheus histogram model (cumulative ``le`` buckets with ``_sum`` and ``_count``; prometheus
client_python ``Histogram``, whose ``observe`` costs a few microseconds: too much to add per row).
"""

from __future__ import annotations

import threading
import time
from bisect import bisect_left
from collections.abc import Callable, Sequence
from typing import Any

__all__ = ["ServerStats", "KINDS", "BUCKETS", "REJECT_REASONS", "table_stats", "dynamic_stats"]

KINDS = ("lookup", "push")
"""The timed kinds of work (a push+lookup request is timed as one push and one lookup)."""
BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.002, 0.004, 0.008, 0.016, 0.032, 0.064, 0.128, 0.5)
"""Upper bounds (seconds) of the timing buckets; a last ``+Inf`` bucket is implied."""
REJECT_REASONS = ("bad_auth", "bad_tls", "handshake_timeout", "too_many_connections", "bad_frame", "over_limit",
                  "frame_timeout")
"""Why a socket server refused a connection: a wrong key (or none), no handshake in time, the connection cap, a
malformed message, a message over the frame limits, a message stalled past the read timeout."""


class ServerStats:
    """Request timings (per kind and namespace) and the pending requests of one server; thread-safe.

    Args:
        buckets: Increasing positive upper bounds, seconds (default :data:`BUCKETS`).

    Raises:
        ValueError: ``buckets`` empty, not increasing, or not positive.

    Example:
        >>> s = ServerStats(buckets=(0.001, 0.01))
        >>> s.observe("lookup", "emb", 0.002)
        >>> s.snapshot()["timings"][("lookup", "emb")]
        {'buckets': [(0.001, 0), (0.01, 1), (inf, 1)], 'sum': 0.002, 'count': 1}
    """

    def __init__(self, buckets: Sequence[float] = BUCKETS) -> None:
        bounds = tuple(float(b) for b in buckets)
        if not bounds or bounds[0] <= 0 or any(a >= b for a, b in zip(bounds, bounds[1:])):
            raise ValueError(f"ServerStats: buckets must be increasing positive seconds, got {tuple(buckets)}")
        self.buckets = bounds
        self._lock = threading.Lock()
        self._timings: dict[tuple[str, str], list[Any]] = {}  # (kind, namespace) -> [counts per bucket, sum, count]
        self._pending = 0
        self._rejected = dict.fromkeys(REJECT_REASONS, 0)

    # ---- updates (per request) -----------------------------------------------------------------------------
    def observe(self, kind: str, namespace: str, seconds: float) -> None:
        """Count one ``kind`` ("lookup" | "push") of ``namespace`` that took ``seconds``."""
        i = bisect_left(self.buckets, seconds)  # the first bound >= seconds ("le"); len(buckets): +Inf
        with self._lock:
            t = self._timings.get((kind, namespace))
            if t is None:
                t = self._timings[(kind, namespace)] = [[0] * (len(self.buckets) + 1), 0.0, 0]
            t[0][i] += 1
            t[1] += seconds
            t[2] += 1

    def timed(self, kind: str, namespace: str, fn: Callable[[], Any]) -> Callable[[], Any]:
        """``fn`` that, when called, also counts its duration (:meth:`observe`; a raise counts too)."""
        def run() -> Any:
            t0 = time.perf_counter()
            try:
                return fn()
            finally:
                self.observe(kind, namespace, time.perf_counter() - t0)
        return run

    def track(self, done: Callable[[Any, BaseException | None], None]) -> Callable[[Any, BaseException | None], None]:
        """One more pending request, until the returned callback (which then calls ``done``) is called."""
        with self._lock:
            self._pending += 1
        settled = [False]

        def finished(value: Any, error: BaseException | None) -> None:
            with self._lock:
                if not settled[0]:
                    settled[0] = True
                    self._pending -= 1
            done(value, error)
        return finished

    def reject(self, reason: str) -> None:
        """Count one connection refused for ``reason`` (one of :data:`REJECT_REASONS`, or another word)."""
        with self._lock:
            self._rejected[reason] = self._rejected.get(reason, 0) + 1

    # ---- reads (per scrape) ---------------------------------------------------------------------------------
    @property
    def pending(self) -> int:
        """Requests received and not answered yet (waiting for their turn, or running)."""
        return self._pending

    def snapshot(self) -> dict[str, Any]:
        """A consistent copy: ``{"pending": int, "timings": {(kind, namespace): {"buckets": [(upper bound
        in seconds, cumulative count), ..., (inf, count)], "sum": seconds, "count": int}}, "rejected": {reason:
        connections refused}}``."""
        with self._lock:
            raw = {k: (list(t[0]), t[1], t[2]) for k, t in self._timings.items()}
            pending = self._pending
            rejected = dict(self._rejected)
        timings = {}
        for key, (counts, total, count) in raw.items():
            cumulative, acc = [], 0
            for bound, c in zip((*self.buckets, float("inf")), counts):
                acc += c
                cumulative.append((bound, acc))
            timings[key] = {"buckets": cumulative, "sum": total, "count": count}
        return {"pending": pending, "timings": timings, "rejected": rejected}


def table_stats(server: Any) -> list[dict[str, Any]]:
    """Per table of each namespace, what ``server`` (a ``PSServer``) holds now, its shards of one table summed:
    ``[{"namespace", "table", "rows", "bytes", "dynamic", "inserts", "evictions"}]``.

    ``rows``: a fixed table's rows held; a dynamic table's live rows (admitted ids, not its capacity).
    ``bytes``: the stored rows plus the optimizer state (all slots of a dynamic table). ``inserts`` and
    ``evictions``: a dynamic table's running counters (:class:`scheduling.ps.dynamic.DynamicTable`: ids first
    seen, LRU evictions), 0 for a fixed table. Reads without the shards' locks: a scrape never waits for a push.
    """
    out: dict[tuple[str, str], dict[str, Any]] = {}
    for key, shard in list(server.shards.items()):
        namespace = key.rpartition("/")[0]
        entry = out.setdefault((namespace, shard.spec.table.name), {
            "namespace": namespace, "table": shard.spec.table.name, "rows": 0, "bytes": 0,
            "dynamic": shard.dynamic is not None, "inserts": 0, "evictions": 0})
        weight, state = shard.weight, shard.state
        entry["bytes"] += weight.numel() * weight.element_size() + (
            0 if state is None else state.numel() * state.element_size())
        if shard.dynamic is None:
            entry["rows"] += shard.spec.num_rows
            continue
        stats = shard.dynamic.stats()                   # its live-row count: no map built per scrape
        entry["rows"] += stats["rows"]
        entry["inserts"] += stats["inserts"]
        entry["evictions"] += stats["evictions"]
    return list(out.values())


def dynamic_stats(server: Any, namespace: str) -> dict[str, dict[str, int]]:
    """Per dynamic table of ``namespace`` that ``server`` (a ``PSServer``) holds, its
    :meth:`~scheduling.ps.dynamic.DynamicTable.stats` (``rows``, ``capacity``, ``candidates``, ``step``, ``inserts``,
    ``admitted``, ``evictions``, ``expired``, ``rejected``): a few numbers per table, no copy of its rows or id map
    (what ``PSServer.state_dict`` would send). Fixed tables are left out; ``{}`` for an unknown namespace.
    Reads without the shards' locks, as :func:`table_stats`."""
    prefix = namespace + "/"
    return {shard.spec.table.name: shard.dynamic.stats() for key, shard in list(server.shards.items())
            if key.startswith(prefix) and shard.dynamic is not None}
