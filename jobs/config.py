"""Job configuration: a TOML file parsed into frozen dataclasses, with errors that name the bad key.

A config has ten tables; every key is optional and defaults to the values below, which run on one
laptop (``jobs/default.toml`` spells them out). Example::

    [job]
    name = "dlrm-criteo"     # unset: "dlrm-criteo", or "<module>-<function>" of [model] factory
    steps = 200              # training steps per phase, per trainer
    batch_size = 128         # samples per step, per trainer

    [data]
    path = ""                # a file, directory or glob; "" = ../shared/data/criteo/train_examples.txt, else synthetic
    batches = ""             # "package.module:function" yielding your batches ("" = the Criteo reader)

    [train]
    loss = "bce_with_logits" # "mse", or "package.module:function"
    train_step = ""          # or "package.module:function": train_step(model, batch) -> loss, instead of loss

    [model]
    factory = ""             # "package.module:function" returning your nn.Module ("" = the built-in DLRM)
    embedding_dim = 16
    table_size = 20000       # hash buckets per categorical feature (26 tables)
    table_sizes = "uniform"  # "data": per-feature sizes from the data, capped at max_table_size;
                             # "dynamic": collisionless tables on the servers (dynamic_capacity rows each)

    [cluster]
    trainers = 2
    parameter_servers = 1    # 0 = embedding tables live in the trainers (DDP)

    [phases]
    passes = ["async_rpc_prefetch"]   # fxdist.optimize passes of the optimized phase
    block_steps = 10         # the phases alternate blocks of this many steps
    parity = "error"         # "warn": report a loss/AUC difference instead of failing the job
    max_staleness = 0        # 1: the optimized phase's lookups one step stale; parity = AUC within tolerance

    [metrics]
    port = 9400              # trainer rank r exports on port + r, server i on port + trainers + i

Every numeric key has an allowed range (floats must also be finite), given next to its default in the
section dataclasses below and checked when the config is loaded, together with the constraints between
keys (the metrics port range must fit below 65536, fault steps within ``[job] steps``, known pass names, a
``[job] name`` that is safe as a folder name). Unknown tables or keys, values of the wrong type and values
out of range raise :class:`ConfigError` naming the key, e.g.
``ConfigError: jobs/default.toml: [cluster] trainers: expected int, got str ('two')`` or
``ConfigError: <dict>: [job] lr = nan: must be a finite number in (0, 10]``.

>>> parse_config({"job": {"lr": -1.0}})
Traceback (most recent call last):
    ...
jobs.config.ConfigError: <dict>: [job] lr = -1.0: must be a finite number in (0, 10]
"""

from __future__ import annotations

import dataclasses
import math
import tomllib
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from jobs.config_rules import dynamic_errors, exposure_errors, follow_errors, train_errors
from jobs.config_sections import (
    NAME_PATTERN,
    ClusterSection,
    DataSection,
    ExportSection,
    FaultSection,
    JobSection,
    MetricsSection,
    ModelSection,
    PhasesSection,
    QuantSection,
    TrainSection,
    default_name,
)
from jobs.hosting import in_trainer_errors
from jobs.staleness import staleness_errors

__all__ = ["ConfigError", "JobSection", "DataSection", "ModelSection", "ClusterSection", "PhasesSection",
           "MetricsSection", "QuantSection", "FaultSection", "TrainSection", "ExportSection", "JobConfig", "DEFAULT_CONFIG",
           "load_config", "parse_config"]

DEFAULT_CONFIG = Path(__file__).resolve().with_name("default.toml")


