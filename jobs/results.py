"""A job's results as typed objects: :class:`JobResults` (``results.json``), :class:`PhaseResult` (one entry of
``phases``) and :class:`InferenceResult` (``inference``).

Each field is one key of ``results.json``, named as the key (each JSON key is written in exactly one place: the
field's name). A field left :data:`ABSENT` is not in the JSON (e.g. ``inference`` of a job without
``[quant] enabled``, ``error`` of a completed run); a field that is None is written as ``null``.
:meth:`JobResults.to_json` gives the dict for ``json.dump`` (NaN / inf as null, tuples as lists, the nested results
by their own ``to_json``), :meth:`JobResults.from_json` reads it back; ``from_json(x.to_json()) == x`` for results
read from JSON. Open-ended parts (a config, a user's metrics, per-lookup records, int8 layers) stay dicts. The
objects also read like the JSON dict (``results["phases"]["baseline"]["qps"]``, ``.get(key, default)``, ``key in``),
so the table code (:mod:`jobs.launcher.report`) and scripts read a results dict and the typed results alike.

Source: the results.json written by :func:`jobs.launcher.report.write` (the schema was prose in
:mod:`jobs.launcher.report`).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Callable, ClassVar, Literal

from jobs.records import (
    CheckpointRecord,
    DataRecord,
    Gain,
    HostingRecord,
    LauncherRecord,
    LayerRecord,
    ModelQuality,
    NodeLost,
    OptimizeRecord,
    Parity,
    ProcessStats,
    Quality,
    ReaderSummary,
    Reshard,
    ServerJoin,
    TablePlace,
    TableSizes,
    Where,
)

__all__ = ["ABSENT", "Absent", "ResultsError", "PhaseResult", "InferenceResult", "JobResults", "strict_json"]


class Absent:
    """The type of :data:`ABSENT`: a key not in ``results.json`` (falsy, compares equal only to itself)."""

    _one: ClassVar[Absent | None] = None

    def __new__(cls) -> Absent:
        if cls._one is None:
            cls._one = super().__new__(cls)
        return cls._one

    def __bool__(self) -> Literal[False]:  # Literal: mypy drops Absent from ``x or default``
        return False

    def __repr__(self) -> str:
        return "ABSENT"

    def __reduce__(self) -> str:  # pickles (Ray) to the same singleton
        return "ABSENT"


ABSENT = Absent()
"""A field whose key is not in ``results.json``."""


class ResultsError(ValueError):
    """A results dict that does not fit the schema: a required key missing, or a key no field knows.

    See docs/troubleshooting.md#resultserror.
    """


def strict_json(value: Any) -> Any:
    """``value`` with NaN/inf floats as None and tuples as lists (strict JSON); dataclass results by their
    ``to_json``."""
    if isinstance(value, _Result):
        return value.to_json()
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {str(k): strict_json(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [strict_json(v) for v in value]
    return value


class _Result:
    """The shared ``to_json`` / ``from_json`` of the results dataclasses (fields without a default are required)."""

    _nested: ClassVar[dict[str, Callable[[Any, str], Any]]] = {}
    """Field name -> how a JSON value of it is read (a ``from_json``), for nested results."""

    def to_json(self) -> dict[str, Any]:
        """The results as a JSON-ready dict: the fields not :data:`ABSENT`, under their names (strict JSON)."""
        return {f.name: strict_json(getattr(self, f.name)) for f in dataclasses.fields(self)  # type: ignore[arg-type]
                if getattr(self, f.name) is not ABSENT}

    @classmethod
    def from_json(cls, data: dict[str, Any] | _Result, where: str = "results") -> Any:
        """Read the dict ``data`` (``where`` names it in errors, e.g. ``results.phases.baseline``).

        Raises:
            ResultsError: ``data`` is not a dict, lacks a required key, or has a key no field knows (the
                message names the key and where).
        """
        if isinstance(data, cls):
            return data
        if not isinstance(data, dict):
            raise ResultsError(f"{where}: expected a JSON object, got {type(data).__name__}")
        fields = {f.name: f for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
        unknown = [k for k in data if k not in fields]
        if unknown:
            raise ResultsError(f"{where}: unknown key {unknown[0]!r} (not a field of {cls.__name__}; known: "
                               f"{', '.join(fields)})")
        for name, f in fields.items():
            if name not in data and f.default is dataclasses.MISSING:
                raise ResultsError(f"{where}: required key {name!r} is missing ({cls.__name__})")
        values = {k: cls._nested[k](v, f"{where}.{k}") if k in cls._nested and v is not None else v
                  for k, v in data.items()}
        return cls(**values)

    def get(self, key: str, default: Any = None) -> Any:
        """The field ``key``, or ``default`` when it is :data:`ABSENT` (read like the JSON dict)."""
        value = getattr(self, key, ABSENT)
        return default if value is ABSENT else value

    def __getitem__(self, key: str) -> Any:
        value = getattr(self, key, ABSENT)
        if value is ABSENT:
            raise KeyError(key)
        return value

    def __contains__(self, key: str) -> bool:
        return getattr(self, key, ABSENT) is not ABSENT


@dataclass(frozen=True)
class PhaseResult(_Result):
    """One phase (``baseline`` / ``optimized``) of ``results.json["phases"]``: :func:`jobs.stats.phase_summary`
    plus what the trainers add after evaluation (``jobs.trainer.phases._finish_phases``)."""

    qps: float | None
    """Job-wide training throughput, samples/s: all trainers' samples / the slowest trainer's phase wall time."""
    step_p50_ms: float | None
    """Median training step time, ms, pooled over every step of every trainer."""
    step_p99_ms: float | None
    """99th percentile of the step time, ms."""
    lookup_p50_ms: float | None
    """Median parameter-server lookup time, ms; None without lookups (no servers)."""
    lookup_p99_ms: float | None
    """99th percentile of the lookup time, ms; None without lookups."""
    loss: float | None
    """Training loss: the mean over trainers of each one's mean over its last 10 % of steps."""
    trainers: int | Absent = ABSENT
    """Trainers (DDP ranks) that ran the phase."""
    steps: int | Absent = ABSENT
    """Training steps per trainer."""
    samples: int | Absent = ABSENT
    """Samples trained by all trainers, samples."""
    wall_seconds: float | Absent = ABSENT
    """The slowest trainer's wall time of the phase, seconds."""
    prefetched_lookups: int | Absent = ABSENT
    """Lookups of all trainers answered by a prefetch (``async_rpc_prefetch``), lookups."""
    metrics_percent: float | None | Absent = ABSENT
    """Largest trainer share of the phase time spent updating Prometheus metrics, %."""
    qps_series: list[Sequence[float]] | Absent = ABSENT  # (seconds, QPS) pairs: tuples, lists when read from JSON
    """[(seconds since the phase started, samples/s of the job)] over sliding windows of rank 0's steps."""
    loss_series: list[float] | Absent = ABSENT
    """Rank 0's training loss per step."""
    quality: Quality | None | Absent = ABSENT
    """Held-out quality of the model after ``quality_step``: ``auc``, ``log_loss``, ``rows``, ``positives`` (or
    ``rmse``/``mae``, ``eval_loss``; a user's ``metric`` dict), :func:`jobs.entry.quality`."""
    quality_step: int | Absent = ABSENT
    """The step whose model ``quality`` measures (``[job] eval_epochs`` passes over a trainer's shard), steps."""
    quality_epochs: float | Absent = ABSENT
    """Passes over a trainer's shard at ``quality_step``, epochs."""
    quality_end: Quality | None | Absent = ABSENT
    """The same metrics as ``quality`` for the model at the phase end."""
    optimize: OptimizeRecord | None | Absent = ABSENT
    """What ``fxdist.optimize`` did: ``passes`` run (name, nodes added / erased), ``fallback``, ``placement``;
    ``prefetch``: per lookup ``prefetched``, ``reason``, ``where`` (:func:`jobs.trainer.lookups.optimize_record`)."""
    resumed_from_step: int | Absent = ABSENT
    """The step the phase's summarised run started at (0 unless restarted from a checkpoint), steps."""
    epochs: float | Absent = ABSENT
    """Passes over a trainer's shard in the whole phase, epochs."""
    block_seconds: list[list[float]] | Absent = ABSENT
    """Per trainer, the seconds of each interleaved block (:func:`jobs.stats.interleaved_gain`), seconds."""
    reader: ReaderSummary | None | Absent = ABSENT
    """The trainers' reader statistics (lines/s; :func:`jobs.trainer.phases.reader_summary`), None without a stream."""
    dynamic_tables: dict[str, dict[str, int]] | Absent = ABSENT
    """Dynamic tables (``[model] table_sizes = "dynamic"``) at the end of the phase's training: per table (``t_C1``
    ...) ``rows`` held and ``capacity`` (rows), and the counts ``inserts`` (ids first seen), ``admitted`` (rows
    made), ``evictions`` (LRU), ``rejected`` (lookup and push positions of ids without a row), ``expired``
    (:func:`jobs.trainer.servers.dynamic_stats`)."""


