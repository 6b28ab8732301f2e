"""Many embedding modules, several trainers, one server: no request waiting for the step order holds a thread.

The hang this guards against: with more embedding modules on one server than its 16 worker threads and 2 trainers, training hung:
every thread was held by a request waiting at the step barrier, so the push that would release them was
never served. Here 60 modules (``nn.EmbeddingBag`` and ``nn.Embedding``) go to 1 server shared by 4 trainers,
on both transports, with the default thread count; the trainers must finish within the clients' timeout and
train exactly like synchronous data-parallel SGD on local tables (the reference, computed here). A lower-level
test parks many waiting requests with 2 threads in all.
"""

from __future__ import annotations

import asyncio
import functools
import multiprocessing as mp
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
import torch
from torch import nn

from scheduling.ps import ordering
from scheduling.ps.transport.ports import free_port
from tests.scheduling._group import leave_one_server_group, spawn_and_collect

NUM_MODULES, WORLD, STEPS, BATCH, BAG, LR = 60, 4, 3, 4, 3, 0.5


class ManyTables(nn.Module):
    """60 small tables, every fifth an ``nn.Embedding`` (one id per sample), the others sum-pooled bags of
    ``BAG`` ids; a fixed projection (a buffer: nothing dense to train) to one score per sample."""

    def __init__(self) -> None:
        super().__init__()
        self.tables = nn.ModuleList(nn.Embedding(10 + i, 4) if i % 5 == 0 else nn.EmbeddingBag(10 + i, 4, mode="sum")
                                    for i in range(NUM_MODULES))
        self.register_buffer("proj", 0.05 * torch.linspace(-1.0, 1.0, 4 * NUM_MODULES).unsqueeze(1))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:   # ids (B, NUM_MODULES, BAG) -> (B,)
        outs = []
        for i, table in enumerate(self.tables):
            outs.append(table(ids[:, i, 0]) if i % 5 == 0 else table(ids[:, i]))
        return (torch.cat(outs, dim=1) @ self.proj).squeeze(1)


def _model() -> nn.Module:
    torch.manual_seed(0)
    return ManyTables()


def _batches(rank: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(1000 + rank)
    out = []
    for _ in range(STEPS):
        ids = torch.stack([torch.randint(0, 10 + i, (BATCH, BAG), generator=gen) for i in range(NUM_MODULES)], 1)
        out.append((ids, torch.randn(BATCH, generator=gen)))
    return out


def _loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return ((out - target) ** 2).mean()


def _reference() -> tuple[list[list[float]], dict[str, torch.Tensor]]:
    """Synchronous data-parallel SGD on local tables: every trainer's step-k loss at the same weights, then
    each trainer's gradient, divided by the trainer count, applied in rank order (the servers' step order,
    row-wise SGD)."""
    model = _model()
    data = [_batches(r) for r in range(WORLD)]
    losses: list[list[float]] = [[] for _ in range(WORLD)]
    for step in range(STEPS):
        grads = []
        for r in range(WORLD):
            model.zero_grad()
            loss = _loss(model(data[r][step][0]), data[r][step][1])
            loss.backward()
            losses[r].append(loss.item())
            grads.append([p.grad.clone() for p in model.tables.parameters()])
        with torch.no_grad():
            for g in grads:
                for p, gp in zip(model.tables.parameters(), g):
                    p -= LR * (gp / WORLD)      # the servers' default grad_reduction="mean", as DDP
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items() if k.startswith("tables.")}


def _train(rank: int, servers: list[str], group: str, prefix: str, barrier: Any) -> dict[str, Any]:
    """One trainer: its tables on the servers (the ``parameter_servers`` pass), lookups started together
    (``async_rpc``), pushes from backward hooks."""
    import fxdist
    import scheduling
    from scheduling import placement

    torch.set_num_threads(1)
    ps = functools.partial(scheduling.parameter_servers, optimizer="sgd", lr=LR, servers=servers, client=prefix,
                           rank=rank, world_size=WORLD, group=group, timeout_s=60.0, verbose=False,
                           group_tables=False)    # 60 clients, the case that deadlocked (grouped: 2)
    if rank != 0:
        barrier.wait()                      # rank 0 has created the tables
    gm = fxdist.optimize(_model(), passes=(ps, "async_rpc"))
    if rank == 0:
        barrier.wait()
    try:
        losses = []
        for ids, target in _batches(rank):
            loss = _loss(gm(ids), target)
            loss.backward()
            losses.append(loss.item())
        placement.flush(gm)
        barrier.wait()                      # every trainer's last pushes are applied
        moved = len(placement.client_names(gm))
        tables = {k: v.tolist() for k, v in placement.table_state_dict(gm).items()} if rank == 0 else None
        return {"losses": losses, "tables": tables, "moved": moved}
    finally:
        placement.close(gm)


