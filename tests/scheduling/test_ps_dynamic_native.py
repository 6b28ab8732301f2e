"""scheduling.ps.dynamic_native: the compiled kernels against the torch SlotIndex and group path (the reference),
state tensor for state tensor, over long random runs; and the build: cache, lock, fallback."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from scheduling.ps.dynamic import DynamicSpec, DynamicTable, group_tables
from scheduling.ps.dynamic_group import initial_rows_keyed
from scheduling.ps.dynamic_index import SlotIndex, mix64_torch
from scheduling.ps.dynamic_native import (
    NativeSlotIndex,
    gather_rows,
    initial_rows_native,
    load,
    native_available,
    scatter_rows,
    sgd_rows,
)
from scheduling.ps.fused import unique_inverse
from scheduling.ps.optimizer import RowWiseSGD, make_optimizer

ROOT = Path(__file__).resolve().parents[2]
needs_native = pytest.mark.skipif(not native_available(),
                                  reason="compiled dynamic-table kernels unavailable (FXDIST_NATIVE=0, no C++ "
                                         "compiler, or the build failed: see the logged line)")
TOP = (1 << 63) - 1
INDEX_STATE = ("hslot", "hpos", "deleted", "log", "head", "tail", "high")
GROUP_STATE = ("weight", "state", "slot_id", "last_seen", "rows", "step", "counters")


def _groups(monkeypatch, n, spec, dim=4, optimizer="rowwise_adagrad"):
    """The same ``n`` tables twice, one group each: (torch tables, compiled tables)."""
    out = []
    for flag in ("0", "1"):
        monkeypatch.setenv("FXDIST_NATIVE", flag)
        opt = make_optimizer(optimizer, lr=0.3)
        tables = [DynamicTable(dim, spec, opt, seed=3, salt=100 + i) for i in range(n)]
        group_tables(tables)
        out.append(tables)
    assert not out[0][0].group.index.native and out[1][0].group.index.native
    return out


def _same_index(a: SlotIndex, b: SlotIndex, where) -> None:
    for name in INDEX_STATE:
        assert torch.equal(getattr(a, name), getattr(b, name)), (where, name)
    assert len(a.freed) == len(b.freed) and all(torch.equal(x, y) for x, y in zip(a.freed, b.freed)), where


def _same(ta, tb, where) -> None:
    a, b = ta[0].group, tb[0].group
    for name in GROUP_STATE:
        x, y = getattr(a, name), getattr(b, name)
        assert (x is None and y is None) or torch.equal(x, y), (where, name)
    for ca, cb in zip(a.cands, b.cands):
        assert all(torch.equal(x, y) for x, y in zip(ca, cb)), (where, "candidates")
    _same_index(a.index, b.index, where)


def _ids(gen, t, size, pool):
    """Ids of table ``t``: a small pool of raw 63-bit values (repeats, returns after eviction), some near the
    int64 limit and some with bit 62 set, none equal to the padding value (int64 max)."""
    raw = torch.randint(0, pool, (size,), generator=gen)
    near_top = TOP - 1 - raw * 7919                              # just below int64 max
    high = (raw * 0x9E3779B97F4A7C1 + t) & (TOP >> 1) | (1 << 62)
    pick = torch.randint(0, 3, (size,), generator=gen)
    return torch.where(pick == 0, raw * (1 << 40) + t, torch.where(pick == 1, near_top, high))


@needs_native
@pytest.mark.parametrize("capacity, min_count, expire, steps", [
    (8, 1, None, 1200), (5, 1, 3, 600), (12, 2, 4, 600), (40, 1, None, 800), (6, 3, None, 400), (64, 1, 9, 400)])
def test_long_random_runs_give_identical_state_and_outputs(monkeypatch, capacity, min_count, expire, steps):
    """Thousands of steps over 4 tables (random subsets in random order, unequal lengths, eviction, expiry,
    candidates, pushes of the looked-up and of other ids, checkpoint restores mid-way): every output and every
    state tensor of the compiled path equals the torch path's, the index's hash table and log included."""
    spec = DynamicSpec(capacity, min_count, expire)
    ta, tb = _groups(monkeypatch, 4, spec)
    gen = torch.Generator().manual_seed(capacity * 31 + min_count)
    saved = None
    for step in range(steps):
        perm = torch.randperm(4, generator=gen)[:1 + int(torch.randint(0, 4, (1,), generator=gen))].tolist()
        sizes = [int(torch.randint(0, 3 * capacity, (1,), generator=gen)) for _ in perm]
        ids = [_ids(gen, t, n, 3 * capacity) for t, n in zip(perm, sizes)]
        ra, sa = ta[0].group.lookup(perm, ids)
        rb, sb = tb[0].group.lookup(perm, ids)
        for x, y, u, v in zip(ra, rb, sa, sb):
            assert torch.equal(x, y) and torch.equal(u, v), step
        grads = [torch.randn(n, 4, generator=gen) for n in sizes]
        other = [i.flip(0) for i in ids] if step % 5 == 0 else ids      # a push of other ids probes again
        assert ta[0].group.push(perm, other, grads) == tb[0].group.push(perm, other, grads)
        if step % 4 == 0 or step > steps - 50:
            _same(ta, tb, step)
        if step % 97 == 50:
            saved = [(t.state_dict(), u.state_dict()) for t, u in zip(ta, tb)]
        if saved is not None and step % 211 == 100:                    # restore an older checkpoint: reindex
            j = step % 4
            ta[j].load_state_dict(saved[j][0])
            tb[j].load_state_dict(saved[j][1])
            _same(ta, tb, (step, "restored"))
    counters = ta[0].group.counters.sum(0).tolist()
    assert counters[1] > 0 and (counters[2] > 0 or counters[3] > 0)   # admitted, evicted or expired


@needs_native
def test_batched_inserts_with_colliding_homes_and_wrapping_rehashes_match(monkeypatch):
    """Op by op on a bare index: ids sharing home entries inserted in one batch (claims decided round by round),
    removals past ``H / 4`` (rehashes, wrapping at the end), victims, expiry and log compaction and growth."""
    cap, tables = 16, 3
    a, b = SlotIndex(tables, cap), NativeSlotIndex(tables, cap, load())
    h = a.hsize
    homes = mix64_torch(torch.arange(200_000)) & (h - 1)
    end = torch.cat([(homes == x).nonzero().flatten()[:3] for x in (h - 2, h - 1, 0, 1)])   # clusters that wrap
    slot_id = torch.full((tables, cap), -1, dtype=torch.int64)
    last_seen = torch.zeros(tables, cap, dtype=torch.int64)
    gen = torch.Generator().manual_seed(5)
    for step in range(1, 300):
        t = step % tables
        free = (slot_id[t] < 0).nonzero().flatten()
        if free.numel() and step % 4:                               # a batch of new ids, many sharing homes
            n = int(torch.randint(1, free.numel() + 1, (1,), generator=gen))
            pool = torch.cat([end, torch.randint(0, 1 << 62, (8,), generator=gen)])
            fresh = pool[torch.randperm(pool.numel(), generator=gen)]
            fresh = fresh[~torch.isin(fresh, slot_id[t])].unique()[:n]
            slots = free[:fresh.numel()]
            slot_id[t, slots] = fresh
            last_seen[t, slots] = step
            for index in (a, b):
                index.insert(torch.full_like(slots, t), slots, fresh)
                index.append(torch.tensor([t]), (step * cap + slots).view(1, -1), torch.tensor([slots.numel()]),
                             slot_id, last_seen)
        else:                                                       # evict a few, expire the old
            need = torch.tensor([int(torch.randint(1, 4, (1,), generator=gen))])
            (va, na), (vb, nb) = [x.victims(torch.tensor([t]), need, slot_id, last_seen) for x in (a, b)]
            assert torch.equal(va, vb) and torch.equal(na, nb)
            gone = va[0, :int(na[0])]
            (ea, sa), (eb, sb) = [x.expired(torch.tensor([t]), torch.tensor([step - 40]), slot_id, last_seen)
                                  for x in (a, b)]
            assert torch.equal(ea, eb) and torch.equal(sa, sb)
            gone = torch.cat([gone, sa])
            for index in (a, b):
                index.remove(torch.full_like(gone, t), gone)
            slot_id[t, gone] = -1
        for index in (a, b):
            index.maintain(slot_id)
        _same_index(a, b, step)
        q = torch.cat([slot_id.view(-1), end, torch.tensor([TOP, 0])])
        tix = torch.arange(tables).repeat_interleave(cap)
        tix = torch.cat([tix, torch.zeros(q.numel() - tix.numel(), dtype=torch.int64)])
        assert torch.equal(a.find(slot_id, tix, q), b.find(slot_id, tix, q))
    assert int(a.log.shape[1]) == int(b.log.shape[1])


@needs_native
@pytest.mark.parametrize("dim, bound", [(16, 3000 ** -0.5), (7, 1.0), (64, 1e6 ** -0.5)])
def test_fresh_rows_are_bit_identical_to_initial_rows_keyed(dim, bound):
    gen = torch.Generator().manual_seed(dim)
    ids = torch.cat([torch.randint(-(1 << 63), TOP, (3000,), generator=gen), torch.tensor([TOP, -(1 << 63), 0])])
    keys = torch.randint(-(1 << 63), TOP, (ids.numel(),), generator=gen)
    got, want = initial_rows_native(load(), ids, keys, dim, bound), initial_rows_keyed(ids, keys, dim, bound)
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))


_CHILD = ("import logging, sys; logging.basicConfig(level=logging.INFO, stream=sys.stdout); "
          "from scheduling.ps.dynamic_native import load; print('native' if load() else 'torch')")


def _child(env_extra, cache):
    env = {**os.environ, "FXDIST_NATIVE": "1", "XDG_CACHE_HOME": str(cache), "PYTHONPATH": str(ROOT), **env_extra}
    return subprocess.Popen([sys.executable, "-c", _CHILD], env=env, cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


@needs_native
def test_fresh_processes_build_once_under_the_lock_and_load_the_cached_library(tmp_path):
    """Three processes starting together with an empty cache: all load the kernels, one library file and its
    recorded sha256 are left (no temporary ones) in a folder of mode 0700, and a later process loads it without
    building."""
    import hashlib

    procs = [_child({}, tmp_path) for _ in range(3)]
    outs = [p.communicate(timeout=300)[0] for p in procs]
    assert all(o.strip().splitlines()[-1] == "native" for o in outs), outs
    folder = tmp_path / "fxdist" / "native"
    built = sorted(p.name for p in folder.iterdir() if not p.name.startswith(".build"))
    assert len(built) == 2 and built[0].endswith(".so") and built[1] == built[0] + ".sha256", built
    assert (folder / built[1]).read_text() == f"{hashlib.sha256((folder / built[0]).read_bytes()).hexdigest()}  {built[0]}\n"
    assert folder.stat().st_mode & 0o777 == 0o700
    again = _child({"CXX": "/nonexistent/c++"}, tmp_path)                # cached: no compiler needed
    assert again.communicate(timeout=120)[0].strip().splitlines()[-1] == "native"


def test_without_a_compiler_or_when_switched_off_the_torch_index_is_used_and_says_why(tmp_path):
    broken = _child({"CXX": "/nonexistent/c++"}, tmp_path)
    out = broken.communicate(timeout=120)[0]
    assert out.strip().splitlines()[-1] == "torch" and "compiled kernels unavailable" in out, out
    off = _child({"FXDIST_NATIVE": "0"}, tmp_path)
    out = off.communicate(timeout=120)[0]
    assert out.strip().splitlines()[-1] == "torch" and "FXDIST_NATIVE=0" in out, out


@needs_native
def test_a_packaged_library_is_loaded_without_a_compiler_and_only_when_safe(tmp_path, monkeypatch):
    """The library a wheel carries next to the module (setup.py) loads with no compiler and an empty cache; one
    built from another source (another name) or writable by others is not used."""
    import hashlib
    import shutil

    from scheduling.ps import dynamic_native as dn

    source = tmp_path / "pkg" / "dynamic_kernels.cpp"
    source.parent.mkdir()
    shutil.copy(dn.SOURCE, source)
    digest = hashlib.sha256(source.read_bytes() + " ".join(dn.FLAGS).encode()).hexdigest()[:16]
    packaged = source.with_name(f"dynamic_kernels-{digest}.so")
    subprocess.run([shutil.which("g++") or shutil.which("c++") or "c++", *dn.FLAGS, "-o", str(packaged), str(source)],
                   check=True, timeout=300)
    packaged.chmod(0o755)
    source.parent.chmod(0o755)
    monkeypatch.setattr(dn, "SOURCE", source)
    monkeypatch.setenv("CXX", "/nonexistent/c++")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setattr(dn, "_state", {})
    lib = dn.load()
    assert lib is not None and Path(lib._name) == packaged and not (tmp_path / "cache").exists()
    assert dn.packaged_library("0" * 16) is None                       # another source or flags: another name
    packaged.chmod(0o777)
    assert dn.packaged_library(digest) is None                         # writable by others: the cache build then
    monkeypatch.setattr(dn, "_state", {})
    assert dn.load() is None                                           # ... which needs the (missing) compiler


_PLANTED = """#include <stdio.h>
__attribute__((constructor)) static void planted(void) { FILE *f = fopen(MARKER, "w"); if (f) fclose(f); }
long fx_version(void) { return VERSION; }
"""


def _planted_cache(tmp_path, monkeypatch, mode: int = 0o700, record: str | None = None) -> tuple[Path, Path]:
    """A cache folder (``XDG_CACHE_HOME`` = tmp_path/cache) holding, under the kernels' name, a library whose loading
    writes a marker file; ``record``: the sha256 line written beside it (None: none). Returns (library, marker)."""
    import hashlib
    import shutil

    from scheduling.ps import dynamic_native as dn

    cxx = shutil.which("gcc") or shutil.which("cc")
    if cxx is None:
        pytest.skip("no C compiler to build the planted library")
    folder, marker = tmp_path / "cache" / "fxdist" / "native", tmp_path / "marker"
    folder.mkdir(parents=True)
    digest = hashlib.sha256(dn.SOURCE.read_bytes() + " ".join(dn.FLAGS).encode()).hexdigest()[:16]
    planted, source = folder / f"dynamic_kernels-{digest}.so", tmp_path / "planted.c"
    source.write_text(_PLANTED)
    subprocess.run([cxx, "-shared", "-fPIC", f'-DMARKER="{marker}"', f"-DVERSION={dn.VERSION}", "-o", str(planted),
                    str(source)], check=True, timeout=120)
    if record is not None:
        planted.with_name(planted.name + ".sha256").write_text(record)
    folder.chmod(mode)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setenv("FXDIST_NATIVE", "1")
    monkeypatch.setattr(dn, "_state", {})
    monkeypatch.setattr(dn, "packaged_library", lambda digest: None)  # no wheel's library: the cache decides
    return planted, marker


@pytest.mark.parametrize("record", [None, "0" * 64 + "  planted.so\n"])
def test_a_library_planted_in_the_cache_without_its_recorded_hash_is_not_loaded(tmp_path, monkeypatch, caplog,
                                                                                  record):
    """No sha256 recorded, or another one: the file is not loaded (its constructor would write the marker); without
    a compiler to rebuild it the torch path is used, and the log says why."""
    from scheduling.ps import dynamic_native as dn

    planted, marker = _planted_cache(tmp_path, monkeypatch, record=record)
    monkeypatch.setenv("CXX", "/nonexistent/c++")
    with caplog.at_level("INFO", logger=dn.__name__):
        assert dn.load() is None and dn.make_slot_index(1, 8).__class__ is SlotIndex
    assert not marker.exists()
    said = caplog.text
    assert f"not loading {planted}" in said and ("no sha256 recorded" if record is None else "is not the one") in said
    assert "compiled kernels unavailable" in said


@needs_native
def test_a_planted_library_is_replaced_by_a_build_that_records_its_hash(tmp_path, monkeypatch, caplog):
    """With a compiler the unverified file is rebuilt from the source and the rebuilt one (hash recorded) loads."""
    from scheduling.ps import dynamic_native as dn

    planted, marker = _planted_cache(tmp_path, monkeypatch)
    monkeypatch.delenv("CXX", raising=False)
    with caplog.at_level("WARNING", logger=dn.__name__):
        lib = dn.load()
    assert lib is not None and Path(lib._name) == planted and not marker.exists()
    assert "no sha256 recorded" in caplog.text and "rebuilding" in caplog.text
    assert dn._unverified(planted) is None


@pytest.mark.parametrize("mode", [0o777, 0o770])
def test_a_cache_folder_others_can_write_is_not_used(tmp_path, monkeypatch, caplog, mode):
    """A folder writable by group or others is refused before anything in it is loaded or built, even a library
    with a matching recorded hash; the torch path is used, and one logged line says why."""
    import hashlib

    from scheduling.ps import dynamic_native as dn

    planted, marker = _planted_cache(tmp_path, monkeypatch, mode=0o700)
    planted.with_name(planted.name + ".sha256").write_text(hashlib.sha256(planted.read_bytes()).hexdigest())
    planted.parent.chmod(mode)
    with caplog.at_level("INFO", logger=dn.__name__):
        assert dn.load() is None
    assert not marker.exists()
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and f"has mode {mode:04o}, writable by group or others" in lines[0], lines
    assert "compiled kernels unavailable" in lines[0]


def test_the_cache_folder_is_made_private_and_must_be_this_users(tmp_path, monkeypatch):
    from scheduling.ps.dynamic_native import private_folder

    folder = tmp_path / "a" / "native"
    private_folder(folder)
    assert folder.stat().st_mode & 0o777 == 0o700
    link = tmp_path / "link"
    link.symlink_to(folder)
    with pytest.raises(RuntimeError, match="not a directory"):
        private_folder(link)
    monkeypatch.setattr(os, "getuid", lambda: folder.stat().st_uid + 1)
    with pytest.raises(RuntimeError, match=r"belongs to uid \d+, not to this user"):
        private_folder(folder)


@pytest.mark.parametrize("flag", ["1", "0"])
@pytest.mark.parametrize("dtype, shape", [(torch.float32, (300, 16)), (torch.float16, (300, 64)),
                                          (torch.uint8, (300, 24)), (torch.float32, (300,)),
                                          (torch.float32, (300, 600))])
def test_row_gather_and_scatter_give_index_select_and_index_copy_bytes(monkeypatch, flag, dtype, shape):
    """Compiled (``"1"``, where they load) and torch (``"0"``) alike; rows of 1 to 2,400 bytes (a prefetch distance
    of 4 to 32 rows), fewer rows than the distance included."""
    monkeypatch.setenv("FXDIST_NATIVE", flag)
    gen = torch.Generator().manual_seed(shape[-1])
    table = (torch.randn(shape, generator=gen) * 50).to(dtype)
    for n in (0, 3, 257):
        rows = torch.randint(0, shape[0], (n,), generator=gen)
        assert torch.equal(gather_rows(table, rows), table.index_select(0, rows))
        unique = torch.randperm(shape[0], generator=gen)[:n]
        values = (torch.randn((n, *shape[1:]), generator=gen) * 50).to(dtype)
        got, want = table.clone(), table.clone().index_copy_(0, unique, values)
        scatter_rows(got, unique, values)
        assert torch.equal(got, want)


@needs_native
def test_rows_outside_the_table_are_refused_before_any_copy():
    table = torch.arange(12.0).view(6, 2)
    with pytest.raises(IndexError, match="row 6 at position 2"):
        gather_rows(table, torch.tensor([0, 5, 6]))
    with pytest.raises(IndexError, match="row -1 at position 1"):
        scatter_rows(table, torch.tensor([0, -1]), torch.zeros(2, 2))
    assert torch.equal(table, torch.arange(12.0).view(6, 2))     # nothing written
    strided = torch.zeros(6, 4)[:, ::2]                            # not contiguous: torch's index_copy_
    scatter_rows(strided, torch.tensor([1]), torch.ones(1, 2))
    assert strided[1].eq(1).all() and strided.sum() == 2


def test_tables_the_kernels_do_not_take_go_to_torch():
    """Empty rows, a table autograd tracks (the gather keeps its graph) and int32 rows: torch's results."""
    empty = torch.zeros(5, 0)
    assert gather_rows(empty, torch.tensor([1, 4])).shape == (2, 0)
    tracked = torch.randn(6, 3, requires_grad=True)
    picked = gather_rows(tracked, torch.tensor([2, 2, 5]))
    picked.sum().backward()
    assert tracked.grad is not None and tracked.grad[2].eq(2).all() and tracked.grad[0].eq(0).all()
    table = torch.randn(6, 3)
    assert torch.equal(gather_rows(table, torch.tensor([5, 0], dtype=torch.int32)), table[[5, 0]])


