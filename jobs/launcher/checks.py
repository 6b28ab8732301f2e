"""Checks ``fxdist launch`` runs before it starts Ray: everything that can be known to fail, fails here.

:func:`check` runs, cheapest first, and raises on the first problem (the CLI exits with status 2):

1. the config's own ranges and cross-key constraints (already checked by :func:`jobs.config.parse_config`);
2. the passes of ``[phases] passes`` resolve (their modules import; nothing is run);
3. your model (``[model] factory``): every entry point imports, the factory returns an ``nn.Module`` and the
   first train batch follows the batch contract (:func:`jobs.user_code.check`); else the data file
   (:func:`jobs.launcher.data.locate_data`: missing, a directory, empty, unreadable, unsupported compression, no valid
   line near the start), or enough synthetic rows when none is found;
4. on this machine only (no Ray cluster): the metrics ports are free (:func:`check_ports`), and the job's
   memory (:func:`estimate_memory`) fits in the memory available (:func:`available_memory_bytes`).

On a cluster the trainers and servers run on other hosts, so ports and memory are left to them.

Source: Ray Train ``TorchTrainer`` (retries are for process and node failures, not for a job that cannot
run); Linux ``/proc/meminfo`` (``MemAvailable``).
"""

from __future__ import annotations

import socket
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from jobs import table_sizes
from jobs.config import ConfigError, JobConfig
from jobs.config_rules import torch_rpc_error
from jobs.launcher.data import locate_data
from recsys.criteo_format import NUM_DENSE, NUM_SPARSE

__all__ = ["check", "log_memory", "check_synthetic_rows", "check_passes", "check_ports", "check_memory", "estimate_memory", "server_table_bytes", "MemoryEstimate", "server_table_copies",
           "available_memory_bytes"]

GIB = 1024**3
FLOAT_BYTES = 4
DENSE_COPIES = 4
"""Per trainer and phase: dense weights, their gradients, Adagrad's ``sum`` state and DDP's gradient buckets."""
PROCESS_BASE_BYTES = 512 * 1024**2
"""Fixed cost of each process of a job (Python, torch, torchrec, Ray; 0.4-0.6 GiB each in benchmarks/scale.py)."""


def server_table_copies(phases: int) -> int:
    """With parameter servers, float32 copies of the tables (weights + row-wise Adagrad state) at a checkpoint,
    besides the servers' own (one per phase, counted in ``MemoryEstimate.server_bytes``, in their storage
    form), for ``phases`` phases trained side by side (each its own table set): the copy a server answers
    ``state_dict`` with (1), the checkpoint trainer rank 0 gathers (one per phase) and the evaluated-model
    snapshot (1) (see jobs/trainer/servers.py ``ServerTables`` and jobs/trainer/checkpoints.py ``save_checkpoint`` /
    jobs/trainer/evaluation.py ``evaluate_mid_phase``)."""
    return phases + 2


STORED_ROW_BYTES = {"fp32": lambda dim: 4 * dim, "fp16": lambda dim: 2 * dim, "fused8bit": lambda dim: dim + 8}
"""Bytes of one stored row of width ``dim`` per ``[model] server_storage`` (scheduling.ps.storage)."""


def check(config: JobConfig, *, local: bool, log: Any = None) -> Path | None:
    """Run every check that needs no Ray (see the module docstring).

    Args:
        local: The job runs on this machine (no Ray cluster): also check ports and memory.
        log: ``log(message)`` for what was checked, or None.

    Returns:
        The data file, or None when synthetic data is to be generated or the job reads your batches.

    Raises:
        ConfigError: a pass or entry point that does not resolve, bad batches, a taken port, not enough
            memory (the memory estimate is the built-in DLRM's; your model's is not estimated), or the
            unauthenticated ``torch_rpc`` transport on a cluster (:func:`jobs.config_rules.torch_rpc_error`).
        recsys.criteo_format.DataError: the data file cannot be used.
    """
    unsafe = torch_rpc_error(config.cluster, on_cluster=not local)
    if unsafe:
        raise ConfigError(f"{config.source}: {unsafe}")
    check_passes(config)
    import torch

    from jobs.optimizers import dense_optimizer

    dense_optimizer(config, [torch.nn.Parameter(torch.zeros(1))])   # the class or factory and its kwargs
    if config.user_model:
        from jobs import user_code

        note = user_code.check(config)
        if log is not None:
            log(note)
        if local and config.metrics.enabled:
            check_ports(config)
        return None
    data = locate_data(config.data.path, config.model.table_size, follow=config.data.follow)
    if data is None:
        check_synthetic_rows(config)
    if local:
        if config.metrics.enabled:
            check_ports(config)
        if config.model.table_sizes != "data":  # else the first pass checks, once the sizes are known
            log_memory(check_memory(config), log)
    return data