def _check(results: dict[int, dict[str, Any]]) -> None:
    losses, tables = _reference()
    assert results[0]["moved"] == NUM_MODULES
    for rank in range(WORLD):
        torch.testing.assert_close(results[rank]["losses"], losses[rank], rtol=1e-5, atol=1e-6)
    got = {k: torch.tensor(v) for k, v in results[0]["tables"].items()}
    assert got.keys() == tables.keys() and len(got) == NUM_MODULES
    start = _model().state_dict()
    for key in got:
        torch.testing.assert_close(got[key], tables[key], rtol=1e-5, atol=1e-6)
    assert sum(not torch.equal(got[k], start[k]) for k in got) == NUM_MODULES    # every table trained


# ---- torch_rpc: 1 server process and 4 trainer processes ---------------------------------------------------
def _server_main(rank: int, world: int, port: int) -> None:
    from scheduling.ps import start_server

    start_server("ps0", rank, world, master_port=port, timeout_s=60)   # default num_worker_threads (16)


def _rpc_trainer_main(rank: int, port: int, group: str, barrier: Any, queue: Any) -> None:
    from scheduling.ps import init_trainer

    init_trainer(f"trainer{rank}", rank, WORLD + 1, master_port=port, timeout_s=60)
    try:
        queue.put((rank, _train(rank, ["ps0"], group, "many", barrier)))
    except BaseException as e:
        queue.put((rank, {"error": f"{type(e).__name__}: {e}"}))
        raise
    finally:
        leave_one_server_group(rank)


@pytest.mark.timeout(400)
def test_sixty_modules_four_trainers_one_server_torch_rpc():
    ctx = mp.get_context("spawn")
    queue, barrier = ctx.Queue(), ctx.Barrier(WORLD, timeout=120)
    port = free_port()
    targets = [(_server_main, (WORLD, WORLD + 1, port))]
    targets += [(_rpc_trainer_main, (r, port, "g-rpc", barrier, queue)) for r in range(WORLD)]
    results = spawn_and_collect(ctx, targets, queue, WORLD, timeout_s=300)
    errors = {r: res["error"] for r, res in results.items() if "error" in res}
    assert not errors, errors
    _check(results)


# ---- ray: 1 server actor and 4 trainer tasks ---------------------------------------------------------------
class _RayBarrier:
    """A reusable barrier of ``n`` parties as an asyncio Ray actor."""

    def __init__(self, n: int) -> None:
        self.n, self.arrived, self.event = n, 0, asyncio.Event()

    async def wait(self) -> None:
        event = self.event
        self.arrived += 1
        if self.arrived == self.n:
            self.arrived, self.event = 0, asyncio.Event()
            event.set()
        await asyncio.wait_for(event.wait(), 120)


class _BarrierClient:
    def __init__(self, actor: Any) -> None:
        self.actor = actor

    def wait(self) -> None:
        import ray

        ray.get(self.actor.wait.remote(), timeout=150)


def _ray_trainer(rank: int, server: Any, barrier: Any) -> dict[str, Any]:
    from scheduling.ps.transport.ray_transport import register_servers

    register_servers({"ps0": server})
    return _train(rank, ["ps0"], "g-ray", "many", _BarrierClient(barrier))


@pytest.mark.timeout(400)
def test_sixty_modules_four_trainers_one_server_ray(local_ray):
    from scheduling.ps.transport.ray_transport import kill_actors, start_actors

    ray = local_ray
    (server,) = start_actors(["ps0"])                     # default num_worker_threads (16)
    barrier = ray.remote(num_cpus=0)(_RayBarrier).remote(WORLD)
    train = ray.remote(num_cpus=0, max_retries=0)(_ray_trainer)
    refs = [train.remote(r, server, barrier) for r in range(WORLD)]
    results = dict(enumerate(ray.get(refs, timeout=300)))
    kill_actors([server, barrier], ["ps0"])
    _check(results)


