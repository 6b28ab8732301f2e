"""The served model of ``fxdist serve``: ``RUN_DIR/model/`` loaded, kept up to date with the run's deltas.

:class:`ServedModel` builds the model with the run's entry point as :func:`jobs.launcher.model_export.model_state_dict`
does (the bundled DLRM: :func:`jobs.criteo.dlrm`, its tables on ``meta``; your model: :func:`jobs.entry.make_model`),
loads ``state_dict.pt`` into it (``torch.load(weights_only=True)``, ``load_state_dict(strict=True, assign=True)``)
and puts it in eval mode. Together with the dynamic tables' id maps (``dynamic_ids.pt``) and its step
(``model.json``) it is one :class:`Snapshot`, never changed once made.

:meth:`ServedModel.poll` (a background thread calls it every ``poll_s`` seconds: :meth:`ServedModel.start`) applies
each newly committed delta (:func:`jobs.deltas.committed_steps` above the served step) in step order: copy on write,
the tensors a delta touches are cloned, the untouched ones shared with the served snapshot, the delta is applied
to the copy (:func:`jobs.deltas.apply_delta`), a fresh module takes the new tensors, and the new snapshot replaces
the old one in one reference assignment. A request reads the snapshot once, so it sees one step's model whole,
never a half-applied delta, and is never blocked by one. A model folder replaced by a newer one (``fxdist export``,
the end of the job) is reloaded when its step is above the served step and every committed delta.

Dynamic tables (``[model] table_sizes = "dynamic"``): a request's raw ids are mapped to their table's slots through
the id map (``dynamic_ids.pt``, then each delta's new and evicted ids); an id the map does not hold is dropped
from its bag, which with sum pooling is the zero row the parameter servers answer for an id not admitted. A table
that is not a sum-pooled table of a torchrec ``EmbeddingBagCollection`` is refused when the model loads.

Source: PyTorch docs, "Saving and loading models" (``load_state_dict(assign=True)``, ``weights_only=True``);
torchrec ``EmbeddingBagCollection`` / ``KeyedJaggedTensor``; Liu et al. 2022, "Monolith: Real Time Recommendation
System With Collisionless Embedding Table" §2.3 (parameters synchronised to the serving model while training
goes on).
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypedDict, cast

import torch
from torch import nn

from jobs.config import ConfigError, JobConfig, parse_config
from jobs.launcher.model_export import MODEL_DIR, ModelRecord, load_sample_input
from jobs.launcher.serving_inputs import RequestError, criteo_rows, decode_inputs, to_json

__all__ = ["ServeError", "IdIndex", "Snapshot", "ServedModel", "model_folder"]

log = logging.getLogger(__name__)


class ServeError(RuntimeError):
    """``fxdist serve`` cannot serve this run: no model folder (``RUN_DIR/model/`` with ``model.json`` and
    ``state_dict.pt``), a model that cannot be rebuilt from it, inputs it cannot take (a dynamic table outside a
    sum-pooled torchrec ``EmbeddingBagCollection``, no ``sample_input.pt`` for your model), or a delta that does not
    fit the model. The message names the file or table.

    See docs/troubleshooting.md#serveerror.
    """


def _chain_start(model_dir: Path) -> int | None:
    """The step of the newest full delta under ``model_dir`` (where the chain of deltas can start), or None."""
    from jobs.deltas import DELTAS_DIR, committed_steps

    for step in reversed(committed_steps(model_dir)):
        try:
            if json.loads((model_dir / DELTAS_DIR / f"{step:010d}" / "delta.json").read_text()).get("full"):
                return step
        except (OSError, ValueError):
            continue
    return None


def model_folder(run: str | Path) -> Path:
    """The model folder of ``run``: ``run/model/`` (``run`` may name the model folder itself). A job with ``[export]
    every_steps`` that has not ended yet has no ``model.json`` there but its deltas, from a full one on: the folder
    is served from them (the config from ``run/results.json``).

    Raises:
        ServeError: neither holds ``model.json`` and ``state_dict.pt``, nor a full delta beside a ``results.json``.
    """
    path = Path(run)
    for folder in (path / MODEL_DIR, path):
        if (folder / "model.json").is_file() and (folder / "state_dict.pt").is_file():
            return folder
    if (path / "results.json").is_file() and _chain_start(path / MODEL_DIR) is not None:
        return path / MODEL_DIR
    raise ServeError(f"{path}: no trained model (no {MODEL_DIR}/model.json and state_dict.pt, nor deltas); `fxdist "
                     "launch` writes it when a job ends (its deltas every [export] every_steps), `fxdist export "
                     f"{path}` from a checkpoint")


class Prediction(TypedDict, total=False):
    """The answer to ``POST /predict``: the served ``step``, the ``predictions`` (the bundled DLRM's click
    probabilities, ``(B,)``; your model's outputs as JSON) and, for the DLRM, its ``logits`` ``(B,)``."""

    step: int
    predictions: Any
    logits: Any


@dataclass(frozen=True)
class IdIndex:
    """A dynamic table's id -> slot map, sorted by id for ``torch.searchsorted``.

    Shapes: ``ids``, ``slots`` ``(R,)`` int64.
    """

    ids: torch.Tensor
    slots: torch.Tensor

    @classmethod
    def of(cls, ids: torch.Tensor, slots: torch.Tensor) -> IdIndex:
        """The index of ``dynamic_ids.pt``'s ``{"ids", "slots"}`` of one table."""
        order = torch.argsort(ids)
        return cls(ids[order].contiguous(), slots[order].contiguous())

    def lookup(self, raw: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(slots, hit)`` of raw ids: ``hit`` False where the map has no row (slot then meaningless).
        Shapes: ``(N,)`` int64 -> ``(N,)`` int64, ``(N,)`` bool."""
        if not len(self.ids):
            return torch.zeros_like(raw), torch.zeros(raw.shape, dtype=torch.bool)
        pos = torch.searchsorted(self.ids, raw).clamp_(max=len(self.ids) - 1)
        return self.slots[pos], self.ids[pos] == raw


@dataclass(frozen=True)
class Snapshot:
    """One step's served model: the module (eval mode), the tensors it holds (its ``state_dict``, shared storage),
    the dynamic tables' id maps, and each dynamic feature's :class:`IdIndex` (``{KJT key: index}``)."""

    step: int
    module: nn.Module
    state: dict[str, torch.Tensor]
    dynamic_ids: dict[str, dict[str, torch.Tensor]]
    index: dict[str, IdIndex] = field(default_factory=dict)


def _dynamic_features(module: nn.Module, paths: list[str]) -> dict[str, str]:
    """``{feature (KJT key): table path}`` of the dynamic tables ``paths`` (``<ebc path>.embedding_bags.<table>``).

    Raises:
        ServeError: a table that is not in a torchrec ``EmbeddingBagCollection`` or is not sum-pooled.
    """
    features: dict[str, str] = {}
    for path in paths:
        owner, sep, name = path.rpartition(".embedding_bags.")
        try:
            ebc = module.get_submodule(owner) if sep else None
        except AttributeError:
            ebc = None
        configs = [c for c in getattr(ebc, "embedding_bag_configs", lambda: [])() if c.name == name]
        if not configs:
            raise ServeError(f"dynamic table {path}: serving maps raw ids to slots only for the tables of a torchrec "
                             "EmbeddingBagCollection (the bundled DLRM's); this model's inputs are not supported")
        if getattr(configs[0].pooling, "name", "") != "SUM":
            raise ServeError(f"dynamic table {path}: pooling {configs[0].pooling}; an id without a row is served as a "
                             "zero row, which only sum pooling allows")
        features.update(dict.fromkeys(configs[0].feature_names, path))
    return features


def _remap(value: Any, index: dict[str, IdIndex]) -> Any:
    """``value`` (a model input) with the raw ids of every dynamic feature of its ``KeyedJaggedTensor``\\ s turned into
    slots, the ids without a row dropped from their bags (lengths reduced, weights kept in step)."""
    if isinstance(value, (tuple, list)):
        items = [_remap(v, index) for v in value]
        return tuple(items) if isinstance(value, tuple) else items
    if isinstance(value, dict):
        return {k: _remap(v, index) for k, v in value.items()}
    if type(value).__name__ != "KeyedJaggedTensor" or not index.keys() & set(value.keys()):
        return value
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    keys, stride = value.keys(), value.stride()
    lengths = value.lengths().view(len(keys), stride)
    weights = value.weights_or_none()
    values_out, lengths_out, weights_out = [], [], []
    for k, key in enumerate(keys):
        lo = int(lengths[:k].sum())
        hi = lo + int(lengths[k].sum())
        vals, lens = value.values()[lo:hi], lengths[k]
        w = None if weights is None else weights[lo:hi]
        if key in index:
            slots, hit = index[key].lookup(vals.long())
            bags = torch.repeat_interleave(torch.arange(stride), lens.long())
            vals, lens = slots[hit].to(vals.dtype), torch.bincount(bags[hit], minlength=stride).to(lens.dtype)
            w = None if w is None else w[hit]
        values_out.append(vals)
        lengths_out.append(lens)
        weights_out.append(w)
    return KeyedJaggedTensor(keys=keys, values=torch.cat(values_out), lengths=torch.cat(lengths_out),
                             weights=None if weights is None else torch.cat([w for w in weights_out if w is not None]))


class ServedModel:
    """``RUN_DIR/model/`` as a served model (see the module docstring); thread-safe: :meth:`predict` from any number
    of threads, :meth:`poll` from one.

    Args:
        run: a run folder of ``fxdist launch`` (or its ``model/`` folder).
        on_applied: called with each delta step applied (metrics).
        on_failed: called with each exception of a failed delta or reload (metrics).
        check_only: only check that the run can be served (everything but reading ``state_dict.pt``); the object
            then serves nothing.

    Raises:
        ServeError: no model folder, a config or entry point that does not build the model, or inputs the
            deployment cannot take (see :class:`ServeError`).
    """

    def __init__(self, run: str | Path, on_applied: Callable[[int], None] | None = None,
                 on_failed: Callable[[BaseException], None] | None = None, *, check_only: bool = False) -> None:
        self.folder = model_folder(run)
        self.on_applied = on_applied or (lambda step: None)
        self.on_failed = on_failed or (lambda error: None)
        self.failures = 0
        """Deltas (or reloads) that failed to load or apply (each retried on the next poll)."""
        self.applied = 0
        """Deltas applied."""
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._poll_lock = threading.Lock()
        if check_only:
            self._inspect()
            return
        self._snapshot = self._load()

    # ---- loading -----------------------------------------------------------------------------------------------
    def _record(self) -> ModelRecord:
        try:
            record = json.loads((self.folder / "model.json").read_text())
        except (OSError, ValueError) as e:
            raise ServeError(f"{self.folder / 'model.json'}: unreadable ({e})") from e
        return cast(ModelRecord, record) if isinstance(record, dict) else {}

    def _config(self, parsed: Any) -> JobConfig:
        """The run's config from its parsed tables (``model.json``'s ``config.parsed``, or results.json's ``config``
        while the job is under way)."""
        try:
            return parse_config(parsed or {}, source=str(self.folder / "model.json"))
        except ConfigError as e:
            raise ServeError(f"{self.folder / 'model.json'}: its config does not parse ({e})") from e

    def _skeleton(self) -> nn.Module:
        """A fresh model of the run's entry point, its tables (the bundled DLRM's) on ``meta``."""
        from jobs import criteo, entry

        try:
            return entry.make_model(self.config) if self.config.user_model else criteo.dlrm(self.config,
                                                                                            tables_device="meta")
        except (ConfigError, ValueError) as e:
            raise ServeError(f"{self.folder}: the run's model cannot be built here: {e}") from e

    def _build(self, step: int, state: dict[str, torch.Tensor], ids: dict[str, dict[str, torch.Tensor]]) -> Snapshot:
        module = self._skeleton()
        try:
            module.load_state_dict(state, strict=True, assign=True)
        except RuntimeError as e:
            raise ServeError(f"{self.folder / 'state_dict.pt'} does not fit the model the config builds: {e}") from e
        module.eval().requires_grad_(False)
        index = {f: IdIndex.of(ids[p]["ids"], ids[p]["slots"]) for f, p in self.features.items()}
        return Snapshot(step, module, {k: v.detach() for k, v in module.state_dict().items()}, ids, index)

    def _inspect(self) -> dict[str, dict[str, torch.Tensor]]:
        """Read ``model.json``, ``sample_input.pt`` and ``dynamic_ids.pt`` and check the model's inputs can be served;
        the id maps."""
        from jobs.table_sizes import reader_sizes
        from scheduling.ps.safe_load import safe_load

        self.chain_start: int | None = None
        if (self.folder / "model.json").is_file():
            record = self._record()
            config = record.get("config")
            parsed = config.get("parsed") if isinstance(config, dict) else None
        else:  # a job under way: its deltas, from the newest full one on, and the config in results.json
            from jobs.launcher import runs

            self.chain_start = _chain_start(self.folder)
            parsed = (runs.read(self.folder.parent) or {}).get("config")
            record = {"step": -1}
        self.config = self._config(parsed)
        if self.chain_start is not None and self.config.user_model:
            raise ServeError(f"{self.folder}: no model.json and sample_input.pt yet, so the structure of your model's "
                             "inputs is unknown; serve it once the job has written its model folder")
        files = {p.name for p in self.folder.iterdir()}
        self.sample: tuple[Any, ...] | None = None
        if self.config.user_model:
            if "sample_input.pt" not in files:
                raise ServeError(f"{self.folder}: no sample_input.pt, so the structure of your model's inputs is "
                                 "unknown (the job had no held-out batch, or the model has dynamic tables)")
            self.sample = load_sample_input(self.folder / "sample_input.pt")
            self.sizes: list[int] = []
        else:
            try:
                self.sizes = reader_sizes(self.config)
            except ConfigError as e:
                raise ServeError(f"{self.folder}: {e}") from e
        ids = safe_load(self.folder / "dynamic_ids.pt", map_location="cpu") if "dynamic_ids.pt" in files else {}
        if self.chain_start is not None:
            from jobs.deltas import load_delta

            empty = torch.empty(0, dtype=torch.int64)
            ids = {p: {"ids": empty, "slots": empty} for p in load_delta(self.folder, self.chain_start).dynamic}
        self.features = _dynamic_features(self._skeleton(), sorted(ids))
        self.record_step = int(record.get("step") or 0)
        return ids

    def _load(self) -> Snapshot:
        """The folder's model (``model.json``, ``state_dict.pt``, ``dynamic_ids.pt``, ``sample_input.pt``), or, for a
        job under way, a fresh model with the newest full delta applied."""
        from scheduling.ps.safe_load import safe_load

        ids = self._inspect()
        if self.chain_start is None:
            return self._build(self.record_step, safe_load(self.folder / "state_dict.pt", map_location="cpu"), ids)
        from jobs import criteo
        from jobs.deltas import load_delta

        fresh = criteo.dlrm(self.config)  # every tensor is set by the full delta
        base = Snapshot(-1, fresh, {k: v.detach() for k, v in fresh.state_dict().items()}, ids)
        return self._apply(base, load_delta(self.folder, self.chain_start))

    # ---- serving -----------------------------------------------------------------------------------------------
    @property
    def snapshot(self) -> Snapshot:
        """The model served now."""
        return self._snapshot

    @property
    def step(self) -> int:
        """The step of the model served now."""
        return self._snapshot.step

    def inputs(self, body: Any, snapshot: Snapshot) -> tuple[Any, ...]:
        """A ``POST /predict`` body as the model's positional inputs (dynamic ids mapped with ``snapshot``'s maps).

        Raises:
            RequestError: see :mod:`jobs.launcher.serving_inputs`.
        """
        if not isinstance(body, dict):
            raise RequestError(f"the body must be a JSON object, got {type(body).__name__}")
        field = "inputs" if self.config.user_model else "rows"
        other = "rows" if self.config.user_model else "inputs"
        if field not in body:
            hint = f" (this model takes '{field}', not '{other}')" if other in body else ""
            raise RequestError(f"the body has no '{field}'{hint}")
        if self.sample is not None:
            args = decode_inputs(body[field], self.sample)
        else:
            from jobs import criteo

            dense, ids = criteo_rows(body[field], self.sizes)
            args = (dense, criteo.to_kjt(ids))
        return _remap(args, snapshot.index) if snapshot.index else args

    def predict(self, body: Any) -> Prediction:
        """``{"step", "predictions"}`` for a ``POST /predict`` body: the bundled DLRM's click probabilities
        (``sigmoid`` of its ``(B, 1)`` logits, as a ``(B,)`` list) and ``"logits"``; your model's outputs as JSON
        (:func:`jobs.launcher.serving_inputs.to_json`).

        Raises:
            RequestError: a body the model cannot take, or inputs ``forward`` refuses (its message).
        """
        snap = self._snapshot
        args = self.inputs(body, snap)
        try:
            with torch.inference_mode():
                out = snap.module(*args)
        except (RuntimeError, ValueError, TypeError, IndexError) as e:
            raise RequestError(f"the model refused the inputs: {type(e).__name__}: {str(e).splitlines()[0][:300]}"
                               ) from None
        if self.sample is None:
            logits = out.reshape(-1)
            return {"step": snap.step, "predictions": to_json(torch.sigmoid(logits)), "logits": to_json(logits)}
        return {"step": snap.step, "predictions": to_json(out)}

    # ---- deltas ------------------------------------------------------------------------------------------------
    def _apply(self, snap: Snapshot, delta: Any) -> Snapshot:
        """A new snapshot: ``snap`` with ``delta`` applied to copies of the tensors it touches."""
        from jobs import deltas

        state = dict(snap.state)
        touched = set(delta.dense) | set(delta.tables)
        for path in delta.dynamic:
            if path not in snap.dynamic_ids:
                raise ServeError(f"delta {delta.step}: dynamic table {path} is not one of the model's "
                                 f"{sorted(snap.dynamic_ids)}")
            touched |= {k for k in state if k.startswith(path + ".")}
        unknown = sorted(touched - set(state))
        if unknown:
            raise ServeError(f"delta {delta.step}: {unknown} not in the model's state dict")
        state.update({k: state[k].clone() for k in touched})
        ids = dict(snap.dynamic_ids)  # apply_delta replaces a table's map, never changes it in place
        deltas.apply_delta(state, ids, delta)
        return self._build(int(delta.step), state, ids)

    def _newer_folder(self, pending: list[int]) -> bool:
        """Whether ``model.json`` names a step above the served one and every pending delta (a replaced folder)."""
        if not (self.folder / "model.json").is_file():
            return False
        try:
            step = int(self._record().get("step") or 0)
        except ServeError:
            return False
        return step > self._snapshot.step and step >= max(pending, default=0) and step != self.record_step

    def poll(self) -> list[int]:
        """Apply the deltas committed since the served step, in step order, each swapped in whole (or reload a
        newer model folder); the steps now served, one per swap. A delta that fails to load or apply is logged,
        counted in :attr:`failures` and tried again on the next call (the served model stays as it was)."""
        try:
            from jobs import deltas
        except ImportError:
            return []
        with self._poll_lock:
            done: list[int] = []
            try:
                pending = [s for s in deltas.committed_steps(self.folder) if s > self._snapshot.step]
                if self._newer_folder(pending):
                    self._snapshot = self._load()
                    done.append(self._snapshot.step)
                    pending = [s for s in pending if s > self._snapshot.step]
                for step in pending:
                    self._snapshot = self._apply(self._snapshot, deltas.load_delta(self.folder, step))
                    done.append(step)
                    self.applied += 1
                    self.on_applied(step)
            except Exception as e:  # noqa: BLE001 - the served model stays; retried on the next poll
                self.failures += 1
                self.on_failed(e)
                log.warning("fxdist serve: %s: %s (serving step %d; retried on the next poll)",
                            type(e).__name__, e, self._snapshot.step)
            return done

    def start(self, poll_s: float) -> None:
        """Poll for deltas every ``poll_s`` seconds in a daemon thread (until :meth:`stop`)."""
        if self._thread is not None:
            return
        self._stop.clear()

        def loop() -> None:
            while not self._stop.wait(poll_s):
                self.poll()

        self._thread = threading.Thread(target=loop, name="fxdist-serve-deltas", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop the polling thread (a poll under way finishes first)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