def _sgd_by_torch(table, rows, grads, grad_rows, lr):
    """The torch reference of ``sgd_rows``: ``FusedTables.row_grads`` (unique, ``index_add_`` into zeros), then
    ``RowWiseSGD`` on float32 rows."""
    unique, inverse = unique_inverse(rows)
    summed = torch.zeros(unique.numel(), table.shape[1]).index_add_(0, inverse, grads.index_select(0, grad_rows))
    RowWiseSGD(lr=lr).step(table, None, unique, summed)
    return unique.numel()


@needs_native
@pytest.mark.parametrize("dim", [1, 3, 16, 17, 64, 130])
def test_the_sgd_kernel_writes_the_bits_of_unique_index_add_and_sub(dim):
    """Repeated rows summed in id order, one rounding for ``w - lr * s``: bit for bit torch's ops, for widths with
    and without a vector tail, gradients of magnitudes 1e-6 to 1e2, -0.0 in the table and the gradients."""
    gen = torch.Generator().manual_seed(dim)
    if not sgd_rows(torch.zeros(1, dim), torch.zeros(1, dtype=torch.long), torch.zeros(1, dim),
                    torch.zeros(1, dtype=torch.long), 0.1) == 1:
        pytest.skip("torch's CPU kernels here do not round a + alpha * b once (no AVX2 / AVX-512 build)")
    for n_rows, n_ids, lr in ((5, 40, 0.1), (1000, 300, 0.01), (300_000, 3328, 0.37)):
        table = torch.randn(n_rows, dim, generator=gen)
        table[0] = -0.0
        rows = torch.randint(0, n_rows, (n_ids,), generator=gen)
        rows[: n_ids // 4] = rows[0]       # many repeats of one row: a long sum in id order
        grads = torch.randn(n_ids + 7, dim, generator=gen) * 10.0 ** torch.randint(-6, 3, (n_ids + 7, 1),
                                                                                  generator=gen)
        grads[1] = -0.0
        grad_rows = torch.randperm(n_ids + 7, generator=gen)[:n_ids]
        want, got = table.clone(), table.clone()
        assert sgd_rows(got, rows, grads, grad_rows, lr) == _sgd_by_torch(want, rows, grads, grad_rows, lr)
        assert torch.equal(got.view(torch.int32), want.view(torch.int32))


@needs_native
def test_the_sgd_kernel_refuses_bad_rows_before_writing_and_leaves_other_tensors_to_torch(monkeypatch):
    table = torch.arange(12.0).view(6, 2)
    with pytest.raises(IndexError, match="id 1 has row 6"):
        sgd_rows(table, torch.tensor([0, 6]), torch.ones(2, 2), torch.tensor([0, 1]), 0.1)
    with pytest.raises(IndexError, match="gradient row 2"):
        sgd_rows(table, torch.tensor([0, 1]), torch.ones(2, 2), torch.tensor([0, 2]), 0.1)
    assert torch.equal(table, torch.arange(12.0).view(6, 2))    # nothing written
    ids = torch.tensor([1, 1])
    assert sgd_rows(table.double(), ids, torch.ones(2, 2).double(), ids, 0.1) is None     # float64
    assert sgd_rows(torch.zeros(6, 4)[:, ::2], ids, torch.ones(2, 2), ids, 0.1) is None   # strided table
    assert sgd_rows(table.requires_grad_(), ids, torch.ones(2, 2), ids, 0.1) is None      # tracked by autograd
    monkeypatch.setenv("FXDIST_NATIVE", "0")
    assert sgd_rows(torch.zeros(6, 2), ids, torch.ones(2, 2), ids, 0.1) is None