def log_memory(estimate: MemoryEstimate, log: Any) -> None:
    """Log the memory ``estimate`` (bytes, shown in GiB) and what this machine has available; nothing without
    ``log``."""
    if log is not None:
        biggest = max(estimate.processes.items(), key=lambda kv: kv[1], default=("", 0))
        log(f"memory: the job needs about {estimate.total_bytes / GIB:.2f} GiB "
            f"(embedding tables {estimate.tables_bytes / GIB:.2f} GiB each copy; largest process {biggest[0]} "
            f"{biggest[1] / GIB:.2f} GiB), {available_memory_bytes() / GIB:.1f} GiB available")


def check_synthetic_rows(config: JobConfig) -> None:
    """Generated data must give every trainer a training line and, with ``eval_fraction > 0``, the
    evaluation a held-out line (every k-th line, k = round(1 / eval_fraction), is held out).

    Raises:
        ConfigError: naming ``[data] synthetic_rows`` and the smallest value that works.
    """
    rows, trainers, fraction = config.data.synthetic_rows, config.cluster.trainers, config.data.eval_fraction
    every = round(1 / fraction) if fraction > 0 else 0
    need = max(every, trainers + (trainers - 1) // (every - 1) if every > 1 else trainers)
    if rows < need:
        raise ConfigError(f"{config.source}: [data] synthetic_rows = {rows}: the generated data must give each of "
                          f"the {trainers} trainers a training line"
                          f"{' and hold out every ' + str(every) + '-th line' if every else ''}; use >= {need}")


def check_passes(config: JobConfig) -> None:
    """Resolve every pass of ``[phases] passes`` (imports its module, runs nothing).

    Raises:
        ConfigError: an unknown pass (listing the known ones), or one whose module cannot be imported.
    """
    from fxdist.pipeline import resolve_pass

    for name in config.phases.passes:
        try:
            resolve_pass(name)
        except (ValueError, ImportError) as e:
            raise ConfigError(f"{config.source}: [phases] passes: {e}") from None


def check_ports(config: JobConfig) -> None:
    """Fail early, with the fix, when an exporter port of this machine is taken.

    Raises:
        ConfigError: naming the port in use.
    """
    m, c = config.metrics, config.cluster
    last = m.port + c.trainers + c.parameter_servers - 1
    host = "0.0.0.0" if m.host == "node" else m.host  # "node": this machine's Ray address, not known yet
    for port in range(m.port, last + 1):
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError as e:
                raise ConfigError(
                    f"{config.source}: [metrics] port: {m.host}:{port} is in use ({e.strerror}); the job needs ports "
                    f"{m.port}..{last}. Pick another base, e.g. --set metrics.port={m.port + 100}, or "
                    "--set metrics.enabled=false"
                ) from None


@dataclass(frozen=True)
class MemoryEstimate:
    """What a job holds in memory at its peak (a checkpoint in the last phase), in bytes."""

    tables_bytes: int
    """One float32 copy of the 26 tables: ``sum(table_sizes) * D`` float32, plus the row-wise Adagrad state
    (``sum(table_sizes)`` float32) when they live on parameter servers."""
    table_copies: int
    """How many copies exist at once (see :func:`server_table_copies`; in-trainer tables: 2 per trainer and
    phase, weights and Adagrad's dense ``sum``, plus rank 0's evaluated-model snapshot)."""
    dense_bytes: int
    """Dense (MLP) parameters of all trainers, times DENSE_COPIES."""
    server_bytes: int = 0
    """The servers' own table sets (one per phase), rows in ``[model] server_storage`` form plus the fp32
    row-wise Adagrad state."""
    fixed_bytes: int = 0
    """Every process's :data:`PROCESS_BASE_BYTES`, plus, with ``[quant] enabled``, the launcher's two float32
    copies of the evaluated model's tables (the final checkpoint's pages it maps, and the rebuilt model)."""
    processes: dict[str, int] = field(default_factory=dict)
    """Peak bytes per process: ``trainer<r>``, ``ps<i>`` (its shards as the ``parameter_servers`` pass places them,
    :func:`server_table_bytes`);
    they add up to :attr:`total_bytes`."""

    @property
    def total_bytes(self) -> int:
        return self.tables_bytes * self.table_copies + self.server_bytes + self.dense_bytes + self.fixed_bytes


def dense_parameters(config: JobConfig) -> int:
    """Parameters of the DLRM's bottom and top MLPs (weights and biases)."""
    m = config.model
    features = NUM_SPARSE + 1
    count = 0
    for inputs, widths in ((NUM_DENSE, [*m.bottom_mlp, m.embedding_dim]),
                           (m.embedding_dim + features * (features - 1) // 2, [*m.top_mlp, 1])):
        for width in widths:
            count += inputs * width + width
            inputs = width
    return count


def _server_rows(config: JobConfig) -> list[int]:
    """Rows each parameter server holds of one table set, placed as the ``parameter_servers`` pass places the
    built-in DLRM's tables ``t_C1 .. t_C26`` (:func:`scheduling.placement.plan.plan_tables`, with ``[model] plan``'s
    overrides): table-wise, a large table row-wise when the servers would otherwise be unbalanced."""
    from scheduling.placement.plan import TableInfo, plan_tables, shards_of
    from scheduling.ps.shard_plan import TableSpec

    m, n = config.model, config.cluster.parameter_servers
    module = "sparse_arch.embedding_bag_collection"  # where jobs.criteo.dlrm keeps them
    tables = [TableInfo(TableSpec(f"t_C{j + 1}", size, m.embedding_dim, (f"C{j + 1}",)), module,
                        f"{module}.embedding_bags.t_C{j + 1}") for j, size in enumerate(table_sizes.sizes(config))]
    rows = [0] * n
    for placement in plan_tables(tables, n, dict(m.plan) or None):
        for shard in shards_of(placement, n):
            rows[shard.server] += shard.num_rows
    return rows


def server_table_bytes(config: JobConfig) -> list[int]:
    """Bytes each parameter server holds for one table set (one phase): its rows (:func:`_server_rows`) in
    ``[model] server_storage`` form plus the fp32 row-wise Adagrad state (one float per row), as
    ``PSServer.memory()["bytes"]`` counts them."""
    stored_row = STORED_ROW_BYTES[config.model.server_storage](config.model.embedding_dim)
    return [n * (stored_row + FLOAT_BYTES) for n in _server_rows(config)]


def estimate_memory(config: JobConfig) -> MemoryEstimate:
    """The job's peak memory on one machine, per process and in total (see :class:`MemoryEstimate`), from
    the per-feature table sizes (:func:`jobs.table_sizes.sizes`), the servers' storage form and
    the optimizer state.

    Raises:
        ConfigError: ``[model] table_sizes = "data"`` not resolved yet.
    """
    m, c = config.model, config.cluster
    phases = 2 if config.phases.baseline else 1  # trained side by side, each with its own tables
    rows, width = sum(table_sizes.sizes(config)), m.embedding_dim * FLOAT_BYTES
    per_trainer = dense_parameters(config) * FLOAT_BYTES * DENSE_COPIES * phases
    dense = per_trainer * c.trainers
    procs = {f"trainer{r}": per_trainer for r in range(c.trainers)}
    if c.parameter_servers:
        state_row, stored_row = FLOAT_BYTES, STORED_ROW_BYTES[m.server_storage](m.embedding_dim)
        copy = rows * (width + state_row)
        procs["trainer0"] += (server_table_copies(phases) - 1) * copy  # the gathered checkpoint and the snapshot
        for i, (n, held) in enumerate(zip(_server_rows(config), server_table_bytes(config))):
            procs[f"ps{i}"] = phases * held + n * (width + state_row)  # its tables per phase, its state_dict answer
        copies, server = server_table_copies(phases), phases * rows * (stored_row + state_row)
    else:
        for r in range(c.trainers):
            procs[f"trainer{r}"] += 2 * phases * rows * width + (rows * width if r == 0 else 0)
        copy, copies, server = rows * width, 2 * c.trainers * phases + 1, 0
    # the launcher maps the final checkpoint (torch.load(mmap=True)); the int8 comparison pages in the evaluated
    # model's tables and copies them into a rebuilt model
    launcher = 2 * rows * width if config.quant.enabled else 0
    procs = {name: n + PROCESS_BASE_BYTES for name, n in {**procs, "launcher": launcher}.items()}
    return MemoryEstimate(copy, copies, dense, server, len(procs) * PROCESS_BASE_BYTES + launcher, procs)


def available_memory_bytes() -> int:
    """Memory available to new processes: psutil's ``virtual_memory().available`` when installed, else
    ``MemAvailable`` of ``/proc/meminfo`` (Linux).

    Raises:
        OSError: neither is available.
    """
    try:
        import psutil
    except ImportError:
        pass
    else:
        return int(psutil.virtual_memory().available)
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise OSError("/proc/meminfo has no MemAvailable line")


def check_memory(config: JobConfig, available: int | None = None) -> MemoryEstimate:
    """Refuse a job whose estimated peak memory exceeds what this machine has available.

    Args:
        available: Bytes available (default: :func:`available_memory_bytes`).

    Raises:
        ConfigError: naming the table sizes (``[model] table_size`` or the per-feature ``table_sizes``) and
            ``embedding_dim``, what the tables need per copy and per process, what the machine has, and what
            to change (a smaller cap, 8-bit server rows, more servers on a Ray cluster).
    """
    estimate = estimate_memory(config)
    if available is None:
        try:
            available = available_memory_bytes()
        except OSError:
            return estimate  # not Linux and no psutil: nothing to compare with
    if estimate.total_bytes > available:
        raise ConfigError(f"{config.source}: {_memory_message(config, estimate, available)}")
    return estimate


def _memory_message(config: JobConfig, estimate: MemoryEstimate, available: int) -> str:
    m, c = config.model, config.cluster
    sizes = table_sizes.sizes(config)
    where = (f"on the {c.parameter_servers} parameter server(s) with row-wise Adagrad state"
             if c.parameter_servers else f"in each of the {c.trainers} trainers")
    dynamic = m.table_sizes == "dynamic"
    what = (f"[model] table_size = {m.table_size}" if m.table_sizes == "uniform" else
            f"[model] dynamic_capacity = {m.dynamic_capacity}" if dynamic else
            f"[model] table_sizes = per feature ({sum(sizes):_} rows in all, the largest {max(sizes):_})")
    procs = ", ".join(f"{name} {b / GIB:.2f}" for name, b in estimate.processes.items())
    fixes = ["a smaller table_size" if m.table_sizes == "uniform" else "a smaller dynamic_capacity" if dynamic
             else "a smaller [model] max_table_size (per-feature sizes are capped there)", "a smaller embedding_dim"]
    if c.parameter_servers and m.server_storage != "fused8bit":
        fixes.append('[model] server_storage = "fused8bit" (a quarter of fp32 rows)')
    fixes.append("more parameter servers on a Ray cluster ([cluster] address, parameter_servers)")
    return (f"{what}, embedding_dim = {m.embedding_dim}: the job needs about {estimate.total_bytes / GIB:.1f} GiB, "
            f"more than the {available / GIB:.1f} GiB this machine has available. One copy of the 26 tables "
            f"({where}) is {estimate.tables_bytes / GIB:.2f} GiB and about {estimate.table_copies} float32 copies "
            f"exist at a checkpoint, besides the servers' own ({estimate.server_bytes / GIB:.2f} GiB, [model] "
            f"server_storage = {m.server_storage!r}); the dense models take {estimate.dense_bytes / GIB:.2f} GiB, the "
            f"processes' fixed costs and the launcher's copy {estimate.fixed_bytes / GIB:.2f} GiB. "
            f"Per process (GiB): {procs}. Use {', or '.join(fixes)}")
