"""The tables of a job config (``[job]``, ``[data]``, ``[model]``, ...): one frozen dataclass each, every key
with its default, its allowed range (``_key``) and its documentation (the string under it, which the config
reference page is generated from). :mod:`jobs.config` parses a TOML file into them and checks them.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

__all__ = ["JobSection", "DataSection", "ModelSection", "ClusterSection", "PhasesSection", "MetricsSection",
           "QuantSection", "FaultSection", "TrainSection", "ExportSection", "MAX_TABLE_SIZE", "NAME_PATTERN",
           "default_name"]

def _key(default: Any, lo: float | None = None, hi: float | None = None, *, above: bool = False,
         length: tuple[int, int] | None = None) -> Any:
    """A config key's dataclass field with its allowed range, checked by :meth:`JobConfig.validate`.

    Numbers must satisfy ``lo <= value <= hi`` (``lo < value`` with ``above``; floats must also be
    finite); for a list, ``length`` bounds its length and ``lo``/``hi`` bound each item.
    """
    meta = {"range": (lo, hi, above), "length": length}
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata=meta)
    return field(default=default, metadata=meta)


MAX_TABLE_SIZE = 2**32
"""Largest useful ``[model] table_size``: ids are hashed with CRC-32, so more buckets are never used."""
NAME_PATTERN = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9._-]{0,99}")
"""``[job] name``: it names the run folder, so only ``[A-Za-z0-9._-]``, not starting with '.', <= 100 chars."""


def default_name(factory: str) -> str:
    """``[job] name`` when the config does not set it: ``"dlrm-criteo"`` for the built-in DLRM (``factory = ""``),
    else ``"<module>-<function>"`` of ``[model] factory = "package.module:function"`` (the module's last part), so
    a run folder says which model ran; characters outside :data:`NAME_PATTERN` become ``_`` (``"user-model"`` when
    nothing usable is left).

    >>> default_name(""), default_name("mypkg.models:make_model"), default_name("jobs.movielens:model")
    ('dlrm-criteo', 'models-make_model', 'movielens-model')
    """
    if not factory:
        return "dlrm-criteo"
    module, _, function = factory.partition(":")
    name = "-".join(part for part in (module.rsplit(".", 1)[-1], function) if part)
    name = re.sub(r"[^A-Za-z0-9._-]", "_", name).lstrip(".")[:100]
    return name if NAME_PATTERN.fullmatch(name) else "user-model"


@dataclass(frozen=True)
class JobSection:
    name: str = "dlrm-criteo"
    """Job name; the ``job`` label of every metric and the prefix of the run folder (see NAME_PATTERN). Unset: "dlrm-criteo"
    for the built-in DLRM, else from ``[model] factory`` (``"mypkg.models:make_model"`` -> ``"models-make_model"``,
    :func:`default_name`)."""
    steps: int = _key(200, 1, 10**9)
    """Training steps per phase, per trainer."""
    batch_size: int = _key(128, 1, 2**20)
    """Samples per step, per trainer."""
    eval_epochs: float = _key(1.0, 0, 1000)
    """Held-out AUC / log loss are measured on the model after this many passes over each trainer's shard
    (capped at ``steps``; 0 = at the end of the phase). DLRM on Criteo peaks after about one epoch and
    over-fits when trained longer, while the QPS comparison wants more steps than one epoch has."""
    seed: int = _key(0, 0, 2**32 - 1)
    """Seed of the model initialisation (both phases start from the same weights)."""
    lr: float = _key(0.01, 0, 10, above=True)
    """Adagrad learning rate (dense and embedding parameters)."""
    checkpoint_every: int = _key(50, 0, 10**9)
    """Steps between checkpoints (dense weights + parameter-server tables); 0 = only at phase ends."""
    max_failures: int = _key(2, 0, 1000)
    """Ray Train FailureConfig.max_failures: restarts from the last checkpoint after a process or node
    failure before the job fails (Ray's -1, retry forever, is not allowed). Deterministic errors (bad data
    or config, a model that does not trace) end the job on the first attempt."""
    run_dir: str = "runs"
    """Folder that receives ``<name>-<timestamp>/`` with results.json, qps.png and checkpoints."""
    allow_eager_fallback: bool = False
    """If the model cannot be traced, run the optimized phase eagerly instead of failing."""
    progress: bool = True
    """Show the steps of the phases in the launching process: a tqdm bar on a terminal, plain lines otherwise."""


@dataclass(frozen=True)
class DataSection:
    path: str = ""
    """Criteo TSV, plain or gzip/bz2/xz-compressed (detected from the first bytes): one file, a directory of
    files (natural order, ``day_0 .. day_23``) or a glob; "" = ../shared/data/criteo/train_examples.txt when
    present, else synthetic data. Streamed (:mod:`recsys.criteo_stream`): whole files per trainer when there are
    at least as many files as trainers, else lines round-robin."""
    synthetic_rows: int = _key(20000, 1, 10**7)
    """Rows of Criteo-format data generated when no file is found."""
    eval_fraction: float = _key(0.1, 0, 0.5)
    """Fraction of lines (every k-th line of each file, k = round(1 / eval_fraction)) held out for AUC / log
    loss; never trained on. At most 0.5, so that training keeps at least every other line."""
    batches: str = ""
    """Your data: ``"package.module:function"`` called with a :class:`jobs.entry.DataContext`, returning an
    iterable of batches (the contract: :mod:`jobs.entry`); "" = the Criteo reader (``path`` above). Needs
    ``[model] factory``."""
    reader_workers: int = _key(1, 0, 64)
    """Worker processes that read and parse each trainer's Criteo data off the training thread (a torch
    DataLoader; :mod:`recsys.criteo_stream`); 0 = parse in the training process. The batches do not depend on it.
    With ``follow``, at most 1 (chunk boundaries depend on when the data arrives)."""
    eval_max_rows: int = _key(200_000, 1, 10**8)
    """At most this many held-out rows are kept in memory for AUC / log loss (the first ones, in file order)."""
    follow: bool = False
    """Train from a stream: read ``path`` (a folder, or a glob) as files appear, new files picked up and a partial
    last line waited for, until the job is stopped or has trained ``[job] steps`` (online training; pairs with
    ``[export] every_steps``). false = the files as they are when the job starts, in epochs. Files must arrive in
    natural order and stay until the job ends; a file is finished when the next one appears; the training lines of
    every file are dealt round-robin to the trainers; the held-out metrics are measured at the phase end on the
    held-out lines there when the job starts (:mod:`recsys.criteo_follow`). Needs a folder or glob ``path`` and the
    Criteo reader, and not ``[model] table_sizes = "data"``."""
    follow_poll_s: float = _key(1.0, 0.01, 60)
    """With ``follow``: seconds between looks for new data when a trainer has read all there is."""
    options: dict = field(default_factory=dict)
    """Free-form keys for your ``batches`` function (``DataContext.options``), e.g. ``{min_rating = 1}``."""


@dataclass(frozen=True)
class ModelSection:
    factory: str = ""
    """Your model: ``"package.module:function"`` returning an ``nn.Module``, called as ``factory(config)``
    (the :class:`JobConfig`) or ``factory()``, after ``torch.manual_seed([job] seed)``; "" = the built-in
    DLRM (the keys below). Needs ``[data] batches``."""
    options: dict = field(default_factory=dict)
    """Free-form keys for your ``factory`` (read them from ``config.model.options``)."""
    embedding_dim: int = _key(16, 1, 4096)
    """D: width of every embedding and of the bottom MLP's output."""
    table_size: int = _key(20000, 2, MAX_TABLE_SIZE)
    """Hash buckets per categorical feature (each of the 26 features has its own table) when ``table_sizes``
    is "uniform". The launcher also checks that the tables fit in the machine's memory (:mod:`jobs.launcher.checks`)."""
    table_sizes: list[int] | str = _key("uniform", 2, MAX_TABLE_SIZE, length=(26, 26))
    """Rows of each of the 26 tables: "uniform" (``table_size`` each), "dynamic" (collisionless tables on the
    parameter servers, ``dynamic_*`` below), "data" (from the data: a first pass
    counts the distinct values of each categorical feature, and table ``j`` gets ``min(distinct_j + 1,
    max_table_size)`` rows, row 0 for missing values; the launcher records the counts in
    ``<run>/cardinalities.json`` and the resolved list in results.json's config), or a list of 26 sizes.
    Read the resolved sizes with :func:`jobs.table_sizes.sizes`."""
    max_table_size: int = _key(10_000_000, 2, MAX_TABLE_SIZE)
    """Cap on each table's rows with ``table_sizes = "data"``: the values of a feature with more distinct values
    are hashed into this many rows."""
    dynamic_capacity: int = _key(20000, 1, MAX_TABLE_SIZE)
    """With ``table_sizes = "dynamic"``: rows per table, at most (each of the 26 tables keeps one row per raw id
    admitted, least recently used rows evicted beyond this; :mod:`scheduling.ps.dynamic`). Needs servers."""
    dynamic_min_count: int = _key(1, 1, 10**9)
    """Occurrences of an id in lookups before it gets a row (until then it reads zeros, its updates are dropped)."""
    dynamic_expire_steps: int = _key(0, 0, 10**9)
    """A row not looked up for this many lookups of its table is dropped; 0 = never."""
    bottom_mlp: list[int] = _key([512, 256], 1, 65536, length=(1, 16))
    """Hidden widths of the dense (bottom) MLP (1 to 16 layers); its output width is embedding_dim."""
    top_mlp: list[int] = _key([512, 256], 1, 65536, length=(1, 16))
    """Hidden widths of the over (top) MLP (1 to 16 layers); its output width is 1 (the click logit)."""
    plan: dict = field(default_factory=dict)
    """Placement overrides of the ``parameter_servers`` pass: ``{table name, weight path or module = "table_wise" |
    "row_wise" | server index | "local"}``, e.g. ``{t_C1 = "row_wise", pos = "local"}`` ("local": on the trainers)."""
    local_below_rows: int = _key(32, 0, MAX_TABLE_SIZE)
    """Your modules whose tables all have fewer rows stay on the trainers (DDP) unless ``plan`` places them;
    0 = none."""
    server_storage: str = "fp32"
    """How the parameter servers store the rows: "fp32", "fp16" (half the memory) or "fused8bit" (FBGEMM's
    fused 8-bit row-wise form, about a quarter; see scheduling.ps.storage). Lookups answer float32."""


