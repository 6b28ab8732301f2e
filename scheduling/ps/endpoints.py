"""The requests a parameter server answers, whatever transport carries them.

:class:`ServerEndpoints` holds one :class:`~scheduling.ps.server.PSServer` and has one method per request
(``configure``, ``lookup``, ``push``, ``push_lookup``, ``state_dict``, ``load_state_dict``, ``save``,
``set_delays``, ``stats``). Each applies the request order the client asked for
(:func:`scheduling.ps.ordering.in_order`), so the tables, the optimizer, the step order and the fused path
are the same on every transport:

- ``torch_rpc``: the module-level ``_rpc_<method>`` functions of :mod:`scheduling.ps.server` call the
  process-wide endpoints (:func:`scheduling.ps.start_server` sets their server);
- ``ray``: the class itself is the Ray actor (:mod:`scheduling.ps.ray_transport`); a client calls
  ``handle.lookup.remote(...)`` and waits with ``ray.get``.

Source: torch.fx paper §6.2.3 (parameter-server fetches); Ray actors (a class whose methods are the calls).
"""

from __future__ import annotations

import os
from typing import Any

import torch

from .ordering import Order, in_order

__all__ = ["ServerEndpoints", "METHODS"]

METHODS = ("configure", "lookup", "push", "push_lookup", "state_dict", "load_state_dict", "save", "set_delays",
           "stats")
"""The requests every transport carries (``PSClient`` calls only these)."""


class ServerEndpoints:
    """The request handlers of one parameter server (``server``: a ``PSServer``, or None before one runs).

    Raises (every method): RuntimeError when no server runs here yet.
    """

    def __init__(self, server: Any = None) -> None:
        self.server = server
        self.why_none = "call start_server() first"
        """What the error says when no server runs (a restarted Ray actor: it lost its tables)."""

    def _server(self) -> Any:
        if self.server is None:  # a RuntimeError: clients report the server as unavailable
            raise RuntimeError(f"no parameter server runs in process {os.getpid()}; {self.why_none}")
        return self.server

    def configure(self, *args: Any, **kwargs: Any) -> dict[str, int]:
        """``PSServer.configure``: create the namespace's shards."""
        return self._server().configure(*args, **kwargs)

    def lookup(self, namespace: str, batch: Any, compress: str | None = None, order: Order | None = None,
               ) -> torch.Tensor:
        """Pooled sums ``(B, D_s)`` of the batch, in the request order ``order`` asks for."""
        server = self._server()
        return in_order(order, "lookup", server.name, lookup=lambda: server.lookup(namespace, batch, compress))

    def push(self, namespace: str, batch: Any, grad: torch.Tensor, order: Order | None = None) -> int:
        """Apply ``grad`` ``(B, D_s)``; returns the rows updated."""
        server = self._server()
        return in_order(order, "push", server.name, push=lambda: server.push(namespace, batch, grad))

    def push_lookup(self, namespace: str, batch: Any, grad: torch.Tensor, next_batch: Any,
                    compress: str | None = None, order: Order | None = None) -> tuple[int, torch.Tensor]:
        """A push, then the lookup of the next batch, in one request: ``(rows updated, lookup answer)``."""
        server = self._server()
        return in_order(order, "push+lookup", server.name, push=lambda: server.push(namespace, batch, grad),
                        lookup=lambda: server.lookup(namespace, next_batch, compress))

    def state_dict(self, namespace: str | None = None) -> dict[str, Any]:
        """``PSServer.state_dict`` (copies of the shards)."""
        return self._server().state_dict(namespace)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """``PSServer.load_state_dict``."""
        self._server().load_state_dict(state)

    def save(self, directory: str) -> str:
        """``PSServer.save``: ``<directory>/<name>.pt``; returns the path."""
        return self._server().save(directory)

    def set_delays(self, fetch_delay_s: float, push_delay_s: float) -> None:
        """Added latency per lookup / push, seconds."""
        server = self._server()
        server.fetch_delay_s, server.push_delay_s = fetch_delay_s, push_delay_s

    def stats(self) -> dict[str, int]:
        """Lookups and pushes served, process id, rows and bytes held."""
        server = self._server()
        return {"lookups": server.num_lookups, "pushes": server.num_pushes, "pid": os.getpid(), **server.memory()}
