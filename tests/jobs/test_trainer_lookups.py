"""The job's per-lookup prefetch report (:mod:`jobs.trainer.lookups`): built from the optimized module of a model defined
here, run through ``parameter_servers`` + ``async_rpc_prefetch`` against a real local server; then the results
table's lines and results.json's entry."""

from __future__ import annotations

import functools
import inspect
import json
import warnings

import pytest
import torch
from torch import nn

import fxdist
import scheduling
from jobs.launcher.report import table, to_json
from jobs.trainer.lookups import optimize_record, prefetch_lines
from scheduling.ps import LocalCluster

HERE = "tests/jobs/test_trainer_lookups.py"


class ClusterAndPositions(nn.Module):
    """A lookup at a module's output (``argmax`` of a Linear: not prefetched), one at the input ids and one at
    ``torch.arange(3)`` (both prefetched): ids ``(B, 3)``, dense ``(B, 5)`` -> logits ``(B,)``."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(5, 6)
        self.cluster = nn.Embedding(6, 4)
        self.item = nn.Embedding(11, 4)
        self.pos = nn.Embedding(20, 4)
        self.top = nn.Linear(4, 1)

    def forward(self, dense, ids):
        c = self.cluster(self.proj(dense).argmax(dim=1))
        h = self.item(ids) + self.pos(torch.arange(3))
        return self.top(h.sum(dim=1) + c).squeeze(1)


@pytest.fixture(scope="module")
def optimized():
    with LocalCluster(1, timeout_s=30):
        ps = functools.partial(scheduling.parameter_servers, optimizer="sgd", lr=0.1, verbose=False,
                               group_tables=False)
        with warnings.catch_warnings(record=True) as record:
            warnings.simplefilter("always")
            gm = fxdist.optimize(ClusterAndPositions(), passes=(ps, "async_rpc_prefetch"))
        try:
            yield gm, [str(w.message) for w in record if w.category.__name__ == "PrefetchWarning"]
        finally:
            scheduling.placement.close(gm)


def _lines() -> tuple[int, int]:
    first = inspect.getsourcelines(ClusterAndPositions.forward)[1]
    return first + 1, first + 2


def test_the_record_says_per_lookup_whether_it_is_prefetched_and_where(optimized):
    gm, warned = optimized
    cluster_line, item_line = _lines()
    record = optimize_record(gm)
    assert [p["name"] for p in record["passes"]] == ["parameter_servers", "async_rpc_prefetch"]
    why = "its ids depend on the output of module 'proj' (server 0)"
    assert record["prefetch"] == {
        "cluster": {"prefetched": False, "reason": why, "where": f"{HERE}:{cluster_line}", "servers": [0]},
        "item": {"prefetched": True, "reason": None, "where": f"{HERE}:{item_line}", "servers": [0]},
        "pos": {"prefetched": True, "reason": None, "where": f"{HERE}:{item_line}", "servers": [0]}}
    # the warning names the user's expression, not the graph's internal nodes or the trace's tensor constants
    assert warned == [f"async_rpc_prefetch: the lookup of module 'cluster' (at {HERE}:{cluster_line} in forward: "
                      f"`c = self.cluster(self.proj(dense).argmax(dim=1))`) is not prefetched: {why}; it keeps the "
                      "in-step schedule"]
    assert not any(name in warned[0] for name in ("%", "index_to_kjt", "_tensor_constant"))


def test_the_results_table_and_json_carry_the_prefetch_of_each_lookup(optimized):
    gm, _ = optimized
    cluster_line, item_line = _lines()
    phase = {"qps": 100.0, "prefetched_lookups": 6, "optimize": optimize_record(gm)}
    why = "its ids depend on the output of module 'proj' (server 0)"
    expected = ["prefetch (async_rpc_prefetch): 2 of 3 lookups prefetched; 6 lookups answered by a prefetch",
                f"  cluster  NOT prefetched  {HERE}:{cluster_line}: {why}",
                f"  item     prefetched      {HERE}:{item_line}",
                f"  pos      prefetched      {HERE}:{item_line}"]
    assert prefetch_lines(phase) == expected
    results = {"job": "demo", "config": {}, "phases": {"optimized": phase}}
    text = table(results).splitlines()
    start = text.index(expected[0])
    assert text[start:start + 4] == expected
    saved = json.loads(json.dumps(to_json(results)))
    assert saved["phases"]["optimized"]["optimize"]["prefetch"]["cluster"] == {
        "prefetched": False, "reason": why, "where": f"{HERE}:{cluster_line}", "servers": [0]}


def test_no_prefetch_pass_no_lines_and_no_lookups_says_so():
    assert prefetch_lines({"optimize": {"passes": []}}) == []
    assert optimize_record(nn.Linear(2, 2)) == {"passes": []}
    assert prefetch_lines({"optimize": {"prefetch": {}}, "prefetched_lookups": 0}) == [
        "prefetch (async_rpc_prefetch): 0 of 0 lookups prefetched; 0 lookups answered by a prefetch "
        "(no table on the parameter servers)"]