@dataclass(frozen=True)
class InferenceResult(_Result):
    """``results.json["inference"]``: fp32 vs int8 inference of the trained model
    (:func:`jobs.launcher.inference.compare`), or ``skipped`` with the reason."""

    skipped: str | Absent = ABSENT
    """Why there is no comparison (an error of the stage included); then the fields below are mostly absent."""
    method: str | Absent = ABSENT
    """How the int8 model was made (fuse + ``quant.select_int8``)."""
    fused_modules: int | Absent = ABSENT
    """Linear+ReLU pairs fused, modules."""
    quantized_modules: int | Absent = ABSENT
    """Layers run in int8, modules."""
    isa: str | None | Absent = ABSENT
    """The CPU's int8 instruction set as FBGEMM sees it (e.g. ``avx512_vnni``)."""
    layers: list[LayerRecord] | None | Absent = ABSENT
    """Per layer (by module path): ``target``, ``fp32_us`` / ``int8_us`` µs per call, ``chosen``..."""
    kept_fp32: bool | Absent = ABSENT
    """No layer (or not the whole int8 model) was faster: the int8 row repeats the fp32 model."""
    note: str | None | Absent = ABSENT
    """Why fp32 was kept, in words."""
    all_int8_speedup: float | None | Absent = ABSENT
    """What static int8 of every layer measured, int8 / fp32 QPS (x)."""
    selection: str | Absent = ABSENT
    """``quant.select_int8``'s report, text."""
    output_max_abs_diff: float | None | Absent = ABSENT
    """Largest ``|int8 - fp32|`` over every floating output leaf of every held-out batch."""
    int8_measured: ModelQuality | Absent = ABSENT
    """The int8 model's ``qps`` (rows/s) and quality when it was measured but not kept."""
    rows: int | Absent = ABSENT
    """Held-out rows scored, rows."""
    batch_size: int | Absent = ABSENT
    """Rows per inference batch."""
    threads: int | Absent = ABSENT
    """CPU threads of the measurement."""
    fp32: ModelQuality | Absent = ABSENT
    """``qps`` (rows/s) and the quality metrics (``auc``, ``log_loss``...) of the fp32 model."""
    int8: ModelQuality | Absent = ABSENT
    """The same for the model chosen (a copy of ``fp32`` when ``kept_fp32``)."""
    speedup: float | None | Absent = ABSENT
    """int8 / fp32 inference QPS (x); exactly 1.0 when fp32 is kept."""
    device: str | Absent = ABSENT
    """Where the comparison ran (``"cpu"``: FBGEMM's kernels)."""
    device_note: str | Absent = ABSENT
    """Why the comparison ran on the CPU when the trainers used GPUs."""
    model_step: int | None | Absent = ABSENT
    """The training step of the model quantized, steps."""
    seconds: float | Absent = ABSENT
    """Time of the whole stage, seconds."""


