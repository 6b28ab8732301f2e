"""The trained model of a run, ready to load, export and serve: ``RUN_DIR/model/``.

Every ``fxdist launch`` ends by writing it (:func:`after_job`), and ``fxdist export RUN`` rebuilds it from any
checkpoint of the run (:func:`export_run`). The folder holds:

- ``state_dict.pt``: the trained model's ``state_dict`` under your module's own parameter names, the embedding
  tables gathered from the parameter servers included, so ``model.load_state_dict(torch.load(path,
  weights_only=True))`` works on a model freshly built by the job's entry point (``[model] factory``, or the
  bundled DLRM). Plain tensors only. A dynamic table (``[model] table_sizes = "dynamic"``) is there as its rows by
  slot, ``(capacity, D)``;
- ``dynamic_ids.pt`` (dynamic tables only): per table path, ``{"ids": (R,) int64 raw ids, "slots": (R,) int64}``,
  the id -> row map the servers kept (row of id ``ids[i]`` is ``weight[slots[i]]``);
- ``model.pt2``: a ``torch.export`` program of the fp32 model (``torch.export.export(model, sample, strict=False)``,
  saved with ``torch.export.save``), its shapes those of ``sample_input.pt``; ``model_int8.pt2``: the same of the
  int8 model, when the int8 stage chose one and torch.export can capture it;
- ``sample_input.pt``: the positional inputs the programs were captured with (the first held-out batch), loadable
  with ``torch.load(weights_only=True)``: a ``KeyedJaggedTensor`` is stored as its keys, values, lengths (and
  weights); :func:`load_sample_input` rebuilds the arguments;
- ``model.json``: the entry point, the config (as parsed, its source and SHA-256), the phase and step of the model,
  the held-out metrics results.json reports for it, each export's outcome (the exception's type and first line
  where torch.export could not capture the model), and the files written.
- ``deltas/`` (with ``[export] every_steps``): the model's deltas every that many steps (:mod:`jobs.deltas`), written
  while the job trains; a new folder takes them over from the old one.

The folder is written whole into ``RUN_DIR/model.tmp-<random>/`` and then ``os.replace``\\ d over ``RUN_DIR/model/``
(the previous one removed), so a reader sees the old folder or the new one, never a mix.

Source: PyTorch docs, "torch.export" (``export``, ``save``, ``load``, non-strict mode) and "Saving and loading
models" (``state_dict``, ``torch.load(weights_only=True)``).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any, TypedDict

import torch
from torch import nn

from jobs.config import JobConfig, to_dict
from jobs.deltas import MODEL_DIR
from jobs.records import Checkpoint, HeldOut, ModelQuality, ModelState
from jobs.results import JobResults

__all__ = ["MODEL_DIR", "ExportError", "with_tables", "final_model_state", "model_state_dict", "encode_sample",
           "load_sample_input", "write_model_dir", "after_job", "latest_checkpoint", "export_run"]

FORMAT = 1
"""``model.json``'s ``format``: bumped when the folder's layout changes."""


class ErrorRecord(TypedDict):
    """Why a file was not written: the exception's type and the first line of its message."""

    type: str
    message: str


class ExportRecord(TypedDict, total=False):
    """``model.json``'s ``exports.<fp32|int8|sample>``: the program's ``file`` and ``max_abs_diff``, or ``error``."""

    file: str
    max_abs_diff: float | None
    """Largest difference of the loaded program's outputs from the eager model's on the sample."""
    error: ErrorRecord
    kept_from: str
    """Where a carried-over ``model_int8.pt2`` came from."""


class ConfigRecord(TypedDict):
    """``model.json``'s ``config``: the run's config and its digest."""

    source: str
    sha256: str
    parsed: dict[str, dict[str, Any]]
    """Every table (:func:`jobs.config.to_dict`)."""


