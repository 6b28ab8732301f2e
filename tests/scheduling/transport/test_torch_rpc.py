"""The ``torch_rpc`` client transport's own checks (its requests run in tests/scheduling/test_local_cluster.py)."""

import pytest

from scheduling.ps.transport import make_transport
from scheduling.ps.transport.torch_rpc import TorchRPCTransport


def test_servers_must_be_rpc_worker_names() -> None:
    with pytest.raises(ValueError, match=r"RPC worker names .*transport='ray'"):
        TorchRPCTransport(["ps0", object()])


def test_make_transport_builds_it_by_name() -> None:
    transport = make_transport("torch_rpc", ["ps0", "ps1"])
    assert isinstance(transport, TorchRPCTransport) and transport.names == ["ps0", "ps1"]
