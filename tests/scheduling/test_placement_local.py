"""Tables that stay on the trainer: ``plan={...: "local"}`` and ``local_below_rows`` of the ``parameter_servers``
pass (:func:`scheduling.placement.plan.split_local`), against real servers on loopback.

Differential: a model with a 20-row positional ``nn.Embedding`` (indexed by ``torch.arange``) kept local and its
other tables on a server trains as the same model with every table local, with one trainer, and with two trainers
under DDP (the local table's gradient all-reduced with the dense part's) as one process on the global batch.
"""

from __future__ import annotations

import functools
import io
import multiprocessing as mp
from typing import Any

import pytest
import torch
from torch import nn
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig

import fxdist
import scheduling
from scheduling import placement
from scheduling.placement.plan import TableInfo, split_local
from scheduling.ps import LocalCluster
from scheduling.ps.shard_plan import TableSpec
from scheduling.ps.transport.ports import free_port
from tests.scheduling._group import ddp_trainer_main, one_server_main, spawn_and_collect

LR, STEPS, BATCH, L, WORLD = 0.5, 4, 6, 5, 2


class WithPositions(nn.Module):
    """Item ids ``(B, L)`` plus a position row each (``self.pos(torch.arange(L))``, 20 rows), and a bag of user
    ids ``(B, 3)`` (50 rows): -> ``(B,)``."""

    def __init__(self) -> None:
        super().__init__()
        self.pos = nn.Embedding(20, 4)
        self.item = nn.Embedding(40, 4)
        self.user = nn.EmbeddingBag(50, 4, mode="sum")
        self.head = nn.Linear(8, 1)

    def forward(self, users: torch.Tensor, items: torch.Tensor) -> torch.Tensor:
        seq = (self.item(items) + self.pos(torch.arange(L))).sum(dim=1)
        return self.head(torch.cat([seq, self.user(users)], dim=1)).squeeze(1)


def _model() -> nn.Module:
    torch.manual_seed(0)
    return WithPositions()


def _batches(rank: int = 0) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(31 + rank)
    return [(torch.randint(0, 50, (BATCH, 3), generator=gen), torch.randint(0, 40, (BATCH, L), generator=gen),
             torch.randn(BATCH, generator=gen)) for _ in range(STEPS)]


def _loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return ((out - target) ** 2).mean()


def _reference(data: list[list[tuple]]) -> dict[str, torch.Tensor]:
    """Every table local, one process, ``torch.optim.SGD`` on the batches of every trainer at once."""
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    for step in range(STEPS):
        users, items, target = (torch.cat([d[step][i] for d in data]) for i in range(3))
        opt.zero_grad()
        _loss(model(users, items), target).backward()
        opt.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _pass(**options: Any):
    return functools.partial(scheduling.parameter_servers, optimizer="sgd", lr=LR, group_tables=False, **options)


@pytest.fixture(scope="module")
def cluster():
    with LocalCluster(1, timeout_s=30) as cl:
        yield cl


