"""Job configuration: a TOML file parsed into frozen dataclasses, with errors that name the bad key.

A config has seven tables; every key is optional and defaults to the values below, which run on one
laptop (``jobs/default.toml`` spells them out). Example::

    [job]
    name = "dlrm-criteo"
    steps = 200              # training steps per phase, per trainer
    batch_size = 128         # samples per step, per trainer

    [data]
    path = ""                # "" = ../shared/data/criteo/train_examples.txt if present, else synthetic

    [model]
    embedding_dim = 16
    table_size = 20000       # hash buckets per categorical feature (26 tables)

    [cluster]
    trainers = 2
    parameter_servers = 1    # 0 = embedding tables live in the trainers (DDP)

    [phases]
    passes = ["async_rpc_prefetch"]   # fxdist.optimize passes of the optimized phase
    block_steps = 10         # the phases alternate blocks of this many steps
    parity = "error"         # "warn": report a loss/AUC difference instead of failing the job

    [metrics]
    port = 9400              # trainer rank r exports on port + r, server i on port + trainers + i

Unknown tables or keys and values of the wrong type raise :class:`ConfigError` naming the key,
e.g. ``ConfigError: jobs/default.toml: [cluster] trainers: expected int, got str ('two')``.
"""

from __future__ import annotations

import dataclasses
import tomllib
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = [
    "ConfigError",
    "JobSection",
    "DataSection",
    "ModelSection",
    "ClusterSection",
    "PhasesSection",
    "MetricsSection",
    "QuantSection",
    "FaultSection",
    "JobConfig",
    "DEFAULT_CONFIG",
    "load_config",
    "parse_config",
]

DEFAULT_CONFIG = Path(__file__).resolve().with_name("default.toml")


class ConfigError(ValueError):
    """A job config is malformed: the message names the file, the table and the key."""


@dataclass(frozen=True)
class JobSection:
    name: str = "dlrm-criteo"
    """Job name; the ``job`` label of every metric and the prefix of the run folder."""
    steps: int = 200
    """Training steps per phase, per trainer."""
    batch_size: int = 128
    """Samples per step, per trainer."""
    eval_epochs: float = 1.0
    """Held-out AUC / log loss are measured on the model after this many passes over each trainer's shard
    (capped at ``steps``; 0 = at the end of the phase). DLRM on Criteo peaks after about one epoch and
    over-fits when trained longer, while the QPS comparison wants more steps than one epoch has."""
    seed: int = 0
    """Seed of the model initialisation (both phases start from the same weights)."""
    lr: float = 0.01
    """Adagrad learning rate (dense and embedding parameters)."""
    checkpoint_every: int = 50
    """Steps between checkpoints (dense weights + parameter-server tables); 0 = only at phase ends."""
    max_failures: int = 2
    """Ray Train FailureConfig.max_failures: restarts from the last checkpoint before the job fails."""
    run_dir: str = "runs"
    """Folder that receives ``<name>-<timestamp>/`` with results.json, qps.png and checkpoints."""
    allow_eager_fallback: bool = False
    """If the model cannot be traced, run the optimized phase eagerly instead of failing."""
    progress: bool = True
    """Show a progress bar per phase (tqdm) in the launching process."""


@dataclass(frozen=True)
class DataSection:
    path: str = ""
    """Criteo TSV; "" = ../shared/data/criteo/train_examples.txt when present, else synthetic data."""
    synthetic_rows: int = 20000
    """Rows of Criteo-format data generated when no file is found."""
    eval_fraction: float = 0.1
    """Fraction of lines (every k-th) held out for AUC / log loss; never trained on."""


@dataclass(frozen=True)
class ModelSection:
    embedding_dim: int = 16
    """D: width of every embedding and of the bottom MLP's output."""
    table_size: int = 20000
    """Hash buckets per categorical feature (each of the 26 features has its own table)."""
    bottom_mlp: list[int] = field(default_factory=lambda: [512, 256])
    """Hidden widths of the dense (bottom) MLP; its output width is embedding_dim."""
    top_mlp: list[int] = field(default_factory=lambda: [512, 256])
    """Hidden widths of the over (top) MLP; its output width is 1 (the click logit)."""


