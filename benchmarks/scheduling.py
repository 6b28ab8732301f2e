"""Training QPS of torchrec's DLRM on 2 parameter servers: blocking fetches vs the async_rpc pass and its options.

One trainer (this process, 1 torch thread) and 2 servers on loopback (TCP transport). The model is torchrec's
``DLRM`` (26 tables x 1000 rows), its tables moved to the servers by ``scheduling.parameter_servers``
(row-wise Adagrad on the servers, SGD on the dense part), trained as users write a step: forward, BCE loss,
``loss.backward()`` (which pushes each lookup's gradient from an autograd hook as soon as it is computed, so
the pushes overlap the bottom MLP's backward), ``optimizer.step()``. For an added server-side latency of 0, 1
and 5 ms per fetch (emulating network distance), the placed model runs as is (baseline: blocking lookups,
the pushes waited at the end of the step) and after ``scheduling.async_rpc`` in four variants:

- ``async_rpc``: each step's lookups overlap the bottom MLP (pushes waited at the end of the step);
- ``max_staleness=1``: the pushes are waited at the next step's lookup instead, which may even be sent
  before the last push is acknowledged (still exact: the servers apply each client's requests in issue
  order);
- ``prefetch=True``: each push also asks for the next step's lookup, so that lookup overlaps the rest of
  the step and the next step's bottom MLP (exact);
- ``prefetch=True, max_staleness=1``: the next step's lookup starts right after this step's lookup and
  misses this step's push (1 step stale, the only variant whose training differs from the baseline).

The baseline and ``async_rpc`` take turns step by step; variants whose RPCs outlive a step run in blocks of
consecutive steps, alternating with the others round by round. Measured in the same run:

- compute C: the train step with the fetches served from memory and the pushes dropped (no RPC);
  the placed model's client is swapped for one that answers from memory;
- fetch F: the step's RPCs alone (2 fetches, then 2 pushes), blocking one after the other (F_seq, what the
  baseline pays: T_base ~ C + F_seq) and with the independent ones in flight together (F_par);
- ideal: an overlapped step cannot beat max(C, F_par), so the ideal gain is T_base / max(C, F_par) - 1;
- exact bound: an exact schedule must send the next step's lookup after this step's push, and the push
  needs the gradients of the top (pool, interaction, over arch, loss, backward: C_top). So the lookups cannot
  hide behind C_top: T >= max(C, C_top + F_chain), F_chain = a push carrying the next lookup, to both
  servers in parallel, until both answers are back. "of exact" is the share of that bound's gain reached;
- CPU ms: CPU time per step of all three processes (trainer and servers, every thread). On 2 cores a step
  cannot take less than half of it, whatever the schedule.

Prints per latency and variant: median step time, QPS, gain % = T_base / T_variant - 1, the share of the
ideal gain reached (gain / ideal gain), CPU per step, and the spread (min..max of round medians), which shows
the noise of a shared 2-core machine.

Run: ``.venv/bin/python benchmarks/scheduling.py [--steps 15 --rounds 5]``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import scheduling  # noqa: E402
from recsys.criteo import criteo_batches, criteo_dlrm, criteo_tables  # noqa: E402
from scheduling import placement  # noqa: E402
from scheduling.ps import LocalCluster, PSClient, get_client  # noqa: E402

CRITEO = REPO.parent / "shared" / "data" / "criteo" / "train_examples.txt"


class MemoryClient(PSClient):
    """Takes the name of a placed model's client: serves its fetches from memory and drops its pushes (the
    step's compute without any RPC)."""

    def __init__(self, like: PSClient, answers: dict[int, torch.Tensor]) -> None:
        like.close(flush=False)  # unregistered; its tables stay on the servers, unused
        super().__init__(like.tables, like.servers, name=like.name, configure=False)
        self.shards, self.layouts, self.widths, self._slots = like.shards, like.layouts, like.widths, like._slots
        self.answers = answers

    def lookup(self, server, kjt):
        return self.answers[server].clone().requires_grad_(torch.is_grad_enabled())

    def push_grad_async(self, server, kjt, grad, next_kjt=None):
        return None

    def defer_push(self, server, fut):
        pass


