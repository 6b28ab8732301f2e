"""The JSON-shaped records of a job: what the parts of ``results.json`` hold (:mod:`jobs.results` names them as the
types of its fields), what the trainers and servers report to the launcher, and the JobState's error.

Each is a :class:`typing.TypedDict`: at run time a plain dict (``json.dump`` writes it as it is, so results.json
is the same file), for mypy a record whose keys and value types are known. ``total=False`` / ``NotRequired``
mark the keys a record may lack. The checkpoint's records (:class:`Checkpoint`, :class:`ModelState`) hold tensors
(``torch.save``, read back with the weights-only loader), not JSON. :class:`MetricsTLS` is what the processes
hand their metrics exporters (:func:`jobs.trainer.metrics.tls_options`).
"""

from typing import TYPE_CHECKING, Any, NotRequired, TypedDict

if TYPE_CHECKING:
    import torch

    from recsys.criteo_shard import ScanSummary

__all__ = ["Quality", "HeldOut", "PassRecord", "PrefetchLookup", "OptimizeRecord", "ReaderSummary",
           "LayerRecord", "ModelQuality", "LauncherRecord", "ParseRecord", "DataRecord",
           "TableSizes", "CheckpointRecord", "ServerJoin", "Where", "TablePlace", "TableMove", "Reshard",
           "HostingRecord", "NodeLost", "ProcessStats", "MedianInterval", "Gain", "Within", "Parity",
           "TrainerFailure", "DynamicSpec", "EarlyEval", "Checkpoint", "ModelState", "MetricsTLS"]


# --- one phase ---------------------------------------------------------------------------------------------------

class Quality(TypedDict, total=False):
    """Held-out quality of a model (:func:`jobs.entry.quality`): the keys of the loss's metrics."""

    auc: float
    """Area under the ROC curve of the click probability (``bce_with_logits``, or a binary-label model's score)."""
    log_loss: float
    """Mean binary cross-entropy of the probability."""
    rows: int
    """Held-out rows scored, rows."""
    positives: int
    """Held-out rows with a positive label, rows."""
    rmse: float
    """Root mean squared error (``mse``)."""
    rmse_se: float
    """Standard error of the RMSE."""
    mae: float
    """Mean absolute error (``mse``)."""
    eval_loss: float
    """Mean held-out loss of your own ``[train] loss``."""
    eval_loss_se: float
    """Standard error of ``eval_loss``."""
    score: str
    """Which output leaf the AUC of a binary-label model with its own loss is computed from."""
    score_note: str
    """Why such a model has no AUC."""
    metric: dict[str, float]
    """Your ``[train] metric``'s ``{name: value}``."""


class HeldOut(Quality, total=False):
    """A model's held-out quality with the step of the model (``model.json``'s ``metrics``)."""

    step: int | None
    """The training step of the model measured, steps."""


class PassRecord(TypedDict):
    """One pass ``fxdist.optimize`` ran (``gm.meta["fxdist"]["passes"]``)."""

    name: str
    ms: float
    nodes_added: int
    nodes_erased: int
    modified: bool


class PrefetchLookup(TypedDict, total=False):
    """Whether ``async_rpc_prefetch`` prefetched one lookup, and why not."""

    prefetched: bool
    reason: str | None
    where: str | None
    servers: list[int]


class OptimizeRecord(TypedDict, total=False):
    """What ``fxdist.optimize`` did to a phase's model (:func:`jobs.trainer.pipeline._make_trained_module`)."""

    passes: list[PassRecord]
    """The passes run, in order."""
    fallback: str | None
    """The tracer's error when the phase fell back to the eager model (``[job] allow_eager_fallback``)."""
    placement: str | None
    """The ``parameter_servers`` pass's plan, text."""
    prefetch: dict[str, PrefetchLookup]
    """Per lookup (module path or client), whether it is prefetched (:func:`jobs.trainer.lookups.optimize_record`)."""


class ReaderSummary(TypedDict):
    """The trainers' readers together (:func:`jobs.trainer.phases.reader_summary`)."""

    lines_per_s: float
    """The mean per-worker parse rate, lines/s."""
    capacity_lines_per_s: float
    """All trainers' workers together, lines/s."""
    workers: int
    """Reader workers per trainer."""
    lines: int
    """Lines read by all trainers."""
    rows: int
    """Rows made by all trainers, rows."""
    per_trainer: list[float]
    """Each trainer's ``lines_per_s``."""


