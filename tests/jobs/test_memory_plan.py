"""The job's memory plan places the tables where the ``parameter_servers`` pass places them.

Differential: for a few table sets and server counts, the bytes the memory plan gives each server
(:func:`jobs.launcher.checks.server_table_bytes`, one table set) equal the bytes each real server holds
(``PSServer.memory()``) after the pass moved a model with those tables to it, and its rows likewise.
"""

from __future__ import annotations

import functools

import pytest
import torch
from torch import nn
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor

import fxdist
import scheduling
from jobs.config import JobConfig
from jobs.launcher import checks
from jobs.optimizers import table_optimizer_args
from scheduling.ps import LocalCluster

NUM_TABLES = 26


class Tables(nn.Module):
    """The built-in DLRM's sparse side: tables ``t_C1 .. t_C26`` in ``sparse_arch.embedding_bag_collection``."""

    def __init__(self, sizes: list[int], dim: int) -> None:
        super().__init__()
        self.sparse_arch = nn.Module()
        self.sparse_arch.embedding_bag_collection = EmbeddingBagCollection(tables=[
            EmbeddingBagConfig(name=f"t_C{j + 1}", embedding_dim=dim, num_embeddings=n, feature_names=[f"C{j + 1}"])
            for j, n in enumerate(sizes)])

    def forward(self, kjt: KeyedJaggedTensor) -> torch.Tensor:
        return self.sparse_arch.embedding_bag_collection(kjt).values()


def _server_memory(names: list[str]) -> list[dict[str, int]]:
    from torch.distributed import rpc

    from scheduling.ps import server as srv

    return [rpc.rpc_sync(n, srv._rpc_stats, (), timeout=20) for n in names]


# (table sizes, servers, [model] plan): equal tables; one table too large to balance (row-wise); a pinned table
CASES = [
    ([50] * NUM_TABLES, 2, {}),
    ([70_000] + [10 * (j + 1) for j in range(NUM_TABLES - 1)], 3, {}),
    ([70_000] + [10 * (j + 1) for j in range(NUM_TABLES - 1)], 2, {}),
    ([300 - 7 * j for j in range(NUM_TABLES)], 3, {"t_C5": 2, "t_C1": "row_wise"}),
    ([1000 + j for j in range(NUM_TABLES)], 1, {}),
]


def test_memory_plan_bytes_equal_what_the_pass_places_on_each_server():
    with LocalCluster(num_servers=3, timeout_s=60.0) as cluster:
        for k, (sizes, n, plan) in enumerate(CASES):
            config = JobConfig().replace(model={"table_sizes": sizes, "embedding_dim": 4, "plan": plan},
                                         cluster={"parameter_servers": n})
            names = cluster.server_names[:n]
            before = _server_memory(names)
            kjt = KeyedJaggedTensor(keys=[f"C{j + 1}" for j in range(NUM_TABLES)],
                                    values=torch.zeros(NUM_TABLES, dtype=torch.long),
                                    lengths=torch.ones(NUM_TABLES, dtype=torch.long))
            to_servers = functools.partial(scheduling.parameter_servers, **table_optimizer_args(config),
                                           servers=tuple(names), client=f"memplan{k}",
                                           storage=config.model.server_storage)
            gm = fxdist.optimize(Tables(sizes, 4), passes=(to_servers,), example_inputs=(kjt,))
            after = _server_memory(names)
            placed_bytes = [a["bytes"] - b["bytes"] for a, b in zip(after, before)]
            placed_rows = [a["rows"] - b["rows"] for a, b in zip(after, before)]
            assert checks._server_rows(config) == placed_rows, (k, gm.meta["fxdist"]["placement"]["plan_text"])
            assert checks.server_table_bytes(config) == placed_bytes, k
            estimate = checks.estimate_memory(config)
            for i, held in enumerate(placed_bytes):  # the per-process estimate holds one table set per phase
                assert estimate.processes[f"ps{i}"] >= held


def test_a_large_table_makes_the_memory_plan_row_wise_as_the_pass_does():
    sizes = [70_000] + [10] * (NUM_TABLES - 1)
    config = JobConfig().replace(model={"table_sizes": sizes, "embedding_dim": 4}, cluster={"parameter_servers": 2})
    rows = checks._server_rows(config)
    assert sum(rows) == sum(sizes)
    assert abs(rows[0] - rows[1]) < 70_000 // 2  # split by rows, not one server holding the large table whole
    with pytest.raises(ValueError, match="nope"):
        checks._server_rows(config.replace(model={"plan": {"nope": "row_wise"}}))
