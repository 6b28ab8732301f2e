"""The wording of the results table (jobs.launcher.report.table) and of the placement plan: counts with the right plural, and
the pass records said in words."""

from __future__ import annotations

from jobs.launcher.report import counted, table


def _results(trainers: int, servers: int) -> dict:
    passes = [{"name": "parameter_servers", "nodes_added": 3, "nodes_erased": 1},
              {"name": "async_rpc_prefetch", "nodes_added": 1, "nodes_erased": 0}]
    return {"job": "j", "config": {"cluster": {"trainers": trainers, "parameter_servers": servers},
                                   "job": {"steps": 10, "batch_size": 8}},
            "phases": {"optimized": {"qps": 1.0, "optimize": {"passes": passes}}}}


def test_counted():
    assert [counted(n, "server") for n in (0, 1, 2)] == ["0 servers", "1 server", "2 servers"]


def test_the_table_says_counts_and_pass_records_in_words():
    text = table(_results(1, 1))
    assert "fxdist job j: 1 trainer, 1 parameter server, 10 steps per phase" in text
    assert ("passes run: parameter_servers (3 graph nodes added, 1 removed), "
            "async_rpc_prefetch (1 graph node added, 0 removed)") in text
    assert "+/" not in text
    assert "2 trainers, 0 parameter servers," in table(_results(2, 0))


def test_the_placement_plan_header_counts_tables_and_servers():
    import torch
    from torch import nn

    import scheduling
    from scheduling.ps import LocalCluster

    class OneBag(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.bag = nn.EmbeddingBag(10, 4, mode="sum")

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            return self.bag(ids)

    with LocalCluster(num_servers=1):
        gm = scheduling.parameter_servers(OneBag(), optimizer="sgd", lr=0.1, verbose=False)
        text = gm.meta["fxdist"]["placement"]["plan_text"]
    assert text.startswith("parameter_servers plan: 1 table on 1 server, optimizer sgd")