class Step:
    """One training step of a placed torchrec DLRM, as a user writes it; ``wait=True``: the step also waits
    its pushes (which ``loss.backward()`` started from hooks) before returning."""

    def __init__(self, model, gm, prefetch: bool = False, wait: bool = False) -> None:
        self.model, self.gm, self.prefetch, self.wait = model, gm, prefetch, wait
        self.client = placement.client_names(gm)[0]
        self.opt = torch.optim.SGD(gm.parameters(), lr=0.01)

    def __call__(self, dense, kjt, labels, next_kjt=None) -> None:
        extra = {"next_sparse_features": next_kjt} if self.prefetch else {}
        loss = F.binary_cross_entropy_with_logits(self.gm(dense, kjt, **extra).squeeze(-1), labels)
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        self.opt.step()
        if self.wait:
            get_client(self.client).flush()


def build(name: str, args, dims: tuple[int, ...], async_options: dict | None) -> tuple:
    """(torchrec's DLRM, the same with its tables on the servers (client prefix ``name``) and then, unless
    ``async_options`` is None, ``scheduling.async_rpc(gm, **async_options)``)."""
    torch.manual_seed(0)
    model = criteo_dlrm(1000, dims[-1], dense_layers=dims, over_layers=(64, 1))
    gm = scheduling.parameter_servers(model, "rowwise_adagrad", lr=0.01, client=name, verbose=False,
                                      plan={t.name: args.sharding for t in criteo_tables(1000, dims[-1])})
    if async_options is not None:
        gm = scheduling.async_rpc(gm, **async_options)
    return model, gm


def top_step(model, client: PSClient, batch, answers: dict[int, torch.Tensor]) -> None:
    """C_top, the compute between a step's lookups and its pushes: pool the answers, interaction and over
    arch, loss, and the backward pass down to the answers' gradients (eager, same shapes as the step)."""
    dense, kjt, labels = batch
    dim = client.tables[0].embedding_dim
    cut = torch.randn(dense.shape[0], dim, requires_grad=True)     # stands for the dense arch output
    parts = [answers[s].clone().requires_grad_(True) for s in range(len(answers))]
    kt = client.pool(kjt, parts)
    sparse = torch.cat(list(kt.to_dict().values()), dim=1).reshape(dense.shape[0], -1, dim)
    logits = model.over_arch(model.inter_arch(cut, sparse))
    F.binary_cross_entropy_with_logits(logits.squeeze(-1), labels).backward()
    model.zero_grad(set_to_none=True)


def rpc_chain(client: PSClient, kjt) -> float:
    """F_chain: seconds from sending each server this step's push (carrying the next lookup, as
    ``prefetch=True`` does) to holding both lookups; the lookups that provide the gradients are not timed."""
    servers = range(len(client.servers))
    parts = [client.lookup(s, kjt) for s in servers]
    for part in parts:
        part.grad = torch.zeros_like(part)
    t0 = time.perf_counter()
    for s, part in zip(servers, parts):
        client.settle_push(client.push_async(s, kjt, part, next_kjt=kjt), s)
    for s in servers:
        client.finish_lookup(client.lookup_async(s, kjt), s)
    elapsed = time.perf_counter() - t0
    client.flush()
    return elapsed


def time_block(fn, batches) -> float:
    """Median seconds per call of ``fn(*batch)`` over ``batches``."""
    times = []
    for batch in batches:
        t0 = time.perf_counter()
        fn(*batch)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def rpc_step(client: PSClient, kjt, parallel: bool) -> None:
    """One step's RPCs alone: a fetch per server, then a push per server; blocking one by one, or
    (``parallel``) the fetches in flight together, then the pushes."""
    servers = range(len(client.servers))
    if parallel:
        futs = [client.lookup_async(s, kjt) for s in servers]
        parts = [client.finish_lookup(f, s) for s, f in zip(servers, futs)]
    else:
        parts = [client.lookup(s, kjt) for s in servers]
    for part in parts:
        part.grad = torch.zeros_like(part)
    if parallel:
        futs = [client.push_async(s, kjt, part) for s, part in zip(servers, parts)]
        for s, f in zip(servers, futs):
            client.finish_push(f, s)
    else:
        for s, part in zip(servers, parts):
            client.push(s, kjt, part)