def test_a_table_the_plan_keeps_local_stays_on_the_trainer_and_trains_as_local(cluster):
    out = io.StringIO()
    gm = fxdist.optimize(_model(), passes=(_pass(plan={"pos": "local"}, file=out), "async_rpc_prefetch"))
    try:
        assert isinstance(gm.get_submodule("pos"), nn.Embedding)          # still in the module, a parameter of it
        assert any(p is gm.pos.weight for p in gm.parameters())
        meta = gm.meta["fxdist"]["placement"]
        assert [t["module"] for t in meta["tables"]] == ["item", "user"]
        assert meta["local"] == [{"module": "pos", "rows": [20], "reason": "plan['pos'] = 'local'"}]
        assert out.getvalue().splitlines()[0] == "parameter_servers plan: 2 tables on 1 server, optimizer sgd (lr=0.5)"
        assert out.getvalue().splitlines()[-1] == "  kept local: pos (plan['pos'] = 'local')"
        opt = torch.optim.SGD(gm.parameters(), lr=LR)
        data = _batches()
        for (users, items, target), nxt in scheduling.lookahead(data):
            opt.zero_grad()
            _loss(gm(users, items, next_users=nxt and nxt[0], next_items=nxt and nxt[1]), target).backward()
            opt.step()
        placement.flush(gm)
        # the trace keeps torch.arange(L) as a buffer _tensor_constant0 of gm: not a weight
        got = {**{k: v for k, v in gm.state_dict().items() if not k.startswith("_tensor_constant")},
               **placement.table_state_dict(gm)}
        want = _reference([data])
        assert got.keys() == want.keys()
        for key in want:
            torch.testing.assert_close(got[key], want[key], rtol=1e-6, atol=1e-7)
        assert not torch.equal(got["pos.weight"], _model().pos.weight)     # trained, on the trainer
    finally:
        placement.close(gm)


def test_a_small_table_stays_local_by_default_and_the_printout_says_why(cluster):
    out = io.StringIO()
    gm = fxdist.optimize(_model(), passes=(_pass(local_below_rows=32, file=out),))
    try:
        assert [t["module"] for t in gm.meta["fxdist"]["placement"]["tables"]] == ["item", "user"]
        assert isinstance(gm.get_submodule("pos"), nn.Embedding)
        assert out.getvalue().splitlines()[-1] == "  kept local: pos (20 rows < local_below_rows=32)"
        assert gm.meta["fxdist"]["placement"]["plan_text"].splitlines()[-1] == (
            "  kept local: pos (20 rows < local_below_rows=32)")
    finally:
        placement.close(gm)
    # the plan places it: it moves whatever its size
    gm = fxdist.optimize(_model(), passes=(_pass(local_below_rows=32, plan={"pos": 0}, verbose=False),))
    try:
        assert [t["module"] for t in gm.meta["fxdist"]["placement"]["tables"]] == ["item", "pos", "user"]
        assert gm.meta["fxdist"]["placement"]["local"] == []
    finally:
        placement.close(gm)


def test_every_table_local_moves_nothing_and_prints_why(cluster):
    out = io.StringIO()
    gm = scheduling.parameter_servers(_model(), local_below_rows=100, file=out)
    assert out.getvalue().splitlines() == ["parameter_servers plan: no table on the servers",
                                           "  kept local: item (40 rows < local_below_rows=100)",
                                           "  kept local: pos (20 rows < local_below_rows=100)",
                                           "  kept local: user (50 rows < local_below_rows=100)"]
    assert gm.meta["fxdist"]["unchanged_reason"] == (
        "every embedding module stays on the trainer (3 by the plan or local_below_rows, 0 that cannot move)")
    assert placement.client_names(gm) == []


def _infos(module: str, sizes: dict[str, int]) -> list[TableInfo]:
    return [TableInfo(TableSpec(name, rows, 8, (name,)), module, f"{module}.embedding_bags.{name}")
            for name, rows in sizes.items()]


def test_split_local_rules_and_errors():
    ebc = _infos("ebc", {"t0": 3, "t1": 17})
    pos = [TableInfo(TableSpec("pos", 20, 8, ("pos",)), "pos", "pos")]
    modules = {"ebc": ebc, "pos": pos}
    assert split_local(modules, None) == ({}, {})
    assert split_local(modules, {"t1": "row_wise"}, 32) == ({"pos": "20 rows < local_below_rows=32"},
                                                              {"t1": "row_wise"})
    assert split_local(modules, None, 32) == ({"ebc": "2 tables of at most 17 rows < local_below_rows=32",
                                               "pos": "20 rows < local_below_rows=32"}, {})
    assert split_local(modules, {"ebc": "local"}) == ({"ebc": "plan['ebc'] = 'local'"}, {})
    assert split_local(modules, {"t0": "local", "t1": "local"}) == ({"ebc": "plan['t0'] = 'local'"}, {})
    assert split_local(modules, {"hidden.emb": "local"}, staying=["hidden"]) == ({}, {})
    with pytest.raises(ValueError, match=r"plan keeps ebc.embedding_bags.t0 of module 'ebc' local but not "
                                         r"ebc.embedding_bags.t1: a module moves as a whole; name the module "
                                         r"\(ebc = 'local'\)"):
        split_local(modules, {"t0": "local"})
    with pytest.raises(ValueError, match=r"plan\['posx'\] = 'local' names no embedding table of the model "
                                         r"\(ebc.embedding_bags.t0, ebc.embedding_bags.t1, pos, t0, t1\)"):
        split_local(modules, {"posx": "local"})


