"""The ``torch_rpc`` client transport: requests as ``torch.distributed.rpc.rpc_async`` calls.

Servers are ``torch.distributed.rpc`` worker names of one static group (rendezvous in
:mod:`scheduling.ps.transport.rendezvous`, no re-admission after a crash); a server may live in a trainer's
process (:mod:`scheduling.ps.in_trainers`), and that trainer's own requests to it skip RPC.

Security: ``torch.distributed.rpc`` has no authentication (pytorch issue 46904) and its rendezvous store
listens on every interface; a job refuses it on a non-loopback network unless the config allows it
(``[cluster] allow_unauthenticated``). See SECURITY.md.

Source: torch.distributed.rpc (``rpc_async``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from .. import in_trainers

__all__ = ["TorchRPCTransport"]


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

        from .. import server as _srv

        name = self.names[server]
        local = in_trainers.local_endpoints(name)
        if local is not None:
            return in_trainers.call_local(local, method, args)
        return rpc.rpc_async(name, getattr(_srv, f"_rpc_{method}"), args, timeout=timeout_s)

    def stop(self, timeout_s: float, names: Sequence[str] | None = None) -> None:
        """Ask every server (or those of ``names``) to leave the group (their ``start_server(block=True)``
        returns); best effort: the one stop loop of the ``torch_rpc`` servers."""
        from torch.distributed import rpc

        from .. import server as _srv

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