class ConfigError(ValueError):
    """A malformed job config: the message names the file, table and key. See docs/troubleshooting.md#configerror."""


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
    train: TrainSection = field(default_factory=TrainSection)
    export: ExportSection = field(default_factory=ExportSection)
    source: str = "<defaults>"
    """Where the config came from (a path, or "<defaults>")."""
    named: bool = field(default=False, compare=False)
    """``[job] name`` was given (in the TOML or to :meth:`replace`); False: it is :func:`jobs.config_sections.default_name`
    of ``[model] factory``, derived again when :meth:`replace` changes the factory."""

    def replace(self, **sections: dict[str, Any]) -> JobConfig:
        """Return a copy with some keys of some tables changed, e.g. ``replace(job={"steps": 5})``.

        Raises:
            ConfigError: an unknown table or key, or a value of the wrong type or out of range.
        """
        raw = to_dict(self)
        if not self.named and "name" not in sections.get("job", {}):
            del raw["job"]["name"]  # derived: derive it again from the new config
        for table, values in sections.items():
            if table not in raw:
                raise ConfigError(f"{self.source}: unknown table [{table}]; known: {', '.join(raw)}")
            raw[table].update(values)
        return parse_config(raw, source=self.source)

    def validate(self) -> None:
        """Check every key's range (see each section's fields) and the constraints between keys.

        Raises:
            ConfigError: naming the offending key, its value and the allowed range.
        """
        for table in _SECTIONS:
            section = getattr(self, table)
            for f in dataclasses.fields(section):
                message = _out_of_range(getattr(section, f.name), f)
                if message:
                    raise ConfigError(f"{self.source}: [{table}] {f.name} = {getattr(section, f.name)!r}: {message}")
        for message in self._cross_field_errors():
            raise ConfigError(f"{self.source}: {message}")

    def _cross_field_errors(self) -> list[str]:
        j, c, m, f = self.job, self.cluster, self.metrics, self.faults
        errors = []
        if not NAME_PATTERN.fullmatch(j.name):
            errors.append(f"[job] name = {j.name!r}: it names the run folder, so it may only contain letters, "
                          "digits, '.', '_' and '-', must not start with '.', and has at most 100 characters")
        for table, key, value in (("job", "run_dir", j.run_dir), ("metrics", "host", m.host)):
            if not value.strip():
                errors.append(f"[{table}] {key} must not be empty")
        last = m.port + c.trainers + c.parameter_servers - 1
        if m.enabled and last > 65535:
            errors.append(f"[metrics] port = {m.port}: the exporters use ports {m.port}..{last} (trainers + "
                          f"parameter_servers = {c.trainers + c.parameter_servers}), past 65535; use a base <= "
                          f"{65536 - c.trainers - c.parameter_servers}")
        for key, step in (("kill_trainer_at_step", f.kill_trainer_at_step),
                          ("kill_server_at_step", f.kill_server_at_step), ("pause_at_step", f.pause_at_step)):
            if step != -1 and not 1 <= step <= j.steps:
                errors.append(f"[faults] {key} = {step}: must be -1 (never) or a step in 1..[job] steps = {j.steps}")
        if f.pause_at_step != -1 and c.parameter_servers and f.pause_seconds >= c.rpc_timeout_s:
            errors.append(f"[faults] pause_seconds = {f.pause_seconds}: must be below [cluster] rpc_timeout_s = "
                          f"{c.rpc_timeout_s} (the other trainers' lookups wait for rank 0's pushes that long)")
        if f.kill_server_at_step != -1 and c.parameter_servers == 0:
            errors.append("[faults] kill_server_at_step is set but [cluster] parameter_servers = 0")
        sizes = self.model.table_sizes
        if isinstance(sizes, str) and sizes not in ("uniform", "data", "dynamic"):
            errors.append(f'[model] table_sizes = {sizes!r}: must be "uniform", "data", "dynamic" or a list of 26 sizes')
        if self.model.server_storage not in ("fp32", "fp16", "fused8bit"):
            errors.append(f'[model] server_storage = {self.model.server_storage!r}: must be fp32, fp16 or fused8bit')
        if c.transport not in ("torch_rpc", "ray", "socket"):
            errors.append(f'[cluster] transport = {c.transport!r}: must be "torch_rpc", "ray" or "socket"')
        elif c.tls and c.transport != "socket":
            errors.append(f'[cluster] tls = true needs transport = "socket" (not {c.transport!r}), or tls = false')
        if c.placement not in ("pack", "spread"):
            errors.append(f'[cluster] placement = {c.placement!r}: must be "pack" or "spread"')
        errors += train_errors(self.train, self.model.plan, self.user_model)
        errors += dynamic_errors(self.model, c, self.user_model)
        errors += follow_errors(self.data, self.model.table_sizes)
        errors += in_trainer_errors(self) + exposure_errors(m)
        if self.phases.parity not in ("error", "warn"):
            errors.append(f'[phases] parity = {self.phases.parity!r}: must be "error" or "warn"')
        errors += self._entry_point_errors()
        errors += staleness_errors(self)
        unknown = _unknown_passes(self.phases.passes)
        if unknown:
            errors.append(f"[phases] passes: unknown pass {unknown[0]!r}; known passes: {', '.join(_known_passes())}")
        return errors


    @property
    def user_model(self) -> bool:
        """The job trains a model of ``[model] factory`` (not the built-in DLRM)."""
        return bool(self.model.factory)

    def _entry_point_errors(self) -> list[str]:
        """Keys that must go together (the spelling of each entry point is checked by :mod:`jobs.entry`)."""
        m, d, t = self.model, self.data, self.train
        if bool(m.factory) != bool(d.batches):
            given, missing = ("[model] factory", "[data] batches") if m.factory else ("[data] batches", "[model] factory")
            return [f"{given} is set but {missing} is not: your model needs your batches and the other way round "
                    "(the built-in DLRM reads the Criteo data); set both, or neither"]
        for key, value in (("train_step", t.train_step), ("metric", t.metric)):
            if value and not m.factory:
                return [f"[train] {key} = {value!r} is set but [model] factory is not: the built-in DLRM "
                        "trains with its own step and reports AUC"]
        if not m.factory and t.loss != "bce_with_logits":
            return [f'[train] loss = {t.loss!r}: the built-in DLRM trains with "bce_with_logits" (other losses need '
                    "[model] factory)"]
        return []


