"""TensorPipe options (timeouts, threads) and the timed ``tcp://`` rendezvous of a PS group (:mod:`scheduling.ps.transport.rendezvous`)."""

from __future__ import annotations

from scheduling.ps import server
from scheduling.ps.transport.rendezvous import rpc_backend_options


def test_tcp_rendezvous_goes_through_the_timed_handler_and_tcp_transport_only():
    opts = rpc_backend_options("tcp://127.0.0.1:29512", 7.5, num_worker_threads=3)
    assert opts.init_method == "fxdisttcp://127.0.0.1:29512?timeout_s=7.5"
    assert opts.rpc_timeout == 7.5 and opts.num_worker_threads == 3
    # other schemes are left as given; the server module still offers the same function
    assert rpc_backend_options("file:///tmp/x", 2.0).init_method == "file:///tmp/x"
    assert server.rpc_backend_options is rpc_backend_options
