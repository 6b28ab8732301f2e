"""The ``parameter_servers`` pass: move the embedding tables of *your own* model to parameter servers.

Your model stays as written: a torchrec ``DLRM`` / ``DLRM_DCN`` with an ``EmbeddingBagCollection``, a torchrec
``EmbeddingCollection`` (sequence embeddings), or any ``nn.Module`` with ``nn.EmbeddingBag`` / ``nn.Embedding``
tables, anywhere in its submodules. The pass finds
those modules in the traced graph, puts their tables on the servers of the running group (current weights, so
the model computes the same), and replaces each call by blocking lookups that :func:`scheduling.async_rpc`
can then schedule::

    %kt = call_module[sparse_arch.embedding_bag_collection](%sparse_features)
        ->
    %ps_lookup = ps_lookup("ps:sparse_arch.embedding_bag_collection", 0, %sparse_features)
    %ps_push_in_backward = ps_push_in_backward("ps:...", 0, %sparse_features, %ps_lookup)
    ... one fetch + hook per server holding a shard ...
    %kt = ps_pool("ps:...", %sparse_features, %ps_push_in_backward, %ps_push_in_backward_1)

A ``torch.cat`` of all of ``%kt``'s features in its key order (torchrec ``SparseArch``: ``to_dict()`` then ``cat``)
becomes ``%kt.values()`` (:mod:`scheduling.placement.pooled`: no split and copy back, same values and gradients).

``nn.EmbeddingBag`` inputs ``(input, offsets)`` or 2-D ``input``, ``nn.Embedding`` index tensors and
``EmbeddingCollection`` inputs (each id a bag of its own) are turned into the servers' ``KeyedJaggedTensor`` format
in the graph (:mod:`scheduling.placement.conversions`), and the lookup's result back into what the module returned
(``(B, D)``; ``(*S, D)``; ``{feature: JaggedTensor}``).

Configuration (what trains what):

- The tables are trained *on the servers* by the pass's ``optimizer`` (``"sgd"``: ``w -= lr * g`` on the touched
  rows, exactly ``torch.optim.SGD`` without momentum; ``"rowwise_adagrad"``). The gradient of each lookup is
  pushed from an autograd hook (``ps_push_in_backward``) as soon as ``loss.backward()`` computes it. One
  optimizer for every table: a server runs one optimizer for all its tables (``scheduling.ps.server``), so
  per-table optimizers are not supported, and the pass refuses servers that a live client with other optimizer
  settings uses.
- The dense part is trained by *your* optimizer: build it on ``gm.parameters()`` after the pass (the moved
  tables are no longer parameters of ``gm``).
- Tables that stay on the trainer: ``plan={"pos": "local"}`` (a table, weight path or module), and with
  ``local_below_rows=n`` every module whose tables all have fewer than ``n`` rows, unless the plan places it
  (default 0: none). Such a module stays in ``gm`` as written: a parameter of ``gm``, trained by your optimizer
  (and, wrapped in DDP, its gradient all-reduced like the dense part's). The printed plan ends with
  ``kept local: pos (20 rows < local_below_rows=32)`` per such module.
- ``storage`` sets how the servers hold the rows (``"fp32"``, ``"fp16"``, ``"fused8bit"``:
  :mod:`scheduling.ps.storage`); lookups still answer float32.
- A module called from several nodes moves once (one table on the servers) and pushes once per call; with SGD
  that equals one step on the summed gradient.
- Each moved module gets one ``PSClient`` (its namespace on the servers) named ``"<client>:<module path>"``,
  made unique in the process (``"#2"`` appended when taken before: a server keeps the shards of a name it has
  seen); ``gm.meta["fxdist"]["placement"]["clients"]`` maps each module to its client. ``nn.EmbeddingBag`` and
  ``nn.Embedding`` modules called once share clients instead, in groups (``group_tables=True``, the default:
  one lookup and one push per server and step for a whole group, named ``"<client>:<first module>+<others>"``;
  :mod:`scheduling.placement.table_groups`).
- After the last step call :func:`flush` (waits the pushes still in flight); :func:`table_state_dict` reads the
  tables back under your model's state-dict names (with ``optimizer_state=True`` also the row-wise Adagrad
  state, ``"<path>.momentum"``), :func:`load_table_state_dict` writes such a dict back (checkpoint restore);
  :func:`close` unregisters the clients.
- Several trainers (data parallel, ``rank`` / ``world_size`` / ``group``): every trainer runs the pass on the same
  model (same weights, same client names); rank 0 creates the tables on the servers, the others attach to them,
  and the servers serve the trainers in step order (:mod:`scheduling.ps.ordering`: a step-``k`` lookup sees
  exactly the pushes of steps ``0 .. k-1`` of every trainer), so training is deterministic whatever the
  schedule. The other ranks must not run a step before rank 0's pass has returned: synchronise after the pass
  (e.g. ``torch.distributed.barrier()``).
- Prefetch: after ``async_rpc_prefetch`` each step's push also asks for the next batch's lookup; pass the next
  batch as ``next_<input name>`` (e.g. ``gm(dense, kjt, next_kjt=nxt)``, pairs from
  :func:`scheduling.lookahead`). This works for a lookup whose batch is a graph input (a KeyedJaggedTensor
  input of an ``EmbeddingBagCollection``) or computed from inputs only (``nn.EmbeddingBag(ids, offsets)``:
  pass ``next_ids=..., next_offsets=...``; ``emb(ids[:, j].long())``, a KeyedJaggedTensor built in forward:
  pass ``next_ids=...``); a module called twice in a step, or fed by a module's output, keeps the in-step
  schedule, with a ``PrefetchWarning`` saying why (:mod:`scheduling.prefetch`).

Source: torch.fx paper §6.2.3 (parameter-server fetches in the graph, then scheduled); torchrec
``DistributedModelParallel`` (shard a user's model's embedding modules by a plan, leave the rest dense).
"""