@dataclass(frozen=True)
class ClusterSection:
    trainers: int = _key(2, 1, 1024)
    """Ray Train workers (DDP ranks)."""
    parameter_servers: int = _key(1, 0, 26)
    """Parameter-server actors holding the embedding tables; 0 keeps the tables in the trainers. The 26
    tables are placed table-wise, so more than 26 servers would hold nothing."""
    cpus_per_trainer: float = _key(1.0, 0, 1024, above=True)
    """Ray CPU resources reserved per trainer (servers reserve none)."""
    use_gpu: bool = False
    """Trainers on GPUs (DDP over nccl, one GPU each); servers, their RPC group and the int8 comparison stay on CPU."""
    address: str = ""
    """Ray cluster address; "" = $RAY_ADDRESS if set, else a local ray.init()."""
    placement: str = "pack"
    """Where Ray puts trainers and parameter servers: "pack" (Ray Train's PACK placement group; servers by
    Ray's default scheduling) or "spread" (trainers SPREAD over nodes, servers round-robin over the nodes,
    those that cannot hold a trainer first). See jobs.cluster; results.json's "placement" says where each ran."""
    transport: str = "socket"
    """How trainers reach the parameter servers: "socket" (one TCP connection per trainer process and server
    actor, tensors as raw buffers; the fastest, see docs/history.md "Parameter-server transports"), "torch_rpc" (a
    torch.distributed.rpc group per worker group) or "ray" (the server actors' methods called directly). See
    scheduling.ps.transport."""
    server_threads: int = _key(16, 1, 1024)
    """Threads each parameter server runs requests on (a request waiting for its turn holds none)."""
    servers_in_trainers: bool | str = "auto"
    """true: trainer i's process also serves parameter server i (parameter_servers <= trainers; no server actors);
    false: a Ray actor per server; "auto": in the trainers when parameter_servers = trainers and the job's CPUs are
    fewer than separate servers need to have a core each. See jobs.hosting; results.json's "servers_in_trainers"
    says what was chosen and why."""
    rpc_timeout_s: float = _key(30.0, 0, 3600, above=True)
    """Timeout of every parameter-server RPC and of joining the RPC group, seconds."""
    server_fetch_delay_ms: float = _key(1.0, 0, 10_000)
    """Added latency per parameter-server lookup, milliseconds: emulates the network round trip to a
    remote server, which a one-machine job does not have (0 = none)."""
    allow_unauthenticated: bool = False
    """Let ``transport = "torch_rpc"`` run on a cluster: torch.distributed.rpc has no authentication and its
    rendezvous store listens on every interface (:func:`jobs.config_rules.torch_rpc_error`)."""
    tls: bool = False
    """TLS 1.3 around every ``socket``-transport connection, with a per-job authority handed out through Ray
    (scheduling.ps.transport.tls): for traffic between hosts. Needs ``transport = "socket"``."""


