"""Prometheus metrics of trainers and parameter servers, each in its own ``CollectorRegistry``.

Every trainer and server process owns one :class:`Exporter`: a fresh registry (never the global one,
so Ray's and other libraries' metrics are left as they are and tests can build as many as they like)
served over HTTP by ``prometheus_client.start_http_server`` on ``127.0.0.1`` unless told otherwise (another address
needs ``[metrics] expose = true``; ``certfile``/``keyfile`` serve HTTPS, ``client_cafile`` with
``client_auth_required`` admits only scrapers with a client certificate: :func:`tls_options`).

Metrics (labels ``job``, ``phase`` = baseline | optimized, ``rank``; servers use ``rank = "ps<i>"``):

==================================  =========  ===========================================================
``fxdist_samples_total``            counter    training samples processed
``fxdist_step_seconds``             histogram  wall time of one training step (forward, backward, update)
``fxdist_ps_lookup_seconds``        histogram  trainer: time blocked on embedding lookups in a step (the servers'
                                               own serve time is ``fxdist_ps_server_lookup_seconds``)
``fxdist_rpc_fetch_seconds``        histogram  the same observations under the old name, an alias kept for one
                                               release (:data:`DEPRECATED_ALIASES`); dashboards use the new name
``fxdist_loss``                     gauge      training loss of the last step (binary cross-entropy)
``fxdist_qps_gain_ratio``           gauge      trainer rank 0: QPS gain of the optimized phase over the baseline
                                               so far, as a fraction (0.12 = +12 %), from the interleaved
                                               blocks; label ``stat`` = median | min | max, and low | high (the
                                               95 % interval of the median, once enough blocks exist)
``fxdist_export_deltas_total``      counter    trainer rank 0: deltas of the model written (``[export]
                                               every_steps``, :mod:`jobs.trainer.deltas`)
``fxdist_export_delta_rows_total``  counter    trainer rank 0: table rows those deltas carried
==================================  =========  ===========================================================

Parameter servers (:meth:`Exporter.watch_server`) export their own metrics, read at scrape time
(:mod:`jobs.trainer.server_metrics`: lookup and push serve times, rows and bytes per table, dynamic-table inserts
and evictions, pending requests); trainers add ``fxdist_ps_staleness_steps`` (:meth:`Exporter.watch_staleness`).

Source: prometheus client_python (registries, ``start_http_server``); Prometheus naming conventions
(``_total`` counters, ``_seconds`` units).
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Callable, Iterable, Mapping
from typing import Any
from wsgiref.simple_server import WSGIServer

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from jobs.records import Gain, MetricsTLS
from scheduling.ps.transport.ports import free_port, free_port_block  # one free_port for the project (re-exported here)

__all__ = ["LABELS", "DEPRECATED_ALIASES", "STEP_BUCKETS", "LOOKUP_BUCKETS", "Exporter", "free_port", "free_port_block",
           "tls_options"]

LABELS = ("job", "phase", "rank")
DEPRECATED_ALIASES = {"fxdist_rpc_fetch_seconds": "fxdist_ps_lookup_seconds"}
"""Old metric name -> its new name; the old one is still exported, with the same observations, for one release."""
STEP_BUCKETS = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.05, 0.075, 0.1, 0.25, 0.5, 1.0, 2.5)
"""Step latency buckets, seconds."""
LOOKUP_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.002, 0.004, 0.008, 0.016, 0.032, 0.064, 0.128, 0.5)
"""Embedding fetch latency buckets, seconds."""


def tls_options(metrics: Any) -> MetricsTLS | None:
    """``start_http_server``'s TLS keyword arguments from the ``[metrics]`` section ``metrics`` (``certfile``,
    ``keyfile``, ``client_cafile``, ``client_auth_required``), or None when ``certfile`` is "" (plain HTTP).
    prometheus_client has no HTTP basic auth; client certificates are how a scraper is authenticated."""
    if not metrics.certfile:
        return None
    return {"certfile": metrics.certfile, "keyfile": metrics.keyfile, "client_cafile": metrics.client_cafile or None,
            "client_auth_required": metrics.client_auth_required}


class Exporter:
    """One process's fxdist metrics, in a private registry, optionally served over HTTP.

    Args:
        job: The ``job`` label (the job name).
        rank: The ``rank`` label ("0", "1", ... for trainers, "ps0", ... for servers).
        registry: Registry to register into; a fresh ``CollectorRegistry()`` by default.

    Example:
        >>> e = Exporter("demo", "0")
        >>> e.observe_step("baseline", samples=128, step_seconds=0.01, lookup_seconds=0.002, loss=0.5)
        >>> e.registry.get_sample_value("fxdist_samples_total", {"job": "demo", "phase": "baseline", "rank": "0"})
        128.0
    """

    def __init__(self, job: str, rank: str | int, registry: CollectorRegistry | None = None) -> None:
        self.job = job
        self.rank = str(rank)
        self.registry = registry if registry is not None else CollectorRegistry()
        self.samples = Counter("fxdist_samples", "Training samples processed.", LABELS, registry=self.registry)
        self.step_seconds = Histogram(
            "fxdist_step_seconds", "Wall time of one training step.", LABELS, registry=self.registry,
            buckets=STEP_BUCKETS,
        )
        self.lookup_seconds = Histogram(
            "fxdist_ps_lookup_seconds", "Time spent on embedding lookups on the parameter servers.", LABELS,
            registry=self.registry, buckets=LOOKUP_BUCKETS,
        )
        self.lookup_seconds_alias = Histogram(
            "fxdist_rpc_fetch_seconds", "Deprecated alias of fxdist_ps_lookup_seconds (removed next release).",
            LABELS, registry=self.registry, buckets=LOOKUP_BUCKETS,
        )
        self.loss = Gauge("fxdist_loss", "Training loss of the last step.", LABELS, registry=self.registry)
        self.gain = Gauge("fxdist_qps_gain_ratio", "QPS gain of the optimized phase over the baseline (fraction), "
                          "median of the interleaved block pairs and its interval.", ("job", "stat"),
                          registry=self.registry)
        self.reader_rate = Gauge("fxdist_reader_lines_per_second", "Criteo lines this trainer's reader parses per "
                                 "second of parse time, per worker process (recsys.criteo_stream).", ("job", "rank"),
                                 registry=self.registry)
        self.deltas = Counter("fxdist_export_deltas_total", "Deltas of the trained model written (trainer rank 0, "
                              "[export] every_steps; jobs.trainer.deltas).", LABELS, registry=self.registry)
        self.delta_rows = Counter("fxdist_export_delta_rows_total", "Embedding-table rows the deltas of the model "
                                  "carried (rows changed since the previous delta).", LABELS, registry=self.registry)
        self._cache: dict[str, tuple[Any, Any, Any, Any]] = {}
        self._server_collector: Any = None
        self._staleness: Any = None
        self._server: WSGIServer | None = None
        self._thread: threading.Thread | None = None
        self.port: int | None = None

    def labels(self, phase: str) -> dict[str, str]:
        return {"job": self.job, "phase": phase, "rank": self.rank}

    def touch(self, phases: Iterable[str]) -> None:
        """Create the series of ``phases`` at zero, so every series exists from the first scrape."""
        for phase in phases:
            labels = self.labels(phase)
            self.samples.labels(**labels)
            self.step_seconds.labels(**labels)
            self.lookup_seconds.labels(**labels)
            self.lookup_seconds_alias.labels(**labels)

    def _children(self, phase: str) -> tuple[Any, Any, Any, Any]:
        """The labelled series of ``phase`` (samples, step, lookup (with its alias), loss), looked up once per phase: a
        ``labels()`` lookup costs more than the update itself (prometheus client_python's advice)."""
        children = self._cache.get(phase)
        if children is None:
            labels = self.labels(phase)
            children = self._cache[phase] = (self.samples.labels(**labels), self.step_seconds.labels(**labels),
                                             _Both(self.lookup_seconds.labels(**labels),
                                                   self.lookup_seconds_alias.labels(**labels)),
                                             self.loss.labels(**labels))
        return children

    def observe_step(
        self, phase: str, *, samples: int, step_seconds: float, lookup_seconds: float | None, loss: float
    ) -> None:
        """Record one training step (seconds; ``lookup_seconds=None``: no parameter-server lookup in this step)."""
        samples_total, step, lookup, last_loss = self._children(phase)
        samples_total.inc(samples)
        step.observe(step_seconds)
        if lookup_seconds is not None:
            lookup.observe(lookup_seconds)
        last_loss.set(loss)

    def watch_server(self, server: Any, rank: str | None = None) -> None:
        """Export the metrics of parameter server ``server`` (a ``scheduling.ps.PSServer``) from now on, read from
        it at each scrape (:class:`jobs.trainer.server_metrics.ServerCollector`), under the ``rank`` label ``rank``
        (default this exporter's; a trainer hosting server ``i`` gives ``"ps<i>"``); a later call (a new server of
        the same process) replaces it."""
        from jobs.trainer.server_metrics import ServerCollector

        if self._server_collector is None:
            self._server_collector = ServerCollector(self.job, rank or self.rank)
            self.registry.register(self._server_collector)
        self._server_collector.rank = rank or self.rank
        self._server_collector.watch(server)

    def watch_staleness(self, source: Callable[[], Mapping[str, collections.Counter[int]]]) -> None:
        """Export ``fxdist_ps_staleness_steps`` from ``source()`` = ``{phase: Counter(pushes in flight -> lookups)}``
        at each scrape (:class:`jobs.trainer.server_metrics.StalenessCollector`); a later call replaces the source."""
        from jobs.trainer.server_metrics import StalenessCollector

        if self._staleness is None:
            self._staleness = StalenessCollector(self.job, self.rank, source)
            self.registry.register(self._staleness)
        self._staleness.source = source

    def observe_reader(self, lines_per_s: float) -> None:
        """The trainer's parse throughput so far (:meth:`recsys.criteo_stream.CriteoStream.stats`), lines/s."""
        self.reader_rate.labels(job=self.job, rank=self.rank).set(lines_per_s)

    def observe_gain(self, gain: Gain) -> None:
        """Publish :func:`jobs.stats.interleaved_gain` (percent values) as ``fxdist_qps_gain_ratio`` fractions;
        statistics that do not exist yet (no blocks, no interval) are left out."""
        stats = {"median": gain.get("median_percent"), "min": gain.get("min_percent"), "max": gain.get("max_percent"),
                 "low": gain.get("low_percent"), "high": gain.get("high_percent")}
        for stat, value in stats.items():
            if value is not None and value == value:
                self.gain.labels(job=self.job, stat=stat).set(value / 100.0)

    def observe_delta(self, phase: str, rows: int) -> None:
        """One delta of ``phase``'s model written, carrying ``rows`` table rows (:mod:`jobs.trainer.deltas`)."""
        labels = self.labels(phase)
        self.deltas.labels(**labels).inc()
        self.delta_rows.labels(**labels).inc(rows)

    def observe_lookup(self, phase: str, seconds: float) -> None:
        """Record one served (server) or issued (trainer) embedding lookup, ``seconds`` long."""
        self._children(phase)[2].observe(seconds)

    def serve(self, port: int, host: str = "127.0.0.1", tls: MetricsTLS | None = None) -> int:
        """Serve ``/metrics`` on ``host:port`` in a daemon thread; ``port=0`` picks a free port. ``tls``:
        :func:`tls_options` (HTTPS, client certificates checked when it says so), or None for plain HTTP.

        Returns:
            The bound port.

        Raises:
            OSError: the port is taken, or a TLS file cannot be read (the message names host and port).
        """
        try:
            if tls is None:
                self._server, self._thread = start_http_server(port, addr=host, registry=self.registry)
            else:
                self._server, self._thread = start_http_server(port, addr=host, registry=self.registry, **tls)
        except OSError as e:  # ssl.SSLError is an OSError too
            raise OSError(f"metrics exporter of rank {self.rank}: cannot bind {host}:{port}"
                          f"{' or read its TLS files' if tls else ''}: {e}") from e
        self.port = self._server.server_port
        return self.port

    def close(self) -> None:
        """Stop serving (idempotent)."""
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None


class _Both:
    """Two labelled histograms observed together (a metric and its deprecated alias)."""

    def __init__(self, new: Any, old: Any) -> None:
        self.new, self.old = new, old

    def observe(self, value: float) -> None:
        self.new.observe(value)
        self.old.observe(value)
