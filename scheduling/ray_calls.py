"""Ray actor calls in traced models, for the ``async_rpc`` pass.

A model may call a Ray actor itself and block on the answer::

    class Model(nn.Module):
        def __init__(self, tables):          # tables: a Ray actor handle
            super().__init__()
            self.tables, self.dense = tables, nn.Linear(4, 4)

        def forward(self, ids, x):
            rows = ray.get(self.tables.lookup.remote(ids))   # one round trip, nothing overlaps it
            return self.dense(x) + rows

:class:`RayTracer` (or :func:`symbolic_trace`) records that as two ``call_function`` nodes, the start and
the wait, with the handle read from the module (``get_attr``)::

    %tables = get_attr[target=tables]
    %ray_remote = ray_remote(%tables, "lookup", %ids)      # handle.lookup.remote(ids): an ObjectRef
    %get = ray.get(%ray_remote)

and registers the pair ``ray_remote`` / ``ray.get`` with :mod:`scheduling.async_pairs` (``presplit``), so
:func:`scheduling.async_rpc` hoists ``ray_remote`` to just after its inputs and sinks ``ray.get`` to the
first use of the answer (here the lookup overlaps ``self.dense(x)``), as it does with ``rpc_sync`` ->
``rpc_async`` + wait. :func:`ray_call` is the one-node blocking form (``ray.get(handle.m.remote(...))``),
split the same way. Calls are assumed to be reads (they may overlap each other); register your own
:class:`~scheduling.async_pairs.AsyncPair` with ``kind="write"`` for calls that must stay ordered.

How tracing captures them: ``RayTracer`` adds ``ray`` to ``autowrap_modules`` (torch.fx's mechanism that
records ``math.sqrt`` calls): ``ray.get`` (and any public ``ray`` function) given a Proxy becomes a leaf
call; while it traces, ``ActorMethod.remote`` given a Proxy records ``ray_remote`` instead of submitting a
task; an ``ActorHandle`` argument becomes a ``get_attr`` of the module attribute that holds it (or of a new
``_ray_actor<i>`` attribute).

The generic pass code never imports Ray, nor names this module: importing it (as :class:`RayTracer`,
:func:`ray_call` and :func:`ray_remote` need) registers its pair, so a graph holding those nodes finds it.

Source: torch.fx ``Tracer(autowrap_modules=...)`` and ``wrap``; torch.fx paper §6.2.3; Ray actors.
"""

from __future__ import annotations

import math
from types import ModuleType
from typing import Any, Callable

import ray
import torch
from ray.actor import ActorHandle, ActorMethod

import fxdist
from fxdist.graph_module import GraphModule
from fxdist.node import has_side_effect, map_aggregate
from fxdist.proxy import Proxy
from fxdist.tracer import Tracer

from .async_pairs import AsyncPair, register_async_pair

__all__ = ["ray_remote", "ray_call", "RayTracer", "symbolic_trace"]


@has_side_effect
def ray_remote(handle: ActorHandle, method: str, *args: Any, **kwargs: Any) -> Any:
    """``handle.<method>.remote(*args, **kwargs)``: start an actor call; returns its ``ObjectRef``."""
    return getattr(handle, method).remote(*args, **kwargs)


@has_side_effect
def ray_call(handle: ActorHandle, method: str, *args: Any, **kwargs: Any) -> Any:
    """``ray.get(handle.<method>.remote(*args, **kwargs))``: a blocking actor call."""
    return ray.get(getattr(handle, method).remote(*args, **kwargs))


has_side_effect(ray.get)  # a wait: dead-code elimination must keep it (its call may have effects)
fxdist.wrap("ray_remote")
fxdist.wrap("ray_call")


def _proxy_in(value: Any) -> Proxy | None:
    found: list[Proxy] = []
    map_aggregate(value, lambda a: found.append(a) if isinstance(a, Proxy) else None)
    return found[0] if found else None


class RayTracer(Tracer):
    """An fxdist ``Tracer`` that records Ray calls given traced values: ``ray.get(...)`` (and other public
    ``ray`` functions) as leaf calls, ``handle.m.remote(...)`` as :func:`ray_remote`.

    Args: as :class:`fxdist.Tracer`; ``ray`` is added to ``autowrap_modules``.
    """

    def __init__(self, autowrap_modules: tuple[ModuleType, ...] = (math,),
                 autowrap_functions: tuple[Callable[..., Any], ...] = ()) -> None:
        super().__init__(autowrap_modules=(*autowrap_modules, ray), autowrap_functions=autowrap_functions)

    def create_arg(self, a: Any) -> Any:
        """An ``ActorHandle`` becomes ``get_attr`` of the module attribute holding it (a new
        ``_ray_actor<i>`` attribute of the root if none does); everything else as ``Tracer``."""
        if isinstance(a, ActorHandle):
            for prefix, module in self.root.named_modules():
                for name, value in vars(module).items():
                    if value is a:
                        return self.create_node("get_attr", f"{prefix}.{name}" if prefix else name, (), {})
            name = self.get_fresh_qualname("_ray_actor")
            setattr(self.root, name, a)
            return self.create_node("get_attr", name, (), {})
        return super().create_arg(a)

    def trace(self, root: torch.nn.Module | Callable[..., Any], concrete_args: dict[str, Any] | None = None) -> Any:
        """``Tracer.trace`` with ``ActorMethod.remote`` recording :func:`ray_remote` when given a Proxy."""
        orig = ActorMethod.remote

        def remote(method: ActorMethod, *args: Any, **kwargs: Any) -> Any:
            if _proxy_in((args, kwargs)) is None:
                return orig(method, *args, **kwargs)
            # the global is fxdist.wrap's recording stand-in while tracing: one node targeting ray_remote
            return ray_remote(method._actor, method._method_name, *args, **kwargs)

        # patched for the trace (restored below); ray types remote's first parameter as self, a plain function here
        ActorMethod.remote = remote  # type: ignore[method-assign, assignment]
        try:
            return super().trace(root, concrete_args)
        finally:
            ActorMethod.remote = orig  # type: ignore[method-assign]


def symbolic_trace(root: torch.nn.Module | Callable[..., Any], concrete_args: dict[str, Any] | None = None,
                   ) -> GraphModule:
    """``fxdist.symbolic_trace`` with :class:`RayTracer`: a GraphModule whose Ray calls are graph nodes."""
    tracer = RayTracer()
    graph = tracer.trace(root, concrete_args)
    name = root.__class__.__name__ if isinstance(root, torch.nn.Module) else root.__name__
    return GraphModule(tracer.root, graph, name)


register_async_pair(AsyncPair(ray_call, ray_remote, ray.get, "read", ((0, "handle"),), family="ray", presplit=True))