class InferenceMetrics(TypedDict, total=False):
    """``model.json``'s ``metrics.inference``: the int8 stage's rows, or why it was skipped."""

    step: int | None
    fp32: ModelQuality | None
    int8: ModelQuality | None
    kept_fp32: bool | None
    skipped: str | None


class ModelMetrics(TypedDict, total=False):
    """``model.json``'s ``metrics``: what results.json says of the model's held-out quality."""

    held_out: HeldOut
    held_out_end: HeldOut
    inference: InferenceMetrics


class ModelRecord(TypedDict, total=False):
    """``model.json`` (see the module docstring)."""

    format: int
    entry_point: dict[str, str]
    config: ConfigRecord
    phase: str | None
    step: int | None
    metrics: ModelMetrics
    exports: dict[str, ExportRecord]
    dynamic_tables: list[str]
    files: list[str]
    written_by: str
    checkpoint: str


class ExportError(RuntimeError):
    """``fxdist export`` cannot rebuild the model folder: no checkpoint, no config, or a checkpoint without the
    model (the message names the path).

    See docs/troubleshooting.md#exporterror.
    """


def with_tables(state: Checkpoint, run_dir: str | os.PathLike[str], evaluated: bool = True) -> Checkpoint:
    """``state`` with every phase's tables whole: a checkpoint by shard names its folder (``{"dcp": "tables/..."}``,
    relative to ``run_dir``), read here in one process (:func:`scheduling.placement.sharded.read_tables`: the model
    file holds whole tables); tables already whole (an older checkpoint) are kept. ``evaluated``: so are the tables
    of each phase's early-eval snapshot (``state["eval"][phase]["tables"]``, the model the job quantizes), which
    name their folder the same way (``tables/eval-<step>-<id>/<phase>``).

    Raises:
        ExportError: a named folder without its merged metadata (the checkpoint was never finished).
    """
    tables = {phase: _whole(saved, run_dir, phase) for phase, saved in (state.get("tables") or {}).items()}
    out: Checkpoint = {**state, "tables": tables}
    if evaluated and state.get("eval"):
        out["eval"] = {phase: {**early, "tables": _whole(early["tables"], run_dir, f"{phase} (evaluated)")}
                       if isinstance(early, dict) and "tables" in early else early
                       for phase, early in (state.get("eval") or {}).items()}
    return out


def _whole(saved: Any, run_dir: str | os.PathLike[str], what: str) -> Any:
    """``saved`` tables whole: read from the folder a ``{"dcp": ...}`` reference names, else as they are.

    Raises:
        ExportError: the folder has no merged metadata.
    """
    from scheduling.placement.sharded import is_sharded_checkpoint, read_tables

    if not (isinstance(saved, dict) and isinstance(saved.get("dcp"), str)):
        return saved
    folder = Path(run_dir) / saved["dcp"]
    if not is_sharded_checkpoint(folder):
        raise ExportError(f"{folder}: the checkpoint's tables of {what!r} are not there (no merged .metadata)")
    return read_tables(folder)


def final_model_state(state: Checkpoint, phase: str | None = None) -> ModelState:
    """The last phase's model in a checkpoint's contents (``state.pt`` of a job: ``{"step", "models": {phase:
    dense weights}, "tables": {phase: the servers' tables}}``): ``{"phase", "step", "model", "tables"}``.

    Raises:
        ExportError: the checkpoint has no model (or not ``phase``'s).
    """
    models = state.get("models") or {}
    if not models:
        raise ExportError(f"the checkpoint has no model (keys: {sorted(state)})")
    phase = phase or list(models)[-1]
    if phase not in models:
        raise ExportError(f"the checkpoint has no {phase!r} model (phases: {list(models)})")
    return {"phase": phase, "step": state.get("step"), "model": models[phase],
            "tables": (state.get("tables") or {}).get(phase) or {}}


