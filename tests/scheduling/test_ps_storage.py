"""Reduced-precision row storage on the server: memory, lookups and training against fp32 storage."""

from __future__ import annotations

import pytest
import torch

from scheduling.ps.dynamic_native import scatter_rows
from scheduling.ps.server import PSServer
from scheduling.ps.shard_plan import TableSpec, plan_shards
from scheduling.ps.storage import HUGE_PAGE, empty_rows, make_store

TABLES = [TableSpec("a", 50, 16, ("fa",)), TableSpec("b", 30, 16, ("fb", "fc"))]
INIT = {"a": torch.randn(50, 16) * 0.1, "b": torch.randn(30, 16) * 0.1}


def _server(storage: str, optimizer: str = "sgd", fused: bool = True) -> PSServer:
    srv = PSServer("ps0")
    srv.configure("ns", plan_shards(TABLES, 1), 0, optimizer, {"lr": 0.5}, seed=1, init_weights=INIT,
                  storage=storage)
    if not fused:
        srv.fused["ns"] = None
    return srv


def _batch(seed: int, batch_size: int = 8):
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, 3, (3 * batch_size,), generator=gen)
    values = torch.randint(0, 30, (int(lengths.sum()),), generator=gen)
    return ("fa", "fb", "fc"), values, lengths.int(), None


@pytest.mark.parametrize("storage, ratio, atol", [("fp16", 2.0, 2e-3), ("fused8bit", 4 * 16 / (16 + 8), 2e-3)])
def test_reduced_storage_saves_memory_and_answers_close_to_fp32(storage, ratio, atol):
    full, small = _server("fp32"), _server(storage)
    assert full.memory()["rows"] == small.memory()["rows"] == 80
    assert full.memory()["bytes"] / small.memory()["bytes"] == pytest.approx(ratio)
    batch = _batch(0)
    exact = full.lookup("ns", batch)
    approx = small.lookup("ns", batch)
    assert approx.dtype == torch.float32 and approx.shape == exact.shape
    assert not torch.equal(approx, exact)
    torch.testing.assert_close(approx, exact, atol=atol * 3, rtol=0)  # up to 3 rows per bag
    state = small.state_dict("ns")                    # checkpoints hold float32 rows
    assert all(e["weight"].dtype == torch.float32 for e in state.values())
    copy = PSServer("ps1")
    copy.configure("ns", plan_shards(TABLES, 1), 0, "sgd", {"lr": 0.5}, seed=1, storage=storage)
    copy.load_state_dict(state)
    torch.testing.assert_close(copy.lookup("ns", batch), approx)


def test_fp16_fused_and_per_shard_paths_agree():
    fast, slow = _server("fp16", "rowwise_adagrad"), _server("fp16", "rowwise_adagrad", fused=False)
    for step in range(5):
        batch = _batch(step)
        out = fast.lookup("ns", batch)
        assert torch.equal(out, slow.lookup("ns", batch))
        grad = torch.randn_like(out)
        assert fast.push("ns", batch, grad) == slow.push("ns", batch, grad)
    for key, entry in fast.state_dict().items():
        assert torch.equal(entry["weight"], slow.state_dict()[key]["weight"])


def test_stochastic_rounding_keeps_updates_smaller_than_the_8bit_step():
    store = make_store("fused8bit", seed=0)
    rows = torch.linspace(-1, 1, 16).repeat(4, 1)             # quantization step 2/255 ~ 7.8e-3
    update = torch.zeros(4, 16)
    update[:, 5] = 1e-3                                        # one inner element: min and max stay put
    stored, nearest = store.encode(rows), store.encode(rows)
    idx = torch.arange(4)
    for _ in range(400):
        store.apply(stored, idx, update, lr=1.0)
        nearest = store.encode(store.decode(nearest) - update)  # FBGEMM's round-to-nearest each time
    moved = (store.decode(stored) - rows)[:, 5]
    assert moved.mean().item() == pytest.approx(-0.4, abs=0.05)
    assert torch.equal(store.decode(nearest), store.decode(store.encode(rows)))  # nearest lost every update


def test_training_with_reduced_storage_tracks_fp32_training():
    servers = {name: _server(name, "rowwise_adagrad") for name in ("fp32", "fp16", "fused8bit")}
    target = torch.randn(8, 48)
    for step in range(60):
        batch = _batch(step % 5)
        for srv in servers.values():
            out = srv.lookup("ns", batch)
            srv.push("ns", batch, 2 * (out - target) / out.numel())
    losses = {n: float(((s.lookup("ns", _batch(0)) - target) ** 2).mean()) for n, s in servers.items()}
    start = float(((_server("fp32").lookup("ns", _batch(0)) - target) ** 2).mean())
    assert losses["fp32"] < 0.8 * start
    assert losses["fp16"] == pytest.approx(losses["fp32"], rel=0.02)
    assert losses["fused8bit"] == pytest.approx(losses["fp32"], rel=0.1)


def test_unknown_storage_is_refused():
    with pytest.raises(ValueError, match=r"unknown row storage 'int4'; use one of fp32, fp16, fused8bit"):
        _server("int4")


