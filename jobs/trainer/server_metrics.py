"""Parameter-server metrics read at scrape time: custom Prometheus collectors over ``scheduling.ps``'s own counters.

The servers keep their statistics without any metrics library (:mod:`scheduling.ps.server_stats`: request
timings, pending requests; the shards' rows, bytes and dynamic-table counters), and the clients count the
pushes in flight at each lookup (``PSClient.staleness``). The collectors here turn them into Prometheus
metric families each time ``/metrics`` is scraped, so serving a request costs no Prometheus call at all.

Server side (:class:`ServerCollector`, labels ``job``, ``rank`` = ``ps<i>``; ``phase`` and ``module`` come from the
namespace ``fxdist-job-<phase>:<module path>`` of the table set; ``table`` is the table's name):

==================================  =========  =============================================================
``fxdist_ps_server_lookup_seconds`` histogram  time the server spends answering one lookup (per request, the
                                               work only, not its wait for its turn); + phase, module
``fxdist_ps_server_push_seconds``   histogram  time the server spends applying one push; + phase, module
``fxdist_ps_rows``                  gauge      rows held (a dynamic table: live rows); + phase, module, table
``fxdist_ps_bytes``                 gauge      bytes of stored rows and optimizer state; + phase, module, table
``fxdist_ps_inserts_total``         counter    dynamic tables: ids first seen; + phase, module, table
``fxdist_ps_evictions_total``       counter    dynamic tables: rows evicted (LRU); + phase, module, table
``fxdist_ps_pending_requests``      gauge      requests received and not answered yet (waiting or running)
==================================  =========  =============================================================

and ``fxdist_ps_rejected_connections_total`` (counter, + ``reason``): connections the server's ``socket`` listener
refused (``bad_auth``, ``bad_tls``, ``handshake_timeout``, ``too_many_connections``, ``bad_frame``, ``over_limit``,
``frame_timeout``: :mod:`scheduling.ps.transport.socket_server`), every reason exported from 0 on.

Trainer side (:class:`StalenessCollector`, labels ``job``, ``phase``, ``rank``): ``fxdist_ps_staleness_steps``,
a histogram of the pushes of the same client to the same server still in flight when a lookup was sent (only
with ``max_staleness``; the steps the rows may lag).

Source: prometheus client_python custom collectors (``prometheus_client.core.*MetricFamily``,
``CollectorRegistry.register``); Prometheus naming conventions (``_total``, ``_seconds``).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.utils import floatToGoString

from scheduling.ps.server_stats import table_stats

__all__ = ["ServerCollector", "StalenessCollector", "STALENESS_BUCKETS", "SERVER_METRICS", "split_namespace"]

STALENESS_BUCKETS = (0, 1, 2, 3, 4, 8, 16)
"""Upper bounds (pushes in flight, i.e. steps) of ``fxdist_ps_staleness_steps``; ``+Inf`` is implied."""
SERVER_METRICS = ("fxdist_ps_server_lookup_seconds", "fxdist_ps_server_push_seconds", "fxdist_ps_rows",
                  "fxdist_ps_bytes", "fxdist_ps_inserts_total", "fxdist_ps_evictions_total",
                  "fxdist_ps_pending_requests", "fxdist_ps_rejected_connections_total")
"""The metric names a server's :class:`ServerCollector` exports (counters with their ``_total``)."""


def split_namespace(namespace: str) -> tuple[str, str]:
    """``(phase, module)`` of a server namespace: ``"fxdist-job-optimized:sparse.ebc"`` ->
    ``("optimized", "sparse.ebc")``; a name without ``-`` or ``:`` gives itself and ``""``."""
    head, _, module = namespace.partition(":")
    return head.rpartition("-")[2], module


