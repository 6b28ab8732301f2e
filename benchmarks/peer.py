"""fxdist's parameter servers side by side with torchrec's DistributedModelParallel, 2 trainers on CPU/gloo.

The model is torchrec's ``DLRM`` (dense arch 512-256-D, over arch 512-256-1) over 26 Criteo-layout tables
(13 dense features, one id per table and sample, ids drawn uniformly), batch 128 per trainer, BCE loss, SGD
(lr 0.05) on the tables and on the dense part. Each system trains with 2 trainer processes (gloo):

- ``dmp_tw``: torchrec ``DistributedModelParallel`` (DMP), tables sharded table-wise (the planner constrained to
  ``table_wise``, ``EmbeddingBagCollectionSharder``), their SGD fused into backward
  (``apply_optimizer_in_backward``); a plain loop: forward, backward, dense optimizer step;
- ``dmp_tw_pipeline``: the same through torchrec's ``TrainPipelineSparseDist`` (batch ``i + 1``'s input
  distribution overlaps batch ``i``);
- ``dmp_rw``: DMP row-wise, through a sharder subclass offering ``row_wise`` on the CPU (torchrec offers it for
  CUDA only);
- ``ddp_local``: the plain DLRM in every trainer, dense part in ``DistributedDataParallel``, the tables' sparse
  gradients averaged after backward (``jobs.trainer.sparse_grads``);
- ``fx_blocking_{0,1}ms`` / ``fx_prefetch_{0,1}ms``: ``fxdist.optimize(model, passes=(parameter_servers(sgd),
  "async_rpc" | "async_rpc_prefetch"))``: the tables on ``--servers`` parameter-server processes (default 2
  where the host has a core for each trainer and server, else 1: :func:`default_servers`; table ``i`` on server
  ``i % N``), reached over the ``socket`` transport, the job's default (``scheduling.ps.transport.socket_transport``: one TCP
  connection per trainer and server, tensors as raw buffers; the servers bind free ports and publish them to the
  trainers, which start beside them), 0 or 1 ms added server latency per lookup (``PSClient.set_delays``);
  prefetch passes the next batch (``next_sparse_features``); dense part DDP over gloo, without broadcasting
  buffers each step, as DMP wraps its dense part.
- ``fx_stale1_0ms``: prefetch with ``max_staleness=1`` (``async_rpc(prefetch=True, max_staleness=1)``): a
  step's pushes may stay in flight while the next step's lookups run;
- ``fx_inproc_prefetch_0ms`` / ``fx_inproc_stale1_0ms``: the same with server ``i`` inside trainer ``i``'s
  process, listening on a free port of its own (``in_trainers.serve_in_trainer_socket``; the trainers share their
  addresses over their gloo group), the other trainer's requests served on its socket reader threads, its own
  called directly; 2 processes in all instead of 4;
- ``fx_rpc_prefetch_0ms`` / ``fx_rpc_stale1_0ms`` / ``fx_rpc_inproc_*``: the same over ``torch.distributed.rpc``
  (TensorPipe, TCP/uv; ``[cluster] transport = "torch_rpc"``), the servers inside the trainers through
  ``scheduling.ps.in_trainers`` (their requests to their own server skip RPC);
- ``fx_dynamic_prefetch_0ms``: ``fx_prefetch_0ms`` with the 26 tables dynamic (``parameter_servers(dynamic=...)``,
  collisionless, capacity = the size's rows, the same ids sent raw): the cost of dynamic tables against fixed
  ones of the same rows, as a ratio from the same run (its rows start as ``scheduling.ps.dynamic`` makes them,
  so its losses and ``|W-W0|`` are not compared);
- ``fx_nice19_prefetch_0ms`` / ``fx_nice19_stale1_0ms`` / ``fx_nice4_prefetch_0ms``: the same with the separate
  server processes at nice 19 (or 4), a lower CPU priority than the trainers' (``os.nice``), so that on shared
  cores a server runs when a trainer blocks instead of preempting it; any ``fx_nice<N>_<schedule>`` name works the
  same way (a Ray job's workers, trainers and servers alike, run at Ray's worker niceness, 15);
- ``fx_send1_prefetch_0ms`` / ``fx_send0_prefetch_0ms``: exact prefetch with the trainers' pushes pickled and sent
  by a sender thread of each socket connection / by the trainer's main thread in its backward hook
  (``FXDIST_SOCKET_SEND_THREAD=1`` / ``0``); the other ``fx_*`` systems take the setting's ``auto`` (on from 8 CPUs);
- ``fx_shm0_prefetch_0ms`` / ``fx_shm0_stale1_0ms``: the same with every message over the socket
  (``FXDIST_SOCKET_SHM_BYTES=0``); the other ``fx_*`` systems pass a message's large buffers (a push's gradients, a
  lookup's answer) through a shared-memory arena of each trainer's connection (``scheduling.ps.transport.shm_arena``);
- ``fx_noauth_prefetch_0ms``: ``fx_prefetch_0ms`` with the socket transport's security layer switched off in this
  benchmark's own processes only (``_peer_systems.without_security``, a monkeypatch in the trainers and the
  servers; the shipped code has no switch for it): no HMAC handshake on either end, plain ``pickle.loads`` in place
  of the restricted unpickler (``socket_wire.safe_loads``) and ``torch.empty`` receive buffers in place of the
  numpy-backed ones (``fresh_bytes``); peer.py prints the ratio "auth on / off" (``fx_prefetch_0ms`` /
  ``fx_noauth_prefetch_0ms``) per round;
- ``dense_only``: the ceiling: the same trainers with DLRM's sparse arch returning a constant ``(B, 26, D)``
  tensor (no lookups, no table gradients, nothing sent for tables), dense part DDP as fxdist's.

Every (size, system) run starts fresh processes (spawn); the systems take turns within a round, round after
round. All start from the same weights (dense arches from one seed; each table the rows fxdist's servers make
from their seed, copied into DMP's shards and the local tables), see the same batches (seeded per trainer),
and average table gradients over the trainers (torchrec's ``GRADIENT_DIVISION``, fxdist's
``grad_reduction="mean"``, DDP), so their losses should agree up to float rounding.

Prints per size and system (the table on stdout, per-run progress on stderr): QPS (samples/s over both
trainers, over ``--steps`` timed steps after ``--warmup`` steps: ``2 * 128 * steps`` / the slower trainer's
seconds between barriers; median over rounds, spread min..max), the ratio to ``dmp_tw`` of the same round
(min / median / max over rounds), ``loss last`` (the last step's loss, mean over the trainers), ``d loss`` and
``d loss0`` (largest |difference| to ``dmp_tw``'s last and first loss over all pairs of rounds; the first is
~0 when the start is the same), ``|W-W0|`` (Frobenius norm of the tables' change, all 26 tables, float64; only
for sizes of at most 128 MB of tables, since fxdist's trainer gathers them from the servers for it) and the
median wall time of a run (spawn to exit, seconds); then the largest differences of the fxdist systems'
final loss and table change to ``dmp_tw``'s. One torch thread per process (trainers and servers share the
machine's cores). CPU model and ISA (AVX-512 VNNI or not) and the load average are printed at start and end.

After each size's table: each DMP and fxdist system's fraction of the ceiling (QPS / ``dense_only``'s, round by
round); with ``--profile [STEPS]`` (off by default), ``STEPS`` (5) more steps after the first round's timed ones,
trainer 0 under ``torch.profiler`` (CPU activities): the top 30 ops by self CPU time to
``<--run-dir>/profile_<size>_<system>.txt`` (default run folder ``runs/peer-<time>``) and a table of ms per step:
forward (fxdist's lookups, starts, waits and prefetches inside it as ``(lookup)``), backward (fxdist's pushes,
started from its hooks, as ``(push)``; DMP's fused table SGD), optimizer (dense SGD and ``zero_grad``) and other.
``dense_only``'s losses differ from the others' (no tables); its ``d loss`` columns are not a check.

With ``--cpu-account`` (off by default) trainer 0 snapshots ``/proc`` of every process of the run (trainers and
servers, every thread; ``benchmarks/_peer_cpu.py``) before and after the timed steps, and peer.py prints per
system, per training step: CPU ms (time on a core, schedstat) and run-queue wait ms (runnable, waiting for a
core) of the trainers and of the servers (each summed over the kind's processes), their minor page faults, the
total CPU and the cores it kept busy (total / step); then the busiest thread groups (``main``,
``pt_thread_pool``: RPC workers, ``TP_UV_loop``: TensorPipe, ``gloo_tcp_loop``...; all of them in
``<--run-dir>/cpu_<size>_<system>.txt``). On a machine with fewer cores than busy threads the step is set by
this total, so it is the figure to compare; it moves far less with other load than wall time does.

TensorPipe's lines at an RPC group's shutdown ("RPC agent for ps0 encountered error when reading incoming request
from trainer1: EOF", "pipe closed") and, with ``--profile``, the profiler's "USDT: ... profiler_start" /
"profiler_stop" lines are dropped from stderr (:data:`NOISE`, ``recsys.quiet.filtered_stderr``, inherited by every
run's processes); other lines pass at once.

SIGTERM (``timeout``'s signal) stops peer.py between or inside runs: the run in flight is killed and the tables
are printed from the runs finished so far (a system's rounds may then number one less than another's).

Loss agreement is a weak check here: the labels are random and SGD at lr 0.05 hardly moves the tables
(``|W-W0|`` ~ 5e-5 after 10 steps of 1e3-row tables), so the loss mostly reflects the dense part and the start;
``|W-W0|`` compares the tables' training itself.

Run: ``.venv/bin/python benchmarks/peer.py [--rounds 3 --steps 60 --warmup 5 --sizes 10000x16 10000x64
1000000x16 1000000x64] [--systems ...] [--json PATH]`` (``--json``: the run's record, ``benchmarks/_bench.py``'s
``Record``); ``--quick``: one size, one round, 8 steps (a smoke run). The 1e6-row
sizes hold 26 x 1e6 x D float32 per copy (6.7 GB at D=64; ``ddp_local`` holds one per trainer).

Allocator: runs with ``MALLOC_MMAP_THRESHOLD_=33554432`` (re-executes itself; fewer page faults) and
``MALLOC_TRIM_THRESHOLD_=67108864`` (``--malloc-trim-threshold``), every process of every system alike. Fixing
the mmap threshold turns off glibc's dynamic thresholds, which would also raise the trim threshold to twice the
mmap threshold; left at glibc's 128 KiB, every free of a few hundred KB at the top of a thread's heap gave the
memory back (``madvise``) and the next step faulted it in again: ``--cpu-account`` counted 1,000-1,900 minor
page faults per step in the trainers and as many in fxdist's servers (36 % of a server's CPU in the kernel,
``perf``); with 64 MiB, 10-120.

Sources: torchrec ``DistributedModelParallel`` (torchrec/distributed/model_parallel.py) and
``TrainPipelineSparseDist`` (torchrec/distributed/train_pipeline/train_pipelines.py), torchrec 1.8.0;
``DLRM``: Naumov et al. 2019 (torchrec/models/dlrm.py).
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import re
import signal
import statistics
import sys
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the repository's `scheduling` package, not benchmarks/scheduling.py

import _bench  # noqa: E402  (benchmarks/ is sys.path[1])
import _peer_cpu as cpu_account  # noqa: E402
import _peer_systems as systems  # noqa: E402

from recsys.quiet import TENSORPIPE_SHUTDOWN, filtered_stderr  # noqa: E402

SIZES = ("10000x16", "10000x64", "1000000x16", "1000000x64")
NAME_WIDTH = 30
"""Width of the system-name column (the longest name, ``fx_rpc_inproc_prefetch_0ms``, is 26)."""
PAIRS = (("socket / torch_rpc transport", "fx_prefetch_0ms", "fx_rpc_prefetch_0ms"),
         ("in the trainers, socket / torch_rpc", "fx_inproc_prefetch_0ms", "fx_rpc_inproc_prefetch_0ms"),
         ("in the trainers / separate servers", "fx_inproc_prefetch_0ms", "fx_prefetch_0ms"),
         ("dynamic / fixed tables of the same rows", "fx_dynamic_prefetch_0ms", "fx_prefetch_0ms"),
         ("servers at nice 19 / at the trainers' priority", "fx_nice19_prefetch_0ms", "fx_prefetch_0ms"),
         ("staleness 1, servers at nice 19 / at the trainers'", "fx_nice19_stale1_0ms", "fx_stale1_0ms"),
         ("pushes sent by a sender thread / by the main thread", "fx_send1_prefetch_0ms", "fx_send0_prefetch_0ms"),
         ("pushes as auto picks / by the main thread", "fx_prefetch_0ms", "fx_send0_prefetch_0ms"),
         ("large buffers through shared memory / all over the socket", "fx_prefetch_0ms", "fx_shm0_prefetch_0ms"),
         ("staleness 1, shared memory / all over the socket", "fx_stale1_0ms", "fx_shm0_stale1_0ms"),
         ("auth on / off", "fx_prefetch_0ms", "fx_noauth_prefetch_0ms"))
"""(label, system, peer): after each size's table, the QPS ratio of ``system`` to ``peer`` per round, when both ran."""
NOISE = re.compile(f"{TENSORPIPE_SHUTDOWN.pattern}|"
                   r"^USDT:.*SyncActivityProfilerHandler\.cpp:\d+\] profiler_(start|stop)$")
