"""A ``socket`` parameter server's CPU per ``push_lookup`` request, against the table work alone.

The shape of ``benchmarks/peer.py``'s ``fx_prefetch_0ms`` (socket): 26 tables of ``--rows`` x ``--dim`` (one
feature each, one id per table and sample) placed table-wise on ``--servers`` servers (peer.py's default: 1 on
fewer than 4 cores, else 2), of which this benchmark runs server 0 (all 26 tables, or 13 of 2 servers) in a child
process (:func:`scheduling.ps.transport.socket_server.serve`, one torch thread) with SGD. Two trainers (ranks 0 and 1 of one
group, each its own connection) send per step what a prefetching trainer sends: one ``push_lookup`` (the push of
step ``k`` and the lookup of step ``k + 1``, the whole 26-key KeyedJaggedTensor of batch ``--batch``) with the
client's order tuple, and wait for both answers.

Measured:

- **server**: the child's CPU time per request, summed over its threads (``/proc/<pid>/task/<tid>/schedstat``
  field 1, ns: time on a CPU, whatever else loads the machine), over the timed steps;
- **tables**: the same pushes and lookups called directly on a :class:`~scheduling.ps.fused.FusedTables` in this
  process (the same weights: the same seed), their batches resolved to rows beforehand, ``time.thread_time`` of
  the pushes and lookups alone per request: the table work itself (gather and pooling, unique and ``index_add_``, the SGD update); resolving a
  batch (once per request on the server) is timed apart and counts as overhead;
- **endpoints**: the same requests through the server's own request path in this process, without the socket
  (:class:`~scheduling.ps.endpoints.ServerEndpoints` ``submit``, i.e. the ordering, the statistics, resolving the
  batches and the tables, then pickling the answer as the socket server does before sending it), CPU per request:
  server - endpoints is what the transport costs (reading and unpickling the request, sending the answer, the
  reader threads), endpoints - tables what handling a request costs besides the table work.

It prints them, the overhead (server - tables) and the ratios server/tables and overhead/tables (a peer measured
in the same run), and checks that every lookup answered over the socket equals the direct one bit for bit (by a
checksum of each: the answers are not kept, whose fresh pages would be counted as table work).
``--profile DIR``: the first round's server reader threads run under ``cProfile``; their merged stats go to
``DIR/server.prof`` and the top functions (own time) are printed.

Run: ``.venv/bin/python benchmarks/server_request.py [--rows 10000 --dim 64 --steps 300 --profile /tmp/p]``.
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import itertools
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import _peer_systems as peer  # noqa: E402  (benchmarks/ is sys.path[1] when run as a script)

from scheduling.ps.server import PSServer, freeze_process_objects  # noqa: E402
from scheduling.ps.shard_plan import TableSpec, plan_shards  # noqa: E402

NAMESPACE, TABLES, WORLD = "emb", peer.TABLES, peer.WORLD   # peer.py's 26 tables and 2 trainers


def _server_child(queue: Any, profile_dir: str | None) -> None:
    """The server process: :func:`serve` until stopped; with ``profile_dir`` every reader thread runs under
    cProfile and dumps ``reader_<tid>.prof`` there when its connection ends."""
    import threading

    from scheduling.ps.transport import socket_server

    readers: list[threading.Thread] = []
    if profile_dir:
        import cProfile

        serve_connection = socket_server.SocketServer._serve

        def profiled(self: Any, peer: Any) -> None:
            readers.append(threading.current_thread())
            prof = cProfile.Profile(time.thread_time)  # CPU time of this thread, not wall time
            try:
                prof.runcall(serve_connection, self, peer)
            finally:
                prof.dump_stats(os.path.join(profile_dir, f"reader_{threading.get_native_id()}.prof"))

        socket_server.SocketServer._serve = profiled  # type: ignore[method-assign]
    socket_server.serve("ps0", on_ready=lambda address: queue.put((os.getpid(), address)))
    for thread in readers:  # closed by serve(): let each write its profile
        thread.join(10)


def cpu_ns(pid: int) -> int:
    """CPU time of every live thread of process ``pid``, ns (schedstat field 1)."""
    total = 0
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            total += int(Path(f"/proc/{pid}/task/{tid}/schedstat").read_text().split()[0])
        except OSError:  # the thread ended
            pass
    return total


def user_sys_faults(pid: int) -> tuple[int, int, int]:
    """``(user ticks, system ticks, minor page faults)`` of process ``pid`` (``/proc/<pid>/stat``)."""
    stat = Path(f"/proc/{pid}/stat").read_text()
    fields = stat[stat.rindex(")") + 2:].split()  # fields[0] is field 3 (state)
    return int(fields[11]), int(fields[12]), int(fields[7])


def _batches(rows: int, batch: int, count: int, seed: int) -> list[tuple]:
    gen = torch.Generator().manual_seed(seed)
    keys = tuple(f"C{i}" for i in range(TABLES))
    return [(keys, torch.randint(0, rows, (TABLES * batch,), generator=gen),
             torch.ones(TABLES * batch, dtype=torch.long), None) for _ in range(count)]


def _configure_args(args: argparse.Namespace) -> tuple:
    tables = [TableSpec(f"t{i}", args.rows, args.dim, (f"C{i}",)) for i in range(TABLES)]
    return (NAMESPACE, plan_shards(tables, args.servers), 0, "sgd", {"lr": 0.01}, 0)


class _Answers:
    """The lookups of one run per rank, kept as checksums: keeping thousands of answers (0.4-0.85 MB each) made
    every step fault in fresh pages, which the direct run's CPU time then counted as table work. ``compare``:
    the checksums of a run to check against (None: this run is the reference)."""

    def __init__(self, compare: "_Answers | None" = None) -> None:
        self.sums: list[list[bytes]] = [[] for _ in range(WORLD)]
        self.compare, self.same = compare, True

    def add(self, rank: int, answer: torch.Tensor) -> None:
        digest = hashlib.blake2b(answer.contiguous().numpy().tobytes(), digest_size=16).digest()
        k = len(self.sums[rank])
        self.sums[rank].append(digest)
        if self.compare is not None and (k >= len(self.compare.sums[rank]) or self.compare.sums[rank][k] != digest):
            self.same = False


def over_socket(args: argparse.Namespace, batches: list[list[tuple]], grads: list[torch.Tensor],
                profile: str | None = None) -> tuple[float, _Answers]:
    """Serve the requests from a child process: (its CPU ms per push_lookup, the lookups answered per rank)."""
    import multiprocessing as mp

    from scheduling.ps.transport.auth import job_key
    from scheduling.ps.transport.socket_transport import SocketTransport, _Connection

    job_key(create=True)   # the socket transport's key, before spawning: the server inherits it
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=_server_child, args=(queue, profile), daemon=True)
    proc.start()
    pid, address = queue.get(timeout=120)
    timeout_s = 120.0
    try:
        conns = [_Connection(address, timeout_s) for _ in range(WORLD)]  # one per trainer, as in a job
        conns[0].call("configure", _configure_args(args), timeout_s).wait()
        keys = [f"{NAMESPACE}:trainer{r}" for r in range(WORLD)]
        answers = _Answers()

        def order(r: int, seq: int, count: int) -> tuple:
            return (keys[r], seq, args.timeout, (f"group/{NAMESPACE}", r, WORLD, count, 0))

        first = [conns[r].call("lookup", (NAMESPACE, batches[r][0], None, order(r, 0, 0)), timeout_s)
                 for r in range(WORLD)]
        for r, f in enumerate(first):
            answers.add(r, f.wait())
        start, before = 0, (0, 0, 0)
        for k in range(args.warmup + args.steps):
            if k == args.warmup:
                start, before = cpu_ns(pid), user_sys_faults(pid)
            futs = [conns[r].call("push_lookup", (NAMESPACE, batches[r][k], grads[k], batches[r][k + 1], None,
                                                  order(r, k + 1, k)), timeout_s) for r in range(WORLD)]
            for r, f in enumerate(futs):
                pushed, looked = f.wait()
                answers.add(r, looked)
        used = cpu_ns(pid) - start
        after = user_sys_faults(pid)
        SocketTransport([address]).stop(5.0)
        proc.join(10)
    finally:
        if proc.is_alive():
            proc.kill()
    n, tick_ms = args.steps * WORLD, 1e3 / os.sysconf("SC_CLK_TCK")
    print(f"server per request: user {(after[0] - before[0]) * tick_ms / n:.3f} ms, system "
          f"{(after[1] - before[1]) * tick_ms / n:.3f} ms (10 ms ticks), minor faults {(after[2] - before[2]) / n:.1f}")
    return used / 1e6 / n, answers


def direct(args: argparse.Namespace, batches: list[list[tuple]], grads: list[torch.Tensor], reference: _Answers
           ) -> tuple[float, float, _Answers]:
    """The same pushes and lookups on the server's :class:`FusedTables`, in the order the server applies them
    (rank 0's push, rank 1's, then the lookups), their batches resolved beforehand: (CPU ms per push + lookup,
    CPU ms to resolve one batch (:meth:`FusedTables.index`, once per request on the server: its push reuses
    its lookup's), the lookups' checksums, compared with ``reference``'s). Only the pushes and lookups are
    timed (this thread's CPU time), not the checksums."""
    server = PSServer("ps0")
    server.configure(*_configure_args(args))
    fused, optimizer = server.fused[NAMESPACE], server.optimizer
    assert fused is not None
    count = args.warmup + args.steps + 1
    start = time.process_time()
    index = [[fused._resolve(*batches[r][k], where="ps0") for k in range(count)] for r in range(WORLD)]
    index_ms = (time.process_time() - start) * 1e3 / (count * WORLD)
    answers = _Answers(reference)
    for r in range(WORLD):
        answers.add(r, fused.lookup(index[r][0]))
    used = 0.0
    for k in range(args.warmup + args.steps):
        start = time.thread_time()
        for r in range(WORLD):
            fused.push(index[r][k], grads[k], optimizer)
        looked = [fused.lookup(index[r][k + 1]) for r in range(WORLD)]
        used += (time.thread_time() - start) if k >= args.warmup else 0.0
        for r in range(WORLD):
            answers.add(r, looked[r])
    return used * 1e3 / (args.steps * WORLD), index_ms, answers


_IN_PROCESS_RUNS = itertools.count()


def in_process(args: argparse.Namespace, batches: list[list[tuple]], grads: list[torch.Tensor], reference: _Answers
               ) -> tuple[float, _Answers]:
    """The same requests through :meth:`ServerEndpoints.submit` in this process, each answer pickled as the socket
    server pickles it (:func:`dumps`): (CPU ms per push_lookup request, the lookups' checksums, compared with
    ``reference``'s; this thread's CPU time, the checksums not counted)."""
    from scheduling.ps.endpoints import ServerEndpoints
    from scheduling.ps.transport.socket_transport import dumps

    endpoints = ServerEndpoints(PSServer("ps0"))
    endpoints.configure(*_configure_args(args))
    run = next(_IN_PROCESS_RUNS)  # fresh clients and group each run: sequence numbers and counts start at 0
    keys = [f"{NAMESPACE}:inproc{run}/{r}" for r in range(WORLD)]
    answers = _Answers(reference)
    untimed = [0.0]   # CPU time of the checksums, taken off

    def order(r: int, seq: int, count: int) -> tuple:
        return (keys[r], seq, args.timeout, (f"group/{NAMESPACE}/inproc{run}", r, WORLD, count, 0))

    def done(r: int, value: Any, error: BaseException | None) -> None:
        if error is not None:
            raise error
        dumps(value)
        start = time.thread_time()
        answers.add(r, value[1] if isinstance(value, tuple) else value)
        untimed[0] += time.thread_time() - start

    for r in range(WORLD):
        endpoints.submit("lookup", (NAMESPACE, batches[r][0], None, order(r, 0, 0)), functools.partial(done, r))
    start = 0.0
    for k in range(args.warmup + args.steps):
        if k == args.warmup:
            start, untimed[0] = time.thread_time(), 0.0
        for r in range(WORLD):
            endpoints.submit("push_lookup", (NAMESPACE, batches[r][k], grads[k], batches[r][k + 1], None,
                                             order(r, k + 1, k)), functools.partial(done, r))
    return (time.thread_time() - start - untimed[0]) * 1e3 / (args.steps * WORLD), answers


def _print_profile(directory: str, top: int) -> None:
    import pstats

    files = sorted(str(p) for p in Path(directory).glob("reader_*.prof"))
    if not files:
        print(f"no profile in {directory}")
        return
    stats = pstats.Stats(*files)
    stats.dump_stats(os.path.join(directory, "server.prof"))
    print(f"\nserver reader threads under cProfile (CPU time per thread; {len(files)} threads; own time, top {top}):")
    stats.sort_stats("tottime").print_stats(top)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=10_000, help="rows per table")
    p.add_argument("--dim", type=int, default=64, help="embedding dimension")
    p.add_argument("--batch", type=int, default=128, help="samples per trainer and step")
    p.add_argument("--steps", type=int, default=300, help="timed steps (2 push_lookup requests each)")
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--rounds", type=int, default=3, help="socket and direct runs, alternating (the first profiled)")
    p.add_argument("--timeout", type=float, default=120.0,
                   help="how long the server lets a request wait for its turn, seconds (the order's timeout_s; a run "
                        "longer than it shows what the deadlines of past waits cost)")
    p.add_argument("--profile", default=None, help="directory for the server's cProfile stats")
    p.add_argument("--top", type=int, default=25, help="profile lines printed")
    p.add_argument("--servers", type=int, default=peer.default_servers(os.cpu_count() or 1),
                   help="servers the 26 tables are placed on, table-wise; this benchmark runs the first (default: "
                        "peer.py's, 1 on fewer than 4 cores, else 2)")
    args = p.parse_args()
    torch.set_num_threads(1)
    count = args.warmup + args.steps + 1
    batches = [_batches(args.rows, args.batch, count, seed=r) for r in range(WORLD)]
    gen = torch.Generator().manual_seed(7)
    plan = _configure_args(args)[1]
    width = sum(spec.server == 0 for spec in plan) * args.dim   # server 0's tables (table-wise: one feature each)
    grads = [torch.randn(args.batch, width, generator=gen) for _ in range(count)]
    if args.profile:
        Path(args.profile).mkdir(parents=True, exist_ok=True)
        for old in Path(args.profile).glob("reader_*.prof"):
            old.unlink()
    freeze_process_objects()  # as the server process does (socket_server.serve)
    runs = []
    for i in range(args.rounds):  # alternating: all see the same load over time
        server_ms, got = over_socket(args, batches, grads, profile=args.profile if i == 0 else None)
        tables_ms, index_ms, want = direct(args, batches, grads, got)
        endpoints_ms, handled = in_process(args, batches, grads, got)
        same = want.same and handled.same and all(len(a) == len(b) == len(c) for a, b, c in
                                                    zip(got.sums, want.sums, handled.sums))
        runs.append((server_ms, tables_ms, index_ms, endpoints_ms, same))
    server_ms, tables_ms, index_ms, endpoints_ms = (statistics.median(run[i] for run in runs) for i in range(4))
    same = all(run[4] for run in runs)
    over = server_ms - tables_ms
    ratios = sorted(run[0] / run[1] for run in runs)
    print(f"{width // args.dim} of {TABLES} tables of {args.rows}x{args.dim} on this server, batch {args.batch}, SGD, {WORLD} "
          f"trainers, {args.steps} steps x {args.rounds} rounds (medians); load {os.getloadavg()[0]:.2f}")
    print(f"server CPU per push_lookup request:  {server_ms:7.3f} ms")
    print(f"table work alone (FusedTables):      {tables_ms:7.3f} ms")
    print(f"overhead (server - tables):          {over:7.3f} ms, of which resolving the batch (alone): {index_ms:.3f} ms")
    print(f"  endpoints in process, no socket:   {endpoints_ms:7.3f} ms: handling {endpoints_ms - tables_ms:.3f} ms "
          f"(ordering, statistics, batches, pickling the answer), transport {server_ms - endpoints_ms:.3f} ms")
    print("  per round (server / tables / endpoints, ms): "
          + "  ".join(f"{run[0]:.3f}/{run[1]:.3f}/{run[3]:.3f}" for run in runs))
    print(f"server / tables: {server_ms / tables_ms:.2f}x (rounds {ratios[0]:.2f}..{ratios[-1]:.2f})   overhead / "
          f"tables: {over / tables_ms:.2f}x   lookups bit-identical: {same}")
    if args.profile:
        _print_profile(args.profile, args.top)
    if not same:
        sys.exit("the socket server's lookups differ from the direct ones")


if __name__ == "__main__":
    main()