@dataclass(frozen=True)
class PhasesSection:
    baseline: bool = True
    """Also train the baseline (eager module, no passes), interleaved with the optimized phase."""
    passes: list[str] = _key(["async_rpc_prefetch"], length=(0, 32))
    """fxdist.optimize pass names of the optimized phase, applied in order; each must be a name of
    ``fxdist.pipeline.known_passes()`` (checked when the config is loaded)."""
    block_steps: int = _key(10, 1, 10**9)
    """Steps per block: the phases alternate blocks of this many steps over the same batches (the order
    flips every block); the QPS gain is the median of the paired block ratios."""
    parity: str = "error"
    """The optimized phase's loss and AUC must match the baseline's within the baseline's own spread (with
    ``max_staleness``: its AUC within ``staleness_tolerance``): "error" (exit 3 when not), "warn" (report only)."""
    max_staleness: int = _key(0, 0, 64)
    """0 = exact training. k >= 1: the optimized phase's ``async_rpc_prefetch`` runs as ``async_rpc(prefetch=True,
    max_staleness=k)``, its lookups one step stale; needs parameter servers and that pass (:mod:`jobs.staleness`)."""
    staleness_tolerance: float = _key(0.002, 0, 1)
    """With ``max_staleness``: the largest |optimized - baseline| held-out AUC (RMSE or mean loss for a job
    without AUC) that the parity check accepts."""