"""The stderr lines peer.py drops: TensorPipe's at an RPC group's shutdown, and the ones torch.profiler's Kineto
writes when a profile starts and stops (``--profile``)."""


class Stopped(BaseException):
    """SIGTERM arrived (:func:`_on_sigterm`): finish with the runs done so far (a BaseException, so that a run's
    ``except Exception`` does not take it for a failed run)."""


_STOPPING = False
_MEASURING = False


def _on_sigterm(signum: int, frame: object) -> None:
    """Note the stop; inside :func:`measure`'s runs, stop them now (:class:`Stopped`), else after this table."""
    global _STOPPING
    _STOPPING = True
    if _MEASURING:
        raise Stopped


def cpu_isa() -> str:
    """CPU model name and whether it has AVX-512 VNNI (from /proc/cpuinfo)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return "unknown CPU (no /proc/cpuinfo)"
    model = next((line.split(":", 1)[1].strip() for line in text.splitlines() if line.startswith("model name")), "?")
    flags = next((line.split(":", 1)[1].split() for line in text.splitlines() if line.startswith("flags")), [])
    isa = "avx512_vnni" if "avx512_vnni" in flags else "avx512f, no avx512_vnni" if "avx512f" in flags else (
        "avx2, no avx512" if "avx2" in flags else "no avx2")
    return f"{model} ({isa})"


def run_once(setting: systems.Setting, timeout_s: float, cpu_account: bool = False,
             server_nice: int = 0) -> tuple[dict[int, dict], float]:
    """One (size, system) run in fresh processes: ``({rank: result}, wall seconds)``; ``cpu_account``: trainer 0
    also accounts every process's CPU over the timed steps (its result's ``"cpu"``, ``_peer_cpu.account``);
    ``server_nice``: fxdist's server processes run at this nice value over the trainers' (``fx_nice<N>_*``: at ``N``,
    :func:`systems.server_nice`)."""
    from scheduling.ps.transport.auth import job_key
    from scheduling.ps.transport.ports import free_port

    job_key(create=True)   # the socket transport's key, before spawning: every server and trainer inherits it
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    fx = setting.system.startswith("fx_")
    socket = systems.over_socket(setting.system)
    setting = systems.Setting(**{**setting.__dict__, "pg_port": free_port(),
                                 "rpc_port": free_port() if fx and not socket else 0, "group": f"peer-{uuid.uuid4().hex}"})
    servers = setting.servers if fx and not systems.in_trainers(setting.system) else 0
    server_nice = systems.server_nice(setting.system, server_nice)
    pids = ctx.Array("i", systems.WORLD + servers) if cpu_account else None   # filled once all have started
    start = time.perf_counter()
    addresses = ctx.Queue() if socket and servers else None   # each server's "host:port", once it listens
    if addresses is not None:   # servers and trainers start together; the trainers wait for the addresses
        ready = ctx.Queue()
        server_procs = [ctx.Process(target=systems.socket_server_main, args=(i, ready, server_nice, setting.system),
                                   daemon=True)
                        for i in range(servers)]
    else:
        server_procs = [ctx.Process(target=systems.server_main, args=(systems.WORLD + i, setting.rpc_port, servers,
                                                                             server_nice),
                                    daemon=True) for i in range(servers)]
    trainer_procs = [ctx.Process(target=systems.trainer_main, args=(r, setting, queue, pids, addresses), daemon=True)
                     for r in range(systems.WORLD)]
    procs = trainer_procs + server_procs   # trainers first (the pids' order)
    for p in procs:
        if p.pid is None:
            p.start()
    if pids is not None:
        pids[:] = [p.pid or 0 for p in procs]
    results: dict[int, dict] = {}
    try:
        if addresses is not None:
            try:
                found = dict(ready.get(timeout=120) for _ in range(servers))
            except Exception as e:  # queue.Empty: a server died before listening
                results[-1] = {"error": f"socket servers did not listen within 120 s ({type(e).__name__})"}
                return results, time.perf_counter() - start
            for _ in range(systems.WORLD):
                addresses.put(tuple(found[i] for i in range(servers)))
        for _ in range(systems.WORLD):
            rank, res = queue.get(timeout=timeout_s)
            results[rank] = res
            if "error" in res:
                break
    except Exception as e:  # queue.Empty: a trainer died or hung
        results.setdefault(-1, {"error": f"no result within {timeout_s:.0f} s ({type(e).__name__})"})
    finally:
        for p in procs:
            p.join(0.1 if _STOPPING else 30 if not any("error" in r for r in results.values()) else 5)
            if p.is_alive():
                p.kill()
                p.join()
    return results, time.perf_counter() - start


def summarize(results: dict[int, dict], steps: int) -> dict:
    """QPS over both trainers (the slower trainer's time) and the mean losses; or the error."""
    errors = [r["error"] for r in results.values() if "error" in r]
    if errors or len(results) < systems.WORLD:
        return {"error": "; ".join(errors) or f"only {len(results)} trainer(s) answered"}
    seconds = max(r["seconds"] for r in results.values())
    return {"qps": systems.WORLD * systems.BATCH * steps / seconds,
            "first_loss": statistics.mean(r["first_loss"] for r in results.values()),
            "last_loss": statistics.mean(r["last_loss"] for r in results.values()),
            "table_change": results[0].get("table_change"), "prefetch_hits": results[0].get("prefetch_hits"),
            "profile": results[0].get("profile"), "cpu": results[0].get("cpu"),
            "ready_at": max(r.get("ready_at", 0.0) for r in results.values())}


def measure(rows: int, dim: int, names: list[str], args: argparse.Namespace) -> dict[str, list[dict]]:
    """Per system, one summary per round (the systems take turns within a round)."""
    global _MEASURING
    found: dict[str, list[dict]] = {n: [] for n in names}
    _MEASURING = True
    try:
        if not _STOPPING:
            _rounds(rows, dim, names, args, found)
    except Stopped:
        print("  stopped (SIGTERM): the run in flight was killed; the tables below cover the runs finished",
              file=sys.stderr, flush=True)
    finally:
        _MEASURING = False
    return {n: runs for n, runs in found.items() if runs}


def _rounds(rows: int, dim: int, names: list[str], args: argparse.Namespace, found: dict[str, list[dict]]) -> None:
    """:func:`measure`'s rounds, each run's summary appended to ``found[system]`` as it ends."""
    for rnd in range(args.rounds):
        for name in names:
            profile = args.profile if rnd == 0 else 0   # the first round only
            setting = systems.Setting(name, rows, dim, args.warmup, args.steps, pg_port=0, profile=profile,
                                      servers=args.servers, profile_file=str(args.run_dir / f"profile_{rows}x{dim}_{name}.txt"))
            started = time.time()
            results, wall = run_once(setting, args.timeout, args.cpu_account, args.server_nice)
            found[name].append({**summarize(results, args.steps), "wall": wall})
            r = found[name][-1]
            set_up = f"{r['ready_at'] - started:.0f} s to the first step, " if r.get("ready_at") else ""
            status = f"error: {r['error']}" if "error" in r else (
                f"{r['qps']:,.0f} samples/s, loss {r['first_loss']:.7f} -> {r['last_loss']:.7f}"
                + ("" if r.get("prefetch_hits") is None else f", trainer 0's prefetch hits {r['prefetch_hits']}"))
            print(f"  round {rnd + 1} {name:<{NAME_WIDTH}} {status} ({set_up}{wall:.0f} s in all)", file=sys.stderr,
                  flush=True)


def _max_diff(runs: list[dict], base: list[dict], key: str) -> float | None:
    """Largest ``|run[key] - base run[key]|`` over all pairs of successful runs (None: no pair)."""
    pairs = [(r[key], b[key]) for r in runs for b in base
             if "error" not in r and "error" not in b and r.get(key) is not None and b.get(key) is not None]
    return max((abs(x - y) for x, y in pairs), default=None)


def _fmt(value: float | None, spec: str, width: int) -> str:
    return f"{'-':>{width}}" if value is None else f"{value:>{width}{spec}}"


def _row(name: str, runs: list[dict], base: list[dict]) -> str:
    """One system's line of the table."""
    ok = [r for r in runs if "error" not in r]
    if not ok:
        return f"{name:<{NAME_WIDTH}} FAILED: {runs[0]['error'][:300]}"
    qps = [r["qps"] for r in ok]
    ratios = _ratios(runs, base)
    ratio = (f"{min(ratios):>11.2f} {statistics.median(ratios):>5.2f} {max(ratios):>5.2f}" if ratios
             else f"{'-':>11} {'-':>5} {'-':>5}")
    errors = [r["error"] for r in runs if "error" in r]
    failed = f"  ({len(errors)} of {len(runs)} failed: {errors[0][:200]})" if errors else ""
    return (f"{name:<{NAME_WIDTH}} {statistics.median(qps):>8,.0f} {min(qps):>7,.0f}..{max(qps):<6,.0f} {ratio} "
            f"{ok[-1]['last_loss']:>10.7f} {_fmt(_max_diff(runs, base, 'last_loss'), '.1e', 8)} "
            f"{_fmt(_max_diff(runs, base, 'first_loss'), '.1e', 8)} {_fmt(ok[-1].get('table_change'), '.3e', 9)} "
            f"{statistics.median(r['wall'] for r in runs):>6.0f}{failed}")


def _ratios(runs: list[dict], base: list[dict]) -> list[float]:
    """QPS ratios of ``runs`` to ``base`` round by round (rounds where both ran)."""
    return [r["qps"] / b["qps"] for r, b in zip(runs, base) if "error" not in r and "error" not in b]


def ceiling(found: dict[str, list[dict]]) -> None:
    """Each fxdist system's QPS as a fraction of ``dense_only``'s (round by round: min / median / max)."""
    top = found.get("dense_only")
    if not top:
        return
    lines = []
    for name, runs in found.items():
        if name != "dense_only" and (name.startswith("fx_") or name.startswith("dmp_")):
            f = _ratios(runs, top)
            if f:
                lines.append(f"  {name:<{NAME_WIDTH}} {min(f):.2f} {statistics.median(f):.2f} {max(f):.2f}")
    if lines:
        print("fraction of the ceiling (QPS / dense_only's, min med max over rounds):\n" + "\n".join(lines))


def profile_table(found: dict[str, list[dict]], run_dir: Path) -> None:
    """Trainer 0's profiled steps, ms per step: the step, forward (lookup inside it), backward (push mostly
    inside it), optimizer (dense SGD and zero_grad), other (step - forward - backward - optimizer)."""
    rows = [(n, runs[0]["profile"]) for n, runs in found.items() if runs and runs[0].get("profile")]
    if not rows:
        return
    print(f"\nprofile, trainer 0, ms per step (torch.profiler, CPU; top ops in {run_dir}/profile_*.txt)\n"
          f"{'system':<{NAME_WIDTH}} {'step':>7} {'forward':>8} {'(lookup)':>9} {'backward':>9} {'(push)':>7} "
          f"{'optimizer':>9} {'other':>7}")
    for name, p in rows:
        other = p["step"] - p["forward"] - p["backward"] - p["optimizer"]
        print(f"{name:<{NAME_WIDTH}} {p['step']:>7.2f} {p['forward']:>8.2f} {p['lookup']:>9.2f} {p['backward']:>9.2f} "
              f"{p['push']:>7.2f} {p['optimizer']:>9.2f} {other:>7.2f}")


def cpu_table(size: str, found: dict[str, list[dict]], run_dir: Path) -> None:
    """``--cpu-account``: per system, CPU ms, run-queue wait ms and minor page faults per training step of the
    trainers and of the servers (each summed over the kind's processes and threads; median over rounds), the cores busy per step
    (total CPU / trainer 0's ms per step); the first round's thread groups to ``<run_dir>/cpu_<size>_<system>.txt``
    and the top 8 to stdout."""
    rows = {n: [r["cpu"] for r in runs if r.get("cpu")] for n, runs in found.items()}
    rows = {n: accs for n, accs in rows.items() if accs}
    if not rows:
        return
    print(f"\nCPU per training step, all processes (/proc schedstat; median over rounds; ms): cpu = on a core, "
          f"wait = runnable, waiting for a core; faults = minor page faults\n{'system':<{NAME_WIDTH}} {'step':>6}  "
          f"{'trainers cpu':>12} {'wait':>6} {'faults':>7}  {'servers cpu':>11} {'wait':>6} {'faults':>7}  "
          f"{'total cpu':>9} {'cores':>5}")
    run_dir.mkdir(parents=True, exist_ok=True)
    for name, accs in rows.items():
        def med(kind: str, key: str, accs: list[dict] = accs) -> float | None:
            values = [a["kinds"][kind][key] for a in accs if kind in a["kinds"]]
            return statistics.median(values) if values else None

        step = statistics.median(a["step_ms"] for a in accs)
        total = statistics.median(sum(k["cpu_ms"] for k in a["kinds"].values()) for a in accs)
        print(f"{name:<{NAME_WIDTH}} {step:>6.1f}  {_fmt(med('trainer', 'cpu_ms'), '.1f', 12)} "
              f"{_fmt(med('trainer', 'wait_ms'), '.1f', 6)} {_fmt(med('trainer', 'faults'), '.0f', 7)}  "
              f"{_fmt(med('server', 'cpu_ms'), '.1f', 11)} {_fmt(med('server', 'wait_ms'), '.1f', 6)} "
              f"{_fmt(med('server', 'faults'), '.0f', 7)}  {total:>9.1f} {total / step:>5.2f}")
        lines = cpu_account.thread_table(accs[0], limit=100)
        (run_dir / f"cpu_{size}_{name}.txt").write_text(
            f"{name} {size}: first round, per training step, by thread group (kind, name with digits as #)\n"
            + "\n".join(lines) + "\n")
    for name, accs in rows.items():
        print(f"  {name}, first round's busiest thread groups (per step):")
        print("\n".join(cpu_account.thread_table(accs[0], limit=8)))


def report(size: str, found: dict[str, list[dict]]) -> None:
    """The table of one size (columns: see the module docstring)."""
    base = found.get("dmp_tw", [])
    print(f"\n{size} (rows x dim per table)\n{'system':<{NAME_WIDTH}} {'QPS':>8} {'min..max':>15} {'/dmp_tw min':>11} "
          f"{'med':>5} {'max':>5} {'loss last':>10} {'d loss':>8} {'d loss0':>8} {'|W-W0|':>9} {'wall s':>6}")
    for name, runs in found.items():
        print(_row(name, runs, base))
    fx = [r for n, runs in found.items() if n.startswith("fx_") and not systems.dynamic_tables(n) for r in runs]
    loss, change = _max_diff(fx, base, "last_loss"), _max_diff(fx, base, "table_change")
    if loss is not None:
        print(f"max |fxdist final loss - dmp_tw final loss| = {loss:.2e} (over fxdist systems and rounds)"
              + ("" if change is None else f"; max | |W-W0| fxdist - |W-W0| dmp_tw | = {change:.2e}"))
    for label, system, peer in PAIRS:
        runs, base_runs = found.get(system), found.get(peer)
        if runs and base_runs and (ratios := _ratios(runs, base_runs)):
            print(f"{label} ({system} / {peer}, QPS per round): "
                  f"median {statistics.median(ratios):.2f}x ({min(ratios):.2f}..{max(ratios):.2f})")


def record_size(record: _bench.Record, size: str, found: dict[str, list[dict]]) -> None:
    """``--json``: one size's QPS of every fxdist system against ``dmp_tw``'s (round by round) and, where
    ``dense_only`` ran, against that ceiling; DMP's own fraction of the ceiling, the failed runs and the fxdist
    systems' largest final-loss difference to DMP as notes."""
    for peer, key, title in (("dmp_tw", f"dmp_{size}", f"{size} tables: QPS vs torchrec DMP table-wise"),
                             ("dense_only", f"ceiling_{size}", f"{size} tables: QPS vs the ceiling (no tables)")):
        base = [r for r in found.get(peer, []) if "error" not in r]
        if not base:
            continue
        record.group(key, title, peer, "samples/s", lower_is_better=False)
        for name, runs in found.items():
            ratios = _ratios(runs, found[peer])
            ok = [r["qps"] for r in runs if "error" not in r]
            if ratios and name.startswith("fx_"):
                record.row(key, name, statistics.median(ok), statistics.median(r["qps"] for r in base),
                           statistics.median(ratios), ratios)
    if found.get("dmp_tw") and found.get("dense_only") and (f := _ratios(found["dmp_tw"], found["dense_only"])):
        record.note(f"{size}: dmp_tw's own fraction of the ceiling {statistics.median(f):.2f} "
                    f"({min(f):.2f}-{max(f):.2f})")
    for name, runs in found.items():
        if errors := [r["error"] for r in runs if "error" in r]:
            record.note(f"{size}: {name}: {len(errors)} of {len(runs)} runs failed (left out): {errors[0][:160]}")
    fx = [r for n, runs in found.items() if n.startswith("fx_") and not systems.dynamic_tables(n) for r in runs]
    loss = _max_diff(fx, found.get("dmp_tw", []), "last_loss")
    if loss is not None:
        record.note(f"{size}: max |fxdist final loss - dmp_tw final loss| = {loss:.1e} over systems and rounds")


default_servers = systems.default_servers
"""``--servers``'s default (:func:`_peer_systems.default_servers`)."""


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", nargs="+", default=list(SIZES), help="ROWSxDIM, rows per table x embedding dim")
    p.add_argument("--systems", nargs="+", default=list(systems.DEFAULT_SYSTEMS), choices=systems.SYSTEMS,
                   help="default: all but the fx_nice<N>_*, fx_send<0|1>_*, fx_shm0_* and fx_noauth_* ones")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=60, help="timed steps per run")
    p.add_argument("--warmup", type=int, default=5, help="untimed steps before them")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds a run may take")
    p.add_argument("--quick", action="store_true", help="smoke run: 1 round, 8 steps, 2 warm-up, first size only")
    p.add_argument("--profile", type=int, nargs="?", const=5, default=0, metavar="STEPS",
                   help="after the timed steps of the first round, profile STEPS (default 5) more on trainer 0 "
                        "(torch.profiler, CPU) and print where a step goes; off by default")
    p.add_argument("--cpu-account", action="store_true",
                   help="account every process's CPU (trainers, servers, per thread) over the timed steps from "
                        "/proc (time on a core and run-queue wait per step) and print it per system; off by default")
    p.add_argument("--servers", type=int, default=None, metavar="N",
                   help=f"fxdist's separate server processes (tables round-robin over them; default: "
                        f"{systems.SERVERS} where the host has a core for each trainer and server, else 1); the "
                        "fx_inproc_* systems always serve one in each trainer")
    p.add_argument("--server-nice", type=int, default=0, metavar="N",
                   help="run fxdist's server processes at nice N over the trainers' (os.nice; 0: the same); the "
                        "fx_nice<N>_* systems run theirs at N whatever this says")
    p.add_argument("--malloc-trim-threshold", type=int, default=64 << 20, metavar="BYTES",
                   help="glibc's MALLOC_TRIM_THRESHOLD_ for every process (default 64 MiB: twice the fixed mmap "
                        "threshold, as glibc's dynamic rule would set it; 131072 is glibc's default)")
    p.add_argument("--json", default=None, metavar="PATH",
                   help="also write the run's record (benchmarks/_bench.py's Record: QPS vs dmp_tw and the ceiling)")
    p.add_argument("--run-dir", type=Path, default=None,
                   help="where --profile and --cpu-account write their files (default runs/peer-<time>)")
    args = p.parse_args()
    if args.run_dir is None:
        args.run_dir = ROOT / "runs" / time.strftime("peer-%Y%m%d-%H%M%S")
    if args.servers is None:
        args.servers = default_servers(os.cpu_count() or 1)
    if args.quick:
        args.rounds, args.steps, args.warmup, args.sizes = 1, 8, 2, args.sizes[:1]
    _bench.reexec_with_fixed_allocator({"MALLOC_TRIM_THRESHOLD_": str(args.malloc_trim_threshold)})
    import torch
    import torchrec

    print(f"CPU: {cpu_isa()}; {os.cpu_count()} cores; load average at start {os.getloadavg()}")
    print(f"torch {torch.__version__}, torchrec {torchrec.__version__}, MALLOC_MMAP_THRESHOLD_="
          f"{os.environ.get('MALLOC_MMAP_THRESHOLD_')}, MALLOC_TRIM_THRESHOLD_={os.environ.get('MALLOC_TRIM_THRESHOLD_')}; "
          f"{systems.WORLD} trainers x batch {systems.BATCH}, "
          f"fxdist servers: {args.servers} at nice {args.server_nice} (fx_nice<N>_*: N; fx_inproc_*: {systems.WORLD}, "
          f"in the trainers); {args.rounds} rounds x ({args.warmup} warm-up + {args.steps} timed "
          "steps); progress on stderr")
    record = _bench.Record("peer", "Parameter servers vs torchrec DistributedModelParallel (DLRM, 26 tables)",
                           {"trainers": systems.WORLD, "batch per trainer": systems.BATCH, "rounds": args.rounds,
                            "steps": args.steps, "warmup": args.warmup, "servers": args.servers,
                            "transport": "socket", "torchrec": torchrec.__version__})
    signal.signal(signal.SIGTERM, _on_sigterm)
    with filtered_stderr(NOISE):   # the runs' processes inherit it
        for size in args.sizes:
            if _STOPPING:
                break
            rows, dim = (int(x) for x in size.lower().split("x"))
            found = measure(rows, dim, args.systems, args)
            report(size, found)
            record_size(record, size, found)
            ceiling(found)
            profile_table(found, args.run_dir)
            cpu_table(size, found, args.run_dir)
    print(f"\nload average at end {os.getloadavg()}")
    record.write(args.json)


if __name__ == "__main__":
    main()
