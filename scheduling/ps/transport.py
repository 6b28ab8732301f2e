"""How a :class:`~scheduling.ps.PSClient` reaches its servers: ``torch_rpc``, ``ray`` or ``socket``.

A transport sends one request (a :data:`~scheduling.ps.endpoints.METHODS` name and its arguments) to
server ``i`` of the client's list and returns a handle with ``wait()`` and ``done()``. Contract shared by
both, so the client needs no branch:

- ``call_async`` raises ``RuntimeError`` when the request cannot be sent;
- ``handle.wait()`` returns the server's answer, raises a plain ``RuntimeError`` when the transport failed
  (timeout, connection lost, server process died) and the server's own exception (``ValueError``...)
  otherwise.

``torch_rpc`` (:class:`TorchRPCTransport`): servers are ``torch.distributed.rpc`` worker names of one
static group (rendezvous, no re-admission after a crash); a server may live in a trainer's process
(:mod:`scheduling.ps.in_trainers`), and that trainer's own requests to it skip RPC.
``ray`` (:mod:`scheduling.ps.ray_transport`, imported only when asked for): servers are Ray actors
(``handle.lookup.remote(...)``, waited with ``ray.get``); no group, so a restarted server actor is reachable
again through the same handle.
``socket`` (:mod:`scheduling.ps.socket_transport`, imported only when asked for): one persistent TCP
connection per (client process, server) to servers run by :mod:`scheduling.ps.socket_server`, tensors sent as
raw buffers; servers named ``"host:port"`` or by names registered there (far less server CPU per request
than ``torch_rpc``, issue 32).

Source: torch.distributed.rpc (``rpc_async``); Ray actors (``ActorHandle.method.remote``, ``ray.get``);
Python ``socket``.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Sequence
from typing import Any

from . import in_trainers

__all__ = ["TRANSPORTS", "DEFAULT_TRANSPORT", "TorchRPCTransport", "CLIENT_TRANSPORTS", "make_transport",
           "transport_of"]

TRANSPORTS = ("torch_rpc", "ray", "socket")
"""The transports a client can use."""
DEFAULT_TRANSPORT = "torch_rpc"
"""Used when nothing says otherwise (see benchmarks/transport.py and the README for why)."""


class TorchRPCTransport:
    """Requests as ``torch.distributed.rpc.rpc_async`` calls of :mod:`scheduling.ps.server`'s ``_rpc_*``
    functions; ``servers`` are the RPC worker names (this process must be in their group).

    Raises:
        ValueError: a server is not an RPC worker name (e.g. a Ray actor handle: use ``transport="ray"``).
    """

    name = "torch_rpc"

    def __init__(self, servers: Sequence[Any]) -> None:
        bad = [s for s in servers if not isinstance(s, str)]
        if bad:
            raise ValueError(f"transport 'torch_rpc': servers are RPC worker names (str), got {bad[0]!r}; "
                             "use transport='ray' for Ray actor handles")
        self.names = list(servers)

    def call_async(self, server: int, method: str, args: tuple, timeout_s: float) -> Any:
        """Send ``method(*args)`` to server ``server``; a server hosted by this very process
        (:func:`scheduling.ps.in_trainers.serve_in_trainer`) is called directly, without RPC."""
        from torch.distributed import rpc

        from . import server as _srv

        name = self.names[server]
        local = in_trainers.local_endpoints(name)
        if local is not None:
            return in_trainers.call_local(local, method, args)
        return rpc.rpc_async(name, getattr(_srv, f"_rpc_{method}"), args, timeout=timeout_s)

    def stop(self, timeout_s: float, names: Sequence[str] | None = None) -> None:
        """Ask every server (or those of ``names``) to leave the group (their ``start_server(block=True)``
        returns); best effort: the one stop loop of the ``torch_rpc`` servers."""
        from torch.distributed import rpc

        from . import server as _srv

        futs = []
        for name in self.names if names is None else names:
            try:
                futs.append(rpc.rpc_async(name, _srv._rpc_stop, (), timeout=timeout_s))
            except RuntimeError:
                pass
        for fut in futs:
            try:
                fut.wait()
            except RuntimeError:
                pass


def transport_of(servers: Sequence[Any]) -> str:
    """The transport for ``servers`` when the caller names none: ``"ray"`` for Ray actor handles or for names
    registered by :func:`scheduling.ps.ray_transport.register_servers` (a ``LocalCluster(transport="ray")``
    or a job does that), ``"socket"`` for names registered by
    :func:`scheduling.ps.socket_transport.register_servers`, else :data:`DEFAULT_TRANSPORT`."""
    ray_transport = sys.modules.get("scheduling.ps.ray_transport")  # only loaded once Ray servers exist
    if ray_transport is not None and servers and all(ray_transport.is_ray_server(s) for s in servers):
        return "ray"
    socket_transport = sys.modules.get("scheduling.ps.socket_transport")
    if socket_transport is not None and servers and all(socket_transport.is_socket_server(s) for s in servers):
        return "socket"
    return DEFAULT_TRANSPORT


def make_transport(name: str | None, servers: Sequence[Any]) -> Any:
    """A transport to ``servers``: ``name`` one of :data:`TRANSPORTS`, None for :func:`transport_of`.

    Raises:
        ValueError: an unknown transport, or servers of the wrong kind for it.
    """
    name = transport_of(servers) if name is None else name
    return _load(CLIENT_TRANSPORTS, name)(servers)


CLIENT_TRANSPORTS = {"torch_rpc": "scheduling.ps.transport:TorchRPCTransport",
                     "ray": "scheduling.ps.ray_transport:RayTransport",
                     "socket": "scheduling.ps.socket_transport:SocketTransport"}
"""Transport name -> the class a client sends its requests with; the ``ray`` and ``socket`` ones are imported
only when asked for."""


def _load(registry: dict[str, str], name: str) -> Any:
    if name not in registry:
        raise ValueError(f"unknown parameter-server transport {name!r}; known transports: "
                         f"{', '.join(sorted(registry))}")
    module, _, cls = registry[name].partition(":")
    return getattr(importlib.import_module(module), cls)