from __future__ import annotations

import logging
import sys
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, ClassVar, Literal, TextIO

import torch
from torch import nn

from fxdist.graph_module import GraphModule
from fxdist.node import Node
from fxdist.passes.pass_base import PassBase, PassResult
from recsys.embedding import EmbeddingLeafTracer, is_embedding_module

from ..async_pairs import trace_meta
from ..ps import ops
from ..ps.shard_plan import TableSpec, table_specs
from . import conversions
from .after import client_names, close, flush, load_table_state_dict, table_state_dict
from .eval_mode import read_only
from .find import Candidate, NotMoved, call_arguments, find_embeddings
from .plan import (
    TableInfo,
    TablePlacement,
    format_plan,
    plan_tables,
    server_bytes,
    shards_of,
    split_local,
    with_dynamic,
)
from .pooled import fold_regroups
from .table_groups import group_candidates, group_label, rewrite_group

__all__ = ["parameter_servers", "ParameterServers", "EmbeddingLeafTracer", "PlacementWarning", "flush", "close",
           "table_state_dict", "load_table_state_dict", "client_names", "read_only"]

logger = logging.getLogger("scheduling.placement")
_USED_NAMES: set[str] = set()


class PlacementWarning(UserWarning):
    """An embedding module stays on the trainer (the message says which and why)."""


def _as_graph_module(gm: Any) -> GraphModule:
    if isinstance(gm, GraphModule):
        return gm
    if not isinstance(gm, nn.Module):
        raise TypeError(f"parameter_servers expects a GraphModule or an nn.Module, got {type(gm).__name__}")
    tracer = EmbeddingLeafTracer()
    graph = tracer.trace(gm)
    return GraphModule(tracer.root, graph, type(gm).__name__)