def interleaved(variants: dict, batches) -> dict[str, list[float]]:
    """Seconds per step of every variant, the variants taking turns step by step (so that load from
    other processes hits them alike)."""
    times: dict[str, list[float]] = {k: [] for k in variants}
    for batch in batches:
        for key, fn in variants.items():
            t0 = time.perf_counter()
            own = fn(batch)  # a variant may time itself (returns seconds)
            times[key].append(own if isinstance(own, float) else time.perf_counter() - t0)
    return times


def block(fn, batches, client: str) -> float:
    """Median seconds per step of ``fn(batch, next_batch)`` over consecutive steps (for variants whose RPCs
    outlive a step), then the client's deferred pushes and prefetches are finished."""
    t = time_block(fn, list(scheduling.lookahead(batches)))
    get_client(client).flush()
    return t


def cpu_seconds(pids: list[int]) -> float:
    """CPU time so far of this process (all its threads) plus the processes ``pids``, in seconds."""
    total = time.process_time()
    for pid in pids:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime
    return total


def cpu_per_step(fn, batches, client: str, pids: list[int], passes: int = 2) -> float:
    """CPU seconds per step of all processes (trainer + servers) over ``passes`` blocks of consecutive steps."""
    pairs = list(scheduling.lookahead(batches)) * passes
    c0 = cpu_seconds(pids)
    for batch, nxt in pairs:
        fn(batch, nxt)
    get_client(client).flush()
    return (cpu_seconds(pids) - c0) / len(pairs)


# (key, label, exact training?, timed step by step (False: in blocks of consecutive steps))
ROWS = [("async", "async_rpc: pushes waited at the step's end", "yes", True),
        ("defer", "async_rpc(max_staleness=1): pushes waited next step", "yes", False),
        ("prefetch", "async_rpc(prefetch=True)", "yes", False),
        ("prefetch_stale", "async_rpc(prefetch=True, max_staleness=1)", "no: 1 step stale", False)]


def measure(delay: float, args, batches, steps: dict[str, Step], base_client: PSClient, pids: list[int], answers,
            ) -> tuple[dict[str, list[float]], dict[str, float]]:
    """Round medians of every variant at one added latency, and each variant's CPU seconds per step."""
    base_client.set_delays(fetch_delay_s=delay / 1000)
    stepwise = {"base": lambda b: steps["base"](*b), "async": lambda b: steps["async"](*b),
                "C": lambda b: steps["memory"](*batches[0]),
                "F": lambda b: rpc_step(base_client, b[1], parallel=False),
                "Fpar": lambda b: rpc_step(base_client, b[1], parallel=True),
                "Ctop": lambda b: top_step(steps["memory"].model, base_client, b, answers),
                "Fchain": lambda b: rpc_chain(base_client, b[1])}
    blocks = {key: (lambda b, nxt, k=key: steps[k](*b, next_kjt=nxt and nxt[1]), steps[key].client)
              for key in ("defer", "prefetch", "prefetch_stale")}
    t: dict[str, list[float]] = {k: [] for k in [*stepwise, *blocks]}
    for _ in range(args.rounds):
        for key, values in interleaved(stepwise, batches).items():
            t[key].append(statistics.median(values))
        for key, (fn, client) in blocks.items():
            t[key].append(block(fn, batches, client))
    cpu = {key: cpu_per_step(lambda b, nxt, k=key: steps[k](*b), batches, steps[key].client, pids)
           for key in ("base", "async")}
    cpu.update({key: cpu_per_step(fn, batches, client, pids) for key, (fn, client) in blocks.items()})
    return t, cpu