@dataclass(frozen=True)
class MetricsSection:
    enabled: bool = True
    """Export Prometheus metrics from every trainer and server."""
    host: str = "127.0.0.1"
    """Address the exporters bind to, on the node where each runs: loopback by default; "node" = the node's
    Ray address (reachable from other hosts, for a Prometheus elsewhere on a cluster). Any address but loopback
    needs ``expose = true``."""
    port: int = _key(9400, 1, 65535)
    """Base port: trainer rank r uses port + r, server i uses port + trainers + i; the whole range
    port .. port + trainers + parameter_servers - 1 must be <= 65535."""
    expose: bool = False
    """Allow a non-loopback ``host`` ("node", "0.0.0.0", an address): the metrics are then served to the network."""
    certfile: str = ""
    """With ``keyfile``: serve HTTPS with this PEM certificate (prometheus_client's TLS); "" = plain HTTP."""
    keyfile: str = ""
    """The PEM private key of ``certfile``."""
    client_cafile: str = ""
    """PEM CA file that client certificates are checked against (with ``certfile``)."""
    client_auth_required: bool = False
    """Refuse scrapers without a client certificate signed by ``client_cafile`` (mutual TLS)."""


@dataclass(frozen=True)
class QuantSection:
    enabled: bool = True
    """After training, quantize the dense MLPs (quant/) and compare fp32 vs int8."""
    calibration_batches: int = _key(8, 1, 10_000)
    """Batches of training data fed to the observers."""
    eval_batch_size: int = _key(256, 1, 2**20)
    """Batch size of the inference QPS / accuracy comparison."""


