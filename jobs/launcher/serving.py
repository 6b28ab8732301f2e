"""``fxdist serve RUN``: the run's trained model behind a Ray Serve deployment, its deltas applied while it serves.

One deployment (:class:`ModelServer`, one replica) holds a :class:`jobs.launcher.serving_model.ServedModel` of
``RUN_DIR/model/``, applies the deltas the job commits (``[export] every_steps``; a background thread polls every
``--poll-s`` seconds), and answers over Ray Serve's HTTP proxy, bound to ``--host`` (``127.0.0.1`` by default:
other hosts reach it only when asked for) on ``--port``:

- ``POST /predict`` with a JSON body (:mod:`jobs.launcher.serving_inputs`: ``{"rows": [Criteo lines]}`` for the
  bundled DLRM, ``{"inputs": [...]}`` for your model) -> ``{"step": the served step, "predictions": [...]}`` (the
  DLRM adds ``"logits"``); a body the model cannot take -> HTTP 400 ``{"error": "<what was wrong>"}``;
- ``GET /step`` -> ``{"step", "deltas_applied", "delta_failures"}``.

The replica's Prometheus metrics (:class:`ServingMetrics`) are served by ``prometheus_client`` on
``--metrics-port`` (default ``--port + 1``; ``0`` picks a free port) on the same host. Ray is started locally, or
joined when ``RAY_ADDRESS`` is set.

Source: Ray Serve docs ("Deployments", ``serve.start(http_options=...)``, ``serve.run``, ``serve.delete``,
Starlette ``Request`` ingress); prometheus client_python (``start_http_server``, Prometheus naming conventions).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from jobs.launcher.serving_inputs import RequestError
from jobs.launcher.serving_model import ServedModel, ServeError

__all__ = ["APP_NAME", "REQUEST_BUCKETS", "ServingMetrics", "ModelServer", "Served", "ServeError", "start", "stop",
           "serve_run"]

APP_NAME = "fxdist"
"""The Ray Serve application's default name (``serve.status()`` lists it)."""
REQUEST_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
"""Bucket bounds (seconds) of ``fxdist_serve_request_seconds``: a one-row request on a small model takes about a
millisecond in the replica, a 256-row one a few."""


