"""Program scheduling for parameter-server training (torch.fx paper §6.2.3).

- :func:`async_rpc` (``scheduling.async_rpc(gm) -> GraphModule``): the pass; :func:`lookahead` pairs each
  batch with the next for its ``prefetch=True`` mode.
- :func:`parameter_servers` (``scheduling.parameter_servers(gm, optimizer=..., lr=...) -> GraphModule``): move
  the embedding tables of your own model to the running parameter servers (:mod:`scheduling.placement`);
  ``fxdist.optimize(model, passes=("parameter_servers", "async_rpc_prefetch"))`` then schedules the lookups.
- :mod:`scheduling.ps`: the parameter-server runtime it schedules, over ``torch_rpc`` or ``ray``
  (:mod:`scheduling.ps.transport`).
- :mod:`scheduling.ray_calls`: trace a model's own ``ray.get(handle.m.remote(x))`` calls (``RayTracer``) so
  :func:`async_rpc` overlaps them.
"""

from __future__ import annotations

from typing import Any

__all__ = ["async_rpc", "AsyncRPC", "format_timeline", "lookahead", "parameter_servers", "ParameterServers"]


def __getattr__(name: str) -> Any:
    # lazy, so that server processes importing scheduling.ps.server never import fxdist or torchrec
    if name in ("async_rpc", "AsyncRPC"):
        from . import async_rpc_pass as _mod

        value = getattr(_mod, name)
    elif name in ("parameter_servers", "ParameterServers"):
        from . import placement as _placement

        value = getattr(_placement, name)
    elif name == "lookahead":
        from .prefetch import lookahead as value
    elif name == "format_timeline":
        from .timeline import format_timeline as value
    else:
        raise AttributeError(f"module 'scheduling' has no attribute {name!r}")
    globals()[name] = value
    return value
