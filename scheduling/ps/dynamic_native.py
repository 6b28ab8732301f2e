"""Compiled kernels: every server's row gather and scatter (:func:`gather_rows`, :func:`scatter_rows`: torch's
``index_select`` / ``index_copy_`` on dim 0 with software prefetching), a push's plain SGD over float32 rows in one
pass (:func:`sgd_rows`), and for dynamic tables :class:`NativeSlotIndex`, a :class:`~scheduling.ps.dynamic_index.SlotIndex`
whose per-step operations each run as one call into ``dynamic_kernels.cpp`` instead of hundreds of small tensor
ops, plus the whole id -> slot step of ``DynamicTableGroup.lookup_padded`` for ``min_count == 1`` (:meth:`lookup_ids`).

Same data (the torch tensors of :class:`SlotIndex`, written in place) and same results as the torch code, which
stays the reference and the fallback. The C++ file has a plain ``extern "C"`` ABI over raw pointers of
contiguous CPU tensors (no torch headers): :func:`load` compiles it once with the system C++ compiler
(``$CXX``, else ``g++``/``c++``; ``-O2 -shared -fPIC``, about a second) into
``$XDG_CACHE_HOME/fxdist/native`` (else ``~/.cache/fxdist/native``), named by the hash of the source and the
flags, under a file lock (several worker processes may start at once) and atomically (a temporary name, then
``os.replace``), and loads it with :mod:`ctypes`. A wheel carries that file already built (``setup.py``, same
compiler choice, flags and name) next to this module: it is loaded instead, without a compiler, when its name matches
this source and flags and neither it nor its folder can be written by another user (:func:`packaged_library`).
Without a compiler, when the build fails, or with
``FXDIST_NATIVE=0`` in the environment, :func:`make_slot_index` gives the torch :class:`SlotIndex` and one line
is logged saying why.

The cache folder holds code this process runs, so it is created with mode 0700 and used only while it is this user's
directory and not writable by group or others (:func:`private_folder`; else the torch path, one logged line saying
why). Each library's sha256 is recorded beside it when it is built (``<name>.so.sha256``, written atomically, under
the lock), and a cached library is loaded only when its bytes match that record; a file without a record or with
another hash is not loaded: it is rebuilt (a logged line says why), or without a compiler the torch path is used.

Source: Python's ``ctypes`` documentation (foreign functions over C pointers); the algorithms are those of
:mod:`scheduling.ps.dynamic_index` (Knuth, TAOCP Vol. 3, §6.4).
"""

from __future__ import annotations

import ctypes
import fcntl
import hashlib
import logging
import os
import shutil
import stat
import subprocess
from collections.abc import Sequence
from pathlib import Path

import torch

from .dynamic_index import SlotIndex

__all__ = ["NativeSlotIndex", "gather_rows", "initial_rows_native", "load", "make_slot_index", "native_available",
           "packaged_library", "private_folder", "scatter_rows", "sgd_rows"]

SOURCE = Path(__file__).with_name("dynamic_kernels.cpp")
FLAGS = ("-O2", "-shared", "-fPIC", "-std=c++17", "-ffp-contract=off")
VERSION = 3
"""``fx_version()`` of the kernels this module calls."""
_log = logging.getLogger(__name__)
_state: dict[str, object] = {}
_P, _I = ctypes.c_void_p, ctypes.c_int64
_SIGNATURES = {
    "fx_find": [_P, _I, _P, _P, _P], "fx_insert": [_P, _I, _P, _P, _P], "fx_remove": [_P, _I, _P, _P],
    "fx_rehash": [_P, _I], "fx_maintain": [_P], "fx_victims": [_P, _I, _P, _P, _I, _P, _P],
    "fx_expired": [_P, _I, _P, _P, _P, _P], "fx_append": [_P, _I, _P, _I, _P, _P],
    "fx_initial_rows": [_I, _P, _P, _I, ctypes.c_double, _P],
    "fx_lookup": [_P, _I, _I, _P, _P, _P, _P, _P, _P, _P, _P, _P, _P, _P, _P, _P, _P, _P, _P, _P, _P],
    "fx_gather_rows": [_P, _I, _I, _I, _P, _P], "fx_scatter_rows": [_P, _I, _I, _I, _P, _P],
    "fx_sgd_rows": [_P, _I, _I, _I, _P, _P, _I, _P, ctypes.c_float],
}
_RETURNS_INT64 = ("fx_expired", "fx_append", "fx_lookup", "fx_gather_rows", "fx_scatter_rows", "fx_sgd_rows")


