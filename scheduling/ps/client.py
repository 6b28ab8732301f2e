"""The trainer side of the parameter server: :class:`PSClient`.

A client knows the table layout (which shard lives on which server), sends lookups and gradient pushes,
and turns the per-server answers back into torchrec's ``KeyedTensor``. Its blocking :meth:`PSClient.lookup`
is the ``rpc_sync`` baseline that :func:`scheduling.async_rpc` rewrites into :meth:`lookup_async` + wait.

Clients are registered by name (:func:`get_client`), so graph nodes refer to them by a string constant.

Source: torch.fx paper §6.2.3 (blocking parameter-server lookups in training models).
"""

from __future__ import annotations

import collections
import threading
import uuid
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from recsys.quiet import rpc_init_warnings_filtered

from . import peek as _peek
from . import pooling as _pooling
from . import server as _srv
from .client_options import GRAD_REDUCTIONS, ClientOptions  # noqa: F401  (GRAD_REDUCTIONS: re-exported)
from .client_state import ClientState
from .device import Lookup, to_host
from .shard_plan import ShardSpec, TableSpec, plan_shards, table_specs
from .transport import make_transport

__all__ = ["PSClient", "PSUnavailableError", "get_client", "init_trainer", "live_clients"]

_CLIENTS: dict[str, "PSClient"] = {}
_CLIENTS_LOCK = threading.Lock()


class PSUnavailableError(RuntimeError):
    """A parameter server did not answer in time, or its connection broke (crash, wrong address).

    See docs/troubleshooting.md#psunavailableerror.
    """


def get_client(name: str) -> "PSClient":
    """The live :class:`PSClient` registered under ``name``.

    Raises:
        KeyError: no such client (it was closed, or never created in this process).
    """
    try:
        return _CLIENTS[name]
    except KeyError:
        raise KeyError(f"no PSClient named {name!r} in this process (live: {sorted(_CLIENTS)}); "
                       "create PSClient(..., name=...) before running the model") from None


def live_clients() -> list["PSClient"]:
    """The clients registered in this process now (not closed)."""
    with _CLIENTS_LOCK:
        return list(_CLIENTS.values())


def init_trainer(name: str, rank: int, world_size: int, *, master_addr: str = "127.0.0.1",
                 master_port: int | None = None, init_method: str | None = None,
                 timeout_s: float = 60.0) -> None:
    """Join the RPC group as a trainer (same transport settings as the servers).

    Raises:
        ValueError: neither ``master_port`` nor ``init_method`` given.
        PSUnavailableError: the group did not assemble within ``timeout_s`` seconds.
    """
    from torch.distributed import rpc

    if init_method is None:
        if master_port is None:
            raise ValueError("init_trainer: give master_port (with master_addr) or init_method")
        init_method = f"tcp://{master_addr}:{master_port}"
    _srv.reset_rpc_process_state()  # the process may have been in another group before (restart)
    try:
        with rpc_init_warnings_filtered():
            rpc.init_rpc(name, rank=rank, world_size=world_size,
                         rpc_backend_options=_srv.rpc_backend_options(init_method, timeout_s))
        _srv._WORLD_SIZE[0] = world_size
    except RuntimeError as e:
        raise PSUnavailableError(f"trainer {name!r}: the RPC group at {init_method} (world_size={world_size}) "
                                 f"did not assemble within {timeout_s} s; are the servers running? ({e})") from e


class _Part:
    """One element of a Future's tuple value, waited like a Future (exceptions pass through unchanged)."""

    def __init__(self, future: torch.futures.Future, index: int) -> None:
        self.future, self.index = future, index

    def wait(self) -> Any:
        return self.future.wait()[self.index]

    def done(self) -> bool:
        return self.future.done()


def _batch(kjt: Any) -> _srv.Batch:
    """A KeyedJaggedTensor as the wire tuple ``(keys, values, lengths, weights)``, tensors on the CPU."""
    return (tuple(kjt.keys()), to_host(kjt.values()), to_host(kjt.lengths()), to_host(kjt.weights_or_none()))


def _check_device(device: str | torch.device | None) -> torch.device | None:
    if device is None:
        return None
    device = torch.device(device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"PSClient: device={str(device)!r}, but CUDA is not available in this process")
    return device