# --- inference ---------------------------------------------------------------------------------------------------

class LayerRecord(TypedDict, total=False):
    """One candidate layer of the int8 selection (``quant.select_int8``'s ``LayerChoice`` as a dict)."""

    name: str
    """The layer's module path (as ``target``)."""
    node: str
    """Its node in the traced graph."""
    target: str
    op: str
    input_shape: list[int]
    predicted_us: float
    fp32_us: float | None
    int8_us: float | None
    boundary_us: float | None
    chosen: bool
    reason: str
    speedup: float | None


class ModelQuality(Quality, total=False):
    """One model's inference row: its throughput and held-out quality (``fp32``, ``int8``)."""

    qps: float
    """Inference throughput, rows/s."""


# --- the job -----------------------------------------------------------------------------------------------------

class LauncherRecord(TypedDict):
    """The launcher of a running job."""

    pid: int
    host: str


class ParseRecord(TypedDict, total=False):
    """Rank 0's parse of its shard (:meth:`recsys.criteo_format.ParseStats.as_dict`) and its rows."""

    valid: int
    malformed: dict[str, int]
    examples: list[str]
    rank0_rows: int


class DataRecord(TypedDict, total=False):
    """``results.json["data"]``."""

    path: str
    """The data file or folder."""
    note: str
    """Where it came from, in words."""
    scan: "ScanSummary"
    """The first pass: lines, files, lines/s (:meth:`recsys.criteo_shard.DataPlan.summary`)."""
    parse: ParseRecord | None
    """Valid and malformed lines of rank 0's shard."""


class TableSizes(TypedDict):
    """Table sizes from the data (``cardinalities.json``, :func:`jobs.table_sizes.resolve`); ``results.json``'s
    ``tables`` holds ``sizes`` and, for sizes from the data, the rest."""

    sizes: list[int]
    """Rows per table, rows."""
    features: NotRequired[list[str]]
    distinct: NotRequired[list[int]]
    """Distinct values of each feature (up to the cap)."""
    distinct_exact: NotRequired[bool]
    max_table_size: NotRequired[int]
    rows: NotRequired[int]
    lines: NotRequired[int]
    files: NotRequired[int]


class CheckpointRecord(TypedDict):
    """A checkpoint written or restored."""

    phase: str
    step: int
    model: str
    """SHA-1 of the dense weights."""
    tables: str
    """SHA-1 of the server tables."""


class ServerJoin(TypedDict, total=False):
    """A server readied for a worker group."""

    pid: int
    group: int
    address: str


Where = TypedDict("Where", {"node_id": str, "address": str, "hostname": str, "pid": int,
                            "metrics": list[Any] | None, "ifnames": dict[str, str], "in": str}, total=False)
"""Where a process runs (:func:`jobs.cluster.where`): ``metrics`` is its exporter's ``[address, port]``; ``in``
the trainer whose process hosts a server."""


class TablePlace(TypedDict):
    """Where the ``parameter_servers`` pass put one table (:func:`scheduling.placement.restore.table_layout`)."""

    servers: list[str]
    table: str
    module: str
    rows: int
    dim: int
    dynamic: bool


class TableMove(TypedDict):
    """One table's servers before and after a reshard."""

    before: list[str]
    after: list[str]


class Reshard(TypedDict):
    """A ``--resume`` onto another number of servers (:func:`jobs.launcher.plan.reshard_plan`)."""

    from_servers: int
    to_servers: int
    tables: dict[str, dict[str, TableMove]]
    """Phase -> table path -> its move."""


class HostingRecord(TypedDict):
    """Where the parameter servers ran (:meth:`jobs.hosting.Hosting.to_json`)."""

    chosen: bool
    """In the trainers' processes."""
    setting: bool | str
    """``[cluster] servers_in_trainers``."""
    reason: str
    cpus: float | None
    """The job's CPUs (for "auto")."""


class NodeLost(TypedDict):
    """A node that died during the job (:func:`jobs.cluster.lost_nodes`)."""

    node_id: str
    address: str | None
    ran: list[str]
    """The job's processes it ran."""


class ProcessStats(TypedDict, total=False):
    """What a process measured at its end."""

    pid: int
    peak_rss_bytes: int
    """Peak resident set size, bytes."""
    rows: int
    """A server's rows held, rows."""
    bytes: int
    """A server's bytes held, bytes."""