# ---- tables and clients ---------------------------------------------------------------------------------------
def _tables_of(c: Candidate) -> list[tuple[TableInfo, torch.Tensor]]:
    """(table, weight) pairs of one module, in its declaration order."""
    m = c.module
    if c.kind == "ebc":
        return [(TableInfo(spec, c.qualname, f"{c.qualname}.embedding_bags.{spec.name}"),
                 m.embedding_bags[spec.name].weight) for spec in table_specs(m.embedding_bag_configs())]
    if c.kind == "ec":  # one-id bags, pooled by sum: the rows themselves
        return [(TableInfo(spec, c.qualname, f"{c.qualname}.embeddings.{spec.name}"), m.embeddings[spec.name].weight)
                for spec in table_specs(m.embedding_configs())]
    # a bag's mode is "sum" or "mean": mode="max" bags stay local (find._module_options)
    pooling: Literal["sum", "mean"] = m.mode if c.kind == "bag" else "sum"
    spec = TableSpec(c.qualname, m.num_embeddings, m.embedding_dim, (c.qualname,), pooling)
    return [(TableInfo(spec, c.qualname, c.qualname), m.weight)]


def _client_name(prefix: str, qualname: str) -> str:
    """``<prefix>:<qualname>``, made unique in this process (a server keeps the shards of a name it has seen)."""
    from ..ps.client import _CLIENTS

    base = name = f"{prefix}:{qualname}"
    k = 1
    while name in _USED_NAMES or name in _CLIENTS:
        k += 1
        name = f"{base}#{k}"
    _USED_NAMES.add(name)
    return name


def _check_optimizer(servers: Sequence[str], optimizer: str, kwargs: Mapping[str, float]) -> None:
    """Raise ValueError when a live client on these servers runs another optimizer (one per server process)."""
    from ..ps.client import _CLIENTS
    from ..ps.optimizer import make_optimizer

    make_optimizer(optimizer, **kwargs)  # unknown names / arguments fail here, before anything is created
    for other in list(_CLIENTS.values()):
        if set(other.servers) & set(servers) and (other.optimizer, other.optimizer_kwargs) != (optimizer, dict(kwargs)):
            raise ValueError(f"parameter_servers: servers {sorted(set(other.servers) & set(servers))} already serve "
                             f"client {other.name!r} with optimizer {other.optimizer} {other.optimizer_kwargs}; a "
                             f"server runs one optimizer for all its tables, so {optimizer} {dict(kwargs)} would "
                             "change that client's training too. Use the same optimizer, or close() that client")


def _use_shards(client: Any, shards: list[Any]) -> None:
    """Give an unconfigured PSClient an explicit shard list (the plan's) instead of its own ``plan_shards``."""
    from ..ps.server import server_layout

    client.shards = list(shards)
    client.layouts = [server_layout(client.shards, s) for s in range(len(client.servers))]
    client.widths = [sum(sp.table.embedding_dim for sp, _ in lay) for lay in client.layouts]
    client._slots = client._feature_slots()
    client._gather = None