@dataclass(frozen=True)
class ClusterSection:
    trainers: int = 2
    """Ray Train workers (DDP ranks)."""
    parameter_servers: int = 1
    """Parameter-server actors holding the embedding tables; 0 keeps the tables in the trainers."""
    cpus_per_trainer: float = 1.0
    """Ray CPU resources reserved per trainer (servers reserve none)."""
    use_gpu: bool = False
    """Train on GPUs (nccl); CPU training uses gloo."""
    address: str = ""
    """Ray cluster address; "" = $RAY_ADDRESS if set, else a local ray.init()."""
    rpc_timeout_s: float = 30.0
    """Timeout of every parameter-server RPC and of joining the RPC group, seconds."""
    server_fetch_delay_ms: float = 1.0
    """Added latency per parameter-server lookup, milliseconds: emulates the network round trip to a
    remote server, which a one-machine job does not have (0 = none)."""


@dataclass(frozen=True)
class PhasesSection:
    baseline: bool = True
    """Also train the baseline (eager module, no passes), interleaved with the optimized phase."""
    passes: list[str] = field(default_factory=lambda: ["async_rpc_prefetch"])
    """fxdist.optimize pass names of the optimized phase, applied in order."""
    block_steps: int = 10
    """Steps per block: the phases alternate blocks of this many steps over the same batches (the order
    flips every block); the QPS gain is the median of the paired block ratios."""
    parity: str = "error"
    """The optimized phase's loss and AUC must match the baseline's within the baseline's own spread:
    "error" (exit 3 when they do not), "warn" (report only)."""


@dataclass(frozen=True)
class MetricsSection:
    enabled: bool = True
    """Export Prometheus metrics from every trainer and server."""
    host: str = "127.0.0.1"
    """Address the exporters bind to (loopback by default)."""
    port: int = 9400
    """Base port: trainer rank r uses port + r, server i uses port + trainers + i."""


@dataclass(frozen=True)
class QuantSection:
    enabled: bool = True
    """After training, quantize the dense MLPs (quant/) and compare fp32 vs int8."""
    calibration_batches: int = 8
    """Batches of training data fed to the observers."""
    eval_batch_size: int = 256
    """Batch size of the inference QPS / accuracy comparison."""


@dataclass(frozen=True)
class FaultSection:
    """Fault injection, for tests: each fault fires once per job (a marker file records it)."""

    kill_trainer_at_step: int = -1
    """SIGKILL trainer rank 1 (or 0 with one trainer) at this optimized-phase step; -1 = never."""
    kill_server_at_step: int = -1
    """ray.kill() parameter server 0 at this optimized-phase step; -1 = never."""


@dataclass(frozen=True)
class JobConfig:
    job: JobSection = field(default_factory=JobSection)
    data: DataSection = field(default_factory=DataSection)
    model: ModelSection = field(default_factory=ModelSection)
    cluster: ClusterSection = field(default_factory=ClusterSection)
    phases: PhasesSection = field(default_factory=PhasesSection)
    metrics: MetricsSection = field(default_factory=MetricsSection)
    quant: QuantSection = field(default_factory=QuantSection)
    faults: FaultSection = field(default_factory=FaultSection)
    source: str = "<defaults>"
    """Where the config came from (a path, or "<defaults>")."""

    def replace(self, **sections: dict[str, Any]) -> JobConfig:
        """Return a copy with some keys of some tables changed, e.g. ``replace(job={"steps": 5})``.

        Raises:
            ConfigError: an unknown table or key, or a value of the wrong type.
        """
        raw = to_dict(self)
        for table, values in sections.items():
            if table not in raw:
                raise ConfigError(f"{self.source}: unknown table [{table}]; known: {', '.join(raw)}")
            raw[table].update(values)
        return parse_config(raw, source=self.source)

    def validate(self) -> None:
        """Check cross-field constraints.

        Raises:
            ConfigError: naming the offending key.
        """
        checks = [
            (self.job.steps >= 1, "[job] steps must be >= 1"),
            (self.job.batch_size >= 1, "[job] batch_size must be >= 1"),
            (self.job.checkpoint_every >= 0, "[job] checkpoint_every must be >= 0"),
            (self.job.eval_epochs >= 0, "[job] eval_epochs must be >= 0"),
            (self.cluster.trainers >= 1, "[cluster] trainers must be >= 1"),
            (self.cluster.parameter_servers >= 0, "[cluster] parameter_servers must be >= 0"),
            (self.model.embedding_dim >= 1, "[model] embedding_dim must be >= 1"),
            (self.model.table_size >= 2, "[model] table_size must be >= 2"),
            (0.0 <= self.data.eval_fraction < 1.0, "[data] eval_fraction must be in [0, 1)"),
            (0 <= self.metrics.port < 65536, "[metrics] port must be in 0..65535"),
            (self.cluster.rpc_timeout_s > 0, "[cluster] rpc_timeout_s must be > 0"),
            (self.cluster.server_fetch_delay_ms >= 0, "[cluster] server_fetch_delay_ms must be >= 0"),
            (self.phases.block_steps >= 1, "[phases] block_steps must be >= 1"),
            (self.phases.parity in ("error", "warn"), f"[phases] parity must be \"error\" or \"warn\", got "
                                                       f"{self.phases.parity!r}"),
        ]
        for ok, message in checks:
            if not ok:
                raise ConfigError(f"{self.source}: {message}")


