"""The parameter server: embedding-table shards held in one process, served over ``torch.distributed.rpc``.

A server process calls :func:`start_server`, which creates the process-wide :class:`PSServer` and joins the
RPC group. Clients then call the module-level ``_rpc_*`` functions below by RPC (they must be importable
by the server, so they live here, never in ``__main__``); each hands the request to the transport-independent
:class:`~scheduling.ps.endpoints.ServerEndpoints`, which with the ``ray`` transport is the Ray actor itself
(:mod:`scheduling.ps.transport.ray_transport`). The lookups and pushes are ``async_execution`` functions: they return a
``torch.futures.Future`` at once, so a request that waits for its turn (:mod:`scheduling.ps.ordering`) holds
none of the ``num_worker_threads`` TensorPipe threads. The shards themselves are created by the first
client that connects (:meth:`PSServer.configure`) or loaded from a checkpoint given to :func:`start_server`.

Wire format of a batch (one per request, the whole KeyedJaggedTensor of the trainer):
``(keys, values, lengths, weights)`` with ``values`` int64 ``(N,)``, ``lengths`` ``(K * B,)`` key-major as in
torchrec, ``weights`` float ``(N,)`` or None. A lookup answers ``(B, D_s)`` float32, the pooled *sums* of every
(shard, feature) pair the server holds, concatenated in :func:`server_layout` order; row-wise shards
contribute the partial sum over their rows (the client adds the partials and divides for mean pooling).

Source: torch.fx paper §6.2.3 (parameter-server fetches); FBGEMM row-wise optimizers and fused 8-bit
row-wise quantization; ``torch.distributed.rpc.functions.async_execution``.
"""

from __future__ import annotations

import gc
import hashlib
import threading
import time
from collections.abc import Sequence
from typing import Any

import torch
from torch.distributed.rpc.functions import async_execution

from .changes import retrack
from .dynamic import DynamicTable, lookup_tables, push_tables, table_salt
from .dynamic_fused import group_shards
from .endpoints import DEFAULT_WORKER_THREADS, ServerEndpoints
from .fused import FusedTables
from .optimizer import RowWiseOptimizer, make_optimizer
from .server_state import ServerState
from .server_state import Shard as _Shard
from .server_stats import ServerStats
from .shard_plan import ShardSpec
from .storage import RowStore, make_store
from .transport.rendezvous import rpc_backend_options

__all__ = ["PSServer", "start_server", "stop_server", "server_layout", "rpc_backend_options", "Batch",
           "reset_rpc_process_state", "freeze_process_objects"]

Batch = tuple[tuple[str, ...], torch.Tensor, torch.Tensor, "torch.Tensor | None"]


_WORLD_SIZE = [0]  # members of the torch.distributed.rpc group this process joined last (0: none yet)


def group_world_size() -> int:
    """Members of the ``torch.distributed.rpc`` group this process joined last (:func:`start_server`,
    ``init_trainer``), 0 before any; tracked here instead of reading torch's private RPC agent."""
    return _WORLD_SIZE[0]


def reset_rpc_process_state() -> None:
    """Let this process join a new ``torch.distributed.rpc`` group after leaving one.

    torch prefixes the rendezvous store keys with a per-process init counter, so a process joining a second
    group (after a restart) would look for keys the other, fresh members never write. Each group gets its own
    store, so counting from 0 again is safe. Likewise the sequence numbers of rpc's internal all-gather
    (used by graceful shutdown) are per process. Workaround for torch/distributed/rpc/__init__.py and api.py;
    called by :func:`start_server` and ``init_trainer``.
    """
    from torch.distributed import rpc
    from torch.distributed.rpc import api as rpc_api

    with rpc._init_counter_lock:
        rpc._init_counter = 0
    with rpc_api._all_gather_dict_lock:
        rpc_api._all_gather_sequence_id.clear()