def _make_clients(groups: list[list[Candidate]], tables: dict[str, list[tuple[TableInfo, torch.Tensor]]],
                  placed: dict[str, TablePlacement], servers: list[str], prefix: str, optimizer: str,
                  kwargs: Mapping[str, float], timeout_s: float, group: tuple[int, int, str | None] = (0, 1, None),
                  storage: str = "fp32", seed: int = 0, grad_reduction: str = "mean",
                  device: torch.device | None = None) -> dict[str, Any]:
    """One PSClient per group of modules (its namespace on the servers, rows stored as ``storage``, rows
    fetched to ``device``, see ``PSClient``), mapped from each member's qualname; rank 0 of ``group``
    ``(rank, world_size, key)`` sets the tables to the modules' weights (the servers initialise those on the
    ``meta`` device from ``seed``), the other ranks attach to them."""
    import functools

    from ..ps.checks import check_kjt
    from ..ps.client import PSClient
    from ..ps.coalesce import PushBatcher

    rank, world_size, key = group
    clients: dict[str, Any] = {}
    batcher = None
    try:
        for members in groups:
            pairs = [pair for c in members for pair in tables[c.qualname]]
            client = PSClient([t.spec for t, _ in pairs], servers, optimizer=optimizer, optimizer_kwargs=kwargs,
                              name=_client_name(prefix, group_label(members)), timeout_s=timeout_s, configure=False,
                              rank=rank, world_size=world_size, group=key, storage=storage, seed=seed,
                              grad_reduction=grad_reduction, device=device)
            clients.update({c.qualname: client for c in members})
            batcher = batcher or PushBatcher(client.transport, timeout_s)   # one message per server for all
            client.batcher = batcher
            if members[0].kind == "ebc":        # the local collection's checks; its weights rule
                client.weighted = bool(members[0].module.is_weighted())
                client.input_check = functools.partial(check_kjt, tables=client.tables, weighted=client.weighted)
            _use_shards(client, [sp for t, _ in pairs for sp in shards_of(placed[t.path], len(servers))])
            if rank == 0:
                # no copy here: each server copies its rows of the weights (PSServer.configure)
                client.configure({t.spec.name: w.detach().float() for t, w in pairs if not w.is_meta})
    except BaseException:
        for client in {id(c): c for c in clients.values()}.values():
            client.close(flush=False)
        raise
    return clients


def _model_device(gm: nn.Module) -> torch.device | None:
    """Where fetched rows go when the ids are on the CPU: the device of the model's first tensor that is not on
    ``meta`` (tables the servers initialise are); None (the CPU) when there is none."""
    tensors = [*gm.parameters(), *gm.buffers()]
    return next((t.device for t in tensors if not t.is_meta), None)


# ---- the graph rewrite ----------------------------------------------------------------------------------------
def _wire_input(graph: Any, c: Candidate, node: Node, dynamic: bool = False) -> tuple[Any, Any]:
    """(the KeyedJaggedTensor node, a function turning the pooled KeyedTensor node into the module's output);
    ids of ``dynamic`` tables are raw: no range check."""
    args = call_arguments(c.module, node)
    m = c.module
    if c.kind == "ebc":
        return args[0], lambda kt: kt
    fn: Callable[..., Any]
    if c.kind == "ec":
        features = tuple(f for cfg in m.embedding_configs() for f in cfg.feature_names)
        names = tuple(n for names in m.embedding_names_by_table() for n in names)
        rows = tuple(cfg.num_embeddings for cfg in m.embedding_configs() for _ in cfg.feature_names)
        fn, fn_args, kwargs = conversions.sequence_to_kjt, (args[0], features), {"num_embeddings": rows}
        finish = lambda kt: graph.call_function(conversions.sequence_output,  # noqa: E731
                                                (kt, args[0], features, names, m.need_indices()))
    elif c.kind == "bag":
        fn, fn_args = conversions.bag_to_kjt, (c.qualname, *args[:3])
        kwargs = {"include_last_offset": m.include_last_offset, "padding_idx": m.padding_idx,
                  "num_embeddings": m.num_embeddings, "mode": m.mode}
        finish = lambda kt: graph.call_method("values", (kt,))  # noqa: E731
    else:
        fn, fn_args, kwargs = conversions.index_to_kjt, (c.qualname, args[0]), {"padding_idx": m.padding_idx,
                                                                                "num_embeddings": m.num_embeddings}
        finish = lambda kt: graph.call_function(conversions.index_output, (kt, args[0]))  # noqa: E731
    # the conversion goes right after its inputs, so that async_rpc can start the lookup that early
    inputs = [a for a in fn_args if isinstance(a, Node)]
    pos = {n: i for i, n in enumerate(graph.nodes)}
    after = max(inputs + [n for n in graph.nodes if n.op == "placeholder"], key=pos.__getitem__)
    with graph.inserting_after(after):
        kjt = graph.call_function(fn, fn_args, {**kwargs, "num_embeddings": None} if dynamic else kwargs)
    kjt.meta.update(trace_meta(node))
    kjt.meta["parameter_servers"] = c.qualname
    return kjt, finish