def _out_of_range(value: Any, f: dataclasses.Field) -> str | None:
    """Why ``value`` is outside field ``f``'s range (its ``_key`` metadata), or None."""
    if "range" not in f.metadata:
        return None
    lo, hi, above = f.metadata["range"]
    length = f.metadata["length"]
    if isinstance(value, list):
        if length is not None and not length[0] <= len(value) <= length[1]:
            return f"must be a list of {length[0]} to {length[1]} items"
        bad = [(i, v) for i, v in enumerate(value) if _out_of_range_number(v, lo, hi, above)]
        if bad:
            i, v = bad[0]
            return f"item {i} ({v!r}) is out of range: each must be {_range_text(v, lo, hi, above)}"
        return None
    return (f"must be {_range_text(value, lo, hi, above)}" if _out_of_range_number(value, lo, hi, above)
            else None)


def _out_of_range_number(value: Any, lo: float | None, hi: float | None, above: bool) -> bool:
    if not isinstance(value, (int, float)):
        return False
    if isinstance(value, float) and not math.isfinite(value):
        return True
    return (lo is not None and (value <= lo if above else value < lo)) or (hi is not None and value > hi)


def _range_text(value: Any, lo: float | None, hi: float | None, above: bool) -> str:
    if isinstance(value, float):
        return f"a finite number in {'(' if above else '['}{lo:g}, {hi:g}]"
    return f"an integer in {lo:_}..{hi:_}"


def _known_passes() -> list[str]:
    from fxdist.pipeline import known_passes

    return known_passes()


def _unknown_passes(passes: list[str]) -> list[str]:
    """Names not in ``fxdist.pipeline.known_passes()`` (by name only: nothing is imported or run)."""
    if not passes:
        return []
    known = set(_known_passes())
    return [p for p in passes if p not in known]


_SECTIONS = {f.name: f.type for f in dataclasses.fields(JobConfig) if f.name not in ("source", "named")}


def _check_type(value: Any, annotation: Any, where: str) -> Any:
    """Return ``value`` converted to ``annotation`` (int -> float allowed) or raise ConfigError."""
    origin = typing.get_origin(annotation)
    if origin is types.UnionType:
        choices = typing.get_args(annotation)
        for choice in choices:
            try:
                return _check_type(value, choice, where)
            except ConfigError:
                continue
        names = " or ".join("a list" if typing.get_origin(c) is list else c.__name__ for c in choices)
        raise ConfigError(f"{where}: expected {names}, got {type(value).__name__} ({value!r})")
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
    """Build a :class:`JobConfig` from a parsed TOML document. Without ``[job] name``, the name is
    :func:`jobs.config_sections.default_name` of ``[model] factory`` ("dlrm-criteo" for the built-in DLRM).

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
    named = "name" in raw.get("job", {})
    if not named:  # unset: "dlrm-criteo" for the built-in DLRM, else from [model] factory
        job, model = sections.get("job", JobSection()), sections.get("model", ModelSection())
        sections["job"] = dataclasses.replace(job, name=default_name(model.factory))
    config = JobConfig(**sections, source=source, named=named)
    config.validate()
    return config


def _resolve(annotation: Any) -> type:
    if isinstance(annotation, str):
        return globals()[annotation]
    if isinstance(annotation, types.GenericAlias):  # pragma: no cover - not used by the sections
        return typing.get_origin(annotation)
    return annotation


def bundled_config(path: str | Path) -> Path | None:
    """The bundled config a relative ``path`` names when it is not a file here: ``jobs/<name>.toml`` (or
    ``<name>.toml``) -> the file of that name next to this module, so ``fxdist launch jobs/movielens.toml``
    works from the repository root and from an installed package alike; None otherwise.

    >>> bundled_config("jobs/movielens.toml").name, bundled_config("elsewhere/movielens.toml")
    ('movielens.toml', None)
    """
    path = Path(path)
    if path.is_absolute() or path.parent not in (Path("."), Path("jobs")):
        return None
    bundled = DEFAULT_CONFIG.with_name(path.name)
    return bundled if bundled.is_file() else None


def load_config(path: str | Path | None = None) -> JobConfig:
    """Read a job config from a TOML file (``None``: the bundled ``jobs/default.toml``; a missing
    ``jobs/<name>.toml``: the bundled file of that name, see :func:`bundled_config`).

    Raises:
        FileNotFoundError: the file does not exist.
        ConfigError: the TOML is invalid (with line and column), or a table/key/value is wrong.
    """
    path = Path(path) if path is not None else DEFAULT_CONFIG
    bundled = bundled_config(path) if not path.is_file() else None
    if bundled is not None:
        path = bundled
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