def model_state_dict(config: JobConfig, state: ModelState) -> tuple[nn.Module, dict[str, torch.Tensor],
                                                                          dict[str, dict[str, torch.Tensor]]]:
    """The trained model (eval mode, :func:`jobs.launcher.inference.rebuild_model`), its ``state_dict`` (tensors,
    contiguous, under the model's own names) and the dynamic tables' id maps (``{path: {"ids", "slots"}}``, int64).

    Raises:
        RuntimeError: a key of the model's state dict that the checkpoint does not hold (it would keep its initial
            value), or a table the model does not have (from :func:`rebuild_model`).
    """
    from jobs.launcher.inference import rebuild_model

    model = rebuild_model(config, state)
    tables = state.get("tables") or {}
    held = set(state.get("model") or {}) | {k for k in tables if k.endswith(".weight")}
    sd = model.state_dict()
    missing = sorted(k for k in sd if k not in held)
    if missing:
        raise RuntimeError(f"the checkpoint does not hold {missing} of {type(model).__name__}'s state dict "
                           f"(checkpoint keys: {sorted(held)})")
    out = {k: v.detach().contiguous() for k, v in sd.items()}
    ids = {k.removesuffix(".dynamic"): {"ids": torch.as_tensor(v["map_ids"], dtype=torch.int64).clone(),
                                         "slots": torch.as_tensor(v["map_slots"], dtype=torch.int64).clone()}
           for k, v in tables.items() if k.endswith(".dynamic") and v is not None}
    return model, out, ids


def encode_sample(value: Any) -> Any:
    """``value`` (a model input: tensors, ``KeyedJaggedTensor``\\ s, tuples, lists, dicts, numbers, strings, None)
    as plain tensors and containers that ``torch.load(weights_only=True)`` reads; :func:`load_sample_input`
    decodes it. A container or KJT becomes ``{"type": ..., ...}``.

    Raises:
        TypeError: a value of another type (named).
    """
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if type(value).__name__ == "KeyedJaggedTensor":
        weights = value.weights_or_none()
        return {"type": "KeyedJaggedTensor", "keys": list(value.keys()), "values": value.values().clone(),
                "lengths": value.lengths().clone(), "weights": None if weights is None else weights.clone()}
    if isinstance(value, (tuple, list)) and not hasattr(value, "_fields"):
        return {"type": type(value).__name__, "items": [encode_sample(v) for v in value]}
    if isinstance(value, dict) and all(isinstance(k, str) for k in value):
        return {"type": "dict", "items": {k: encode_sample(v) for k, v in value.items()}}
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise TypeError(f"sample input of type {type(value).__module__}.{type(value).__qualname__}: only tensors, "
                    "KeyedJaggedTensors, tuples, lists, dicts with str keys, numbers, strings and None are saved")


def _decode(value: Any) -> Any:
    if not isinstance(value, dict):
        return value
    kind = value.get("type")
    if kind == "KeyedJaggedTensor":
        from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

        return KeyedJaggedTensor(keys=list(value["keys"]), values=value["values"], lengths=value["lengths"],
                                 weights=value["weights"])
    if kind in ("tuple", "list"):
        items = [_decode(v) for v in value["items"]]
        return tuple(items) if kind == "tuple" else items
    if kind == "dict":
        return {k: _decode(v) for k, v in value["items"].items()}
    raise ValueError(f"sample input: unknown encoded type {kind!r}")


def load_sample_input(path: str | os.PathLike[str]) -> tuple[Any, ...]:
    """The positional arguments saved in ``sample_input.pt`` (read with ``torch.load(weights_only=True)``):
    ``model(*load_sample_input(path))`` runs the model, ``program.module()(*...)`` the exported one.

    Raises:
        FileNotFoundError: no file at ``path``.
        ValueError: the file is not a sample input written by :func:`write_model_dir`.
    """
    data = torch.load(path, weights_only=True)
    if not isinstance(data, dict) or "args" not in data:
        raise ValueError(f"{path}: not a sample input (expected a dict with 'args')")
    return tuple(_decode(v) for v in data["args"])