def _rewrite(gm: GraphModule, c: Candidate, client: Any, trainable: bool) -> None:
    """Replace every call of ``c`` by fetches (+ backward pushes) and the pooling."""
    graph = gm.graph
    for node in c.nodes:
        anchor = node.prev
        with graph.inserting_before(node):
            kjt, finish = _wire_input(graph, c, node, any(t.dynamic is not None for t in client.tables))
            ids = client.servers_for()
            # every fetch before the first hook: async_rpc does not hoist a fetch above an impure node
            # (the hook) that reads the same batch, so interleaving them would serialise the lookups
            parts = [graph.call_function(ops.ps_lookup, (client.name, s, kjt)) for s in ids]
            if trainable:
                parts = [graph.call_function(ops.ps_push_in_backward, (client.name, s, kjt, p))
                         for s, p in zip(ids, parts)]
            out = finish(graph.call_function(ops.ps_pool, (client.name, kjt, *parts)))
        new = anchor.next
        while new is not node:
            new.meta.update(trace_meta(node))
            new.meta["parameter_servers"] = c.qualname
            new = new.next
        node.replace_all_uses_with(out)
        graph.erase_node(node)


def _drop_module(gm: GraphModule, qualname: str) -> None:
    """Delete a moved module, and the containers it leaves empty (e.g. a SparseArch traced through)."""
    gm.delete_submodule(qualname)
    parent = qualname.rpartition(".")[0]
    while parent:
        mod = gm.get_submodule(parent)
        if any(True for _ in mod.children()) or any(True for _ in mod.parameters()) or any(True for _ in mod.buffers()):
            break
        gm.delete_submodule(parent)
        parent = parent.rpartition(".")[0]


def _rewrite_groups(gm: GraphModule, groups: list[list[Candidate]], clients: dict[str, Any],
                    trainable: dict[str, bool]) -> None:
    for members in groups:
        client = clients[members[0].qualname]
        if len(members) == 1:
            _rewrite(gm, members[0], client, trainable[members[0].qualname])
        else:
            rewrite_group(gm, members, client, trainable[members[0].qualname])
        for c in members:
            _drop_module(gm, c.qualname)
    by_name = {c.name: c for c in clients.values()}
    fold_regroups(gm.graph, ops.ps_pool, lambda name: by_name[name].feature_names)  # SparseArch's split + cat


# ---- the pass -------------------------------------------------------------------------------------------------
def _report(gm: GraphModule, kept: list[NotMoved]) -> None:
    for item in kept:
        warnings.warn(f"parameter_servers: {item.message()}; it stays on the trainer", PlacementWarning, stacklevel=3)
    gm.meta.setdefault("fxdist", {}).setdefault("placement", {})["not_moved"] = [asdict(k) for k in kept]


def _keep_local(gm: GraphModule, found: list[Candidate], kept: list[NotMoved], plan: Mapping[str, Any] | None,
                local_below_rows: int) -> tuple[list[Candidate], dict[str, Any], list[str]]:
    """(the modules to move, the plan left for :func:`plan_tables`, the printout's lines on those that stay on the
    trainer by the plan or ``local_below_rows``: ``kept local: pos (20 rows < local_below_rows=32)``)."""
    if local_below_rows < 0:
        raise ValueError(f"parameter_servers: local_below_rows must be >= 0, got {local_below_rows}")
    tables = {c.qualname: [t for t, _ in _tables_of(c)] for c in found}
    local, rest = split_local(tables, plan, local_below_rows, [k.module for k in kept])
    for c in found:
        if c.qualname in local and any(w.is_meta for w in _weights_of(c)):
            raise ValueError(f"parameter_servers: module '{c.qualname}' stays on the trainer ({local[c.qualname]}) but "
                             "its weights are on the meta device (tables the servers would initialise); build it "
                             "with real weights, or let it move")
    gm.meta.setdefault("fxdist", {}).setdefault("placement", {})["local"] = [
        {"module": q, "rows": [t.spec.num_embeddings for t in tables[q]], "reason": why} for q, why in local.items()]
    return [c for c in found if c.qualname not in local], rest, [f"  kept local: {q} ({why})" for q, why in local.items()]