_SECTIONS = {f.name: f.type for f in dataclasses.fields(JobConfig) if f.name != "source"}


def _check_type(value: Any, annotation: Any, where: str) -> Any:
    """Return ``value`` converted to ``annotation`` (int -> float allowed) or raise ConfigError."""
    origin = typing.get_origin(annotation)
    if origin is list:
        (item_type,) = typing.get_args(annotation)
        if not isinstance(value, list):
            raise ConfigError(f"{where}: expected a list, got {type(value).__name__} ({value!r})")
        return [_check_type(v, item_type, f"{where}[{i}]") for i, v in enumerate(value)]
    if annotation is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if annotation is int and isinstance(value, bool):
        raise ConfigError(f"{where}: expected int, got bool ({value!r})")
    if not isinstance(value, annotation):
        raise ConfigError(f"{where}: expected {annotation.__name__}, got {type(value).__name__} ({value!r})")
    return value


def parse_config(raw: dict[str, Any], *, source: str = "<dict>") -> JobConfig:
    """Build a :class:`JobConfig` from a parsed TOML document.

    Raises:
        ConfigError: an unknown table or key, or a value of the wrong type; the message names them.
    """
    sections: dict[str, Any] = {}
    for table, values in raw.items():
        cls = _SECTIONS.get(table)
        if cls is None:
            raise ConfigError(f"{source}: unknown table [{table}]; known tables: {', '.join(_SECTIONS)}")
        cls = _resolve(cls)
        if not isinstance(values, dict):
            raise ConfigError(f"{source}: [{table}] must be a table, got {type(values).__name__}")
        hints = typing.get_type_hints(cls)
        kwargs = {}
        for key, value in values.items():
            if key not in hints:
                raise ConfigError(f"{source}: [{table}] unknown key {key!r}; known keys: {', '.join(hints)}")
            kwargs[key] = _check_type(value, hints[key], f"{source}: [{table}] {key}")
        sections[table] = cls(**kwargs)
    config = JobConfig(**sections, source=source)
    config.validate()
    return config


def _resolve(annotation: Any) -> type:
    if isinstance(annotation, str):
        return globals()[annotation]
    if isinstance(annotation, types.GenericAlias):  # pragma: no cover - not used by the sections
        return typing.get_origin(annotation)
    return annotation


def load_config(path: str | Path | None = None) -> JobConfig:
    """Read a job config from a TOML file (``None``: the bundled ``jobs/default.toml``).

    Raises:
        FileNotFoundError: the file does not exist.
        ConfigError: the TOML is invalid (with line and column), or a table/key/value is wrong.
    """
    path = Path(path) if path is not None else DEFAULT_CONFIG
    if not path.is_file():
        raise FileNotFoundError(f"job config not found: {path}")
    try:
        raw = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{path}: invalid TOML: {e}") from e
    return parse_config(raw, source=str(path))


def to_dict(config: JobConfig) -> dict[str, dict[str, Any]]:
    """The config as nested plain dicts (TOML-like), without ``source``."""
    return {name: dataclasses.asdict(getattr(config, name)) for name in _SECTIONS}
