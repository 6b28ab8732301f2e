"""Process bodies for the tests of a server group: one parameter server and W trainers (DDP over gloo), spawned
as separate processes (functions sent to spawned processes must be importable): test_ps_group.py's
``server_main``/``trainer_main``, and ``one_server_main``/``ddp_trainer_main`` (a model's tables moved by the
``parameter_servers`` pass, the rest under DDP) for test_placement_local.py and test_table_grad_reduction.py."""

from __future__ import annotations

import itertools
import random
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

TABLES = [("t0", 40, 4, ("f0",)), ("t1", 30, 4, ("f1", "f2"))]
DYNAMIC = {"t0": (8, 1, None), "t1": (6, 2, 4)}
"""A run's tables as dynamic ones (``runs`` entries with a fifth element True): (capacity, min_count, expire_steps)
small enough for the batches' 30 ids to evict."""


class TinyModel(nn.Module):
    """Dense linear over [dense | pooled embeddings]; the embedding gradients go to the servers from
    backward hooks (``ps_push_in_backward``), as in the job's DLRM."""

    def __init__(self, client: str) -> None:
        super().__init__()
        from scheduling.ps import PSEmbeddingBagCollection

        self.ebc = PSEmbeddingBagCollection(client)
        self.client = client
        self.linear = nn.Linear(3 + 12, 1)

    def forward(self, dense: torch.Tensor, kjt: Any) -> torch.Tensor:
        from scheduling.ps import ops

        parts = self.ebc.lookup(kjt)
        parts = [ops.ps_push_in_backward(self.client, s, kjt, p) for s, p in zip(self.ebc.server_ids, parts)]
        kt = self.ebc.pool(kjt, parts)
        return self.linear(torch.cat([dense, kt.values()], dim=1)).squeeze(1)


def batches(rank: int, steps: int, batch_size: int = 8) -> list[tuple[torch.Tensor, Any, torch.Tensor]]:
    from torchrec import KeyedJaggedTensor

    gen = torch.Generator().manual_seed(100 + rank)
    out = []
    for _ in range(steps):
        lengths = torch.randint(0, 3, (3 * batch_size,), generator=gen)
        values = torch.randint(0, 30, (int(lengths.sum()),), generator=gen)
        kjt = KeyedJaggedTensor(keys=["f0", "f1", "f2"], values=values, lengths=lengths)
        out.append((torch.randn(batch_size, 3, generator=gen), kjt, torch.rand(batch_size, generator=gen).round()))
    return out


def server_main(rank: int, world: int, rpc_port: int) -> None:
    from scheduling.ps import start_server

    start_server(f"ps{rank - 2}", rank, world, master_port=rpc_port, timeout_s=60)


def _train(name: str, rank: int, world: int, schedule: str, sync: bool, jitter_s: float, steps: int,
           servers: list[str], group: str, dynamic: bool = False) -> dict[str, Any]:
    import fxdist
    from scheduling import lookahead
    from scheduling.ps import PSClient
    from scheduling.ps.dynamic import DynamicSpec
    from scheduling.ps.shard_plan import TableSpec

    specs = [TableSpec(n, DYNAMIC[n][0], dim, feats, dynamic=DynamicSpec(*DYNAMIC[n])) if dynamic
             else TableSpec(n, rows, dim, feats) for n, rows, dim, feats in TABLES]
    client = PSClient(specs, servers, sharding="table_wise" if dynamic else "row_wise", name=name, seed=7,
                      configure=(rank == 0),
                      optimizer="rowwise_adagrad", optimizer_kwargs={"lr": 0.1}, rank=rank if sync else 0,
                      world_size=world if sync else 1, group=group if sync else None)
    dist.barrier()
    torch.manual_seed(0)
    model = TinyModel(name)
    module = model if schedule == "eager" else fxdist.optimize(model, passes=("async_rpc_prefetch",))
    ddp = nn.parallel.DistributedDataParallel(module)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    rng = random.Random(rank * 31 + len(schedule))
    losses = []
    for (dense, kjt, labels), nxt in lookahead(batches(rank, steps)):
        kwargs = {"next_kjt": nxt[1]} if schedule != "eager" and nxt is not None else {}
        loss = nn.functional.binary_cross_entropy_with_logits(ddp(dense, kjt, **kwargs), labels)
        opt.zero_grad()
        loss.backward()
        if jitter_s:
            time.sleep(rng.random() * jitter_s)  # trainers reach the servers in varying order
        opt.step()
        losses.append(loss.item())
    client.flush()
    dist.barrier()
    tables = {k: v.tolist() for k, v in client.state_dict().items()} if rank == 0 else None  # no shared memory
    if dynamic and rank == 0:  # the id maps, last-seen steps, candidates and counters too, and the stats request
        for states in client.server_states():
            for key, entry in states.items():
                tables[f"{key}.dynamic"] = {k: v.tolist() if isinstance(v, torch.Tensor) else v
                                            for k, v in entry["dynamic"].items()}
        tables["dynamic_stats"] = client.dynamic_stats()
    dist.barrier()
    client.close()
    return {"losses": losses, "tables": tables, "hits": client.prefetch_hits}