def _nothing_to_move(gm: GraphModule, kept: list[NotMoved], local: list[str], verbose: bool,
                     file: TextIO | None) -> GraphModule:
    """Record why the pass changes nothing (returns ``gm``); with ``verbose`` print the modules kept local."""
    if local:
        text = "\n".join(["parameter_servers plan: no table on the servers", *local])
        gm.meta["fxdist"]["placement"]["plan_text"] = text
        logger.info("%s", text)
        if verbose:
            print(text, file=file or sys.stdout)
    gm.meta["fxdist"]["unchanged_reason"] = (
        f"every embedding module stays on the trainer ({len(local)} by the plan or local_below_rows, "
        f"{len(kept)} that cannot move)" if local else
        f"no movable embedding module ({len(kept)} stay local, see the warnings)" if kept else
        "no embedding module found (torchrec EmbeddingBagCollection, nn.EmbeddingBag or nn.Embedding called "
        "as a call_module node; trace with scheduling.placement.EmbeddingLeafTracer)")
    return gm


def _weights_of(c: Candidate) -> list[torch.Tensor]:
    return [w for _, w in _tables_of(c)]


def _record(gm: GraphModule, placements: list[TablePlacement], servers: list[str], clients: dict[str, Any],
            optimizer: dict[str, Any], storage: str = "fp32", local: Sequence[str] = ()) -> str:
    n_tables, n_servers = len(placements), len(servers)
    header = (f"parameter_servers plan: {n_tables} table{'s' * (n_tables != 1)} on {n_servers} "
              f"server{'s' * (n_servers != 1)}, optimizer "
              f"{optimizer['name']} ({', '.join(f'{k}={v}' for k, v in optimizer.items() if k != 'name')})"
              + (f", rows stored {storage}" if storage != "fp32" else ""))
    text = "\n".join([format_plan(placements, servers, header), *local])
    meta = gm.meta.setdefault("fxdist", {}).setdefault("placement", {})
    meta.update({
        "servers": list(servers), "optimizer": optimizer, "storage": storage, "plan_text": text,
        "tables": [{"table": p.table.spec.name, "module": p.table.module, "path": p.table.path,
                    "rows": p.table.spec.num_embeddings, "dim": p.table.spec.embedding_dim, "sharding": p.sharding,
                    "servers": [servers[s] for s in p.servers], "bytes": p.table.nbytes, "reason": p.reason}
                   for p in placements],
        "server_bytes": dict(zip(servers, server_bytes(placements, len(servers)))),
        "clients": {**meta.get("clients", {}), **{q: c.name for q, c in clients.items()}},
    })
    return text


def _check_choices(storage: str, grad_reduction: str) -> None:
    from ..ps.storage import STORAGES

    if storage not in STORAGES:
        raise ValueError(f"parameter_servers: unknown storage={storage!r} (use one of {', '.join(STORAGES)})")
    if grad_reduction not in ("mean", "sum"):
        raise ValueError(f"parameter_servers: unknown grad_reduction={grad_reduction!r} (use 'mean' or 'sum')")


