"""``LocalCluster`` used twice in one process: the second cluster, with another learning rate, trains
with its own optimizer although the first cluster's clients were never closed by the user.

The first cluster's clients are closed with it (their servers are gone; the second cluster's servers have
the same names ``ps<i>``), so the placement pass no longer sees a live client with another optimizer on them.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import scheduling
from scheduling.ps import LocalCluster, get_client
from scheduling.ps.client import live_clients


class TwoBags(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.user = nn.EmbeddingBag(12, 4, mode="sum")
        self.item = nn.EmbeddingBag(9, 4, mode="sum")

    def forward(self, users: torch.Tensor, items: torch.Tensor) -> torch.Tensor:
        return (self.user(users) * self.item(items)).sum(1)


def _step(lr: float, transport: str) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], list[str]]:
    """One step with the tables on the servers; returns (expected tables after local SGD, the servers')."""
    torch.manual_seed(0)
    model = TwoBags()
    users, items = torch.tensor([[1, 2], [3, 3]]), torch.tensor([[0, 8], [5, 1]])
    local = TwoBags()
    local.load_state_dict(model.state_dict())
    local(users, items).pow(2).sum().backward()
    expected = {k: (p - lr * p.grad).detach() for k, p in local.named_parameters()}
    gm = scheduling.parameter_servers(model, optimizer="sgd", lr=lr, verbose=False)
    gm(users, items).pow(2).sum().backward()
    scheduling.placement.flush(gm)
    names = scheduling.placement.client_names(gm)
    assert all(get_client(n).transport.name == transport for n in names)
    return expected, scheduling.placement.table_state_dict(gm), names   # the clients are left open


@pytest.mark.parametrize("transport", ["torch_rpc", "ray", "socket"])
def test_a_second_local_cluster_trains_with_its_own_learning_rate(transport):
    if transport == "ray":
        pytest.importorskip("ray")
    results = []
    for lr in (0.1, 0.7):
        with LocalCluster(1, timeout_s=30, transport=transport) as cluster:
            expected, got, names = _step(lr, transport)
            assert {c.name for c in live_clients()} >= set(names)
            results.append((expected, got))
        assert not set(names) & {c.name for c in live_clients()}        # closed with their cluster
        with pytest.raises(KeyError, match="no PSClient named"):
            get_client(names[0])
        assert cluster.server_names == ["ps0"]
    for expected, got in results:
        assert got.keys() == expected.keys() == {"user.weight", "item.weight"}
        for key in got:
            torch.testing.assert_close(got[key], expected[key], rtol=1e-6, atol=1e-7)
    assert not torch.allclose(results[0][1]["user.weight"], results[1][1]["user.weight"])  # lr 0.1 vs 0.7


def test_an_unknown_transport_names_the_known_ones():
    from scheduling.ps.lifecycle import server_group
    from scheduling.ps.transport import make_transport

    for make in (lambda: LocalCluster(1, transport="grpc"), lambda: make_transport("grpc", ["ps0"]),
                 lambda: server_group("grpc")):
        with pytest.raises(ValueError, match=r"unknown parameter-server transport 'grpc'; known transports: "
                                             r"ray, socket, torch_rpc"):
            make()


_QUIET_SCRIPT = """
import os
from scheduling.ps import LocalCluster
from scheduling.placement import parameter_servers  # a KeyedJaggedTensor and the servers' tables

with LocalCluster(num_servers=2):
    from torchrec import KeyedJaggedTensor
    import torch
    KeyedJaggedTensor(keys=["f"], values=torch.tensor([1]), lengths=torch.tensor([1]))
print("cluster closed", flush=True)
"""


def test_a_local_cluster_starts_and_stops_without_torchs_noise(tmp_path):
    """gloo's 'deprecated since PyTorch 2.0' warning (one per member), TensorPipe's 'EOF' / 'pipe closed' lines at
    shutdown (five with two servers) and torch.fx's is_fx_tracing notice, in a fresh process."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": f"{root}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    proc = subprocess.run([sys.executable, "-c", _QUIET_SCRIPT], capture_output=True, text=True, timeout=180,
                          cwd=tmp_path, env=env)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert "cluster closed" in proc.stdout
    for noise in ("deprecated since PyTorch 2.0", "encountered error when reading incoming request",
                  "is_fx_tracing will return true"):
        assert noise not in out, out