class _Index(ctypes.Structure):
    """The C ``struct Index``: pointers to a SlotIndex's tensors and the group's ``slot_id``/``last_seen``."""

    _fields_ = [(n, ctypes.c_void_p) for n in ("hslot", "hpos", "deleted", "log", "head", "tail", "high",
                                                "slot_id", "last_seen")] + [(n, ctypes.c_int64) for n in "TCHL"]


def _cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "fxdist" / "native"


def packaged_library(digest: str) -> Path | None:
    """The kernels a wheel carries next to this module (``dynamic_kernels-<digest>.so``, built by ``setup.py``) when
    they are this source built with these flags (``digest``: the sha256 of both, as the cache names them) and
    neither the file nor its folder is writable by anyone but its owner, root or this user; else None (the cache
    build then)."""
    lib = SOURCE.with_name(f"dynamic_kernels-{digest}.so")
    try:
        stats = [lib.stat(), lib.parent.stat()]
    except OSError:
        return None
    if lib.is_file() and all(s.st_uid in (0, os.getuid()) and not s.st_mode & 0o022 for s in stats):
        return lib
    _log.warning("not loading %s: it or its folder is writable by another user", lib)
    return None


def _cached_library(digest: str) -> Path:
    """The kernels in the cache folder (:func:`private_folder`), built there when missing or when the file's sha256
    is not the one recorded beside it at its build (``<name>.so.sha256``, written atomically): a file that does not
    match is never loaded; it is rebuilt, with a logged line saying why. Checked, built and recorded under the
    folder's lock, so concurrent processes build once.

    Raises:
        RuntimeError: the folder is refused (:func:`private_folder`), there is no C++ compiler, or the build failed.
    """
    folder = _cache_dir()
    private_folder(folder)
    lib = folder / f"dynamic_kernels-{digest}.so"
    with open(folder / ".build.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)                     # one build; the others wait and load it
        why = _unverified(lib)
        if why is None:
            return lib
        if lib.exists():
            _log.warning("not loading %s: %s; rebuilding it", lib, why)
        cxx = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
        if not cxx:
            raise RuntimeError("no C++ compiler ($CXX, g++ or c++) on PATH")
        tmp = folder / f".{lib.name}.{os.getpid()}.tmp"
        done = subprocess.run([cxx, *FLAGS, "-o", str(tmp), str(SOURCE)], capture_output=True, text=True, timeout=300)
        if done.returncode:
            tmp.unlink(missing_ok=True)
            raise RuntimeError(f"{cxx} failed ({done.returncode}): {done.stderr.strip()[-500:]}")
        record = folder / f".{lib.name}.sha256.{os.getpid()}.tmp"
        record.write_text(f"{_sha256(tmp)}  {lib.name}\n")
        os.replace(record, _record_of(lib))
        os.replace(tmp, lib)
    return lib


def private_folder(folder: Path) -> None:
    """Create ``folder`` (mode 0700, its missing parents as the umask says) unless it exists, then check that it is a
    directory (not a symbolic link) owned by this user and not writable by group or others: anyone else who can
    write there could plant a library that this process would load and run.

    Raises:
        RuntimeError: the folder fails a check (the message says which, and how to fix it).
    """
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    st = os.lstat(folder)
    if not stat.S_ISDIR(st.st_mode):
        raise RuntimeError(f"{folder} is not a directory (a symbolic link?): not building or loading kernels there")
    if st.st_uid != os.getuid():
        raise RuntimeError(f"{folder} belongs to uid {st.st_uid}, not to this user (uid {os.getuid()}): not building "
                           "or loading kernels there; remove it, or set XDG_CACHE_HOME to a folder of your own")
    if st.st_mode & 0o022:
        raise RuntimeError(f"{folder} has mode {stat.S_IMODE(st.st_mode):04o}, writable by group or others, so a "
                           f"library there may have been planted: not building or loading kernels there (chmod 700 "
                           "it, or remove it)")


def _record_of(lib: Path) -> Path:
    """Where the sha256 of ``lib`` is recorded when it is built: ``<lib>.sha256`` (sha256sum's format)."""
    return lib.with_name(lib.name + ".sha256")


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _unverified(lib: Path) -> str | None:
    """Why ``lib`` may not be loaded (missing, no recorded sha256, or another one), or None when it matches."""
    if not lib.exists():
        return "not built yet"
    try:
        recorded = _record_of(lib).read_text().split()[0]
    except (OSError, IndexError):
        return f"no sha256 recorded for it ({_record_of(lib).name} missing or empty)"
    actual = _sha256(lib)
    return None if actual == recorded else f"its sha256 {actual[:16]}... is not the one recorded at its build " \
                                           f"({recorded[:16]}...)"


def _build() -> ctypes.CDLL:
    """Compile (once per source hash) and load the kernels.

    Raises:
        RuntimeError: no C++ compiler, or the build failed (its stderr's tail in the message).
    """
    digest = hashlib.sha256(SOURCE.read_bytes() + " ".join(FLAGS).encode()).hexdigest()[:16]
    lib = packaged_library(digest) or _cached_library(digest)
    dll = ctypes.CDLL(str(lib))
    if dll.fx_version() != VERSION:
        raise RuntimeError(f"{lib} has kernels version {dll.fx_version()}, expected {VERSION}")
    for name, args in _SIGNATURES.items():
        fn = getattr(dll, name)
        fn.argtypes, fn.restype = args, ctypes.c_int64 if name in _RETURNS_INT64 else None
    return dll


def load() -> ctypes.CDLL | None:
    """The compiled kernels, built on first use; None (after one logged line saying why) when ``FXDIST_NATIVE=0``,
    there is no compiler or the build fails. Cached per process (the environment variable is read every call)."""
    if os.environ.get("FXDIST_NATIVE", "1") == "0":
        if not _state.get("said_off"):
            _state["said_off"] = True
            _log.info("FXDIST_NATIVE=0: torch's row gather and scatter, the torch SlotIndex for dynamic tables")
        return None
    if "lib" not in _state:
        try:
            _state["lib"] = _build()
        except (OSError, RuntimeError, subprocess.SubprocessError) as err:
            _state["lib"] = None
            _log.warning("compiled kernels unavailable (%s): torch's row gather and scatter, the torch SlotIndex for "
                         "dynamic tables", err)
    lib = _state["lib"]
    return lib if isinstance(lib, ctypes.CDLL) else None


def native_available() -> bool:
    """Whether :func:`load` gives the compiled kernels."""
    return load() is not None


def make_slot_index(tables: int, capacity: int) -> SlotIndex:
    """A :class:`NativeSlotIndex` when :func:`load` succeeds, else the torch :class:`SlotIndex`."""
    lib = load()
    return SlotIndex(tables, capacity) if lib is None else NativeSlotIndex(tables, capacity, lib)


def initial_rows_native(lib: ctypes.CDLL, ids: torch.Tensor, keys: torch.Tensor, dim: int, bound: float
                        ) -> torch.Tensor:
    """``dynamic_group.initial_rows_keyed`` (bit for bit) by the compiled kernels.

    Shapes: ids ``(N,)`` int64, keys ``(N,)`` int64 -> ``(N, dim)`` float32.
    """
    ids, keys = _c(ids), _c(keys).expand(ids.shape).contiguous()
    out = torch.empty(ids.numel(), dim, dtype=torch.float32)
    lib.fx_initial_rows(ids.numel(), _p(ids), _p(keys), dim, float(bound), _p(out))
    return out


def _rows_args(table: torch.Tensor, rows: torch.Tensor) -> tuple[int, int] | None:
    """``(row bytes, rows)`` where the kernels can index ``table`` ``(R, ...)`` by ``rows`` (a contiguous CPU table of
    at least one non-empty row that autograd does not track, int64 CPU rows), else None."""
    if (table.device.type != "cpu" or rows.device.type != "cpu" or rows.dtype != torch.int64 or table.dim() < 1
            or not table.is_contiguous() or table.shape[0] == 0 or table.requires_grad):
        return None
    row_bytes = table[0].numel() * table.element_size()
    return (row_bytes, table.shape[0]) if row_bytes else None


def gather_rows(table: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """``table.index_select(0, rows)``, the same bytes: ``table`` ``(R, ...)`` any dtype, ``rows`` ``(N,)`` int64 ->
    ``(N, ...)``. On the compiled kernels where they load and apply (contiguous CPU tensors), rows prefetched
    ahead of the copy (3,328 random rows of 64 B out of 26e6 on a 2-core AMD EPYC: 64-73 -> 24-28 us; of 256 B
    out of 260e3: 94-131 -> 40 us); else torch's.

    Raises:
        IndexError: a row outside ``[0, R)`` (its position and value named).
    """
    args, lib = _rows_args(table, rows), load()
    if args is None or lib is None:
        return table.index_select(0, rows)
    rows = rows.contiguous()
    out = table.new_empty((rows.numel(), *table.shape[1:]))
    bad = lib.fx_gather_rows(table.data_ptr(), args[1], args[0], rows.numel(), rows.data_ptr(), out.data_ptr())
    if bad >= 0:
        raise IndexError(f"gather_rows: row {int(rows[bad])} at position {bad} outside the table's {args[1]} rows")
    return out


def scatter_rows(table: torch.Tensor, rows: torch.Tensor, values: torch.Tensor) -> None:
    """``table.index_copy_(0, rows, values)`` for ``rows`` ``(N,)`` without repeats, ``values`` ``(N, ...)`` of
    ``table``'s dtype: in place, on the compiled kernels where they apply (3,300 random rows of 64 float32 into
    260e3 on a 2-core AMD EPYC, under load: 49 us against ``index_copy_``'s 222), else by torch.

    Raises:
        IndexError: a row outside ``[0, R)``; nothing is written then.
    """
    args, lib = _rows_args(table, rows), load()
    if args is None or lib is None or values.dtype != table.dtype or values.shape[1:] != table.shape[1:]:
        table.index_copy_(0, rows, values)
        return
    rows, values = rows.contiguous(), values.contiguous()
    if values.shape[0] != rows.numel():
        raise IndexError(f"scatter_rows: {rows.numel()} rows but {values.shape[0]} values")
    bad = lib.fx_scatter_rows(table.data_ptr(), args[1], args[0], rows.numel(), rows.data_ptr(), values.data_ptr())
    if bad >= 0:
        raise IndexError(f"scatter_rows: row {int(rows[bad])} at position {bad} outside the table's {args[1]} rows")


def _fma_like_torch() -> bool:
    """Whether torch's CPU kernels round ``a + alpha * b`` once (an FMA), as ``fx_sgd_rows`` does: its AVX2 and
    AVX-512 builds (``Vectorized<float>::fmadd``; the default build rounds twice)."""
    found = _state.get("fma")
    if found is None:
        found = _state["fma"] = torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512")
    return bool(found)


def sgd_rows(table: torch.Tensor, rows: torch.Tensor, grads: torch.Tensor, grad_rows: torch.Tensor,
             lr: float) -> int | None:
    """Plain SGD on the rows a push touches, in one pass of the compiled kernels: ``table[r] -= lr * s_r`` where
    ``s_r`` sums ``grads[grad_rows[i]]`` over the ids ``i`` with ``rows[i] == r`` in the order of ``i``. The same
    bits as :meth:`scheduling.ps.fused.FusedTables.row_grads` (``unique`` + ``index_add_`` into zeros) followed by
    :class:`~scheduling.ps.optimizer.RowWiseSGD` on float32 rows (``sub_(s, alpha=lr)``), in less CPU time (a push
    of 3,328 ids of 64 floats into 260e3 rows on a 2-core AMD EPYC, a fresh batch each: 236 against 298 us; the
    same rows again and again, in cache: 105 against 210 us).

    Shapes: table ``(R, D)`` float32, rows and grad_rows ``(N,)`` int64, grads ``(G, D)`` float32.

    Returns:
        The number of distinct rows updated, or None where the kernels do not apply (not loaded, other dtypes or
        devices, a table autograd tracks, non-contiguous tensors, torch's own kernels not rounding with an FMA):
        the caller updates the rows with torch then.

    Raises:
        IndexError: a row outside ``[0, R)`` or a gradient row outside ``[0, G)`` (nothing written).
    """
    lib = load()
    if (lib is None or not _fma_like_torch() or table.dtype != torch.float32 or grads.dtype != torch.float32
            or table.dim() != 2 or grads.dim() != 2 or grads.shape[1] != table.shape[1]
            or _rows_args(table, rows) is None or grad_rows.dtype != torch.int64 or grads.device.type != "cpu"
            or grad_rows.device.type != "cpu" or rows.shape != grad_rows.shape):
        return None
    rows, grads, grad_rows = rows.contiguous(), grads.contiguous(), grad_rows.contiguous()
    got = lib.fx_sgd_rows(table.data_ptr(), table.shape[0], table.shape[1], rows.numel(), rows.data_ptr(),
                          grads.data_ptr(), grads.shape[0], grad_rows.data_ptr(), ctypes.c_float(-lr))
    if got < 0:
        i = -1 - got
        raise IndexError(f"sgd_rows: id {i} has row {int(rows[i])} (table rows: {table.shape[0]}) and gradient row "
                         f"{int(grad_rows[i])} (gradient rows: {grads.shape[0]})")
    return got


def _p(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def _c(t: torch.Tensor) -> torch.Tensor:
    return t.long().contiguous()


class NativeSlotIndex(SlotIndex):
    """:class:`SlotIndex` with its hash table, LRU log and rehash run by the compiled kernels (same tensors, same
    results; ``take_free``, ``release`` and ``reindex``'s bookkeeping stay torch). Victims, expired rows and
    appended entries are processed table by table in order; :meth:`expired` lists its slots table by table
    (the torch one in rounds of 256 log entries: the same pairs)."""

    native = True

    def __init__(self, tables: int, capacity: int, lib: ctypes.CDLL) -> None:
        super().__init__(tables, capacity)
        self.lib = lib

    def _ctx(self, slot_id: torch.Tensor | None = None, last_seen: torch.Tensor | None = None) -> _Index:
        if slot_id is not None and not slot_id.is_contiguous():
            raise ValueError("NativeSlotIndex: slot_id must be contiguous")
        return _Index(_p(self.hslot), _p(self.hpos), _p(self.deleted), _p(self.log), _p(self.head), _p(self.tail),
                      _p(self.high), _p(slot_id), _p(last_seen), self.hslot.shape[0], self.capacity, self.hsize,
                      self.log.shape[1])

    def find(self, slot_id: torch.Tensor, tix: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
        """Slots ``(n,)`` of ids ``q`` ``(n,)`` in tables ``tix`` ``(n,)``, -1 where not admitted."""
        tix, q = _c(tix), _c(q)
        out = torch.empty_like(q)
        self.lib.fx_find(ctypes.byref(self._ctx(slot_id)), q.numel(), _p(tix), _p(q), _p(out))
        return out

    def insert(self, tix: torch.Tensor, slots: torch.Tensor, ids: torch.Tensor) -> None:
        """Enter ids ``(n,)`` (in no table's map yet, distinct per table) at ``slots`` ``(n,)`` of ``tix``."""
        tix, slots, ids = _c(tix), _c(slots), _c(ids)
        self.lib.fx_insert(ctypes.byref(self._ctx()), ids.numel(), _p(tix), _p(slots), _p(ids))

    def remove(self, tix: torch.Tensor, slots: torch.Tensor) -> None:
        """Delete the map entries of occupied ``slots`` ``(n,)`` of tables ``tix`` ``(n,)``."""
        tix, slots = _c(tix), _c(slots)
        self.lib.fx_remove(ctypes.byref(self._ctx()), slots.numel(), _p(tix), _p(slots))

    def maintain(self, slot_id: torch.Tensor) -> None:
        """Rehash the tables with over ``H / 4`` deleted entries."""
        self.lib.fx_maintain(ctypes.byref(self._ctx(slot_id)))

    def _rehash(self, t: int, slot_id: torch.Tensor) -> None:
        self.lib.fx_rehash(ctypes.byref(self._ctx(slot_id)), t)

    def victims(self, tix: torch.Tensor, need: torch.Tensor, slot_id: torch.Tensor, last_seen: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """Up to ``need[r]`` LRU victims of each table ``tix[r]``: slots ``(k, max need)`` oldest first, and
        how many ``(k,)``; the head moves past them."""
        tix, need = _c(tix), _c(need)
        width = int(need.max())
        out = torch.zeros(tix.numel(), width, dtype=torch.int64)
        got = torch.zeros(tix.numel(), dtype=torch.int64)
        self.lib.fx_victims(ctypes.byref(self._ctx(slot_id, last_seen)), tix.numel(), _p(tix), _p(need), width,
                            _p(out), _p(got))
        return out, got

    def expired(self, tix: torch.Tensor, horizon: torch.Tensor, slot_id: torch.Tensor, last_seen: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """The occupied slots last seen before ``horizon[r]`` of tables ``tix[r]``, as flat ``(rows of tix,
        slots)`` ``(n,)`` each; the head leaves them."""
        tix, horizon = _c(tix), _c(horizon)
        bound = int((self.tail[tix] - self.head[tix]).sum())
        rows, slots = torch.empty(bound, dtype=torch.int64), torch.empty(bound, dtype=torch.int64)
        n = self.lib.fx_expired(ctypes.byref(self._ctx(slot_id, last_seen)), tix.numel(), _p(tix), _p(horizon),
                                _p(rows), _p(slots))
        return rows[:n], slots[:n]

    def append(self, tix: torch.Tensor, entries: torch.Tensor, n: torch.Tensor, slot_id: torch.Tensor,
               last_seen: torch.Tensor) -> None:
        """Append the first ``n[r]`` of ``entries`` ``(k, W)`` (``step * C + slot``) to table ``tix[r]``'s log
        (compacting, then growing it to ``max(needed, 2 L)``, as the torch one)."""
        tix, entries, n = _c(tix), _c(entries), _c(n)
        args = (tix.numel(), _p(tix), entries.shape[1], _p(entries), _p(n))
        over = self.lib.fx_append(ctypes.byref(self._ctx(slot_id, last_seen)), *args)
        if over:
            grown = torch.zeros(self.log.shape[0], max(over, 2 * self.log.shape[1]), dtype=torch.int64)
            grown[:, :self.log.shape[1]] = self.log
            self.log = grown
            self.lib.fx_append(ctypes.byref(self._ctx(slot_id, last_seen)), *args)

    def lookup_ids(self, tabs: Sequence[int], tix: torch.Tensor, q: torch.Tensor, valid: torch.Tensor | None,
                   step: torch.Tensor, rows: torch.Tensor, counters: torch.Tensor, slot_id: torch.Tensor,
                   last_seen: torch.Tensor) -> dict[str, torch.Tensor]:
        """``DynamicTableGroup.lookup_padded``'s id -> slot step for ``min_count == 1`` and tables without
        candidates: ids ``q`` ``(k, M)`` (real where ``valid``, None: all) of tables ``tabs`` (``tix``) at steps
        ``step`` ``(k,)``; updates ``rows`` ``(T,)``, ``counters`` ``(T, 5)`` (inserts, admitted, evictions),
        ``slot_id``, ``last_seen``, the maps and the free slots. Returns ``slot`` ``(k, M)`` (-1: padding or no
        slot), ``missed`` ``(k, M)`` bool (not admitted before), the fresh rows ``glob``/``ids``/``row``
        ``(F,)`` (global slot, id, row of ``tabs``), the log ``entries`` ``(k, M)`` with their number
        ``n`` ``(k,)``, and ``want``/``got`` ``(k,)`` (ids missed, slots given)."""
        k, width = q.shape
        tix, q, step = _c(tix), _c(q), _c(step)
        vmask = None if valid is None else valid.contiguous()
        old = [self.freed[t] for t in tabs]
        if any(f.numel() for f in old):
            freed = torch.cat(old)
            foff = torch.tensor([0] + [f.numel() for f in old]).cumsum(0)
        else:
            freed, foff = torch.empty(0, dtype=torch.int64), torch.zeros(k + 1, dtype=torch.int64)
        out = {"slot": torch.empty(k, width, dtype=torch.int64), "missed": torch.empty(k, width, dtype=torch.bool)}
        for name in ("glob", "ids", "row"):
            out[name] = torch.empty(k * width, dtype=torch.int64)
        out["entries"] = torch.empty(k, width, dtype=torch.int64)
        for name in ("n", "want", "got", "used"):
            out[name] = torch.zeros(k, dtype=torch.int64)
        fresh = self.lib.fx_lookup(
            ctypes.byref(self._ctx(slot_id, last_seen)), k, width, _p(tix), _p(q), _p(vmask), _p(step), _p(rows),
            _p(counters), _p(freed), _p(foff), *(_p(out[n]) for n in ("slot", "missed", "glob", "ids", "row",
                                                                        "entries", "n", "want", "got", "used")))
        for name in ("glob", "ids", "row"):
            out[name] = out[name][:fresh]
        used = out.pop("used")
        if bool(used.any()):
            for r, t in enumerate(tabs):
                if int(used[r]):
                    self.freed[t] = old[r][int(used[r]):]
        return out