def parameter_servers(gm: Any, optimizer: str = "rowwise_adagrad", lr: float = 0.01, *,
                      plan: Mapping[str, Any] | None = None, servers: Sequence[str] | None = None,
                      client: str = "ps", optimizer_kwargs: Mapping[str, float] | None = None,
                      timeout_s: float = 30.0, verbose: bool = True, file: TextIO | None = None,
                      rank: int = 0, world_size: int = 1, group: str | None = None,
                      storage: str = "fp32", seed: int = 0, grad_reduction: str = "mean",
                      group_tables: bool = True, local_below_rows: int = 0,
                      dynamic: Mapping[str, Mapping[str, Any]] | None = None) -> GraphModule:
    """Move the embedding tables of ``gm`` to the parameter servers of the running group (in place).

    Args:
        gm: a GraphModule traced with embedding modules as leaves (:class:`EmbeddingLeafTracer`;
            ``fxdist.optimize`` does that for this pass), or an ``nn.Module``, traced here.
        optimizer: the servers' optimizer for every table, ``"rowwise_adagrad"`` or ``"sgd"``.
        lr: its learning rate; ``optimizer_kwargs`` adds others (e.g. ``{"eps": 1e-8}``).
        plan: per-table overrides ``{table name | weight path | module: "table_wise" | "row_wise" | server index
            | "local"}`` (:mod:`scheduling.placement.plan`); ``"local"``: on the trainer (see the module docstring).
        local_below_rows: modules whose tables all have fewer rows stay on the trainer unless ``plan`` places them.
        servers: names of the servers to use (default: every server of the group): ``torch_rpc`` worker names,
            or names of Ray server actors registered in this process (``LocalCluster(transport="ray")``, a job
            with ``[cluster] transport = "ray"``), for which the clients use the ``ray`` transport.
        client: prefix of the clients' names (``"<client>:<module path>"``).
        timeout_s: RPC timeout of the clients, in seconds.
        verbose: print the plan (it is always logged at INFO on ``scheduling.placement``); ``file``: where.
        rank, world_size, group: this trainer's rank among ``world_size`` data-parallel trainers that share the
            tables, and a key they share (e.g. a uuid rank 0 broadcasts); rank 0 creates the tables, the others
            attach, and the servers serve the group in step order (see the module docstring). Default: one
            trainer.
        storage: how the servers store the rows: ``"fp32"``, ``"fp16"`` or ``"fused8bit"`` (FBGEMM's fused 8-bit
            row-wise form, about a quarter of the memory; :mod:`scheduling.ps.storage`). Lookups answer float32;
            the optimizer updates the touched rows in float32 and re-encodes them.
        seed: seed of the rows the servers make for tables whose weights are on the ``meta`` device (e.g.
            ``EmbeddingBagCollection(..., device=torch.device("meta"))``): uniform in ``±sqrt(1 / rows)``, torchrec's
            default, so the trainers never allocate those tables; the same ``seed`` and plan give the same rows.
            Tables with real weights start from them.
        grad_reduction: ``"mean"`` (default) divides each trainer's table gradients by ``world_size`` before
            the push, so the tables train as DDP trains the dense part (and as torchrec's
            ``DistributedModelParallel``, which divides table gradients too); ``"sum"`` applies every
            trainer's gradient as computed (``world_size`` times the learning rate of one trainer).
        group_tables: group ``nn.EmbeddingBag`` / ``nn.Embedding`` modules called once into one client each
            group: one lookup and one push per server and step for a group instead of one per module (which
            modules can share one: :mod:`scheduling.placement.table_groups`). ``False``: one client per module.
        dynamic: ``{table name | weight path | module: {"capacity", "min_count", "expire_steps"}}``: collisionless
            tables on the servers (:mod:`scheduling.ps.dynamic`), ids passed raw (no range check), table-wise.

    Returns:
        ``gm``, rewritten and recompiled; ``gm.meta["fxdist"]["placement"]`` holds the plan (``tables``,
        ``server_bytes``, ``clients``, ``plan_text``), ``not_moved`` (modules that cannot move, with the reason)
        and ``local`` (kept on the trainer by ``plan`` or ``local_below_rows``: ``module``, ``rows``, ``reason``).

    Raises:
        scheduling.ps.NoGroupError: there is something to move but no parameter-server group runs here.
        ValueError: a bad ``plan`` entry (``"local"`` for part of a module, or for meta weights), ``local_below_rows
            < 0``, unknown optimizer or ``storage``, servers used by a client with another optimizer, or
            ``world_size > 1`` without a ``group`` key, or a bad ``dynamic`` entry.
        scheduling.ps.PSUnavailableError: a server did not answer the configuration.
    """
    _check_choices(storage, grad_reduction)
    gm = _as_graph_module(gm)
    found, kept = find_embeddings(gm)
    _report(gm, kept)
    found, plan, local = _keep_local(gm, found, kept, plan, local_below_rows)
    if not found:
        return _nothing_to_move(gm, kept, local, verbose, file)
    names = _server_names(servers)
    kwargs = {"lr": lr, **(optimizer_kwargs or {})}
    _check_optimizer(names, optimizer, kwargs)
    tables = with_dynamic({c.qualname: _tables_of(c) for c in found}, dynamic)
    placements = plan_tables([t for pairs in tables.values() for t, _ in pairs], len(names), plan)
    placed = {p.table.path: p for p in placements}
    trainable = {q: any(w.requires_grad for _, w in pairs) for q, pairs in tables.items()}
    groups = _groups(gm, found, trainable, tables, group_tables)
    clients = _make_clients(groups, tables, placed, names, client, optimizer, kwargs, timeout_s,
                            (rank, world_size, group), storage, seed, grad_reduction, _model_device(gm))
    _rewrite_groups(gm, groups, clients, trainable)
    gm.graph.lint()
    gm.recompile()
    _announce(_record(gm, placements, names, clients, {"name": optimizer, **kwargs}, storage, local), verbose, file)
    return gm