def server_layout(shards: Sequence[ShardSpec], server: int) -> list[tuple[ShardSpec, str]]:
    """The (shard, feature) pairs server ``server`` pools, in output-column order."""
    return [(s, feat) for s in shards if s.server == server for feat in s.table.feature_names]


class PSServer(ServerState):
    """Embedding shards of one server, with lookup, sparse-gradient push and checkpointing.

    Args:
        name: the RPC worker name (used in error messages and checkpoint file names).
        fetch_delay_s: extra sleep before answering each lookup, in seconds (emulates network distance).
        push_delay_s: extra sleep before applying each push, in seconds.
    """

    def __init__(self, name: str, fetch_delay_s: float = 0.0, push_delay_s: float = 0.0) -> None:
        self.name = name
        self.fetch_delay_s = fetch_delay_s
        self.push_delay_s = push_delay_s
        self.shards: dict[str, _Shard] = {}
        self.optimizer: RowWiseOptimizer | None = None
        self.layouts: dict[str, list[tuple[ShardSpec, str]]] = {}
        self.fused: dict[str, FusedTables | None] = {}
        self.stores: dict[str, RowStore] = {}
        self.dynamic_namespaces: set[str] = set()
        """The namespaces with a dynamic table here: their lookups are steps of it, served in the group's
        ``(count, index, rank)`` order (:mod:`scheduling.ps.ordering`, rule 3)."""
        self._lock = threading.Lock()
        self.num_lookups = 0
        self.num_pushes = 0
        self.stats = ServerStats()
        """Request timings and pending requests (:mod:`scheduling.ps.server_stats`), kept by the request handlers."""
        self.tracked: set[str] = set()
        """The namespaces whose changed rows are recorded for deltas (:mod:`scheduling.ps.changes`)."""
        self.changes: dict[str, torch.Tensor] = {}
        """Per fixed shard key of a tracked namespace, its changed-row mask ``(rows,)`` bool."""

    # ---- set-up -----------------------------------------------------------------------------------------
    def configure(self, namespace: str, shards: Sequence[ShardSpec], server: int, optimizer: str,
                  optimizer_kwargs: dict[str, float], seed: int,
                  init_weights: dict[str, torch.Tensor] | None = None, storage: str = "fp32") -> dict[str, int]:
        """Create the shards this server holds for ``namespace`` (a client name; trainers sharing tables use
        the same one). Shards already present, e.g. from a checkpoint, are kept.

        Weights of a new shard: ``init_weights[table][row_start:row_end]`` when given, else uniform in
        ``(-1/sqrt(N), 1/sqrt(N))`` (torchrec's default) from a generator seeded by ``(seed, table name, first
        row)``: a table gets the same rows wherever it is placed, and two tables never the same ones; stored
        as ``storage`` says (:mod:`scheduling.ps.storage`: "fp32", "fp16" or "fused8bit").

        Returns:
            ``{shard key: rows}`` of the shards now held.

        Raises:
            ValueError: a shard already held has another shape than the one requested.
        """
        with self._lock:
            self.optimizer = make_optimizer(optimizer, **optimizer_kwargs)
            store = self.stores[namespace] = make_store(storage, seed)
            mine = [s for s in shards if s.server == server]
            for spec in mine:
                key = f"{namespace}/{spec.key}"
                old = self.shards.get(key)
                if old is not None:
                    if (old.spec.num_rows, old.spec.table.embedding_dim) != (spec.num_rows, spec.table.embedding_dim):
                        raise ValueError(f"server {self.name}: shard {key} exists with shape "
                                         f"({old.spec.num_rows}, {old.spec.table.embedding_dim}), client asks for "
                                         f"({spec.num_rows}, {spec.table.embedding_dim})")
                    old.spec = spec
                    continue
                if spec.table.dynamic is not None:
                    self.shards[key] = self._dynamic_shard(spec, seed, store)
                    continue
                self.shards[key] = _Shard(spec, store.encode(self._init_weight(spec, seed, init_weights)),
                                          self.optimizer.init_state(spec.num_rows, spec.table.embedding_dim),
                                          store=store)
            self.layouts[namespace] = server_layout(mine, server)
            self._fuse(namespace)
            return {k: s.spec.num_rows for k, s in self.shards.items() if k.startswith(namespace + "/")}

    def _dynamic_shard(self, spec: ShardSpec, seed: int, store: RowStore, state: dict[str, Any] | None = None) -> _Shard:
        """A dynamic table's shard (:mod:`scheduling.ps.dynamic`), restored from ``state`` when given."""
        assert self.optimizer is not None and spec.table.dynamic is not None
        table = DynamicTable(spec.table.embedding_dim, spec.table.dynamic, self.optimizer, seed=seed,
                             salt=table_salt(spec.table.name), store=store)
        if state is not None:
            table.load_state_dict(state)
        return _Shard(spec, table.weight, table.state, lock=table.lock, store=store, dynamic=table)

    def _fuse(self, namespace: str) -> None:
        """Stack the namespace's shards into one :class:`FusedTables` (when possible); the shards then hold
        views of it and share its lock."""
        layout = self.layouts[namespace]
        keys = [f"{namespace}/{spec.key}" for spec, _ in layout]
        if any(k in self.shards and self.shards[k].dynamic is not None for k in keys):
            self.dynamic_namespaces.add(namespace)
        else:
            self.dynamic_namespaces.discard(namespace)
        if any(k not in self.shards or self.shards[k].dynamic is not None for k in keys):
            self.fused[namespace] = group_shards(layout, [self.shards.get(k) for k in keys])
            retrack(self, namespace)
            return
        shards = {spec.key: self.shards[k] for (spec, _), k in zip(layout, keys)}
        fused = FusedTables.build(layout, {k: sh.weight for k, sh in shards.items()},
                                  {k: sh.state for k, sh in shards.items()}, threading.Lock())
        self.fused[namespace] = fused
        if fused is not None:
            fused.store = next(iter(shards.values())).store
            fused.use_kernel(self.optimizer)
            for key, (weight, state) in fused.shard_views().items():
                shard = shards[key]
                shard.weight, shard.state, shard.lock = weight, state, fused.lock
        retrack(self, namespace)  # restacked: the record of a tracked namespace starts again

    def _layout(self, namespace: str) -> list[tuple[ShardSpec, str]]:
        try:
            return self.layouts[namespace]
        except KeyError:
            raise ValueError(f"server {self.name}: no tables configured for client {namespace!r} "
                             f"(have {sorted(self.layouts)}); create the PSClient with configure=True") from None

    @staticmethod
    def _init_weight(spec: ShardSpec, seed: int, init_weights: dict[str, torch.Tensor] | None) -> torch.Tensor:
        if init_weights is not None and spec.table.name in init_weights:
            return init_weights[spec.table.name][spec.row_start:spec.row_end].detach().clone().float()
        key = hashlib.blake2b(f"{seed}/{spec.table.name}/{spec.row_start}".encode(), digest_size=8).digest()
        gen = torch.Generator().manual_seed(int.from_bytes(key, "little") >> 1)
        bound = spec.table.num_embeddings ** -0.5
        w = torch.empty(spec.num_rows, spec.table.embedding_dim)
        return w.uniform_(-bound, bound, generator=gen)

    # ---- lookup and push --------------------------------------------------------------------------------
    def _features(self, batch: Batch) -> tuple[dict[str, tuple[torch.Tensor, torch.Tensor, Any]], int]:
        keys, values, lengths, weights = batch
        num_keys = len(keys)
        if num_keys == 0:
            raise ValueError(f"server {self.name}: empty KeyedJaggedTensor")
        batch_size = lengths.numel() // num_keys
        lens = lengths.view(num_keys, batch_size).long()
        per_key = lens.sum(1).tolist()
        vals = values.split(per_key)
        wts = weights.split(per_key) if weights is not None else [None] * num_keys
        return {k: (vals[i], lens[i], wts[i]) for i, k in enumerate(keys)}, batch_size

    def _bag(self, spec: ShardSpec, feat: str, feats: dict[str, Any]
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """(local ids, bag index per id, per-id weight or None) of feature ``feat`` restricted to ``spec``."""
        if feat not in feats:
            raise ValueError(f"server {self.name}: the batch has no feature {feat!r} (table {spec.table.name!r})"
                             f"; got keys {sorted(feats)}")
        ids, lens, wts = feats[feat]
        if ids.numel() and spec.table.dynamic is None:
            lo, hi = int(ids.min()), int(ids.max())
            if lo < 0 or hi >= spec.table.num_embeddings:
                bad = lo if lo < 0 else hi
                raise ValueError(f"server {self.name}: feature {feat!r} has id {bad} outside table "
                                 f"{spec.table.name!r} rows [0, {spec.table.num_embeddings})")
        bags = torch.repeat_interleave(torch.arange(lens.numel()), lens)
        if spec.row_start == 0 and spec.row_end == spec.table.num_embeddings:
            return ids, bags, wts
        keep = (ids >= spec.row_start) & (ids < spec.row_end)
        return ids[keep] - spec.row_start, bags[keep], (wts[keep] if wts is not None else None)

    def lookup(self, namespace: str, batch: Batch, compress: str | None = None) -> torch.Tensor:
        """Pooled sums ``(B, D_s)`` for every (shard, feature) pair of the namespace's layout.

        Raises:
            ValueError: a feature is missing from the batch or an id is out of range.
        """
        if self.fetch_delay_s > 0:
            time.sleep(self.fetch_delay_s)
        self._layout(namespace)  # raises for a client that configured no tables here
        fused = self.fused.get(namespace)
        if fused is not None:
            out = fused.lookup(fused.index(*batch, where=f"server {self.name}"))
        else:
            out = self._lookup_per_shard(namespace, batch)
        return self.answer(out, compress)

    def answer(self, out: torch.Tensor, compress: str | None) -> torch.Tensor:
        """A lookup's pooled rows ``out`` ``(B, D_s)`` as sent back: as they are, or quantized to FBGEMM's fused
        8-bit rows (``compress="fused8bit"``); counts the lookup.

        Raises:
            ValueError: an unknown ``compress``.
        """
        self.num_lookups += 1
        if compress == "fused8bit":
            return _quantize(out)
        if compress is not None:
            raise ValueError(f"server {self.name}: unknown compression {compress!r} (use 'fused8bit')")
        return out

    def _lookup_per_shard(self, namespace: str, batch: Batch, read_only: bool = False) -> torch.Tensor:
        """Pooled sums ``(B, D_s)`` shard by shard; ``read_only``: dynamic tables' rows as held now
        (``DynamicTable.rows_of``, no step: a peek, :mod:`scheduling.ps.peek`)."""
        feats, batch_size = self._features(batch)
        outs = []
        parts = [(spec, self.shards[f"{namespace}/{spec.key}"], *self._bag(spec, feat, feats))
                 for spec, feat in self._layout(namespace)]
        if read_only:
            dynamic = [None if shard.dynamic is None else _rows_held(shard.dynamic, ids)
                       for _, shard, ids, _, _ in parts]
        else:
            dynamic = lookup_tables([(shard.dynamic, ids) for _, shard, ids, _, _ in parts])
        for (spec, shard, ids, bags, wts), known in zip(parts, dynamic):
            rows = shard.store.gather(shard.weight, ids) if known is None else known
            if wts is not None:
                rows = rows * wts.unsqueeze(1)
            pooled = torch.zeros(batch_size, spec.table.embedding_dim).index_add_(0, bags, rows)
            outs.append(pooled)
        return torch.cat(outs, dim=1) if outs else torch.zeros(batch_size, 0)

    def push(self, namespace: str, batch: Batch, grad: torch.Tensor) -> int:
        """Apply the gradient ``grad`` ``(B, D_s)`` of this server's lookup output to the rows it touched.

        Row gradients are summed over all bags and features of the batch, then the optimizer makes one
        update per touched row. Returns the number of rows updated.

        Raises:
            ValueError: ``grad`` has the wrong shape.
        """
        if self.push_delay_s > 0:
            time.sleep(self.push_delay_s)
        layout = self._layout(namespace)
        fused = self.fused.get(namespace)
        # the stacked tables' width without a sum over the layout per request
        width = (fused.dim * len(fused.layout) if isinstance(fused, FusedTables)
                 else sum(spec.table.embedding_dim for spec, _ in layout))
        keys, _, lengths, _ = batch
        batch_size = lengths.numel() // len(keys) if keys else 0
        if keys and tuple(grad.shape) != (batch_size, width):
            raise ValueError(f"server {self.name}: gradient shape {tuple(grad.shape)} != expected "
                             f"({batch_size}, {width})")
        assert self.optimizer is not None
        if fused is None:
            touched = self._push_per_shard(namespace, batch, grad)
        else:
            touched = fused.push(fused.index(*batch, where=f"server {self.name}"), grad, self.optimizer)
        self.num_pushes += 1
        return touched

    def _push_per_shard(self, namespace: str, batch: Batch, grad: torch.Tensor) -> int:
        feats, _ = self._features(batch)
        assert self.optimizer is not None
        per_shard: dict[str, list[tuple[torch.Tensor, torch.Tensor]]] = {}
        col = 0
        for spec, feat in self._layout(namespace):
            dim = spec.table.embedding_dim
            ids, bags, wts = self._bag(spec, feat, feats)
            g = grad[:, col:col + dim].index_select(0, bags)
            if wts is not None:
                g = g * wts.unsqueeze(1)
            per_shard.setdefault(f"{namespace}/{spec.key}", []).append((ids, g))
            col += dim
        touched = push_tables([(self.shards[k].dynamic, torch.cat([p[0] for p in ps]), torch.cat([p[1] for p in ps]))
                               for k, ps in per_shard.items() if self.shards[k].dynamic is not None])
        for key, parts in per_shard.items():
            ids = torch.cat([p[0] for p in parts])
            shard = self.shards[key]
            if shard.dynamic is not None:
                continue
            if ids.numel() == 0:
                continue
            uniq, inverse = torch.unique(ids, return_inverse=True)
            summed = torch.zeros(uniq.numel(), parts[0][1].shape[1]).index_add_(0, inverse,
                                                                                 torch.cat([p[1] for p in parts]))
            with shard.lock:
                self.optimizer.step(shard.weight, shard.state, uniq, summed, shard.store)
                if key in self.changes:   # tracked for deltas (scheduling.ps.changes)
                    self.changes[key][uniq] = True
            touched += uniq.numel()
        return touched


def _quantize(x: torch.Tensor) -> torch.Tensor:
    import fbgemm_gpu  # noqa: F401  (registers torch.ops.fbgemm)

    return torch.ops.fbgemm.FloatToFused8BitRowwiseQuantized(x.contiguous())


# ---- the process-wide server and its torch.distributed.rpc entry points ------------------------------------
_ENDPOINTS = ServerEndpoints()
"""The request handlers of this process's server (``start_server`` sets its ``server``)."""
_STOP = threading.Event()


def _server() -> PSServer:
    return _ENDPOINTS._server()


def _rpc_configure(*args: Any, **kwargs: Any) -> dict[str, int]:
    return _ENDPOINTS.configure(*args, **kwargs)


def _ordered_future(method: str, args: tuple) -> torch.futures.Future:
    """Start ordered request ``method`` (:meth:`ServerEndpoints.submit`) and return the Future of its answer;
    the RPC thread that called returns at once, whether the request runs now or waits for its turn.

    An error is answered as torch's RPC answers a raise in a plain function (``RemoteException``: the client
    raises the same exception type, e.g. ``ValueError``, with the same message).
    """
    from torch.distributed.rpc.internal import RemoteException

    future: torch.futures.Future = torch.futures.Future()

    def done(value: Any, error: BaseException | None) -> None:
        if error is None:
            future.set_result(value)
            return
        import traceback

        from torch.distributed import rpc

        trace = "".join(traceback.format_exception(type(error), error, error.__traceback__))
        future.set_result(RemoteException(f"On {rpc.get_worker_info()}:\n{error!r}\n{trace}", type(error)))

    try:
        _ENDPOINTS.submit(method, args, done)
    except Exception as e:  # no server here, bad arguments: answered like the work's own errors
        done(None, e)
    return future


@async_execution
def _rpc_lookup(*args: Any) -> torch.futures.Future:
    return _ordered_future("lookup", args)


def _rows_held(table: Any, ids: torch.Tensor) -> torch.Tensor:
    """A dynamic table's rows of ``ids`` as held now, under its lock (zeros for ids not admitted)."""
    with table.lock:
        return table.rows_of(ids)


@async_execution
def _rpc_peek(*args: Any) -> torch.futures.Future:
    return _ordered_future("peek", args)


@async_execution
def _rpc_push(*args: Any) -> torch.futures.Future:
    return _ordered_future("push", args)


@async_execution
def _rpc_push_lookup(*args: Any) -> torch.futures.Future:
    return _ordered_future("push_lookup", args)


@async_execution
def _rpc_batch(calls: list[tuple[str, tuple]]) -> torch.futures.Future:
    """Several ordered requests in one message (:meth:`ServerEndpoints.submit_batch`): a Future of
    ``[(answer, error), ...]``, one pair per call."""
    future: torch.futures.Future = torch.futures.Future()
    try:
        _ENDPOINTS.submit_batch(calls, lambda answers, error: future.set_result(answers))
    except Exception as e:  # noqa: BLE001  (no server here: every call answers that error)
        future.set_result([(None, e)] * len(calls))
    return future


def _rpc_state_dict(namespace: str | None = None) -> dict[str, Any]:
    return _ENDPOINTS.state_dict(namespace)


def _rpc_load_state_dict(state: dict[str, Any]) -> None:
    _ENDPOINTS.load_state_dict(state)


def _rpc_save(directory: str) -> str:
    return _ENDPOINTS.save(directory)


def _rpc_save_shards(namespace: str, directory: str, paths: dict[str, str]) -> dict[str, Any]:
    return _ENDPOINTS.save_shards(namespace, directory, paths)


def _rpc_save_status(namespace: str, directory: str, wait: bool = True) -> dict[str, Any] | None:
    return _ENDPOINTS.save_status(namespace, directory, wait)


def _rpc_load_shards(namespace: str, directory: str, paths: dict[str, str]) -> dict[str, int]:
    return _ENDPOINTS.load_shards(namespace, directory, paths)


def _rpc_changes(namespace: str, start: bool = False) -> dict[str, Any]:
    return _ENDPOINTS.changes(namespace, start)


def _rpc_set_delays(fetch_delay_s: float, push_delay_s: float) -> None:
    _ENDPOINTS.set_delays(fetch_delay_s, push_delay_s)


def _rpc_stop() -> bool:
    """Ask the serving loop of :func:`start_server` (``block=True``) to leave the group and return."""
    _STOP.set()
    return True


def _rpc_stats() -> dict[str, int]:
    return _ENDPOINTS.stats()


def _rpc_dynamic_stats(namespace: str) -> dict[str, dict[str, int]]:
    return _ENDPOINTS.dynamic_stats(namespace)


def start_server(name: str, rank: int, world_size: int, *, master_addr: str = "127.0.0.1",
                 master_port: int | None = None, init_method: str | None = None,
                 checkpoint: str | None = None, fetch_delay_s: float = 0.0, push_delay_s: float = 0.0,
                 timeout_s: float = 60.0, num_threads: int = 1, block: bool = True,
                 num_worker_threads: int = DEFAULT_WORKER_THREADS) -> PSServer:
    """Run a parameter server in this process: create :class:`PSServer`, join the RPC group, serve.

    Args:
        name: RPC worker name of this server (e.g. ``"ps0"``); clients list servers by these names.
        rank, world_size: this process's rank in the static RPC group (trainers + servers).
        master_addr, master_port: the rendezvous TCP store (hosted by rank 0); or give ``init_method``.
        checkpoint: a file written by :meth:`PSServer.save` (``PSClient.checkpoint``): its shards and
            optimizer state are loaded before serving (restart after a crash).
        fetch_delay_s, push_delay_s: added latency per lookup / push, in seconds.
        timeout_s: RPC timeout, and how long joining the group may take, in seconds.
        num_threads: torch intra-op threads of this process.
        num_worker_threads: TensorPipe threads serving requests (``TensorPipeRpcBackendOptions``); a request
            waiting for its turn holds none of them (:mod:`scheduling.ps.ordering`), so any number of
            clients and trainers can wait on one server.
        block: if True, serve until a client calls ``PSClient.stop_servers()`` (then leave the group and
            return); if False, return right after joining (a Ray actor does this and calls
            :func:`stop_server` later).

    Returns:
        The :class:`PSServer` (after shutdown when ``block``).

    Raises:
        ValueError: neither ``master_port`` nor ``init_method`` given, or ``num_worker_threads`` < 1.
        RuntimeError: the group did not assemble within ``timeout_s`` (from ``torch.distributed.rpc``).
    """
    from torch.distributed import rpc

    if num_worker_threads < 1:
        raise ValueError(f"start_server: num_worker_threads must be >= 1, got {num_worker_threads}")
    if init_method is None:
        if master_port is None:
            raise ValueError("start_server: give master_port (with master_addr) or init_method")
        init_method = f"tcp://{master_addr}:{master_port}"
    torch.set_num_threads(num_threads)
    server = PSServer(name, fetch_delay_s=fetch_delay_s, push_delay_s=push_delay_s)
    if checkpoint is not None:
        from .safe_load import safe_load

        server.load_state_dict(safe_load(checkpoint))
    _ENDPOINTS.server = server
    reset_rpc_process_state()
    from recsys.quiet import rpc_init_warnings_filtered

    with rpc_init_warnings_filtered():
        rpc.init_rpc(name, rank=rank, world_size=world_size,
                     rpc_backend_options=rpc_backend_options(init_method, timeout_s, num_worker_threads))
    _WORLD_SIZE[0] = world_size
    if block:   # a process of its own
        freeze_process_objects()
        _STOP.wait()
        time.sleep(0.2)  # let the reply to the stop request leave
        stop_server()
    return server


def freeze_process_objects() -> None:
    """Before a server process serves: collect, then freeze what it holds (``gc.freeze``). Torch's modules and the
    server (~170k objects) live as long as the process; unfrozen, every full collection that the requests'
    allocations start now and then walks them all (~0.1 s each, about every 8k requests)."""
    gc.collect()
    gc.freeze()


def stop_server() -> None:
    """Leave the RPC group at once and drop the server.

    Shutdown is never graceful: torch's graceful shutdown is a barrier of the whole group, which hangs when
    a member crashed and cannot be repeated in a process that joins a second group (after a restart).
    """
    from torch.distributed import rpc

    rpc.shutdown(graceful=False)
    _ENDPOINTS.server = None
    _STOP.clear()