class MedianInterval(TypedDict):
    """A median with its range and confidence interval (:func:`jobs.stats.median_interval`)."""

    median: float
    min: float
    max: float
    low: float | None
    high: float | None
    confidence: float
    n: int


class Gain(TypedDict):
    """The interleaved-block QPS gain (:func:`jobs.stats.interleaved_gain`), %."""

    block_gain_percent: list[float]
    median_percent: float
    """The reported gain, %."""
    min_percent: float
    max_percent: float
    low_percent: float | None
    high_percent: float | None
    confidence: float
    blocks: int
    warmup_blocks: int


class Within(TypedDict):
    """One quantity of the parity check against its tolerance."""

    baseline: float
    optimized: float
    diff: float
    tolerance: float
    ok: bool


class Parity(TypedDict, total=False):
    """The parity check: :func:`jobs.stats.parity_check` (``auc`` / ``rmse`` / ``eval_loss``, ``loss``), or with
    ``[phases] max_staleness`` :func:`jobs.staleness.staleness_parity` (``rule``, ``exact``, ``stale``...)."""

    ok: bool
    metrics: list[str]
    """The held-out metric checked."""
    mode: str
    """``[phases] parity``."""
    passes: list[str]
    """``[phases] passes``."""
    auc: Within
    rmse: Within
    eval_loss: Within
    loss: Within
    max_step_loss_diff: float
    identical_losses: bool
    rule: str
    """``"quality_tolerance"`` for a stale phase."""
    metric: str
    max_staleness: int
    exact: float
    stale: float
    abs_diff: float
    tolerance: float
    loss_exact: float
    loss_stale: float


class TrainerFailure(TypedDict):
    """A trainer's deterministic error (:meth:`jobs.launcher.state.JobState.fail`)."""

    kind: str
    type: str
    message: str
    rank: int


class DynamicSpec(TypedDict):
    """One dynamic table's settings for the ``parameter_servers`` pass (:func:`jobs.table_sizes.dynamic`)."""

    capacity: int
    min_count: int
    expire_steps: int | None


# --- the checkpoint (tensors) ------------------------------------------------------------------------------------

class EarlyEval(TypedDict, total=False):
    """A phase's mid-phase evaluation (:func:`jobs.trainer.evaluation.evaluate_mid_phase`)."""

    step: int
    quality: Quality
    model: dict[str, "torch.Tensor"]
    """The evaluated dense weights (the last phase's: the model the job quantizes)."""
    tables: dict[str, Any]
    """Its tables: ``{"dcp": "tables/eval-<step>-<id>/<phase>"}``, the folder (relative to the run folder) the
    servers wrote them into by shard (:func:`jobs.trainer.evaluation.snapshot_tables`); or, tables in the trainers
    and older records, whole (tensors, a dynamic table's nested state)."""


class Checkpoint(TypedDict, total=False):
    """``state.pt`` of a job's checkpoint (:func:`jobs.trainer.checkpoints.save_checkpoint`): per phase."""

    step: int
    final: bool
    models: dict[str, dict[str, "torch.Tensor"]]
    tables: dict[str, dict[str, Any]]
    """Phase -> its tables: ``{"dcp": "tables/step-<k>-<id>/<phase>"}``, the folder (relative to the run folder) the
    servers wrote them into by shard (:mod:`scheduling.placement.sharded`); or, for tables in the trainers and older
    checkpoints, the tables whole (as :attr:`EarlyEval.tables`)."""
    optim: dict[str, dict[str, Any]]
    """Phase -> ``torch.optim.Optimizer.state_dict()``."""
    eval: dict[str, EarlyEval]


class ModelState(TypedDict, total=False):
    """One phase's model in a checkpoint (:func:`jobs.launcher.model_export.final_model_state`)."""

    phase: str
    step: int | None
    model: dict[str, "torch.Tensor"]
    tables: dict[str, Any]


# --- a process's metrics exporter --------------------------------------------------------------------------------

class MetricsTLS(TypedDict):
    """``prometheus_client.start_http_server``'s TLS keyword arguments from ``[metrics]``
    (:func:`jobs.trainer.metrics.tls_options`)."""

    certfile: str
    """The PEM certificate served."""
    keyfile: str
    """Its PEM private key."""
    client_cafile: str | None
    """The PEM CA file client certificates are checked against, or None."""
    client_auth_required: bool
    """Refuse scrapers without such a certificate (mutual TLS)."""