def test_rows_made_by_the_servers_depend_on_the_table_not_its_place():
    """Tables without initial weights (``meta`` on the trainer) get rows the servers make from the seed: the same
    table gets the same rows on any server and in any position; two tables of one shape get different rows
    (they were equal when the seed was the shard's position on its server)."""
    same_shape = [TableSpec("a", 40, 8, ("fa",)), TableSpec("b", 40, 8, ("fb",))]
    two = [PSServer("ps0"), PSServer("ps1")]
    shards = plan_shards(same_shape, 2)
    assert sorted(s.server for s in shards) == [0, 1]        # one table on each server, each first there
    for k, srv in enumerate(two):
        srv.configure("ns", shards, k, "sgd", {"lr": 0.1}, seed=3)
    rows = {v["spec"].table.name: v["weight"] for srv in two for v in srv.state_dict("ns").values()}
    assert not torch.equal(rows["a"], rows["b"])
    one = PSServer("ps0")
    one.configure("ns", plan_shards(same_shape[::-1], 1), 0, "sgd", {"lr": 0.1}, seed=3)
    alone = {v["spec"].table.name: v["weight"] for v in one.state_dict("ns").values()}
    for name in ("a", "b"):
        torch.testing.assert_close(alone[name], rows[name], rtol=0, atol=0)
        assert float(alone[name].abs().max()) <= 40 ** -0.5


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.uint8, torch.bfloat16])
@pytest.mark.parametrize("shape", [(40, 16), (40,)])
def test_the_row_scatter_writes_the_bits_index_copy_writes(dtype, shape):
    gen = torch.Generator().manual_seed(3)
    stored = (torch.randn(shape, generator=gen) * 50).to(dtype)
    rows = torch.randperm(40, generator=gen)[:17]
    values = (torch.randn((17, *shape[1:]), generator=gen) * 50).to(dtype)
    expected = stored.clone().index_copy_(0, rows, values)
    scatter_rows(stored, rows, values)
    assert torch.equal(stored.view(torch.uint8) if dtype != torch.uint8 else stored,
                       expected.view(torch.uint8) if dtype != torch.uint8 else expected)


def test_the_row_scatter_on_a_strided_view_and_out_of_range_rows():
    base = torch.zeros(10, 8)
    view = base[:, ::2]                       # not contiguous: index_copy_'s path
    scatter_rows(view, torch.tensor([1, 3]), torch.ones(2, 4))
    assert base[1, ::2].eq(1).all() and base[1, 1::2].eq(0).all() and base[3].sum() == 4
    for bad in (4, -1):
        stored = torch.zeros(4, 2)
        with pytest.raises(IndexError):
            scatter_rows(stored, torch.tensor([0, bad]), torch.ones(2, 2))
        assert stored.eq(0).all()    # nothing written


@pytest.mark.parametrize("storage", ["fp32", "fp16", "fused8bit"])
def test_a_stores_gather_returns_the_rows_index_select_returns(storage):
    store = make_store(storage)
    stored = store.encode(torch.randn(50, 16))
    rows = torch.tensor([3, 49, 0, 3, 17])
    assert torch.equal(store.gather(stored, rows), store.decode(stored.index_select(0, rows)))
    with pytest.raises(IndexError, match="row 50 at position 1"):
        store.gather(stored, torch.tensor([1, 50]))


def _huge_bytes_at(address: int) -> int | None:
    """AnonHugePages (bytes) of this process's mapping holding ``address``; None without /proc/self/smaps."""
    try:
        lines = open("/proc/self/smaps").read().splitlines()
    except OSError:
        return None
    inside = False
    for line in lines:
        head = line.split()[0]
        if "-" in head and all(c in "0123456789abcdef-" for c in head):
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo <= address < hi
        elif inside and line.startswith("AnonHugePages:"):
            return int(line.split()[1]) * 1024
    return None


def test_empty_rows_asks_for_huge_pages_where_the_kernel_offers_them():
    rows = empty_rows(1 << 18, 64)           # 64 MiB: glibc maps it afresh (>= its 32 MiB mmap threshold at most)
    assert rows.shape == (1 << 18, 64) and rows.dtype == torch.float32
    small = empty_rows(3, 5, torch.float16)  # under a huge page: no advice, still a tensor
    assert small.shape == (3, 5) and small.dtype == torch.float16
    try:
        mode = open("/sys/kernel/mm/transparent_hugepage/enabled").read()
    except OSError:
        pytest.skip("no transparent huge pages on this machine (/sys/kernel/mm/transparent_hugepage absent)")
    if "[never]" in mode:
        pytest.skip(f"transparent huge pages are off here ({mode.strip()})")
    rows.fill_(1.0)                          # the first touch: the kernel picks the page size now
    huge = _huge_bytes_at(rows.data_ptr() + rows.numel() * 2)   # the middle: the advice splits off the ends
    if huge is None:
        pytest.skip("no /proc/self/smaps")
    assert huge >= HUGE_PAGE, f"no huge page backs the rows (THP mode {mode.strip()}, AnonHugePages {huge})"


def test_stacked_tables_hold_the_shards_rows_in_order():
    srv = _server("fp32", "rowwise_adagrad")
    fused = srv.fused["ns"]
    assert fused is not None and fused.state is not None
    assert torch.equal(fused.weight, torch.cat([INIT["a"], INIT["b"]]))
    assert fused.state.shape == (80,)