@dataclass(frozen=True)
class JobResults(_Result):
    """``results.json``: a job's results (:func:`jobs.launcher.launch.launch`; its ``status`` as
    :mod:`jobs.launcher.runs` says)."""

    job: str | None
    """``[job] name``."""
    config: dict[str, Any]
    """The job's config, every table (:func:`jobs.config.to_dict`), table sizes resolved."""
    phases: dict[str, PhaseResult]
    """Phase name -> its :class:`PhaseResult` (finished phases only while running)."""
    status: str | Absent = ABSENT
    """``running``, ``completed``, ``interrupted`` or ``failed`` (absent: completed, before statuses)."""
    config_source: str | Absent = ABSENT
    """Where the config came from (a file, or the defaults)."""
    run_dir: str | Absent = ABSENT
    """The run folder."""
    launcher: LauncherRecord | Absent = ABSENT
    """``pid`` and ``host`` of the launcher while running (to refuse ``--resume`` of a live run)."""
    resumes: int | Absent = ABSENT
    """Times the run was continued with ``--resume``."""
    data: DataRecord | Absent = ABSENT
    """``path``, ``note``, ``scan`` (the first pass: lines, files, lines/s), ``parse`` (valid / malformed lines)."""
    tables: TableSizes | Absent = ABSENT
    """Embedding table ``sizes`` (rows) and the cardinalities they came from."""
    restarts: int | Absent = ABSENT
    """Worker-group restarts from a checkpoint (:func:`jobs.launcher.state.restart_count`)."""
    faults_fired: list[str] | Absent = ABSENT
    """Injected faults that fired (``[faults]``)."""
    checkpoints: list[CheckpointRecord] | Absent = ABSENT
    """Checkpoints written: ``phase``, ``step``, ``model`` / ``tables`` digests."""
    restores: list[CheckpointRecord] | Absent = ABSENT
    """Checkpoints loaded by a restarted worker group (same keys)."""
    timeline: list[list[Any]] | Absent = ABSENT
    """[(seconds since the job started, event)]."""
    starts: list[list[Any]] | Absent = ABSENT
    """[(phase, step)] of every phase start (restarts included)."""
    server_joins: list[list[ServerJoin]] | Absent = ABSENT
    """Per worker group, the servers it readied: ``pid``, ``group`` (joins and resets so far), and over the
    ``socket`` transport ``address`` (the ``host:port`` it serves on)."""
    placement: dict[str, Where] | Absent = ABSENT
    """``trainer<r>`` / ``ps<i>`` -> ``node_id``, ``address``, ``hostname``, ``pid``, ``metrics``
    (:func:`jobs.cluster.where`); a server inside a trainer's process also ``in`` (``trainer<i>``)."""
    table_layout: dict[str, dict[str, TablePlace]] | Absent = ABSENT
    """Phase -> ``"<path>"`` -> where its parameter-server table is: ``servers``, ``table``, ``module``, ``rows``,
    ``dim``, ``dynamic`` (:func:`scheduling.placement.restore.table_layout`)."""
    reshards: list[Reshard] | Absent = ABSENT
    """Per ``--resume`` that changed ``[cluster] parameter_servers``: ``from_servers``, ``to_servers`` and, per phase,
    each table's servers ``before`` and ``after`` (:func:`jobs.launcher.plan.reshard_plan`)."""
    servers_in_trainers: HostingRecord | Absent = ABSENT
    """Where the parameter servers ran (:meth:`jobs.hosting.Hosting.to_json`): ``chosen`` (in the trainers'
    processes), ``setting`` (``[cluster] servers_in_trainers``), ``reason``, ``cpus`` (the job's, for "auto")."""
    nodes_lost: list[NodeLost] | Absent = ABSENT
    """Nodes that died during the job: ``node_id``, ``address``, ``ran``."""
    processes: dict[str, ProcessStats] | Absent = ABSENT
    """``trainer<r>`` / ``ps<i>`` / ``launcher`` -> ``pid``, ``peak_rss_bytes`` (bytes); a server's also
    ``rows`` and ``bytes`` held."""
    train_seconds: float | Absent = ABSENT
    """Wall time of the TorchTrainer's fit, seconds."""
    gain: Gain | Absent = ABSENT
    """The interleaved-block QPS gain, % (:func:`jobs.stats.interleaved_gain`)."""
    parity: Parity | Absent = ABSENT
    """:func:`jobs.stats.parity_check` plus ``mode`` and ``passes``; with ``[phases] max_staleness``,
    :func:`jobs.staleness.staleness_parity` (``rule`` = "quality_tolerance", ``exact``, ``stale``, ``abs_diff``,
    ``tolerance``, ``max_staleness``, ``ok``) plus the same two."""
    inference: InferenceResult | Absent = ABSENT
    """The fp32 vs int8 comparison (with ``[quant] enabled``)."""
    gain_percent: float | None | Absent = ABSENT
    """The reported QPS gain, %: ``gain``'s median, else the ratio of the phases' QPS."""
    progress: dict[str, int] | Absent = ABSENT
    """An interrupted or failed run's unfinished phases -> their last step."""
    error: str | Absent = ABSENT
    """A failed run's error, ``"<type>: <message>"``."""
    resume: str | Absent = ABSENT
    """The command that continues an interrupted or failed run."""


def _phases(data: Any, where: str) -> dict[str, PhaseResult]:
    if not isinstance(data, dict):
        raise ResultsError(f"{where}: expected a JSON object of phases, got {type(data).__name__}")
    return {name: PhaseResult.from_json(p, f"{where}.{name}") for name, p in data.items()}


JobResults._nested = {"phases": _phases, "inference": InferenceResult.from_json}