class ServingMetrics:
    """The serving replica's metrics, in a private registry, optionally served over HTTP.

    ``fxdist_serve_request_seconds`` (histogram: ``POST /predict`` in the replica, decoding to answer),
    ``fxdist_serve_requests_total{code}`` (every request, by HTTP status), ``fxdist_serve_model_step`` (the served
    step), ``fxdist_serve_deltas_applied_total`` and ``fxdist_serve_delta_failures_total`` (deltas or reloads that
    failed, each retried on the next poll).

    Args:
        step: returns the served step (read at each scrape).
        registry: registry to register into; a fresh ``CollectorRegistry()`` by default.
    """

    def __init__(self, step: Callable[[], int] = lambda: 0, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        self.request_seconds = Histogram("fxdist_serve_request_seconds", "Wall time of one POST /predict in the "
                                         "serving replica (decoding, the model, the answer).", registry=self.registry,
                                         buckets=REQUEST_BUCKETS)
        self.requests = Counter("fxdist_serve_requests_total", "HTTP requests answered by the serving replica, by "
                                "status code.", ["code"], registry=self.registry)
        self.model_step = Gauge("fxdist_serve_model_step", "Training step of the model being served.",
                                registry=self.registry)
        self.model_step.set_function(lambda: float(step()))
        self.deltas_applied = Counter("fxdist_serve_deltas_applied_total", "Deltas applied to the served model.",
                                      registry=self.registry)
        self.delta_failures = Counter("fxdist_serve_delta_failures_total", "Deltas (or model reloads) that failed to "
                                      "load or apply; each is retried on the next poll.", registry=self.registry)
        self._server: Any = None
        self.port: int | None = None

    def applied(self, step: int) -> None:
        """Count one delta applied (``step``: its step)."""
        self.deltas_applied.inc()

    def failed(self, error: BaseException) -> None:
        """Count one delta or reload that failed."""
        self.delta_failures.inc()

    def answered(self, code: int, seconds: float | None) -> None:
        """Count one request answered with ``code``; ``seconds``: its time, for a ``POST /predict``."""
        self.requests.labels(code=str(code)).inc()
        if seconds is not None:
            self.request_seconds.observe(seconds)

    def serve(self, port: int, host: str = "127.0.0.1") -> int:
        """Serve ``/metrics`` on ``host:port`` in a daemon thread (``port=0``: a free one); the bound port.

        Raises:
            OSError: the port is taken (the message names host and port).
        """
        try:
            self._server, _ = start_http_server(port, addr=host, registry=self.registry)
        except OSError as e:
            raise OSError(f"fxdist serve: metrics cannot bind {host}:{port}: {e}") from e
        self.port = int(self._server.server_port)
        return self.port

    def close(self) -> None:
        """Stop serving ``/metrics`` (idempotent)."""
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None


def _json(code: int, body: Any) -> Any:
    from starlette.responses import Response

    return Response(json.dumps(body), status_code=code, media_type="application/json")


class ModelServer:
    """The Ray Serve deployment of ``fxdist serve`` (the class :func:`start` deploys, one replica): a
    :class:`ServedModel` of ``run``, polled for deltas every ``poll_s`` seconds, its metrics on
    ``metrics_host:metrics_port`` (None: not served).

    Raises:
        ServeError: the run cannot be served (see :class:`jobs.launcher.serving_model.ServeError`).
        OSError: the metrics port is taken.
    """

    def __init__(self, run: str, poll_s: float = 1.0, metrics_host: str = "127.0.0.1",
                 metrics_port: int | None = None) -> None:
        self.metrics = ServingMetrics(step=lambda: self.model.step)
        self.model = ServedModel(run, on_applied=self.metrics.applied, on_failed=self.metrics.failed)
        if metrics_port is not None:
            self.metrics.serve(metrics_port, metrics_host)
        self.model.start(poll_s)

    def metrics_port(self) -> int | None:
        """The port ``/metrics`` is served on (None: not served)."""
        return self.metrics.port

    def step(self) -> dict[str, int]:
        """``GET /step``'s answer: the served step, deltas applied and failed."""
        return {"step": self.model.step, "deltas_applied": self.model.applied,
                "delta_failures": self.model.failures}

    async def _answer(self, method: str, path: str, request: Any) -> tuple[int, Any]:
        if path == "/step":
            return (200, self.step()) if method == "GET" else (405, {"error": "GET /step"})
        if path != "/predict":
            return 404, {"error": f"no route {path}: POST /predict or GET /step"}
        if method != "POST":
            return 405, {"error": "POST /predict with a JSON body"}
        try:
            body = json.loads(await request.body())
        except ValueError as e:
            return 400, {"error": f"the body is not JSON: {e}"}
        try:
            return 200, await asyncio.to_thread(self.model.predict, body)
        except RequestError as e:
            return 400, {"error": str(e), "step": self.model.step}

    async def __call__(self, request: Any) -> Any:
        """Answer one HTTP request (Starlette ``Request``) with a JSON ``Response``."""
        t0 = time.perf_counter()
        root = request.scope.get("root_path", "") or ""
        path = request.url.path
        path = (path[len(root):] if root and path.startswith(root) else path).rstrip("/") or "/"
        try:
            code, body = await self._answer(request.method, path, request)
        except Exception as e:  # noqa: BLE001 - answered as a 500 naming the error; the replica keeps serving
            logging.getLogger(__name__).exception("fxdist serve: %s %s failed", request.method, path)
            code, body = 500, {"error": f"{type(e).__name__}: {e}"}
        self.metrics.answered(code, time.perf_counter() - t0 if path == "/predict" else None)
        return _json(code, body)

    def __del__(self) -> None:
        model = getattr(self, "model", None)
        if model is not None:
            model.stop()
        if getattr(self, "metrics", None) is not None:
            self.metrics.close()


@dataclass(frozen=True)
class Served:
    """A running deployment: its application ``name``, ``url`` (``http://host:port<route>``), metrics port and the
    step it served when it started."""

    name: str
    url: str
    metrics_port: int | None
    step: int


def _ray() -> bool:
    """Start Ray locally, or join ``RAY_ADDRESS``'s cluster; whether this call started it."""
    import ray

    if ray.is_initialized():
        return False
    address = os.environ.get("RAY_ADDRESS", "")
    if address:
        from jobs.cluster import SETUP_HOOK

        ray.init(address=address, log_to_driver=False, runtime_env={"worker_process_setup_hook": SETUP_HOOK})
    else:
        from recsys.quiet import RAY_TOKEN_AUTH_ENABLED, RAY_TOKEN_AUTH_LOGGER, drop_log_records

        drop_log_records(RAY_TOKEN_AUTH_LOGGER, RAY_TOKEN_AUTH_ENABLED)  # our own local cluster
        ray.init(include_dashboard=False, log_to_driver=False, logging_level=logging.WARNING)
    return True


def start(run: str | Path, *, host: str = "127.0.0.1", port: int = 8000, metrics_port: int | None = None,
          poll_s: float = 1.0, name: str = APP_NAME, route_prefix: str = "/") -> Served:
    """Deploy ``run``'s model (Ray started or joined as needed; Serve's HTTP proxy on ``host:port``, which a Serve
    already running on the cluster keeps as it was) and wait until it answers.

    Args:
        metrics_port: the replica's ``/metrics`` port on ``host``: None for ``port + 1``, 0 for a free one.
        name, route_prefix: the Serve application's name and HTTP route (``/dlrm``: ``POST /dlrm/predict``).

    Raises:
        ServeError: the run cannot be served (checked here before Ray starts, and again by the replica).
    """
    from ray import serve

    ServedModel(run, check_only=True)  # the clear error before Ray and Serve start
    _ray()
    serve.start(http_options={"host": host, "port": port})
    deployment = serve.deployment(name=f"{name}-model", num_replicas=1, ray_actor_options={"num_cpus": 0},
                                  max_ongoing_requests=64)(ModelServer)
    mport = port + 1 if metrics_port is None else metrics_port
    handle = serve.run(deployment.bind(str(Path(run).resolve()), poll_s, host, mport), name=name,
                       route_prefix=route_prefix)
    bound = handle.metrics_port.remote().result()
    step = handle.step.remote().result()["step"]
    return Served(name, f"http://{host}:{port}{route_prefix.rstrip('/')}", bound, step)


def stop(name: str = APP_NAME) -> None:
    """Delete the Serve application ``name`` (its replica stops polling and serving)."""
    from ray import serve

    serve.delete(name)


def serve_run(run: str, *, host: str = "127.0.0.1", port: int = 8000, metrics_port: int | None = None,
              poll_s: float = 1.0, log: Callable[[str], None] = print) -> None:
    """``fxdist serve RUN``: :func:`start`, print where it answers, serve until interrupted, then delete the
    application (and stop Ray if this call started it).

    Raises:
        ServeError: the run cannot be served.
        KeyboardInterrupt: after the clean-up, when interrupted.
    """
    import ray

    started = not ray.is_initialized()
    served = start(run, host=host, port=port, metrics_port=metrics_port, poll_s=poll_s)
    log(f"serving {Path(run)} (step {served.step}) at {served.url}: POST {served.url}/predict, GET "
        f"{served.url}/step; metrics at http://{host}:{served.metrics_port}/metrics; deltas polled every "
        f"{poll_s:g} s (Ctrl-C stops)")
    try:
        while True:
            time.sleep(3600)
    finally:
        stop()
        if started:
            ray.shutdown()

