"""A trainer's own CPU per step: fxdist's exact prefetch against the ceiling, one process, no DDP.

The model and batches of ``benchmarks/peer.py`` (torchrec's DLRM over 26 tables of ``--rows`` x ``--dim``, batch
128, SGD): the ceiling is its ``dense_only`` model (the sparse arch a constant: no lookups, no table gradients);
fxdist is the same DLRM through ``fxdist.optimize(model, passes=(parameter_servers(sgd), "async_rpc_prefetch"))``
with its tables on one ``socket`` server in a child process (the job's default transport), each step passing the
next batch (``next_sparse_features``). All train in this process with one torch thread, without DDP (one
trainer), so each step's CPU is the trainer's own: forward, backward (with fxdist's push and the next lookup) and
the optimizer step. A third system, ``ceiling_grad``, is the ceiling whose constant sparse output is a fresh leaf
that requires grad each step (as fxdist's fetched rows are): backward then also computes the gradient of the 26
pooled embeddings, which any system that trains the tables must (DMP as well), and which the ceiling skips. So
``ceiling_grad - ceiling`` is that gradient's cost, and ``fxdist - ceiling_grad`` what fxdist itself adds (the
lookups, the pooling, the push and the graph).

Measured: the main thread's CPU time of every step (``time.thread_time``), the systems taking turns every
:data:`CHUNK` steps (so the machine's slow drifts reach all three alike), ``--rounds`` x ``--steps`` steps each;
the socket's threads apart (the connection's reader and, with ``FXDIST_SOCKET_SEND_THREAD`` on, its sender; their
``/proc/self/task`` entries). It prints each system's median and quartiles, the two differences and the ratios
ceiling / fxdist and ceiling_grad / fxdist, fxdist with its socket threads and with its main thread alone: where a
server runs on cores of its own (16 cores) the step follows the trainers' main threads, so the main-thread ratio
bounds the fraction of ``peer.py``'s ceiling a trainer can reach (on 2 shared cores the server's CPU and the
socket threads' come on top). The losses are printed as a sanity check that each trained (the ceilings have no
tables, so theirs differ).

Run: ``.venv/bin/python benchmarks/trainer_step.py [--rows 1000000 --dim 16 --steps 200 --rounds 3]``
(``FXDIST_SOCKET_SEND_THREAD=1`` / ``0`` in the environment: the pushes sent by a sender thread / by the main thread;
by default ``auto``, off below 8 CPUs).
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import sys
import time
import uuid
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import _peer_systems as peer  # noqa: E402  (benchmarks/ is sys.path[0] when run as a script)

CHUNK = 20
"""Steps a system runs before the next takes its turn (slow drifts of the machine then reach all alike)."""


def _thread_cpu_ms(name_prefix: str) -> float:
    """CPU ms so far of this process's Python threads whose name starts with ``name_prefix`` (their
    ``/proc/self/task/<native id>/schedstat``)."""
    import threading

    total = 0
    for thread in threading.enumerate():
        if thread.name.startswith(name_prefix) and thread.native_id is not None:
            try:
                with open(f"/proc/self/task/{thread.native_id}/schedstat") as f:
                    total += int(f.read().split()[0])
            except OSError:
                continue
    return total / 1e6


class _PooledWithGrad(peer.ConstantPooled):
    """:class:`ConstantPooled` whose output is a fresh leaf requiring grad each call (its gradient computed, then
    dropped with it)."""

    def forward(self, features: object) -> torch.Tensor:
        return self.value.detach().requires_grad_()


SOCKET_THREADS = "fxdist-socket-"
"""Name prefix of the socket transport's threads: a connection's reader and, when on, its sender
(``fxdist-socket-send-``)."""


def _run(step, count: int) -> tuple[list[float], float, float, float]:
    """(main-thread CPU ms of each of ``count`` steps, the socket threads' CPU ms, of which the sender threads', the
    last loss)."""
    cpu = []
    threads0, sender0 = _thread_cpu_ms(SOCKET_THREADS), _thread_cpu_ms(SOCKET_THREADS + "send-")
    loss = torch.zeros(())
    for i in range(count):
        t0 = time.thread_time()
        loss = step(i)
        cpu.append((time.thread_time() - t0) * 1e3)
    return (cpu, _thread_cpu_ms(SOCKET_THREADS) - threads0, _thread_cpu_ms(SOCKET_THREADS + "send-") - sender0,
            float(loss))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=1_000_000)
    p.add_argument("--dim", type=int, default=16)
    p.add_argument("--steps", type=int, default=200, help="timed steps per round and system (a multiple of 20)")
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    torch.set_num_threads(1)

    import fxdist
    import scheduling
    from scheduling import placement
    from scheduling.ps.transport.socket_server import spawn_servers
    from scheduling.ps.transport.socket_transport import register_servers, send_thread

    procs, addresses = spawn_servers(["ps0"])
    register_servers({"ps0": addresses[0]})
    data = peer.batches(0, args.warmup + args.rounds * args.steps + 1, args.rows)   # the same batches, each system
    try:
        ceiling = peer.dense_only_model(args.rows, args.dim)
        ceiling_grad = peer.dense_only_model(args.rows, args.dim)
        ceiling_grad.sparse_arch = _PooledWithGrad(peer.BATCH, peer.TABLES, args.rows, args.dim)
        ps = functools.partial(scheduling.parameter_servers, optimizer="sgd", lr=peer.LR, rank=0, world_size=1,
                               group=f"trainer-step-{uuid.uuid4().hex}", verbose=False, plan=peer.plan(1),
                               servers=["ps0"], seed=peer.TABLE_SEED, timeout_s=120.0)
        gm = fxdist.optimize(peer.dlrm(args.rows, args.dim, tables_device="meta"), passes=(ps, "async_rpc_prefetch"))
        models = {"ceiling": ceiling, "ceiling_grad": ceiling_grad}
        opts = {"ceiling": torch.optim.SGD(ceiling.parameters(), lr=peer.LR),
                "ceiling_grad": torch.optim.SGD(ceiling_grad.parameters(), lr=peer.LR),
                "fxdist": torch.optim.SGD(gm.parameters(), lr=peer.LR)}
        offset = {"ceiling": 0, "ceiling_grad": 0, "fxdist": 0}

        def step(system: str, i: int) -> torch.Tensor:
            k = offset[system] + i
            dense, kjt, labels = data[k]
            if system in models:
                return peer._sgd_step(lambda: peer._bce(models[system](dense, kjt), labels), opts[system])
            return peer._sgd_step(lambda: peer._bce(gm(dense, kjt, next_sparse_features=data[k + 1][1]), labels),
                                  opts[system])

        steps = {name: [] for name in offset}   # per system: CPU ms of every timed step
        threads, sender, losses = 0.0, 0.0, {}
        for name in offset:   # warm-up
            _run(functools.partial(step, name), args.warmup)
            offset[name] += args.warmup
        for _ in range(args.rounds * args.steps // CHUNK):   # the systems take turns every CHUNK steps
            for name in offset:
                cpu, both, send, losses[name] = _run(functools.partial(step, name), CHUNK)
                steps[name] += cpu
                if name == "fxdist":
                    threads, sender = threads + both, sender + send
                offset[name] += CHUNK
        placement.flush(gm)
        placement.close(gm)
    finally:
        from scheduling.ps.transport.socket_transport import SocketTransport

        SocketTransport(addresses).stop(5.0)
        for proc in procs:
            proc.join(10)
            if proc.is_alive():
                proc.kill()

    med = {name: statistics.median(cpu) for name, cpu in steps.items()}
    threads_ms, sender_ms = threads / len(steps["fxdist"]), sender / len(steps["fxdist"])
    print(f"{args.rows} x {args.dim}, batch {peer.BATCH}, {len(steps['fxdist'])} steps a system in turns of {CHUNK} "
          f"(+{args.warmup} warm-up), 1 torch thread, load average {os.getloadavg()[0]:.1f}; main thread CPU ms a "
          "step (median; quartiles):")
    labels = {"ceiling": "ceiling (dense_only)", "ceiling_grad": "ceiling + embedding grads",
              "fxdist": "fxdist exact prefetch"}
    for name, cpu in steps.items():
        q1, _, q3 = statistics.quantiles(cpu, n=4)
        extra = (f"; socket threads {threads_ms:.3f} ms a step (reader {threads_ms - sender_ms:.3f}, sender "
                 f"{sender_ms:.3f}: {'on' if send_thread() else 'off'})" if name == "fxdist" else "")
        print(f"  {labels[name]:<26} {med[name]:7.3f} ({q1:.3f}-{q3:.3f}), loss {losses[name]:.5f}{extra}")
    fx = med["fxdist"] + threads_ms
    print(f"the embeddings' gradient (ceiling_grad - ceiling): {med['ceiling_grad'] - med['ceiling']:+.3f} ms a step; "
          f"fxdist's own (fxdist + socket threads - ceiling_grad): {fx - med['ceiling_grad']:+.3f} ms a step")
    print(f"ceiling / fxdist (main + socket threads): {med['ceiling'] / fx:.3f}; ceiling_grad / fxdist: "
          f"{med['ceiling_grad'] / fx:.3f}; main threads alone, ceiling / fxdist: {med['ceiling'] / med['fxdist']:.3f}")


if __name__ == "__main__":
    main()
