"""The rendezvous of a ``torch.distributed.rpc`` parameter-server group and its TensorPipe options.

:func:`rpc_backend_options` is what every member of a group (servers: :func:`scheduling.ps.start_server`;
trainers: ``init_trainer``) passes to ``torch.distributed.rpc.init_rpc``; a ``tcp://`` rendezvous goes through
:func:`_rendezvous_handler`, torch's TCP store with a timeout.

Source: ``torch.distributed.rendezvous`` (``register_rendezvous_handler``, the ``tcp://`` handler);
``torch.distributed.rpc.TensorPipeRpcBackendOptions``.
"""

from __future__ import annotations

from typing import Any, cast

from ..endpoints import DEFAULT_WORKER_THREADS

__all__ = ["rpc_backend_options"]

_RDZV_SCHEME = "fxdisttcp"


def _rendezvous_handler(url: str, **kwargs: Any) -> Any:
    """``fxdisttcp://host:port?rank=R&world_size=W&timeout_s=T``: torch's tcp:// store with a timeout.

    torch's ``tcp://`` handler waits up to 30 minutes for missing members; this one gives up after
    ``timeout_s`` seconds, so an absent server fails fast.

    Security: the store is torch's ``TCPStore``, which rank 0 hosts and which listens on every interface
    whatever ``host`` says (torch binds its server socket that way), without authentication; anyone who can
    reach the port can read and write the group's rendezvous keys. ``torch.distributed.rpc`` keeps it for the
    group's lifetime (its shutdown uses it). Run the group on a trusted network, or firewall the port.
    """
    from datetime import timedelta
    from urllib.parse import parse_qs, urlparse

    from torch.distributed import TCPStore

    parsed = urlparse(url)
    query = {k: v[-1] for k, v in parse_qs(parsed.query).items()}
    rank, world_size = int(query["rank"]), int(query["world_size"])
    timeout = timedelta(seconds=float(query.get("timeout_s", 60)))
    host, port = cast(str, parsed.hostname), cast(int, parsed.port)  # rpc_backend_options: from tcp://host:port
    store = TCPStore(host, port, world_size, rank == 0, timeout, multi_tenant=True)
    yield store, rank, world_size
    raise RuntimeError(f"{_RDZV_SCHEME}:// cannot re-rendezvous")


def rpc_backend_options(init_method: str, timeout_s: float, num_worker_threads: int = DEFAULT_WORKER_THREADS) -> Any:
    """TensorPipe options used by every member of a PS group: TCP ("uv") transport only.

    The shared-memory transport starves a 2-core machine (requests reach the server only after the
    trainer's compute ends: 2.5 ms from issue to start, 1.0 ms over ``uv``), so it is disabled. A
    ``tcp://host:port`` rendezvous is routed through a handler that waits at most ``timeout_s`` for the other members.
    """
    import importlib

    from torch.distributed import rpc

    rdzv = importlib.import_module("torch.distributed.rendezvous")  # the module, not the function

    try:
        rdzv.register_rendezvous_handler(_RDZV_SCHEME, _rendezvous_handler)
    except RuntimeError:  # already registered in this process
        pass
    if init_method.startswith("tcp://"):
        init_method = f"{_RDZV_SCHEME}://{init_method[len('tcp://'):]}?timeout_s={timeout_s}"
    return rpc.TensorPipeRpcBackendOptions(init_method=init_method, rpc_timeout=timeout_s,
                                           num_worker_threads=num_worker_threads, _transports=["uv"],
                                           _channels=["basic"])
