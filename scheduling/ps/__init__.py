"""Parameter-server runtime over ``torch.distributed.rpc`` (TensorPipe, TCP transport) or Ray actors.

Embedding tables (torchrec ``EmbeddingBagConfig``) are sharded table-wise or row-wise over N server
processes; trainers look up pooled embeddings for a ``KeyedJaggedTensor`` and push sparse gradients, which the
servers apply with a row-wise optimizer (row-wise Adagrad or SGD).

API for launchers (e.g. jobs/ with Ray). One static RPC group holds T trainers and N servers; rank 0 hosts
the rendezvous TCP store, so make a trainer rank 0 (the store must outlive server restarts)::

    # in each server process (a Ray actor: block=False, then stop_server() when done)
    from scheduling.ps import start_server
    start_server("ps0", rank=T + 0, world_size=T + N, master_addr=addr, master_port=port,
                 checkpoint=None, fetch_delay_s=0.0, timeout_s=60, block=True)
    # block=True serves until a client calls stop_servers(); start-up fails after timeout_s

    # in each trainer process (e.g. a Ray Train worker)
    from scheduling.ps import init_trainer, PSClient, PSEmbeddingBagCollection
    init_trainer(f"trainer{i}", rank=i, world_size=T + N, master_addr=addr, master_port=port)
    client = PSClient(tables, servers=[f"ps{j}" for j in range(N)], sharding="row_wise",
                      optimizer="rowwise_adagrad", optimizer_kwargs={"lr": 0.05}, name="ps", timeout_s=30)
    ebc = PSEmbeddingBagCollection("ps")            # drop-in for torchrec's EmbeddingBagCollection
    kt = ebc(kjt)                                   # KeyedTensor (B, sum D); lookup = blocking rpc_sync
    parts = ebc.lookup(kjt); kt = ebc.pool(kjt, parts)   # training: keep the parts, then after
    loss.backward(); ebc.push(kjt, parts)               # backward push each part's gradient once
    # (or PSEmbeddingBagCollection("ps", push_in_backward=True); for your own model, the
    # scheduling.parameter_servers pass does all this in its graph)
    client.push_async(s, kjt, part, next_kjt=next_batch_kjt)  # the push also asks for the next lookup,
                                                    # which the next client.lookup(s, next_batch_kjt) takes
    client.checkpoint("/ckpt")                      # each server writes /ckpt/<name>.pt
    client.close(stop_servers=True, shutdown_rpc=True)  # last trainer: servers' start_server returns

Rank 0 hosts the rendezvous store. Shutdown is never graceful (torch's graceful shutdown is a group barrier
that hangs after a crash). On one machine :class:`LocalCluster` starts N server processes and joins as
the trainer. When traced
(``fxdist.symbolic_trace``), lookups and pushes are single impure ``call_function`` nodes
(:mod:`scheduling.ps.ops`), which :func:`scheduling.async_rpc` splits into start/wait pairs.

Transports (:mod:`scheduling.ps.transport`): the above is ``torch_rpc``. With ``ray`` the servers are Ray
actors (:class:`~scheduling.ps.transport.ray_transport.PSActor`), called as ``handle.lookup.remote(...)`` and waited
with ``ray.get``; no group, no rendezvous::

    with LocalCluster(num_servers=2, transport="ray") as cluster:   # actors registered as "ps0", "ps1"
        client = PSClient(tables, cluster.server_names, ...)       # picks transport="ray" for those names

The tables, optimizer, step order and fused path are the same code on both
(:class:`~scheduling.ps.endpoints.ServerEndpoints`). Each transport's server lifecycle (start, kill, stop;
in a job, ready the servers for a new trainer group, join, leave) is one object,
:func:`~scheduling.ps.lifecycle.server_group` ``(name)``: ``TorchRPCServers`` or ``RayServers``.

Faults: every RPC fails with :class:`PSUnavailableError` after ``timeout_s`` (crashed or unreachable
server). ``torch.distributed.rpc`` cannot re-admit a crashed member into a live group, so recovery restarts
the group: close the client, start the servers with ``checkpoint=<dir>/<name>.pt`` from the last
``client.checkpoint(dir)``, re-join, create the client again (shards from the checkpoint are kept).
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "TableSpec": "shard_plan", "ShardSpec": "shard_plan", "table_specs": "shard_plan", "plan_shards": "shard_plan",
    "RowWiseSGD": "optimizer", "RowWiseAdagrad": "optimizer", "make_optimizer": "optimizer",
    "PSServer": "server", "start_server": "server", "stop_server": "server",
    "PSClient": "client", "ClientOptions": "client_options", "PSUnavailableError": "client", "get_client": "client", "init_trainer": "client",
    "PSEmbeddingBagCollection": "ebc", "LocalCluster": "local_cluster", "free_port": "transport.ports", "free_port_block": "transport.ports",
    "group_servers": "local_cluster", "NoGroupError": "local_cluster",
    "ps_lookup": "ops", "ps_push": "ops", "ps_pool": "ops", "ps_backward": "ops",
    "ServerEndpoints": "endpoints", "TRANSPORTS": "transport", "make_transport": "transport",
    "server_group": "lifecycle", "SERVER_GROUPS": "lifecycle", "DEFAULT_WORKER_THREADS": "endpoints",
    "ProcessHost": "hosts", "ActorHost": "transport.ray_transport", "server_actor_class": "transport.ray_transport", "PSActor": "transport.ray_transport",
    "wait_all": "transport.ray_transport", "is_bind_failure": "transport.ports",
    "serve_in_trainer": "in_trainers", "stop_serving": "in_trainers", "trainer_servers": "in_trainers",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'scheduling.ps' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"scheduling.ps.{module}"), name)
    globals()[name] = value
    return value
