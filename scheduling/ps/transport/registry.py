"""Which client transport carries a :class:`~scheduling.ps.PSClient`'s requests: the names, the default, and
the classes, imported only when asked for.

Source: Python ``importlib`` (lazy imports by dotted name).
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Sequence
from typing import Any

__all__ = ["TRANSPORTS", "DEFAULT_TRANSPORT", "CLIENT_TRANSPORTS", "make_transport", "transport_of", "load_class"]

TRANSPORTS = ("torch_rpc", "ray", "socket")
"""The transports a client can use."""
DEFAULT_TRANSPORT = "torch_rpc"
"""Used when nothing says otherwise (see benchmarks/transport.py for why)."""


def transport_of(servers: Sequence[Any]) -> str:
    """The transport for ``servers`` when the caller names none: ``"ray"`` for Ray actor handles or for names
    registered by :func:`scheduling.ps.transport.ray_transport.register_servers` (a ``LocalCluster(transport="ray")``
    or a job does that), ``"socket"`` for names registered by
    :func:`scheduling.ps.transport.socket_transport.register_servers`, else :data:`DEFAULT_TRANSPORT`."""
    ray_transport = sys.modules.get("scheduling.ps.transport.ray_transport")  # only loaded once Ray servers exist
    if ray_transport is not None and servers and all(ray_transport.is_ray_server(s) for s in servers):
        return "ray"
    socket_transport = sys.modules.get("scheduling.ps.transport.socket_transport")
    if socket_transport is not None and servers and all(socket_transport.is_socket_server(s) for s in servers):
        return "socket"
    return DEFAULT_TRANSPORT


def make_transport(name: str | None, servers: Sequence[Any]) -> Any:
    """A transport to ``servers``: ``name`` one of :data:`TRANSPORTS`, None for :func:`transport_of`.

    Raises:
        ValueError: an unknown transport, or servers of the wrong kind for it.
    """
    name = transport_of(servers) if name is None else name
    return load_class(CLIENT_TRANSPORTS, name)(servers)


CLIENT_TRANSPORTS = {"torch_rpc": "scheduling.ps.transport.torch_rpc:TorchRPCTransport",
                     "ray": "scheduling.ps.transport.ray_transport:RayTransport",
                     "socket": "scheduling.ps.transport.socket_transport:SocketTransport"}
"""Transport name -> the class a client sends its requests with; the ``ray`` and ``socket`` ones are imported
only when asked for."""


def load_class(registry: dict[str, str], name: str) -> Any:
    """The class ``registry[name]`` names (``"module:Class"``), imported now.

    Raises:
        ValueError: ``name`` is not in ``registry``.
    """
    if name not in registry:
        raise ValueError(f"unknown parameter-server transport {name!r}; known transports: "
                         f"{', '.join(sorted(registry))}")
    module, _, cls = registry[name].partition(":")
    return getattr(importlib.import_module(module), cls)
