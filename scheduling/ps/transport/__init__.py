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
``ray`` (:mod:`scheduling.ps.transport.ray_transport`, imported only when asked for): servers are Ray actors
(``handle.lookup.remote(...)``, waited with ``ray.get``); no group, so a restarted server actor is reachable
again through the same handle.
``socket`` (:mod:`scheduling.ps.transport.socket_transport`, imported only when asked for): one persistent TCP
connection per (client process, server) to servers run by :mod:`scheduling.ps.transport.socket_server`, tensors sent as
raw buffers; servers named ``"host:port"`` or by names registered there (far less server CPU per request
than ``torch_rpc``).

Source: torch.distributed.rpc (``rpc_async``); Ray actors (``ActorHandle.method.remote``, ``ray.get``);
Python ``socket``.
"""

from __future__ import annotations

from .registry import CLIENT_TRANSPORTS, DEFAULT_TRANSPORT, TRANSPORTS, make_transport, transport_of
from .torch_rpc import TorchRPCTransport

__all__ = ["TRANSPORTS", "DEFAULT_TRANSPORT", "TorchRPCTransport", "CLIENT_TRANSPORTS", "make_transport",
           "transport_of"]
