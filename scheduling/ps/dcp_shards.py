"""Embedding-table checkpoints by shard with ``torch.distributed.checkpoint`` (DCP), written and read by the
parameter servers themselves, without a process group among them.

Layout of one checkpoint folder (one model, e.g. one phase of a job)::

    <folder>/.metadata                  the merged DCP metadata (chunk descriptors only, no rows)
    <folder>/<namespace>@<server>/      one server's shards of one namespace, written by that server alone
        .metadata                       its own DCP metadata
        __0_0.distcp                    its rows

Keys are the model's state-dict names: ``"<path>.weight"`` of global shape ``(N, D)`` float32 and
``"<path>.momentum"`` ``(N,)`` (row-wise Adagrad's accumulator), each server's shard a chunk at its row offset;
a dynamic table (held whole by one server) as plain tensors of its state under ``"<path>.dynamic.<name>"``
(:func:`flatten_dynamic`).

- :func:`write_shards` (a server): ``torch.distributed.checkpoint.save`` with ``no_dist=True`` and
  :class:`ChunkSavePlanner`, which declares each tensor as a chunk of its global tensor;
- :func:`merge_metadata` (the trainer): the servers' small ``.metadata`` files into one at the top, so that DCP's
  own :class:`~torch.distributed.checkpoint.FileSystemReader` and load planners read the folder as one checkpoint;
- :func:`read_rows` (a server, on restore): ``torch.distributed.checkpoint.load`` with :class:`ChunkLoadPlanner`,
  which declares each local tensor's row offset, so DCP reads only the saved chunks that overlap it (DCP's
  resharding, ``create_read_items_for_chunk_list``) whatever number of servers wrote them.

DCP stores its ``.metadata`` with ``pickle``; :class:`SafeReader` reads it with :class:`MetadataUnpickler`, which
resolves only DCP's metadata classes, ``torch.Size`` and torch dtypes / layouts / memory formats (anything else is
refused), and DCP itself loads the tensor files with ``torch.load(weights_only=True)``. Nothing here writes or
reads a ``BYTE_IO`` item (they would be unpickled with ``weights_only=False``): every value is a tensor.

:func:`fingerprint` is a digest of a table's rows that does not depend on how they are sharded: a sum modulo
``2**64`` over every element of its float32 bits times an odd multiplier drawn from its global position, so the
servers' partial sums over their shards add up to the same number on 1, 2 or 3 servers (and any changed element
changes it).

Source: PyTorch ``torch.distributed.checkpoint`` docs (``save``/``load`` with ``no_dist``, ``SavePlanner`` /
``LoadPlanner``, ``FileSystemReader``, resharding on load); torchrec's row-wise sharded checkpoints (each rank
writes its own rows as a chunk of the global table); Python ``pickle`` ("Restricting Globals").
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import pickle
import re
import warnings
from collections.abc import Iterator, Mapping
from pathlib import Path, PurePosixPath
from typing import Any

import numpy as np
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint import metadata as md
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.planner import SavePlan, TensorWriteData, WriteItem, WriteItemType
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

__all__ = ["ChunkSavePlanner", "ChunkLoadPlanner", "SafeReader", "MetadataUnpickler", "write_shards", "read_rows",
           "merge_metadata", "read_metadata", "subfolder", "fingerprint", "flatten_dynamic", "unflatten_dynamic",
           "METADATA"]

METADATA = ".metadata"
"""DCP's metadata file name, in each server's sub-folder and (merged) at the top."""
_INT = "#int"
"""Suffix of a dynamic table's integer scalar stored as a 0-d int64 tensor."""