@dataclass(frozen=True)
class FaultSection:
    """Fault injection, for tests: each fault fires once per job (the launcher's JobState actor records it)."""

    kill_trainer_at_step: int = _key(-1, -1, 10**9)
    """SIGKILL trainer rank 1 (or 0 with one trainer) at this optimized-phase step (1 .. [job] steps);
    -1 = never."""
    kill_server_at_step: int = _key(-1, -1, 10**9)
    """ray.kill() parameter server 0 at this optimized-phase step (1 .. [job] steps; needs a parameter
    server); -1 = never."""
    pause_at_step: int = _key(-1, -1, 10**9)
    """Trainer rank 0 stops for ``pause_seconds`` at this optimized-phase step (1 .. [job] steps), once Ray
    Train has registered the last checkpoint before it; the other trainers wait for it at their next step.
    A window for a fault from outside the job, such as a node's death (tests/jobs/test_cluster.py kills a
    host's raylet in it); the timeline says when it starts. -1 = never."""
    pause_seconds: float = _key(20.0, 0, 3600)
    """Length of the ``pause_at_step`` pause, seconds; below ``[cluster] rpc_timeout_s`` with parameter
    servers (the other trainers' lookups wait for rank 0's pushes that long)."""


@dataclass(frozen=True)
class TrainSection:
    loss: str = "bce_with_logits"
    """The training loss of ``model(*inputs)`` against the batch's labels: "bce_with_logits" (labels in
    {0, 1}; quality = held-out AUC and log loss), "mse" (quality = held-out RMSE), or
    ``"package.module:function"``, ``loss(output, labels) -> scalar tensor`` (quality = held-out mean loss;
    with 0/1 labels also AUC and log loss, :func:`jobs.entry.binary_score`). The DLRM uses "bce_with_logits"."""
    train_step: str = ""
    """Instead of ``loss`` in training: ``"package.module:function"``, ``train_step(model, batch) -> scalar loss
    tensor`` (your forward and loss, e.g. with a regularization term; the job runs ``backward()`` and the
    optimizer step). ``loss`` still names the held-out quality metric. Needs ``[model] factory``."""
    optimizer: str = "Adagrad"
    """The dense part's optimizer: a ``torch.optim`` class ("Adam", "torch.optim.AdamW", ...) or
    ``"package.module:function"``, ``function(params, **optimizer_kwargs) -> torch.optim.Optimizer``."""
    optimizer_kwargs: dict = field(default_factory=dict)
    """Its keyword arguments, e.g. ``{lr = 1e-3, weight_decay = 1e-5}``; ``lr`` defaults to ``[job] lr``."""
    metric: str = ""
    """``"pkg.mod:fn"``, ``fn(outputs, labels) -> {name: float}`` over the held-out batches, reported too."""
    table_optimizer: str = "rowwise_adagrad"
    """The parameter servers' optimizer of the tables: "rowwise_adagrad" (alias "adagrad") or "sgd"."""
    table_lr: float = _key(0.0, 0, 10)
    """Its learning rate; 0 = ``[job] lr``."""
    table_grad_reduction: str = "mean"
    """How the trainers' table gradients combine on the servers: "mean" (as DDP and torchrec's
    DistributedModelParallel) or "sum"."""


@dataclass(frozen=True)
class ExportSection:
    every_steps: int = _key(0, 0, 10**9)
    """Steps between deltas of the trained model (``RUN_DIR/model/deltas/``, :mod:`jobs.deltas`): every this many
    steps of the optimized phase, the rows the servers changed since the last delta (with dynamic tables' new and
    evicted ids) and the dense weights, written in step order, exactly once, for ``fxdist serve`` to apply to a live
    model; the first delta of a run is the whole model, its tables written by the servers by shard (no trainer holds
    them; :mod:`jobs.trainer.deltas`). Each delta stops the trainers while rank 0 takes the changed
    rows (about 0.4 us of CPU a row on a 2-core Xeon; ``benchmarks/deltas.py``): keep it a small part of this many
    steps. 0 = no deltas (the model is still written at the end of the job)."""