def trainer_main(rank: int, world: int, rpc_port: int, pg_port: int, num_servers: int, runs: list[tuple],
                 steps: int, queue: Any, in_trainers: str | None = None) -> None:
    """Trainer ``rank`` of ``world``; the servers are ``num_servers`` processes ``ps<i>``, or with
    ``in_trainers`` (``"inline"`` or ``"thread"``: where a trainer's own requests run) the trainers themselves
    (``serve_in_trainer``: server ``i`` is ``trainer<i>``)."""
    from scheduling.ps import init_trainer, serve_in_trainer, stop_serving, trainer_servers

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{pg_port}", rank=rank, world_size=world)
    if in_trainers:
        serve_in_trainer(f"trainer{rank}", name=f"ps{rank}", own_requests=in_trainers)
        num_servers = 0
    init_trainer(f"trainer{rank}", rank, world + num_servers, master_port=rpc_port, timeout_s=60)
    servers = trainer_servers(world) if in_trainers else [f"ps{i}" for i in range(num_servers)]
    box = [f"group-{time.time_ns()}"]
    dist.broadcast_object_list(box, src=0)
    results = {}
    try:
        for name, schedule, sync, jitter_s, *dynamic in runs:
            results[name] = _train(name, rank, world, schedule, sync, jitter_s, steps, servers, box[0], *dynamic)
    finally:
        if rank == 0 and not in_trainers:  # servers in trainers end with their trainers
            from torch.distributed import rpc

            from scheduling.ps import server as srv

            for s in servers:
                rpc.rpc_sync(s, srv._rpc_stop, ())
        from torch.distributed import rpc

        rpc.shutdown(graceful=False)
        stop_serving()
        dist.destroy_process_group()
    queue.put((rank, results))


def spawn_and_collect(ctx: Any, targets: Sequence[tuple[Callable, tuple]], queue: Any, count: int,
                      timeout_s: float = 240.0) -> dict[Any, Any]:
    """Start each ``(target, args)`` as a process of the multiprocessing context ``ctx``, read ``count``
    ``(key, value)`` items from ``queue`` (within ``timeout_s`` each), then join the processes (killing those
    still alive after 20 s). Returns ``{key: value}``."""
    procs = [ctx.Process(target=target, args=args, daemon=True) for target, args in targets]
    for p in procs:
        p.start()
    try:
        return dict(queue.get(timeout=timeout_s) for _ in range(count))
    finally:
        for p in procs:
            p.join(20)
            if p.is_alive():
                p.kill()


def one_server_main(port: int, world: int) -> None:
    """The server ``ps0`` of a group of ``world`` trainers (RPC rank ``world``)."""
    from scheduling.ps import start_server

    start_server("ps0", world, world + 1, master_port=port, timeout_s=60)


def ddp_trainer_main(rank: int, world: int, port: int, ddp_port: int, queue: Any, make_pass: Callable[..., Any],
                     make_model: Callable[[], nn.Module], batches: Callable[[int], list[tuple]],
                     loss: Callable[..., torch.Tensor], lr: float, variants: Sequence[Any] | None = None) -> None:
    """Trainer ``rank`` of ``world`` against :func:`one_server_main`: the pass ``make_pass(rank)`` moves the
    model's tables (rank 0 creates them first), the rest trains under DDP over gloo with SGD(``lr``) on
    ``batches(rank)`` (``(*inputs, target)``, ``loss(out, target)``). Puts ``(rank, state)`` on ``queue``: the
    dense state dict and the tables as lists, ``"local"`` the modules the pass kept on the trainer; or
    ``(rank, {"error": ...})``. With ``variants``, one such training per variant ``v``, one after the other in the
    same group, with the pass ``make_pass(v, rank)`` (its own client names and group key), and ``(rank, {v: state})``
    on ``queue``."""

    from scheduling.ps import init_trainer

    torch.set_num_threads(1)
    init_trainer(f"trainer{rank}", rank, world + 1, master_port=port, timeout_s=60)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{ddp_port}", rank=rank, world_size=world)
    try:
        if variants is None:
            out = _ddp_train(rank, make_pass(rank), make_model, batches, loss, lr)
        else:
            out = {v: _ddp_train(rank, make_pass(v, rank), make_model, batches, loss, lr) for v in variants}
        queue.put((rank, out))
    except BaseException as e:
        queue.put((rank, {"error": f"{type(e).__name__}: {e}"}))
        raise
    finally:
        dist.destroy_process_group()
        leave_one_server_group(rank)