def _first_line(e: BaseException) -> ErrorRecord:
    """The exception's type and the first non-empty line of its message (what model.json records)."""
    line = next((x.strip() for x in str(e).splitlines() if x.strip()), "")
    return {"type": type(e).__name__, "message": line[:500]}


def _leaves_equal(a: Any, b: Any) -> float | None:
    """Largest ``|a - b|`` over the floating tensor leaves of two outputs (:func:`inference.max_abs_diff`)."""
    from jobs.launcher.inference import max_abs_diff

    return max_abs_diff([a], [b])


class _ExportNotice(logging.Filter):
    """Drops torchrec's notice, logged on the root logger at every non-strict export of a ``KeyedJaggedTensor``,
    that such an export is "extremely slow and not recommended": the job exports once, on purpose, and the
    notice reads like a failure at the end of a good run."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "non-strict torch.export KJT" not in record.getMessage()


def _export(model: nn.Module, sample: tuple[Any, ...], path: Path) -> ExportRecord:
    """Export ``model`` on ``sample`` to ``path``; ``{"file", "max_abs_diff"}`` (the loaded program against the
    eager model on the sample) or ``{"error": {"type", "message"}}``. The program is saved without its example
    inputs, so ``torch.export.load`` reads it without torch's ``weights_only=False`` fallback for them."""
    quiet = _ExportNotice()
    logging.getLogger().addFilter(quiet)
    try:
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            program = torch.export.export(model, sample, strict=False)
            program.example_inputs = None
            torch.export.save(program, path)
            loaded = torch.export.load(path)
            diff = _leaves_equal(loaded.module()(*sample), model(*sample))
    except Exception as e:  # noqa: BLE001 - recorded in model.json; the state dict is written all the same
        path.unlink(missing_ok=True)
        return {"error": _first_line(e)}
    finally:
        logging.getLogger().removeFilter(quiet)
    return {"file": path.name, "max_abs_diff": diff}


def _config_record(config: JobConfig) -> ConfigRecord:
    parsed = to_dict(config)
    text = json.dumps(parsed, sort_keys=True, default=str)
    return {"source": config.source, "sha256": hashlib.sha256(text.encode()).hexdigest(), "parsed": parsed}


def _entry_point(config: JobConfig) -> dict[str, str]:
    if config.user_model:
        return {"factory": config.model.factory, "batches": config.data.batches,
                "build": f"jobs.entry.make_model(config) -> {config.model.factory}(config)"}
    return {"factory": "bundled: jobs.criteo.dlrm (torchrec DLRM)",
            "build": "jobs.criteo.dlrm(config) (jobs.trainer.workload.build_model)"}


def write_model_dir(run_dir: str | os.PathLike[str], config: JobConfig, state: ModelState, *,
                    sample: tuple[Any, ...] | None = None, int8: nn.Module | None = None,
                    metrics: ModelMetrics | None = None, extra: ModelRecord | None = None,
                    model: nn.Module | None = None) -> ModelRecord:
    """Write ``run_dir/model/`` (see the module docstring) from one phase's model ``state`` (``{"model", "tables",
    "step", "phase"}``, :func:`final_model_state`) and return what ``model.json`` says.

    Args:
        sample: the positional inputs to export with (None: no program, the reason in model.json).
        int8: the int8 model the int8 stage chose (None: no ``model_int8.pt2``).
        metrics: the held-out metrics to record (from results.json).
        extra: more keys for model.json (``written_by``, ``checkpoint``...).
        model: the model to export instead of the one rebuilt from ``state`` (tests; e.g. one torch.export cannot
            capture).

    Raises:
        RuntimeError: the checkpoint does not fit the model (:func:`model_state_dict`).
        OSError: the folder cannot be written (a half-written ``model.tmp-*`` is removed; ``model/`` is untouched).
    """
    rebuilt, sd, ids = model_state_dict(config, state)
    return _write_dir(Path(run_dir), config, state, (rebuilt if model is None else model, sd, ids), sample=sample,
                      int8=int8, metrics=metrics, extra=extra)