class PSClient(ClientState):
    """Connection of one trainer to the parameter servers of a set of embedding tables.

    Args:
        tables: torchrec ``EmbeddingBagConfig``s (or :class:`TableSpec`s).
        servers: the servers, e.g. ``["ps0", "ps1"]``: RPC worker names (``torch_rpc``: RPC must be
            initialized, see :func:`init_trainer`), or Ray actor handles / registered names (``ray``).
        options: a :class:`~scheduling.ps.client_options.ClientOptions` (None: the defaults); any of its fields
            given as a keyword (``name="ps"``, ``timeout_s=30`` ...) replaces that field. The fields:
        transport: ``"torch_rpc"``, ``"ray"`` or ``"socket"`` (:mod:`scheduling.ps.transport`); None picks
            ``"ray"`` for actor handles and names of Ray servers started here (``LocalCluster(transport="ray")``),
            ``"socket"`` for names of socket servers registered here, else the default.
        sharding: ``"table_wise"``, ``"row_wise"`` or a mapping table name -> scheme.
        optimizer: ``"rowwise_adagrad"`` or ``"sgd"``, applied on the servers; ``optimizer_kwargs`` e.g.
            ``{"lr": 0.05}``.
        name: registry name (graph nodes refer to the client by it) and the servers' namespace of its
            tables: trainers sharing tables use the same name.
        timeout_s: every RPC fails with :class:`PSUnavailableError` after this many seconds.
        compress: ``"fused8bit"`` to receive lookups quantized with FBGEMM's fused 8-bit row-wise format.
        storage: how the servers store the rows: ``"fp32"``, ``"fp16"`` or ``"fused8bit"`` (2x and about 4x
            less memory; :mod:`scheduling.ps.storage`); lookups answer float32 either way.
        seed: seed of the initial weights; ``init_weights`` ``{table: (N, D)}`` (not an option) overrides them.
        configure: (not an option) create the shards on the servers now (shards restored from a checkpoint are kept).
        ordered: each server applies this client's lookups and pushes in the order they were issued
            (sequence numbers), so a lookup sent while a push is in flight still sees that push.
        rank, world_size, group: this trainer's rank among the ``world_size`` trainers that share these
            tables (the same ``name``), and a key the group shares (e.g. a uuid that rank 0 broadcasts).
            With ``world_size > 1`` the servers serve the group in step order
            (:mod:`scheduling.ps.ordering`): every trainer's step-``k`` lookup sees exactly the pushes of
            steps ``0 .. k-1`` of all trainers, applied in rank order, and a server stepping dynamic tables
            takes the group's lookups of them in ``(count, index, rank)`` order, whatever the schedule
            (blocking, ``async_rpc``, prefetch), so training is deterministic. Every trainer must then push to
            each server once per step, run the same number of steps and make the same lookups of each server
            holding a dynamic table (read-only peeks aside).
        grad_reduction: how the group's table gradients combine, ``"mean"`` (default: each trainer's push is
            divided by ``world_size`` before it is sent, as DDP divides the dense gradients and torchrec's
            ``DistributedModelParallel`` divides the table gradients, ``comm_ops.GRADIENT_DIVISION``; so a
            learning rate tuned on one trainer carries over) or ``"sum"`` (each push applied as computed).
        device: where fetched rows go when the batch's ids are on the CPU (ids on an accelerator bring the
            rows to theirs); None: the CPU. Whatever the device, ids, weights and gradients travel to the
            servers as CPU tensors, and rows come back through pinned memory with ``non_blocking`` copies on a
            side CUDA stream (:mod:`scheduling.ps.device`).

    Raises:
        ValueError: bad table declarations or sharding, a bad ``rank`` / ``world_size`` / ``group``, or a
            CUDA ``device`` without CUDA.
        PSUnavailableError: a server does not answer the configuration call.
    """

    def __init__(self, tables: Sequence[Any], servers: Sequence[str], options: ClientOptions | None = None, *,
                 init_weights: Mapping[str, torch.Tensor] | None = None, configure: bool = True,
                 **option_fields: Any) -> None:
        if not servers:
            raise ValueError("PSClient: give at least one server name")
        opts = (options or ClientOptions()).replace(**option_fields) if option_fields else (options or ClientOptions())
        self.options = opts
        """This client's :class:`~scheduling.ps.client_options.ClientOptions` (frozen)."""
        (sharding, optimizer, optimizer_kwargs, name, timeout_s, compress, seed, ordered, rank, world_size, group,
         storage, transport, device) = (opts.sharding, opts.optimizer, opts.optimizer_kwargs, opts.name,
                                        opts.timeout_s, opts.compress, opts.seed, opts.ordered, opts.rank,
                                        opts.world_size, opts.group, opts.storage, opts.transport, opts.device)
        self.device = _check_device(device)
        self.tables: list[TableSpec] = table_specs(tables)
        self.servers = list(servers)
        self.transport = make_transport(transport, self.servers)
        self.shards: list[ShardSpec] = plan_shards(self.tables, len(self.servers), sharding)
        self.name = name
        self.timeout_s = float(timeout_s)
        self.compress = compress
        self.optimizer = optimizer
        self.optimizer_kwargs = dict(optimizer_kwargs or {})
        self.seed = seed
        self.storage = storage
        self.grad_divisor = opts.grad_divisor
        """What each pushed gradient is divided by (``world_size`` for ``grad_reduction="mean"``, as DDP)."""
        self.layouts = [_srv.server_layout(self.shards, s) for s in range(len(self.servers))]
        self.widths = [sum(sp.table.embedding_dim for sp, _ in lay) for lay in self.layouts]
        self._slots = self._feature_slots()
        self._all_servers: tuple[list[ShardSpec], list[int]] | None = None
        self._pending: dict[int, collections.deque[torch.futures.Future]] = collections.defaultdict(
            collections.deque)
        self._prefetched: dict[int, tuple[Any, torch.futures.Future]] = {}
        self._gather: Any = None  # see scheduling.ps.pooling.column_gather
        self.batcher: Any = None
        """A :class:`scheduling.ps.coalesce.PushBatcher` shared with other clients: pushes are queued there and sent
        one message per server (the ``parameter_servers`` pass sets one for all the clients of a model)."""
        self.input_check: Callable[[Any], None] | None = None
        """Called with each batch before its first lookup is sent (e.g. the local collection's checks)."""
        self._checked: Any = None
        self.weighted: bool | None = None
        """Whether the tables take the batches' weights: False drops them (an unweighted torchrec collection
        ignores weights); None sends them as given."""
        self.staleness: collections.Counter[int] = collections.Counter()
        """With ``max_staleness`` given: how many lookups were sent with ``n`` of this client's pushes to their server
        still in flight (``n`` -> lookups), the steps the rows may lag (``ordered=False``; ordered servers apply them
        first)."""
        self.prefetch_hits = 0
        """Lookups answered by an earlier prefetch (:meth:`prefetch`, ``push_async(next_kjt=...)``)."""
        self.ordered = ordered
        self._read_only = 0  # > 0: lookups are read-only peeks (read_only())
        self._key = f"{name}:{uuid.uuid4().hex}"
        self._seq = [0] * len(self.servers)
        self._pushes = [0] * len(self.servers)
        self._lookups = [0] * len(self.servers)  # lookups to each server since the last push (ordering rule 3)
        self._group = (f"{group}/{name}", rank, world_size) if world_size > 1 else None  # one order per table set
        self._seq_lock = threading.Lock()
        with _CLIENTS_LOCK:
            if name in _CLIENTS:
                raise ValueError(f"a PSClient named {name!r} already exists; close() it or pick another name")
            _CLIENTS[name] = self
        if configure:
            try:
                self.configure(init_weights)
            except BaseException:
                self.close(flush=False)
                raise

    # ---- layout -----------------------------------------------------------------------------------------
    def _feature_slots(self) -> dict[str, list[tuple[int, int, int]]]:
        """feature -> [(server, first column, dim)] of every shard part making up its pooled output."""
        slots: dict[str, list[tuple[int, int, int]]] = {}
        for s, layout in enumerate(self.layouts):
            col = 0
            for spec, feat in layout:
                slots.setdefault(feat, []).append((s, col, spec.table.embedding_dim))
                col += spec.table.embedding_dim
        return slots

    @property
    def feature_names(self) -> list[str]:
        """KeyedTensor keys of :meth:`pool`'s output: tables in declaration order, then their features."""
        return [f for t in self.tables for f in t.feature_names]

    def servers_for(self, tables: Sequence[str] | None = None) -> list[int]:
        """Indices of the servers holding a shard of ``tables`` (all tables when None)."""
        if tables is None:  # every step's pool asks for all of them: computed once per shard list
            if self._all_servers is None or self._all_servers[0] is not self.shards:
                self._all_servers = (self.shards, sorted({sp.server for sp in self.shards}))
            return list(self._all_servers[1])
        names = set(tables)
        return sorted({sp.server for sp in self.shards if sp.table.name in names})

    # ---- RPC plumbing -----------------------------------------------------------------------------------
    def _call_async(self, server: int, method: str, args: tuple, what: str, ordered: bool = False,
                    push: bool = False) -> torch.futures.Future:
        """Send request ``method`` (:data:`scheduling.ps.endpoints.METHODS`) through the transport."""
        if not 0 <= server < len(self.servers):
            raise IndexError(f"PSClient {self.name!r}: server index {server} out of range "
                             f"(have {len(self.servers)} servers)")
        try:
            if ordered and self.ordered:
                with self._seq_lock:  # numbered and sent together, so the numbers follow the issue order
                    order: tuple = (self._key, self._seq[server], self.timeout_s)
                    steps = method in ("lookup", "push_lookup")  # a step of the server's dynamic tables, if any
                    if self._group is not None:  # step order across the group: pushes issued before this, and a
                        # lookup's index among this count's (a push+lookup's: the first of the next count)
                        index = (0 if push else self._lookups[server]) if steps else None
                        order += ((*self._group, self._pushes[server], index),)
                    self._seq[server] += 1
                    self._pushes[server] += push
                    self._lookups[server] = (int(steps) if push else self._lookups[server] + int(steps))
                    if self.batcher is not None:
                        if push:
                            return self.batcher.enqueue(server, method, (*args, order))
                        self.batcher.send(server)  # queued pushes go first: the server applies them in order
                    return self.transport.call_async(server, method, (*args, order), self.timeout_s)
            return self.transport.call_async(server, method, args, self.timeout_s)
        except RuntimeError as e:
            raise self._unavailable(server, what, e) from e

    def _unavailable(self, server: int, what: str, err: BaseException) -> PSUnavailableError:
        return PSUnavailableError(f"parameter server {self.transport.names[server]!r} (server {server} of "
                                  f"{len(self.servers)}, client {self.name!r}) failed during {what} within "
                                  f"timeout_s={self.timeout_s}: {str(err).splitlines()[0] if str(err) else err!r}")

    def _wait(self, fut: torch.futures.Future, server: int, what: str) -> Any:
        try:
            return fut.wait()
        except RuntimeError as e:
            if type(e) is RuntimeError:  # RPC failures (timeout, EOF, EPIPE, ...); remote ValueErrors etc. pass
                raise self._unavailable(server, what, e) from e
            raise

    def _call(self, server: int, method: str, args: tuple, what: str) -> Any:
        return self._wait(self._call_async(server, method, args, what), server, what)

    def rows_device(self, kjt: Any) -> torch.device:
        """Where the rows of ``kjt``'s lookup go: its ids' device unless that is the CPU, else :attr:`device`."""
        ids = kjt.values().device
        return ids if ids.type != "cpu" else (self.device or ids)

    def _lookup(self, future: Any, kjt: Any, index: int | None = None) -> Lookup:
        return Lookup(future, self.rows_device(kjt), self.compress, index)

    def _wire(self, kjt: Any) -> _srv.Batch:
        batch = _batch(kjt)
        return batch[:3] + (None,) if self.weighted is False else batch

    # ---- lookup / push ----------------------------------------------------------------------------------
    def lookup_async(self, server: int, kjt: Any, max_staleness: int | None = None) -> torch.futures.Future:
        """Start a lookup on ``server``; the Future's value is the raw answer (see :meth:`finish_lookup`).

        If :meth:`prefetch` already started the lookup of this very ``kjt`` object on ``server``, that
        lookup's Future is returned (a prefetch of another batch is waited and dropped).

        Pushes to this server deferred with :meth:`defer_push` are waited first, until at most
        ``max_staleness`` of them (default 0) are still in flight. With ``ordered`` (default) the server
        applies those in-flight pushes before this lookup anyway, so the answer is exact for any
        ``max_staleness``; without it, the lookup may miss up to ``max_staleness`` pushes.
        """
        if self.input_check is not None and self._checked is not kjt:
            self.input_check(kjt)           # the local module's errors, before anything is sent
            self._checked = kjt
        if self._read_only:  # leaves any prefetch for the training lookup it was started for
            return _peek.peek_async(self, server, kjt)
        early = self._prefetched.get(server)
        if early is not None and early[0] is kjt:
            del self._prefetched[server]
            self.prefetch_hits += 1
            # a push that carried this lookup (push_async(next_kjt=...)) may be deferred: it completes with
            # the lookup, so it is the one push allowed to stay in flight beyond max_staleness
            self.drain(server, (max_staleness or 0) + 1)
            return early[1]
        self._drop_prefetch(server)
        self.drain(server, 0 if max_staleness is None else max_staleness)
        if max_staleness is not None:
            self.staleness[len(self._pending.get(server, ()))] += 1
        # a Lookup is waited like a Future (scheduling.ps.device.Lookup)
        return self._lookup(self._call_async(server, "lookup", (self.name, self._wire(kjt), self.compress),
                                             "lookup", ordered=True), kjt)  # type: ignore[return-value]

    def _drop_prefetch(self, server: int) -> None:
        """Wait and drop an unused prefetched lookup (of another batch), so its errors surface."""
        early = self._prefetched.pop(server, None)
        if early is not None:
            self._wait(early[1], server, "prefetch")

    def prefetch(self, server: int, kjt: Any, max_staleness: int | None = None) -> None:
        """Start the lookup of a *later* batch ``kjt`` now; the next :meth:`lookup_async` of the same object
        on ``server`` picks it up instead of sending a new request.

        The server answers it with the rows as they are when it arrives: after every push this client
        started before (``ordered=True``), so a prefetch started right after this step's push is exact.
        With ``max_staleness`` >= 1 callers may start it before this step's push (it then misses that
        one push).

        Raises:
            RuntimeError: exact prefetch (``max_staleness`` None or 0) on a client with ``ordered=False``,
                whose servers could serve the lookup before an earlier push.
        """
        if not self.ordered and not max_staleness:
            raise RuntimeError(f"PSClient {self.name!r}: an exact prefetch needs ordered=True (the servers "
                               "must apply this step's push before the next step's lookup); create the "
                               "client with ordered=True or allow max_staleness >= 1")
        if self._read_only:  # a read-only lookup sends its own request when it comes
            return
        self._prefetched[server] = (kjt, self.lookup_async(server, kjt, max_staleness))

    def finish_lookup(self, fut: torch.futures.Future, server: int) -> torch.Tensor:
        """Wait for a lookup; returns ``(B, D_s)`` float32 on :meth:`rows_device`, a leaf that requires grad
        when grad is enabled (its gradient is what :meth:`push_async` sends)."""
        out = self._wait(fut, server, "lookup")
        if torch.is_grad_enabled():
            out.requires_grad_(True)
        return out

    def lookup(self, server: int, kjt: Any) -> torch.Tensor:
        """Blocking lookup on one server: pooled sums ``(B, D_s)`` of its shards (the ``rpc_sync`` baseline)."""
        return self.finish_lookup(self.lookup_async(server, kjt), server)

    def read_only(self) -> Any:
        """A context manager: while active, this client's lookups are read-only (:mod:`scheduling.ps.peek`: no step
        of a dynamic table, prefetches left alone; for held-out evaluation)."""
        return _peek.read_only(self)

    def push_async(self, server: int, kjt: Any, fetched: torch.Tensor, next_kjt: Any = None,
                   ) -> torch.futures.Future:
        """Start sending ``fetched.grad`` (the gradient of a :meth:`lookup` output) to ``server``.

        Each fetched tensor's gradient is sent exactly once: a second push of it raises.

        With ``next_kjt`` the same request also asks for the lookup of that later batch, which the server
        answers right after applying the push (an exact prefetch in one round trip instead of two); the
        next :meth:`lookup_async` of that object on ``server`` picks it up. The returned handle then
        completes with the lookup, not before.

        Raises:
            RuntimeError: ``fetched`` has no gradient (backward did not run) or was already pushed.
        """
        if getattr(fetched, "_fxdist_ps_pushed", False):
            raise RuntimeError(f"PSClient {self.name!r}: this lookup's gradient was already pushed to server "
                               f"{server}; gradients reach the server exactly once per step")
        if fetched.grad is None:
            raise RuntimeError(f"PSClient {self.name!r}: the fetched tensor of server {server} has no .grad; "
                               "run loss.backward() before pushing")
        grad = fetched.grad.detach()
        fetched._fxdist_ps_pushed = True  # type: ignore[attr-defined]
        fetched.grad = None
        return self.push_grad_async(server, kjt, grad, next_kjt)

    def push_grad_async(self, server: int, kjt: Any, grad: torch.Tensor, next_kjt: Any = None,
                        ) -> torch.futures.Future:
        """Start sending an explicit gradient ``(B, D_s)`` of server ``server``'s lookup output
        (``next_kjt``: as in :meth:`push_async`); it is divided by :attr:`grad_divisor` first.

        Raises:
            RuntimeError: in :meth:`read_only` mode (evaluation must not train)."""
        if self._read_only:
            raise RuntimeError(f"PSClient {self.name!r}: a push to server {server} while read_only() is active")
        grad = grad.detach() if self.grad_divisor == 1 else grad.detach() / self.grad_divisor
        grad = to_host(grad)
        if next_kjt is None:
            return self._call_async(server, "push", (self.name, self._wire(kjt), grad), "push", ordered=True,
                                    push=True)
        self._drop_prefetch(server)
        both = self._call_async(server, "push_lookup",
                                (self.name, self._wire(kjt), grad, self._wire(next_kjt), self.compress), "push", ordered=True,
                                push=True)
        # a Lookup is waited like a Future (scheduling.ps.device.Lookup)
        self._prefetched[server] = (next_kjt, self._lookup(both, next_kjt, index=1))  # type: ignore[assignment]
        return _Part(both, 0)  # type: ignore[return-value]

    def finish_push(self, fut: torch.futures.Future, server: int) -> int:
        """Wait for a push; returns the number of rows the server updated."""
        return self._wait(fut, server, "push")

    def push(self, server: int, kjt: Any, fetched: torch.Tensor) -> int:
        """Blocking :meth:`push_async` + :meth:`finish_push`."""
        return self.finish_push(self.push_async(server, kjt, fetched), server)

    def settle_push(self, fut: torch.futures.Future, server: int) -> int | None:
        """Wait for a push, unless it also carries the next step's lookup (``push_async(next_kjt=...)``):
        then leave it in flight (:meth:`defer_push`) until that lookup is fetched, and return None."""
        if isinstance(fut, _Part):
            self.defer_push(server, fut)
            return None
        return self.finish_push(fut, server)

    def defer_push(self, server: int, fut: torch.futures.Future) -> None:
        """Keep an in-flight push; the next :meth:`lookup_async` to ``server`` (or :meth:`flush`) waits it."""
        self._pending[server].append(fut)

    def drain(self, server: int, keep: int = 0) -> None:
        """Wait deferred pushes to ``server`` until at most ``keep`` are in flight."""
        queue = self._pending.get(server)
        while queue and len(queue) > keep:
            self.finish_push(queue.popleft(), server)

    def flush(self, drop_prefetched: bool = False) -> None:
        """Wait every deferred push and every prefetched lookup (so errors surface). The prefetched answers stay for
        the lookups they were started for (sent again, a dynamic table would count a second step), unless
        ``drop_prefetched``."""
        for server in list(self._pending):
            self.drain(server, 0)
        for server, (_, fut) in list(self._prefetched.items()):
            if drop_prefetched:
                self._drop_prefetch(server)
            else:
                self._wait(fut, server, "prefetch")

    # ---- pooling (scheduling.ps.pooling) -------------------------------------------------------------------
    def pool(self, kjt: Any, parts: Sequence[torch.Tensor]) -> Any:
        """Assemble per-server answers into torchrec's ``KeyedTensor`` ``(B, sum D)`` keyed by feature
        (:func:`scheduling.ps.pooling.pool`).

        ``parts`` are the answers of the servers :meth:`servers_for` lists, in that order.

        Raises:
            ValueError: another number of answers than servers.
        """
        return _pooling.pool(self, kjt, parts)

    def set_delays(self, fetch_delay_s: float = 0.0, push_delay_s: float = 0.0) -> None:
        """Set the added server-side latency per lookup / push on every server, in seconds (affects all
        clients of those servers; used to emulate network distance)."""
        for s in range(len(self.servers)):
            self._call(s, "set_delays", (fetch_delay_s, push_delay_s), "set_delays")

    def stats(self) -> list[dict[str, int]]:
        """Per server: number of lookups and pushes served, and its process id."""
        return [self._call(s, "stats", (), "stats") for s in range(len(self.servers))]

    def dynamic_stats(self) -> dict[str, dict[str, int]]:
        """Per dynamic table of this client, its counters (``DynamicTable.stats()``: ``rows``, ``capacity``,
        ``inserts``, ``admitted``, ``evictions``, ``expired``, ``rejected``, ...), asked of every server holding
        one (a stats-only request, :func:`scheduling.ps.server_stats.dynamic_stats`; no copy of the tables, unlike
        :meth:`server_states`). Waits this client's pushes first."""
        self.flush()
        servers = sorted({sp.server for sp in self.shards if sp.table.dynamic is not None})
        futs = [(s, self._call_async(s, "dynamic_stats", (self.name,), "dynamic_stats")) for s in servers]
        out: dict[str, dict[str, int]] = {}
        for s, fut in futs:
            for table, stats in self._wait(fut, s, "dynamic_stats").items():  # table-wise: one server per table
                out[table] = stats
        return out

    def track_changes(self) -> None:
        """Every server starts (or restarts) recording the rows it changes in this client's tables
        (:mod:`scheduling.ps.changes`); :meth:`take_changes` reads them. Waits this client's pushes first."""
        self.flush()
        futs = [self._call_async(s, "changes", (self.name, True), "track_changes") for s in range(len(self.servers))]
        for s, fut in enumerate(futs):
            self._wait(fut, s, "track_changes")

    def take_changes(self) -> dict[str, dict[str, torch.Tensor]]:
        """The rows the servers changed in this client's tables since :meth:`track_changes` or the previous call,
        and clear their records: per table name ``{"rows": (K,) int64 global rows (ascending), "values": (K, D)
        float32}``, a dynamic table's with ``"ids"``, ``"slots"`` ``(K',)`` (ids now at slots whose id changed)
        and ``"evicted"`` ``(E,)`` (ids no longer held); its rows are slots. Only changed rows travel. Waits this
        client's pushes first (not the other trainers': the caller orders them, e.g. with a barrier).

        Raises:
            ValueError: a server does not track this client's tables (:meth:`track_changes` first; a restarted
                server tracks nothing).
        """
        self.flush()
        futs = [self._call_async(s, "changes", (self.name,), "take_changes") for s in range(len(self.servers))]
        parts: dict[str, list[dict[str, torch.Tensor]]] = {}
        for s, fut in enumerate(futs):
            for entry in self._wait(fut, s, "take_changes").values():
                parts.setdefault(entry.pop("table"), []).append(entry)
        out = {}
        for table, shards in parts.items():
            if len(shards) == 1:
                out[table] = shards[0]
                continue
            rows = torch.cat([p["rows"] for p in shards])   # row-wise shards: disjoint rows
            rows, order = torch.sort(rows)
            out[table] = {"rows": rows, "values": torch.cat([p["values"] for p in shards])[order]}
        return out

    def stop_servers(self, timeout_s: float = 2.0) -> None:
        """Ask every server to leave the group (their ``start_server(block=True)`` returns); best effort.
        Nothing with the ``ray`` transport (the actors' owner ends them)."""
        self.transport.stop(timeout_s)

    def close(self, shutdown_rpc: bool = False, stop_servers: bool = False, flush: bool = True) -> None:
        """Unregister the client (after waiting deferred pushes when ``flush``); optionally stop the servers
        and leave the RPC group (non-graceful: see :func:`scheduling.ps.stop_server`)."""
        try:
            if flush:
                self.flush(drop_prefetched=True)
        finally:
            with _CLIENTS_LOCK:
                if _CLIENTS.get(self.name) is self:
                    del _CLIENTS[self.name]
            if stop_servers:
                self.stop_servers()
            if shutdown_rpc:
                from torch.distributed import rpc

                rpc.shutdown(graceful=False)