class ChunkSavePlanner(DefaultSavePlanner):
    """A DCP save planner for tensors that are chunks of larger global tensors.

    Args:
        chunks: ``{key: (row offset, global rows)}``: the tensor under ``key`` is rows ``[offset, offset + R)`` of a
            global tensor of ``global rows`` rows (its other dimensions as the tensor's). Keys not listed are whole
            tensors.
    """

    def __init__(self, chunks: Mapping[str, tuple[int, int]]) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self.chunks = dict(chunks)

    def create_local_plan(self) -> SavePlan:
        """One ``SHARD`` write item per chunk (its offset and the global size), a ``TENSOR`` item per whole tensor.

        Raises:
            TypeError: a value that is not a tensor.
        """
        items = []
        for key, tensor in self.state_dict.items():
            if not isinstance(tensor, torch.Tensor):
                raise TypeError(f"ChunkSavePlanner: {key!r} is a {type(tensor).__name__}, not a tensor")
            offset, rows = self.chunks.get(key, (0, tensor.shape[0] if tensor.dim() else 0))
            offsets = torch.Size([offset] + [0] * (tensor.dim() - 1)) if tensor.dim() else torch.Size([])
            size = torch.Size([rows, *tensor.shape[1:]]) if tensor.dim() else torch.Size([])
            items.append(WriteItem(
                index=md.MetadataIndex(key, offsets),
                type=WriteItemType.SHARD if key in self.chunks else WriteItemType.TENSOR,
                tensor_data=TensorWriteData(
                    chunk=md.ChunkStorageMetadata(offsets=offsets, sizes=tensor.size()),
                    properties=md.TensorProperties.create_from_tensor(tensor), size=size)))
        self.plan = SavePlan(items)
        return self.plan

    def lookup_object(self, index: md.MetadataIndex) -> Any:
        """The local tensor of ``index.fqn`` (whatever its offset in the global tensor)."""
        return self.state_dict[index.fqn]


class ChunkLoadPlanner(DefaultLoadPlanner):
    """A DCP load planner filling local tensors that are row ranges of the checkpoint's global tensors.

    Args:
        chunks: ``{key: row offset}`` of each local tensor (absent: 0, the whole tensor or its first rows).
    """

    def __init__(self, chunks: Mapping[str, int]) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self.chunks = dict(chunks)

    def create_local_plan(self) -> Any:
        """Read items for the saved chunks that overlap each local tensor's rows (DCP's resharding).

        Raises:
            KeyError: a key the checkpoint does not hold (the message lists what it holds).
            ValueError: a local tensor whose width or rows do not fit the saved global tensor.
        """
        from torch.distributed.checkpoint.planner import LoadPlan

        assert self.metadata is not None
        saved = self.metadata.state_dict_metadata
        items = []
        for key, tensor in self.state_dict.items():
            if key not in saved:
                raise KeyError(f"checkpoint has no {key!r} (it holds {sorted(saved)})")
            meta = saved[key]
            if not isinstance(meta, md.TensorStorageMetadata):
                raise ValueError(f"checkpoint holds {key!r} as bytes, not a tensor")
            offset = self.chunks.get(key, 0)
            if tensor.dim() != len(meta.size) or (tensor.dim() and (
                    tuple(tensor.shape[1:]) != tuple(meta.size[1:]) or offset + tensor.shape[0] > meta.size[0])):
                raise ValueError(f"{key!r}: local rows [{offset}, {offset + (tensor.shape[0] if tensor.dim() else 0)}) "
                                 f"x {tuple(tensor.shape[1:])} do not fit the saved {tuple(meta.size)}")
            offsets = torch.Size([offset] + [0] * (tensor.dim() - 1)) if tensor.dim() else torch.Size([])
            local = md.ChunkStorageMetadata(offsets=offsets, sizes=tensor.size())
            items += create_read_items_for_chunk_list(key, meta, [local])
        return LoadPlan(items)

    def lookup_tensor(self, index: md.MetadataIndex) -> torch.Tensor:
        """The local tensor of ``index.fqn`` (read items' offsets are relative to it)."""
        return self.state_dict[index.fqn]


_ALLOWED: dict[tuple[str, str], Any] = {
    **{("torch.distributed.checkpoint.metadata", c.__name__): c for c in (
        md.Metadata, md.TensorStorageMetadata, md.BytesStorageMetadata, md.ChunkStorageMetadata,
        md.TensorProperties, md.MetadataIndex, md.StorageMeta, md._MEM_FORMAT_ENCODING)},
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"): _StorageInfo,
    ("torch", "Size"): torch.Size,
    ("pathlib", "PosixPath"): PurePosixPath,   # a writer's checkpoint id: a path, never opened here
    ("torch.serialization", "_get_layout"): lambda name: _torch_attr(name, torch.layout),
    ("collections", "OrderedDict"): __import__("collections").OrderedDict,
}