# ---- lower level: waiting requests hold no thread ------------------------------------------------------------
def test_waiting_requests_are_parked_not_run_on_the_submitting_threads():
    """60 requests that must wait, started from 2 threads in all: every start returns at once; the pushes
    that arrive later release them, in step order."""
    pool = ThreadPoolExecutor(2)                  # the "server threads"
    results: dict[tuple[int, str], Any] = {}
    finished = threading.Semaphore(0)
    log: dict[int, list[str]] = {g: [] for g in range(30)}

    def done_as(name: tuple[int, str]) -> ordering.Done:
        def done(value: Any, error: BaseException | None) -> None:
            results[name] = error if error is not None else value
            finished.release()
        return done

    def start(g: int, rank: int, seq: int, count: int, kind: str) -> None:
        order = (f"parked-{g}-{rank}", seq, 10.0, (f"parked-group-{g}", rank, 2, count))
        work = {"push": lambda: log[g].append(f"push{rank}")} if kind == "push" else {"lookup": lambda: list(log[g])}
        ordering.submit(order, kind, "psT", done_as((g, f"{kind}{rank}")), **work)

    before = ordering.parked_requests()
    try:
        # trainer 0 of each of 30 groups: its push waits for trainer 1's, its next lookup for its push
        starts = [pool.submit(start, g, 0, seq, count, kind)
                  for g in range(30) for seq, count, kind in ((0, 0, "push"), (1, 1, "lookup"))]
        for s in starts:
            s.result(timeout=10)                   # returned without waiting
        assert ordering.parked_requests() - before == 60 and not results
        for g in range(30):                        # trainer 1's pushes release them
            pool.submit(start, g, 1, 0, 0, "push").result(timeout=10)
        for _ in range(90):
            assert finished.acquire(timeout=10), f"only {len(results)} of 90 requests finished"
    finally:
        pool.shutdown(wait=False, cancel_futures=True)
    for g in range(30):
        assert log[g] == ["push0", "push1"]        # rank order within the step
        assert results[(g, "lookup0")] == ["push0", "push1"]   # the lookup after 1 push sees both trainers'


def test_a_wait_past_the_timeout_fails_with_what_it_waited_for():
    errors: list[BaseException | None] = []
    got = threading.Event()

    def done(value: Any, error: BaseException | None) -> None:
        errors.append(error)
        got.set()

    start = time.monotonic()
    ordering.submit(("late-0", 0, 0.3, ("late-group", 0, 2, 0)), "push", "psT", done, push=lambda: None)
    assert got.wait(10) and time.monotonic() - start < 5
    assert isinstance(errors[0], RuntimeError)
    assert str(errors[0]) == ("server psT: push #0 of trainer 0 waited 0.3 s for push #0 of trainer(s) [1]; did a "
                              "trainer of the group stop or run fewer steps than the others?")


@pytest.mark.timeout(300)
@pytest.mark.parametrize("transport", ["torch_rpc", "ray"])
def test_a_server_with_two_threads_serves_forty_waiting_requests(transport):
    """Raw ordered requests of 20 two-trainer groups to a server with ``num_worker_threads=2``: trainer 0's
    40 requests all wait for trainer 1, which comes later; every request is answered, in step order."""
    if transport == "ray":
        pytest.importorskip("ray")

    from scheduling.ps import LocalCluster, PSClient
    from scheduling.ps.shard_plan import TableSpec

    groups, timeout_s = 20, 20.0
    with LocalCluster(1, timeout_s=30, transport=transport, num_worker_threads=2) as cluster:
        client = PSClient([TableSpec("t", groups, 4, ("f",))], cluster.server_names, optimizer="sgd",
                          optimizer_kwargs={"lr": 1.0}, name=f"raw-{transport}", seed=0)
        start = client.state_dict()["t.weight"]
        tag = uuid.uuid4().hex

        def send(g: int, rank: int, method: str, seq: int, count: int) -> Any:
            batch = (("f",), torch.tensor([g]), torch.tensor([1]), None)
            args = (client.name, batch) + ((torch.ones(1, 4),) if method == "push" else (None,))
            order = (f"{tag}-{g}-{rank}", seq, timeout_s, (f"{tag}-group-{g}", rank, 2, count))
            return client.transport.call_async(0, method, (*args, order), timeout_s + 10)

        first = [(g, send(g, 0, "push", 0, 0), send(g, 0, "lookup", 1, 1)) for g in range(groups)]
        time.sleep(1.0)
        assert not any(push.done() or lookup.done() for _, push, lookup in first)   # they wait for trainer 1
        second = [(g, send(g, 1, "push", 0, 0), send(g, 1, "lookup", 1, 1)) for g in range(groups)]
        for g, push, lookup in first + second:
            assert push.wait() == 1
            expected = start[g] - 1.0 - 1.0            # both trainers' pushes, one SGD step each
            torch.testing.assert_close(lookup.wait(), expected.unsqueeze(0), rtol=0, atol=0)
        client.close()
