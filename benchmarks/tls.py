"""What TLS costs the ``socket`` transport between two hosts: a lookup and a push, plain TCP against TLS 1.3.

Two network namespaces joined by a veth pair stand for two hosts (10.78.0.1 and 10.78.0.2, made and removed
by this script; needs root and ``ip``). In the first, one process runs two parameter servers
(:class:`scheduling.ps.transport.socket_server.SocketServer`): one plain, one with the job's TLS credentials
(:mod:`scheduling.ps.transport.tls`); both authenticate clients with the same job key. In the second, one
trainer process holds a :class:`~scheduling.ps.PSClient` to each and, round after round (the order of the two
alternating), times ``--requests`` steps of what a training step sends: a blocking lookup of a batch of
``--batch`` samples over ``--tables`` tables of ``--rows`` x ``--dim`` (one id per table and sample), then
the push of its gradient. It prints each round's median step (ms), the medians over rounds, and the ratio
TLS / plain (a peer measured in the same run), and checks that both servers' tables end equal (TLS changes
nothing of what crosses). Besides wall time it prints the CPU both processes spent per step (the trainer's and
the server host's, every thread, from ``/proc/<pid>/task/*/schedstat``) and its ratio TLS / plain per round. On
shared cores both move with other load (on 2 cores at load 4-8 a plain step took 4.5-17 ms and 8-15 ms of CPU),
so take the figures from a quiet run: each round prints the load average.

Run: ``sudo .venv/bin/python benchmarks/tls.py [--rounds 5 --requests 300 --dim 64 --batch 128]``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

HOSTS = ("10.78.0.1", "10.78.0.2")


def _sh(*args: str) -> None:
    subprocess.run(args, check=True, capture_output=True, text=True)


def _tables(n: int, rows: int, dim: int):
    from torchrec.modules.embedding_configs import EmbeddingBagConfig

    return [EmbeddingBagConfig(name=f"t{i}", embedding_dim=dim, num_embeddings=rows, feature_names=[f"f{i}"])
            for i in range(n)]


def _serve(args: argparse.Namespace) -> None:
    """The server host: a plain and a TLS server, their addresses as one JSON line; until stdin closes."""
    from scheduling.ps.endpoints import ServerEndpoints
    from scheduling.ps.server import PSServer
    from scheduling.ps.transport.socket_server import SocketServer
    from scheduling.ps.transport.tls import TLSCredentials

    creds = TLSCredentials(**{k: v.encode() for k, v in json.loads(Path(args.creds).read_text()).items()})
    plain = SocketServer(ServerEndpoints(PSServer("plain")), HOSTS[0]).start()
    secure = SocketServer(ServerEndpoints(PSServer("tls")), HOSTS[0], tls_credentials=creds).start()
    print(json.dumps({"plain": plain.address, "tls": secure.address}), flush=True)
    sys.stdin.read()
    plain.close()
    secure.close()


def _cpu_ns(pid: int | str) -> int:
    """CPU time of process ``pid`` (``"self"``), every thread, in ns (``/proc/<pid>/task/*/schedstat``, field 1)."""
    total = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            total += int((task / "schedstat").read_text().split()[0])
        except (OSError, IndexError, ValueError):   # a thread that ended meanwhile
            pass
    return total


def _client(args: argparse.Namespace) -> None:
    """The trainer host: time both servers round by round; print the figures."""
    import torch
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    from scheduling.ps import PSClient
    from scheduling.ps.transport import tls

    creds = tls.TLSCredentials(**{k: v.encode() for k, v in json.loads(Path(args.creds).read_text()).items()})
    addresses = json.loads(args.addresses)
    tables = _tables(args.tables, args.rows, args.dim)
    clients = {}
    for mode in ("plain", "tls"):   # TLS is chosen when a connection opens: the first lookup opens it
        tls.set_job_tls(creds if mode == "tls" else None)
        clients[mode] = PSClient(tables, [addresses[mode]], transport="socket", name=f"bench_{mode}", seed=7,
                                 optimizer_kwargs={"lr": 0.01})
    tls.set_job_tls(None)
    gen = torch.Generator().manual_seed(0)
    keys = [f"f{i}" for i in range(args.tables)]

    def batch() -> KeyedJaggedTensor:
        values = torch.randint(0, args.rows, (args.tables * args.batch,), generator=gen)
        return KeyedJaggedTensor(keys=keys, values=values, lengths=torch.ones(args.tables * args.batch, dtype=torch.int64))

    def step(client, kjt) -> None:
        out = client.lookup(0, kjt)
        out.sum().backward()
        client.push(0, kjt, out)

    medians: dict[str, list[float]] = {"plain": [], "tls": []}
    cpu: dict[str, list[float]] = {"plain": [], "tls": []}   # ms a step, trainer + server host
    kjts = [batch() for _ in range(args.requests)]
    for mode in clients:   # warm-up: pages, caches, the TLS session
        for kjt in kjts[:20]:
            step(clients[mode], kjt)
    for r in range(args.rounds):
        for mode in (("plain", "tls") if r % 2 == 0 else ("tls", "plain")):
            times = []
            c0 = _cpu_ns("self") + _cpu_ns(args.server_pid)
            for kjt in kjts:
                t0 = time.perf_counter()
                step(clients[mode], kjt)
                times.append(time.perf_counter() - t0)
            cpu[mode].append((_cpu_ns("self") + _cpu_ns(args.server_pid) - c0) / 1e6 / len(kjts))
            medians[mode].append(statistics.median(times) * 1e3)
        print(f"round {r}: plain {medians['plain'][-1]:.3f} ms, tls {medians['tls'][-1]:.3f} ms a step; CPU "
              f"plain {cpu['plain'][-1]:.3f} ms, tls {cpu['tls'][-1]:.3f} ms a step "
              f"(tls / plain {cpu['tls'][-1] / cpu['plain'][-1]:.3f}x); load {os.getloadavg()[0]:.1f}", flush=True)
    same = all(torch.equal(a, b) for a, b in zip(clients["plain"].state_dict().values(),
                                                 clients["tls"].state_dict().values()))
    p, t = statistics.median(medians["plain"]), statistics.median(medians["tls"])
    answer = 4 * args.batch * args.tables * args.dim
    print(f"\nlookup + push of {args.batch} samples x {args.tables} tables x dim {args.dim} "
          f"({answer / 1024:.0f} KiB each way), between two network namespaces over a veth pair")
    print(f"plain TCP: {p:.3f} ms a step (rounds {min(medians['plain']):.3f}-{max(medians['plain']):.3f})")
    print(f"TLS 1.3:   {t:.3f} ms a step (rounds {min(medians['tls']):.3f}-{max(medians['tls']):.3f})")
    print(f"TLS / plain: {t / p:.3f}x; tables equal after the same steps: {same}")
    ratios = [a / b for a, b in zip(cpu["tls"], cpu["plain"])]
    print(f"CPU a step, trainer + server host: plain {statistics.median(cpu['plain']):.3f} ms, TLS "
          f"{statistics.median(cpu['tls']):.3f} ms; TLS / plain per round: median {statistics.median(ratios):.3f}x "
          f"({min(ratios):.3f}..{max(ratios):.3f})")


def _main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--requests", type=int, default=300, help="steps timed per round and transport")
    parser.add_argument("--tables", type=int, default=26)
    parser.add_argument("--rows", type=int, default=10_000)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--client", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--creds", help=argparse.SUPPRESS)
    parser.add_argument("--addresses", help=argparse.SUPPRESS)
    parser.add_argument("--server-pid", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        return _serve(args)
    if args.client:
        return _client(args)
    from scheduling.ps.transport import auth, tls

    tag = f"fxtls{os.getpid() % 10000}"
    ns = (f"{tag}a", f"{tag}b")
    env = {**os.environ, "FXDIST_AUTH_KEY": auth.new_key().hex(), "PYTHONPATH": str(ROOT)}
    with tempfile.TemporaryDirectory(prefix="fxdist-tls-bench-") as d:
        creds = tls.job_credentials()
        path = Path(d) / "creds.json"
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump({k: getattr(creds, k).decode() for k in ("ca_pem", "cert_pem", "key_pem")}, f)
        server = None
        try:
            for name in ns:
                _sh("ip", "netns", "add", name)
                _sh("ip", "netns", "exec", name, "ip", "link", "set", "lo", "up")
            _sh("ip", "link", "add", f"{tag}x", "type", "veth", "peer", "name", f"{tag}y")
            for name, link, host in zip(ns, (f"{tag}x", f"{tag}y"), HOSTS):
                _sh("ip", "link", "set", link, "netns", name)
                _sh("ip", "netns", "exec", name, "ip", "addr", "add", f"{host}/24", "dev", link)
                _sh("ip", "netns", "exec", name, "ip", "link", "set", link, "up")
            me = [sys.executable, str(Path(__file__).resolve()), "--creds", str(path)]
            server = subprocess.Popen(["ip", "netns", "exec", ns[0], *me, "--serve"], env=env, text=True,
                                      stdin=subprocess.PIPE, stdout=subprocess.PIPE)
            assert server.stdout is not None
            addresses = server.stdout.readline().strip()
            if not addresses:
                raise RuntimeError("the server host did not start (see its output above)")
            sizes = ["--rounds", str(args.rounds), "--requests", str(args.requests), "--tables", str(args.tables),
                     "--rows", str(args.rows), "--dim", str(args.dim), "--batch", str(args.batch)]
            subprocess.run(["ip", "netns", "exec", ns[1], *me, "--client", "--addresses", addresses,
                            "--server-pid", str(server.pid), *sizes],
                           env=env, check=True, timeout=1800)
        finally:
            if server is not None:
                server.communicate(timeout=30)
            for name in ns:
                subprocess.run(["ip", "netns", "del", name], capture_output=True)


if __name__ == "__main__":
    _main()