def _write_dir(run_dir: Path, config: JobConfig, state: ModelState,
               built: tuple[nn.Module, dict[str, torch.Tensor], dict[str, dict[str, torch.Tensor]]], *,
               sample: tuple[Any, ...] | None, int8: nn.Module | None, metrics: ModelMetrics | None,
               extra: ModelRecord | None, kept_int8: tuple[Path, ExportRecord] | None = None) -> ModelRecord:
    """:func:`write_model_dir` of a model already built (``(model, state dict, id maps)``); ``kept_int8``: a
    ``model_int8.pt2`` (and its record) to carry into the new folder."""
    model, sd, ids = built
    tmp = Path(tempfile.mkdtemp(prefix=f"{MODEL_DIR}.tmp-", dir=run_dir))
    try:
        torch.save(sd, tmp / "state_dict.pt")
        if ids:
            torch.save(ids, tmp / "dynamic_ids.pt")
        exports: dict[str, ExportRecord] = {}
        if ids:
            reason: ErrorRecord = {"type": "dynamic tables", "message": "the model's inputs are raw 64-bit ids that the servers' "
                      "id maps turn into rows (dynamic_ids.pt); a program of the local model would index its "
                      "tables with them"}
            exports["fp32"] = {"error": reason}
        elif sample is None:
            exports["fp32"] = {"error": {"type": "no sample input", "message": "no held-out batch to export with"}}
        else:
            try:
                torch.save({"args": [encode_sample(a) for a in sample]}, tmp / "sample_input.pt")
            except TypeError as e:
                exports["sample"] = {"error": _first_line(e)}
            exports["fp32"] = _export(model, sample, tmp / "model.pt2")
            if int8 is not None:
                exports["int8"] = _export(int8, sample, tmp / "model_int8.pt2")
        if kept_int8 is not None and "int8" not in exports:
            shutil.copy2(kept_int8[0], tmp / "model_int8.pt2")
            exports["int8"] = {**kept_int8[1], "kept_from": "the previous model folder (the same step)"}
        if "int8" not in exports:
            exports["int8"] = {"error": {"type": "no int8 model", "message": "the int8 stage kept fp32, was "
                                         "skipped or did not run here"}}
        record: ModelRecord = {"format": FORMAT, "entry_point": _entry_point(config), "config": _config_record(config),
                  "phase": state.get("phase"), "step": state.get("step"), "metrics": metrics or {},
                  "exports": exports, "dynamic_tables": sorted(ids), **(extra or {})}
        _carry_deltas(run_dir / MODEL_DIR, tmp)
        record["files"] = sorted([p.name for p in tmp.iterdir()] + ["model.json"])
        (tmp / "model.json").write_text(json.dumps(record, indent=2, default=str) + "\n")
        _replace_dir(tmp, run_dir / MODEL_DIR)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return record


def _replace_dir(new: Path, target: Path) -> None:
    """Put the folder ``new`` at ``target`` with ``os.replace`` (atomic for an absent target); an existing
    ``target`` is first renamed aside (itself atomic) and removed afterwards. The deltas of the old folder
    (``deltas/``, :mod:`jobs.deltas`) are carried into the new one first, as hard links where the file system has
    them (no copy of their bytes), so a reader of ``target/deltas`` sees them all along."""
    new.chmod(0o755)  # mkdtemp makes it 0700
    if not target.exists():
        os.replace(new, target)
        return
    _carry_deltas(target, new)   # those committed since _write_dir carried the others
    old = Path(tempfile.mkdtemp(prefix=f"{MODEL_DIR}.old-", dir=target.parent))
    os.replace(target, old / MODEL_DIR)
    os.replace(new, target)
    shutil.rmtree(old, ignore_errors=True)