class ServerCollector:
    """The metrics of the parameter server a job's server actor serves now (:meth:`watch`; none before).

    Args:
        job: The ``job`` label; ``rank``: the server's (``ps<i>``).
    """

    def __init__(self, job: str, rank: str) -> None:
        self.job, self.rank = job, rank
        self.server: Any = None

    def watch(self, server: Any) -> None:
        """Read ``server`` (a ``scheduling.ps.PSServer``) from the next scrape on (a restarted or re-joined actor
        serves a new one)."""
        self.server = server

    def collect(self) -> Iterator[Metric]:
        server = self.server
        if server is None:
            return
        job, rank = self.job, self.rank
        snap = server.stats.snapshot()
        per = ("job", "rank", "phase", "module")
        hists = {
            "lookup": HistogramMetricFamily("fxdist_ps_server_lookup_seconds", "Seconds a parameter server spends "
                                            "answering one lookup request (measured on the server; the work, not the "
                                            "wait for the request's turn).", labels=per),
            "push": HistogramMetricFamily("fxdist_ps_server_push_seconds", "Seconds a parameter server spends "
                                          "applying one push request (measured on the server).", labels=per),
        }
        for (kind, namespace), t in sorted(snap["timings"].items()):
            buckets = [(floatToGoString(bound), count) for bound, count in t["buckets"]]
            hists[kind].add_metric([job, rank, *split_namespace(namespace)], buckets, t["sum"])
        yield from hists.values()
        per_table = (*per, "table")
        rows = GaugeMetricFamily("fxdist_ps_rows", "Embedding rows a parameter server holds, per table (a dynamic "
                                 "table: its live rows).", labels=per_table)
        size = GaugeMetricFamily("fxdist_ps_bytes", "Bytes of the stored rows and optimizer state a parameter "
                                 "server holds, per table.", labels=per_table)
        inserts = CounterMetricFamily("fxdist_ps_inserts_total", "Dynamic tables: ids a parameter server saw for "
                                      "the first time (candidates inserted).", labels=per_table)
        evictions = CounterMetricFamily("fxdist_ps_evictions_total", "Dynamic tables: rows a parameter server "
                                        "evicted (least recently used) to admit new ids.", labels=per_table)
        for t in table_stats(server):
            labels = [job, rank, *split_namespace(t["namespace"]), t["table"]]
            rows.add_metric(labels, t["rows"])
            size.add_metric(labels, t["bytes"])
            if t["dynamic"]:
                inserts.add_metric(labels, t["inserts"])
                evictions.add_metric(labels, t["evictions"])
        yield from (rows, size, inserts, evictions)
        pending = GaugeMetricFamily("fxdist_ps_pending_requests", "Lookup and push requests a parameter server "
                                    "received and has not answered yet (waiting for their turn or running).",
                                    labels=("job", "rank"))
        pending.add_metric([job, rank], snap["pending"])
        yield pending
        rejected = CounterMetricFamily("fxdist_ps_rejected_connections_total", "Connections a parameter server's "
                                       "socket listener refused (closed before or while reading a request), per "
                                       "reason.", labels=("job", "rank", "reason"))
        for reason, count in sorted(snap.get("rejected", {}).items()):
            rejected.add_metric([job, rank, reason], count)
        yield rejected


class StalenessCollector:
    """Trainer side: ``fxdist_ps_staleness_steps`` of each phase, from ``source()`` = ``{phase: Counter(pushes in
    flight -> lookups)}`` (the phases' ``PSClient.staleness`` summed); a phase without lookups counted is left out.

    Args:
        job, rank: The ``job`` and ``rank`` labels.
        source: Called at each scrape.
    """

    def __init__(self, job: str, rank: str, source: Callable[[], Mapping[str, Counter[int]]]) -> None:
        self.job, self.rank, self.source = job, rank, source

    def collect(self) -> Iterator[Metric]:
        family = HistogramMetricFamily(
            "fxdist_ps_staleness_steps", "Trainer side: pushes of the same client to the same parameter server still "
            "in flight when a lookup was sent (only with max_staleness): the steps its rows may lag (unordered "
            "clients; ordered servers apply those pushes first).", labels=("job", "phase", "rank"))
        for phase, counts in sorted(self.source().items()):
            total = sum(counts.values())
            if not total:
                continue
            buckets = [(floatToGoString(b), sum(c for n, c in counts.items() if n <= b)) for b in STALENESS_BUCKETS]
            family.add_metric([self.job, phase, self.rank], [*buckets, ("+Inf", total)],
                              float(sum(n * c for n, c in counts.items())))
        yield family