def test_the_builtin_dlrm_tables_all_move_under_the_default_threshold():
    """The job's DLRM keeps its 26 tables in one EBC: with per-feature sizes from the data some have a few rows,
    but the module moves as a whole, and it has large tables."""
    from jobs.config import JobConfig

    sizes = [2, 3, 4, 20000] + [1000] * 22
    tables = _infos("sparse_arch.embedding_bag_collection", {f"t_C{j + 1}": n for j, n in enumerate(sizes)})
    default = JobConfig().model.local_below_rows
    assert split_local({"sparse_arch.embedding_bag_collection": tables}, None, default) == ({}, {})


def test_bad_local_requests_are_clear_errors(cluster):
    with pytest.raises(ValueError, match=r"local_below_rows must be >= 0, got -1"):
        scheduling.parameter_servers(_model(), local_below_rows=-1, verbose=False)
    meta = EmbeddingBagCollection(tables=[EmbeddingBagConfig(name="t0", embedding_dim=4, num_embeddings=10,
                                                             feature_names=["f0"])], device=torch.device("meta"))
    with pytest.raises(ValueError, match=r"module 'ebc' stays on the trainer \(plan\['ebc'\] = 'local'\) but its "
                                         r"weights are on the meta device"):
        scheduling.parameter_servers(_EBCModel(meta), plan={"ebc": "local"}, verbose=False)


class _EBCModel(nn.Module):
    def __init__(self, ebc: nn.Module) -> None:
        super().__init__()
        self.ebc = ebc

    def forward(self, kjt):
        return self.ebc(kjt).values()


# ---- two trainers under DDP -------------------------------------------------------------------------------------
def _ddp_pass(rank: int):
    return _pass(servers=["ps0"], client="loc", rank=rank, world_size=WORLD, group="g-local", timeout_s=60.0,
                 verbose=False, local_below_rows=32)


@pytest.mark.timeout(300)
def test_a_local_table_trains_under_ddp_as_one_process_on_the_global_batch():
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port, ddp_port = free_port(), free_port()
    targets = [(one_server_main, (port, WORLD))] + [
        (ddp_trainer_main, (r, WORLD, port, ddp_port, queue, _ddp_pass, _model, _batches, _loss, LR))
        for r in range(WORLD)]
    results = spawn_and_collect(ctx, targets, queue, WORLD)
    assert not {r: res["error"] for r, res in results.items() if "error" in res}
    want = _reference([_batches(r) for r in range(WORLD)])
    start = _model().state_dict()
    for rank in range(WORLD):
        got = results[rank]
        assert got["local"] == ["pos"]
        for key in ("pos.weight", "head.weight", "head.bias"):      # DDP: the same on every trainer
            torch.testing.assert_close(torch.tensor(got[key]), want[key], rtol=1e-5, atol=1e-6)
        assert not torch.equal(torch.tensor(got["pos.weight"]), start["pos.weight"])
    for key in ("item.weight", "user.weight"):                     # on the server, averaged over the trainers
        torch.testing.assert_close(torch.tensor(results[0][key]), want[key], rtol=1e-5, atol=1e-6)