def _server_names(servers: Sequence[str] | None) -> list[str]:
    from ..ps.local_cluster import group_servers

    return list(servers) if servers else group_servers("parameter_servers")


def _groups(gm: GraphModule, found: list[Candidate], trainable: dict[str, bool],
            tables: dict[str, list[tuple[TableInfo, torch.Tensor]]], group_tables: bool) -> list[list[Candidate]]:
    """The clients' module groups; modules with a dynamic table stay alone (their ids are raw: no checks)."""
    groups = group_candidates(gm, found, trainable) if group_tables else [[c] for c in found]
    alone = {c.qualname for c in found if any(t.spec.dynamic is not None for t, _ in tables[c.qualname])}
    return [g for grp in groups for g in ([[c] for c in grp] if any(c.qualname in alone for c in grp) else [grp])]


def _announce(text: str, verbose: bool, file: TextIO | None) -> None:
    logger.info("%s", text)
    if verbose:
        print(text, file=file or sys.stdout)


parameter_servers.fxdist_leaf_module = is_embedding_module  # type: ignore[attr-defined]  # see fxdist.optimize
parameter_servers.fxdist_no_op_reason = "no embedding module found"  # type: ignore[attr-defined]


@dataclass(frozen=True)
class ParameterServers(PassBase):
    """Pass object for :class:`fxdist.passes.pass_base.PassManager`; see :func:`parameter_servers`."""

    name: ClassVar[str] = "parameter-servers"
    fxdist_leaf_module: ClassVar[Any] = staticmethod(is_embedding_module)
    optimizer: str = "rowwise_adagrad"
    """The servers' optimizer."""
    lr: float = 0.01
    """Its learning rate."""
    plan: Mapping[str, Any] | None = None
    """Per-table sharding overrides."""
    servers: tuple[str, ...] | None = None
    """Servers to use (default: all of the group)."""
    client: str = "ps"
    """Prefix of the clients' names."""
    options: dict[str, Any] = field(default_factory=dict)
    """Other keyword arguments of :func:`parameter_servers`."""

    def call(self, gm: GraphModule) -> PassResult:
        before = str(gm.graph)
        gm = parameter_servers(gm, self.optimizer, self.lr, plan=self.plan, servers=self.servers,
                               client=self.client, **self.options)
        return PassResult(gm, str(gm.graph) != before)