def _ddp_train(rank: int, the_pass: Any, make_model: Callable[[], nn.Module], batches: Callable[[int], list[tuple]],
               loss: Callable[..., torch.Tensor], lr: float) -> dict[str, Any]:
    """One training of :func:`ddp_trainer_main`; returns its state (the tables closed on the trainer)."""
    import fxdist
    from scheduling import placement

    if rank != 0:
        dist.barrier()                       # rank 0 has created the tables
    gm = fxdist.optimize(make_model(), passes=(the_pass,))
    if rank == 0:
        dist.barrier()
    ddp = nn.parallel.DistributedDataParallel(gm)
    opt = torch.optim.SGD(ddp.parameters(), lr=lr)
    for *inputs, target in batches(rank):
        opt.zero_grad()
        loss(ddp(*inputs), target).backward()
        opt.step()
    placement.flush(gm)
    dist.barrier()                           # every trainer's last pushes are applied
    state: dict[str, Any] = {k: v.clone().tolist() for k, v in gm.state_dict().items()}
    state.update({k: v.tolist() for k, v in placement.table_state_dict(gm).items()})  # no shared memory
    state["local"] = [x["module"] for x in gm.meta["fxdist"]["placement"].get("local", [])]
    placement.close(gm)
    return state


def leave_one_server_group(rank: int) -> None:
    """A trainer's exit from a group with the server ``ps0``: rank 0 stops the server (5 s at most; a server
    already gone is fine), then this process leaves RPC without waiting for the others."""
    from torch.distributed import rpc

    from scheduling.ps import server as srv

    if rank == 0:
        try:
            rpc.rpc_sync("ps0", srv._rpc_stop, (), timeout=5)
        except RuntimeError:
            pass
    rpc.shutdown(graceful=False)


WORLD, NUM_SERVERS, STEPS = 2, 2, 8
"""The groups of :func:`run_group`: 2 DDP trainers, 2 servers (separate processes or in the trainers), 8 steps."""

RUNS = [("eager", "eager", True, 0.0), ("prefetch", "prefetch", True, 0.0),
        ("eager_jitter", "eager", True, 0.02), ("prefetch_jitter", "prefetch", True, 0.02)]
"""Fixed tables trained eagerly and with ``async_rpc_prefetch``, with and without random delays (``runs`` entries
of :func:`trainer_main`: name, schedule, sync, jitter_s)."""

DYNAMIC_RUNS = [(f"dyn_{s}{'_jitter' if j else ''}", s, True, j, True)
                for s, j in itertools.product(("eager", "prefetch"), (0.0, 0.02))]
"""The same four schedules and timings with the tables as :data:`DYNAMIC` ones."""

GROUP_RUNS: dict[str | None, list[tuple]] = {None: RUNS + DYNAMIC_RUNS, "inline": RUNS + DYNAMIC_RUNS,
                                             "thread": RUNS}
"""What :func:`run_group` trains per place of the servers (None: separate processes; ``"inline"`` / ``"thread"``:
in the trainers), shared by test_ps_group.py and test_ps_in_trainers.py (each group is spawned once a session:
``trained_groups`` in conftest.py)."""


def run_group(in_trainers: str | None) -> dict[int, dict[str, Any]]:
    """Spawn :data:`WORLD` trainers (and, with ``in_trainers`` None, :data:`NUM_SERVERS` server processes), train
    ``GROUP_RUNS[in_trainers]`` one after the other for :data:`STEPS` steps. Returns ``{rank: {run name: {"losses",
    "tables" (rank 0), "hits"}}}``."""
    import multiprocessing as mp

    from scheduling.ps.transport.ports import free_port

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    rpc_port, pg_port = free_port(), free_port()
    runs = GROUP_RUNS[in_trainers]
    targets = [] if in_trainers else [(server_main, (WORLD + i, WORLD + NUM_SERVERS, rpc_port))
                                      for i in range(NUM_SERVERS)]
    targets += [(trainer_main, (r, WORLD, rpc_port, pg_port, NUM_SERVERS, runs, STEPS, queue, in_trainers))
                for r in range(WORLD)]
    return spawn_and_collect(ctx, targets, queue, WORLD)


def assert_in_trainers_train_as_separate(found: dict, runs: Sequence[tuple], world: int, steps: int) -> None:
    """``found[None]`` (separate servers) vs ``found["inline"]`` / ``found["thread"]`` (servers in the trainers):
    every run's per-rank losses equal (and equal to the eager run's), all prefetches hit, the tables equal."""
    separate = found[None]
    assert separate[0]["eager"]["losses"] != separate[1]["eager"]["losses"]  # the trainers saw different batches
    for (name, schedule, _, _), own in itertools.product(runs, ("inline", "thread")):
        inside = found[own]
        for rank in range(world):
            assert len(inside[rank][name]["losses"]) == steps
            assert inside[rank][name]["losses"] == separate[rank][name]["losses"], (name, own, rank)
            assert inside[rank][name]["losses"] == separate[rank]["eager"]["losses"], (name, own, rank)
            if schedule == "prefetch":
                assert inside[rank][name]["hits"] == world * (steps - 1)
        tables = inside[0][name]["tables"]
        assert tables.keys() == separate[0][name]["tables"].keys()
        for key, value in tables.items():
            assert value == separate[0][name]["tables"][key], (name, own, key)