def _torch_attr(name: Any, kind: type) -> Any:
    """``torch.<name>`` when it is a ``kind`` (a dtype, layout or memory format), else refused."""
    found = getattr(torch, str(name).removeprefix("torch."), None)
    if not isinstance(found, kind):
        raise pickle.UnpicklingError(f"refused {name!r}: not a torch {kind.__name__}")
    return found


class MetadataUnpickler(pickle.Unpickler):
    """Reads DCP ``.metadata``: resolves only DCP's metadata classes, ``torch.Size`` and torch's dtypes, layouts and
    memory formats."""

    def find_class(self, module: str, name: str) -> Any:
        """The allowed object ``module.name`` stands for.

        Raises:
            pickle.UnpicklingError: ``module.name`` is not allowed.
        """
        found = _ALLOWED.get((module, name))
        if found is None and module == "torch" and "." not in name:
            attr = getattr(torch, name, None)
            if isinstance(attr, (torch.dtype, torch.layout, torch.memory_format)):
                found = attr
        if found is None:
            raise pickle.UnpicklingError(f"refused global {module}.{name} in a checkpoint's {METADATA}: not one of "
                                         "torch.distributed.checkpoint's metadata types")
        return found


def read_metadata(path: str | os.PathLike) -> md.Metadata:
    """A DCP ``.metadata`` file, read with :class:`MetadataUnpickler`.

    Raises:
        pickle.UnpicklingError: the file names a global that is not allowed, or is not a DCP metadata file.
        FileNotFoundError: no such file.
    """
    with open(path, "rb") as f:
        meta = MetadataUnpickler(f).load()
    if not isinstance(meta, md.Metadata):
        raise pickle.UnpicklingError(f"{path} holds a {type(meta).__name__}, not DCP metadata")
    return meta


class SafeReader(FileSystemReader):
    """:class:`torch.distributed.checkpoint.FileSystemReader` reading ``.metadata`` with
    :class:`MetadataUnpickler` (DCP itself unpickles it unrestricted)."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> md.Metadata:
        """The folder's metadata (:func:`read_metadata`).

        Raises:
            pickle.UnpicklingError: see :func:`read_metadata`.
        """
        rank = kwargs.get("rank")   # DCP first asks for a rank's own metadata (none here: not found)
        meta = read_metadata(Path(self.path) / (METADATA if rank is None else f"__{rank}{METADATA}"))
        storage = meta.storage_meta if meta.storage_meta is not None else md.StorageMeta()
        storage.load_id = self.load_id
        meta.storage_meta = storage
        return meta


def subfolder(directory: str | os.PathLike, namespace: str, server: str) -> Path:
    """``<directory>/<namespace>@<server>``: where one server writes one namespace's shards (characters other than
    letters, digits, ``_.-`` replaced by ``_``)."""
    def safe(name: str) -> str:
        return re.sub(r"[^A-Za-z0-9_.-]", "_", name)

    return Path(directory) / f"{safe(namespace)}@{safe(server)}"


@contextlib.contextmanager
def _single_process() -> Iterator[None]:
    """Around a ``no_dist`` DCP call: without its warning that it assumes one process (it is meant), and raising the
    planner's or writer's own exception (DCP wraps them in a ``CheckpointException``, a ``BaseException``)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        try:
            yield
        except CheckpointException as e:
            failures = [exc for exc, _ in e.failures.values()]
            if failures and isinstance(failures[0], Exception):
                raise failures[0] from None
            raise RuntimeError(str(e)) from None