def _carry_deltas(old: Path, new: Path) -> None:
    """The committed deltas of the model folder ``old`` (``deltas/<step>/``) that ``new`` lacks, into ``new``: hard
    links where the file system has them (no copy of their bytes), else copies."""
    from jobs.deltas import committed_steps, delta_path

    for step in committed_steps(old):
        if not delta_path(new, step).exists():
            shutil.copytree(delta_path(old, step), delta_path(new, step), copy_function=_link_or_copy)


def _link_or_copy(src: str, dst: str) -> None:
    """A hard link of ``src`` at ``dst``, or a copy where links cannot be made (another file system)."""
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


def _metrics(results: JobResults | None, phase: str | None, step: int | None) -> ModelMetrics:
    """What results.json says of the model's held-out quality: the phase's ``quality`` (at ``quality_step``) and
    ``quality_end`` (the phase's end), and the int8 stage's fp32 / int8 rows with the step it measured."""
    if not results:
        return {}
    out: ModelMetrics = {}
    p = (results.get("phases") or {}).get(phase) or {}
    if p.get("quality") is not None:
        out["held_out"] = {"step": p.get("quality_step"), **p["quality"]}
    if p.get("quality_end"):
        out["held_out_end"] = {"step": step, **p["quality_end"]}
    inf = results.get("inference") or {}
    if inf and not inf.get("skipped"):
        out["inference"] = {"step": inf.get("model_step"), "fp32": inf.get("fp32"), "int8": inf.get("int8"),
                            "kept_fp32": inf.get("kept_fp32")}
    elif inf:
        out["inference"] = {"skipped": inf.get("skipped")}
    return out


def _sample(config: JobConfig, model: nn.Module, data_path: Any) -> tuple[Any, ...] | None:
    """The first held-out batch's positional inputs (:func:`jobs.trainer.workload.inference_batches`), or None."""
    from jobs import entry
    from jobs.launcher.inference import _positional
    from jobs.trainer.workload import inference_batches

    held_out, _ = inference_batches(config.replace(quant={"calibration_batches": 1}), data_path)
    if not held_out:
        return None
    return _positional(model, entry.split_batch(held_out[0], forward=model.forward))


def _write(run_dir: Path, config: JobConfig, checkpoint: Checkpoint, results: JobResults | None,
           data_path: Any, int8: nn.Module | None, extra: ModelRecord,
           kept_int8: tuple[Path, ExportRecord] | None = None) -> ModelRecord:
    state = final_model_state(checkpoint)
    model, sd, ids = model_state_dict(config, state)
    sample = None if ids else _sample(config, model, data_path)
    return _write_dir(run_dir, config, state, (model, sd, ids), sample=sample, int8=int8,
                      metrics=_metrics(results, state["phase"], state["step"]), extra=extra, kept_int8=kept_int8)


def after_job(config: JobConfig, final: Checkpoint, results: JobResults, run_dir: Path,
              data_path: Any, int8: nn.Module | None, log: Any) -> ModelRecord | None:
    """The end of ``fxdist launch``: write ``run_dir/model/`` from the final checkpoint ``final`` (logged); the
    model.json record, or None when it could not be written (the reason logged: the job's results stand).

    Never raises an ``Exception``: the job trained, and this only adds to its outputs."""
    t0 = time.perf_counter()
    try:
        record = _write(run_dir, config, final, results, data_path, int8,
                        {"written_by": "fxdist launch", "checkpoint": "the job's final checkpoint"})
    except Exception as e:  # noqa: BLE001 - a model folder that cannot be written never fails the trained job
        log(f"the model folder was not written: {type(e).__name__}: {e} (retry with `fxdist export {run_dir}`)")
        return None
    done = [k for k, v in record["exports"].items() if "file" in v]
    log(f"trained model: {run_dir / MODEL_DIR} (state_dict.pt{''.join(', ' + record['exports'][k]['file'] for k in done)}"
        f") in {time.perf_counter() - t0:.1f} s")
    return record