def report(delay: float, t: dict[str, list[float]], cpu: dict[str, float], batch_size: int) -> None:
    m = {k: statistics.median(v) for k, v in t.items()}
    ideal = m["base"] / max(m["C"], m["Fpar"]) - 1
    exact = m["base"] / max(m["C"], m["Ctop"] + m["Fchain"]) - 1
    print(f"{delay:g} ms added per fetch: compute C {m['C'] * 1e3:.2f} ms, RPCs blocking Fseq {m['F'] * 1e3:.2f} ms,"
          f" in parallel Fpar {m['Fpar'] * 1e3:.2f} ms; ideal gain base/max(C, Fpar) - 1 = {ideal * 100:.1f}%")
    print(f"  exact schedules: the next lookup must follow this step's push, which needs the top's backward: "
          f"Ctop {m['Ctop'] * 1e3:.2f} ms + push->lookup Fchain {m['Fchain'] * 1e3:.2f} ms; "
          f"bound base/max(C, Ctop + Fchain) - 1 = {exact * 100:.1f}%")
    spread = f"{min(t['base']) * 1e3:.1f}..{max(t['base']) * 1e3:.1f}"
    print(f"  {'variant':<52} {'exact':<17} {'ms/step':>8} {'QPS':>7} {'gain %':>7} {'share':>6} {'of exact':>8} "
          f"{'CPU ms':>7}  spread ms")
    print(f"  {'baseline: blocking fetches, pushes waited at end':<52} {'yes':<17} {m['base'] * 1e3:>8.2f} "
          f"{batch_size / m['base']:>7.0f} {'':>7} {'':>6} {'':>8} {cpu['base'] * 1e3:>7.1f}  {spread}")
    for key, label, is_exact, _ in ROWS:
        gain = m["base"] / m[key] - 1
        of_exact = f"{gain / exact:.0%}" if is_exact == "yes" else "-"
        print(f"  {label:<52} {is_exact:<17} {m[key] * 1e3:>8.2f} {batch_size / m[key]:>7.0f} {gain * 100:>7.1f} "
              f"{gain / ideal:>6.0%} {of_exact:>8} {cpu[key] * 1e3:>7.1f}  "
              f"{min(t[key]) * 1e3:.1f}..{max(t[key]) * 1e3:.1f}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch-size", type=int, default=256)
    ap.add_argument("--steps", type=int, default=15, help="steps per block")
    ap.add_argument("--rounds", type=int, default=5, help="alternating blocks per variant and latency")
    ap.add_argument("--delays-ms", type=float, nargs="*", default=[0.0, 1.0, 5.0])
    ap.add_argument("--dense-layers", type=int, nargs="*", default=[512, 256, 16])
    ap.add_argument("--sharding", choices=["table_wise", "row_wise"], default="table_wise")
    args = ap.parse_args()
    torch.set_num_threads(1)
    if not CRITEO.is_file():
        sys.exit(f"Criteo sample not found at {CRITEO}")
    batches = list(criteo_batches(CRITEO, args.batch_size, num_embeddings=1000,
                                  limit=args.batch_size * args.steps))
    dims = tuple(args.dense_layers)
    print(f"torchrec DLRM on PS (parameter_servers pass): batch {args.batch_size}, 26 tables x 1000 x {dims[-1]} "
          f"{args.sharding} on 2 servers, dense arch {list(dims)}, over arch [64, 1]; {args.steps} steps/block, "
          f"{args.rounds} rounds; torch threads 1; transport uv (loopback)")
    with LocalCluster(2, timeout_s=120) as cluster:
        options = {"base": None, "async": {}, "defer": {"max_staleness": 1}, "prefetch": {"prefetch": True},
                   "prefetch_stale": {"prefetch": True, "max_staleness": 1}, "memory": None}
        steps = {key: Step(*build(key, args, dims, opts), prefetch=bool(opts and opts.get("prefetch")),
                           wait=key in ("base", "async", "memory")) for key, opts in options.items()}
        base_client = get_client(steps["base"].client)
        answers = {s: base_client.lookup(s, batches[0][1]).detach() for s in range(2)}
        MemoryClient(get_client(steps["memory"].client), answers)
        for key, step in steps.items():  # warm-up
            time_block(step, [batches[0]] * 3 if key == "memory" else batches[:3])
            get_client(step.client).flush()
        for delay in args.delays_ms:
            pids = [p.pid for p in cluster.processes]
            report(delay, *measure(delay, args, batches, steps, base_client, pids, answers), args.batch_size)
        base_client.set_delays(0.0)
        for step in steps.values():
            get_client(step.client).close()


if __name__ == "__main__":
    main()