def write_shards(tensors: Mapping[str, tuple[torch.Tensor, int, int]], directory: str | os.PathLike) -> int:
    """Write ``{key: (tensor, row offset, global rows)}`` as one DCP checkpoint in ``directory`` (created), from
    this process alone (``no_dist=True``); a tensor whose global rows are its own rows at offset 0 is written
    whole. Returns the bytes of tensor data written.

    Raises:
        TypeError: a value that is not a tensor.
    """
    Path(directory).mkdir(parents=True, exist_ok=True)
    state = {k: t for k, (t, _, _) in tensors.items()}
    chunks = {k: (off, rows) for k, (t, off, rows) in tensors.items() if t.dim() and (off, rows) != (0, t.shape[0])}
    with _single_process():
        dcp.save(state, storage_writer=FileSystemWriter(str(directory), single_file_per_rank=True, sync_files=False),
                 planner=ChunkSavePlanner(chunks), no_dist=True)
    return sum(t.numel() * t.element_size() for t in state.values())


def read_rows(directory: str | os.PathLike, targets: Mapping[str, tuple[torch.Tensor, int]]) -> None:
    """Fill ``{key: (tensor, row offset)}`` in place from the DCP checkpoint in ``directory`` (its merged
    ``.metadata``), reading only the saved chunks that overlap each tensor's rows.

    Raises:
        KeyError, ValueError: see :meth:`ChunkLoadPlanner.create_local_plan`.
        pickle.UnpicklingError, FileNotFoundError: see :func:`read_metadata`.
    """
    if not targets:
        return
    read_metadata(Path(directory) / METADATA)   # its own errors here (DCP would turn them into an AssertionError)
    with _single_process():
        dcp.load({k: t for k, (t, _) in targets.items()}, storage_reader=SafeReader(str(directory)),
                 planner=ChunkLoadPlanner({k: off for k, (_, off) in targets.items()}), no_dist=True)


def merge_metadata(directory: str | os.PathLike) -> md.Metadata:
    """Merge the ``.metadata`` of every sub-folder of ``directory`` into ``<directory>/.metadata`` (written
    atomically): each tensor's chunks from all sub-folders, each chunk's storage at ``<sub-folder>/<file>``.

    Raises:
        ValueError: no sub-folder has metadata; two sub-folders disagree on a key's global size or hold the same
            chunk; a row-sharded key's chunks do not cover its rows exactly once (each message names the key).
    """
    root = Path(directory)
    merged: dict[str, md.TensorStorageMetadata] = {}
    storage: dict[md.MetadataIndex, _StorageInfo] = {}
    subs = sorted(p for p in root.iterdir() if (p / METADATA).is_file()) if root.is_dir() else []
    if not subs:
        raise ValueError(f"merge_metadata: no server wrote a checkpoint under {root}")
    for sub in subs:
        meta = read_metadata(sub / METADATA)
        for key, value in meta.state_dict_metadata.items():
            if not isinstance(value, md.TensorStorageMetadata):
                raise ValueError(f"merge_metadata: {key!r} in {sub.name} is not a tensor")
            have = merged.setdefault(key, md.TensorStorageMetadata(value.properties, value.size, []))
            if have.size != value.size:
                raise ValueError(f"merge_metadata: {key!r} is {tuple(value.size)} in {sub.name}, "
                                 f"{tuple(have.size)} elsewhere")
            have.chunks.extend(value.chunks)
        for index, info in (meta.storage_data or {}).items():
            if index in storage:
                raise ValueError(f"merge_metadata: chunk {index.fqn!r} at {tuple(index.offset or ())} written twice")
            storage[index] = dataclasses.replace(info, relative_path=f"{sub.name}/{info.relative_path}")
    for key, value in merged.items():
        _check_rows(key, value)
    out = md.Metadata(state_dict_metadata=dict(merged), storage_data=storage)
    tmp = root / (METADATA + ".tmp")
    with open(tmp, "wb") as f:
        pickle.dump(out, f)
    os.replace(tmp, root / METADATA)
    return out