def latest_checkpoint(run_dir: str | os.PathLike[str]) -> Path:
    """The run's checkpoint of the largest step: ``state.pt`` under ``run_dir/ray/`` (Ray Train's storage).

    Raises:
        ExportError: the run has no checkpoint.
    """
    from scheduling.ps.safe_load import safe_load

    found = sorted((run_dir_path := Path(run_dir)).glob("ray/**/state.pt"))
    if not found:
        raise ExportError(f"{run_dir_path}: no checkpoint (no ray/**/state.pt); a run with [job] checkpoint_every = 0 "
                          "still writes its final checkpoint, so this folder holds no finished phase")
    steps = [(int(safe_load(p, map_location="cpu", mmap=True).get("step") or 0), p.stat().st_mtime, p) for p in found]
    return max(steps)[2]


def export_run(run_dir: str | os.PathLike[str], checkpoint: str | os.PathLike[str] | None = None, *,
               log: Any = print) -> ModelRecord:
    """``fxdist export RUN``: rebuild ``RUN/model/`` from the run's latest checkpoint (or ``checkpoint``, a
    ``state.pt`` or the folder holding one), without Ray. The config is the run's (results.json); the int8 program
    is not made again (the int8 stage measures this CPU): an existing ``model_int8.pt2`` of the same step is kept.

    Raises:
        ExportError: no results.json with a config, or no checkpoint.
        scheduling.ps.safe_load.CheckpointRefused: the checkpoint holds a type the weights-only loader refuses.
        RuntimeError: the checkpoint does not fit the model the config builds.
    """
    from jobs.config import parse_config
    from jobs.launcher import runs
    from scheduling.ps.safe_load import safe_load

    run = Path(run_dir).resolve()
    results = runs.read(run)
    if not results or "config" not in results:
        raise ExportError(f"{run}: no {runs.RESULTS} with the run's config; is this a run folder of fxdist launch?")
    config = parse_config(results["config"], source=str(run / runs.RESULTS))
    path = Path(checkpoint) if checkpoint is not None else latest_checkpoint(run)
    if path.is_dir():
        path = path / "state.pt"
    if not path.is_file():
        raise ExportError(f"--checkpoint {path}: no such file (a run's checkpoints are ray/train/checkpoint_*/state.pt)")
    state = with_tables(safe_load(path, map_location="cpu", mmap=True), run, evaluated=False)
    data_path = (results.get("data") or {}).get("path") or None
    kept = _kept_int8(run, final_model_state(state).get("step"))
    try:
        record = _write(run, config, state, _read_results(results), data_path, None,
                        {"written_by": "fxdist export", "checkpoint": str(path)}, kept_int8=kept)
    finally:
        if kept is not None:
            shutil.rmtree(kept[0].parent, ignore_errors=True)
    log(f"wrote {run / MODEL_DIR} from {path} (step {record['step']}): {', '.join(record['files'])}")
    return record


def _read_results(data: dict[str, Any]) -> JobResults | None:
    """results.json's dict as :class:`jobs.results.JobResults`, or None when it does not fit the schema (the model
    folder is written without the metrics then)."""
    from jobs.results import ResultsError

    try:
        return JobResults.from_json(data)
    except ResultsError:
        return None


def _kept_int8(run: Path, step: int | None) -> tuple[Path, ExportRecord] | None:
    """A copy (outside ``model/``) of the current folder's ``model_int8.pt2`` and its record when it is of
    ``step``, else None."""
    folder = run / MODEL_DIR
    try:
        record = json.loads((folder / "model.json").read_text())
    except (OSError, ValueError):
        return None
    if record.get("step") != step or not (folder / "model_int8.pt2").is_file():
        return None
    keep = Path(tempfile.mkdtemp(prefix=f"{MODEL_DIR}.int8-", dir=run)) / "model_int8.pt2"
    shutil.copy2(folder / "model_int8.pt2", keep)
    return keep, record["exports"]["int8"]