def _check_rows(key: str, value: md.TensorStorageMetadata) -> None:
    """A key's chunks cover its rows ``[0, N)`` exactly once (each chunk full width)."""
    if not value.size:
        return
    end = 0
    for chunk in sorted(value.chunks, key=lambda c: c.offsets[0]):
        if chunk.offsets[0] != end or tuple(chunk.sizes[1:]) != tuple(value.size[1:]):
            raise ValueError(f"merge_metadata: {key!r} rows from {min(end, chunk.offsets[0])} are held twice or by "
                             "no server")
        end += chunk.sizes[0]
    if end != value.size[0]:
        raise ValueError(f"merge_metadata: {key!r} rows [{end}, {value.size[0]}) are on no server")


_MASK = (1 << 64) - 1
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_GOLDEN2 = np.uint64(0xC2B2AE3D27D4EB4F)
_BLOCK = 1 << 20
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
"""The integer type of each element size: fingerprints read the elements' bit patterns."""


def fingerprint(tensor: torch.Tensor, row_start: int = 0) -> int:
    """A digest of ``tensor``'s rows that does not depend on how the global tensor is sharded: the sum modulo
    ``2**64`` over its elements of (their bit pattern) x (an odd multiplier of their global row) x (an odd
    multiplier of their column), ``tensor`` being rows ``[row_start, row_start + R)`` of the global one. The fingerprints of a table's shards add
    up (modulo ``2**64``) to the whole table's; a 0-d or 1-d tensor counts as one column.

    >>> w = torch.randn(10, 3)
    >>> (fingerprint(w[:4]) + fingerprint(w[4:], 4)) % 2**64 == fingerprint(w)
    True
    """
    if tensor.numel() == 0:
        return 0
    flat = tensor.detach().reshape(tensor.shape[0] if tensor.dim() else 1, -1).contiguous()
    width = flat.shape[1]
    bits = flat.view(_BITS[flat.element_size()])
    with np.errstate(over="ignore"):
        cols = (np.arange(1, width + 1, dtype=np.uint64) * _GOLDEN2) | np.uint64(1)
        total, step = 0, max(1, _BLOCK // max(width, 1))
        for r in range(0, flat.shape[0], step):
            block = bits[r:r + step].numpy().astype(np.uint64)
            rows = (np.arange(row_start + r + 1, row_start + r + 1 + block.shape[0], dtype=np.uint64) * _GOLDEN
                    ) | np.uint64(1)
            total = (total + int(((block @ cols) * rows).sum(dtype=np.uint64))) & _MASK
    return total


def flatten_dynamic(path: str, state: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    """A dynamic table's state (:meth:`scheduling.ps.dynamic.DynamicTable.state_dict`) as plain tensors:
    ``"<path>.dynamic.<name>"`` (nested dicts joined with ``.``; an integer as a 0-d int64 tensor whose key ends in
    ``#int``; None left out).

    Raises:
        TypeError: a value that is neither a tensor, an int, a dict nor None.
    """
    out: dict[str, torch.Tensor] = {}

    def walk(prefix: str, value: Any) -> None:
        if isinstance(value, torch.Tensor):
            out[prefix] = value
        elif isinstance(value, bool) or not isinstance(value, (int, dict)) and value is not None:
            raise TypeError(f"flatten_dynamic: {prefix!r} is a {type(value).__name__}")
        elif isinstance(value, int):
            out[prefix + _INT] = torch.tensor(value, dtype=torch.int64)
        elif isinstance(value, dict):
            for k, v in value.items():
                walk(f"{prefix}.{k}", v)

    walk(f"{path}.dynamic", state)
    return out


def unflatten_dynamic(path: str, flat: Mapping[str, torch.Tensor]) -> dict[str, Any]:
    """:func:`flatten_dynamic`'s inverse for the keys under ``"<path>.dynamic."`` (others ignored); the table's
    ``state`` (optimizer state) is None when absent."""
    prefix = f"{path}.dynamic."
    out: dict[str, Any] = {"state": None}
    value: Any
    for key, value in flat.items():
        if not key.startswith(prefix):
            continue
        name, whole = key[len(prefix):], value
        if name.endswith(_INT):
            name, whole = name[:-len(_INT)], int(whole.item())
        *parents, leaf = name.split(".")
        node = out
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = whole
    return out

