"""The interleaving of a trainer's phases: every phase trains over the same batches, alternating blocks of
``[phases] block_steps`` steps (the order flips every block, :func:`block_ends`), each with its own model, optimizer
and tables; checkpoints at block ends, mid-phase evaluation and faults after each step; at the end every phase's
summary to the launcher's JobState (with the trainers' reader statistics, :func:`reader_summary`).

The QPS gain is the median of paired block ratios (:func:`jobs.stats.interleaved_gain`): both phases see the same
machine load.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

from jobs.records import EarlyEval, ReaderSummary
from jobs.stats import interleaved_gain, phase_summary
from jobs.trainer.checkpoints import digest, poll_pending, restore_tables, save_checkpoint
from jobs.trainer.evaluation import eval_step, evaluate, evaluate_mid_phase
from jobs.trainer.faults import maybe_inject_faults
from jobs.trainer.pipeline import PHASES, TrainPipeline
from recsys.criteo_stream import ReaderStats


def gather(obj: Any) -> list[Any]:
    if not (dist.is_available() and dist.is_initialized()):
        return [obj]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def block_ends(start: int, steps: int, block_steps: int, checkpoint_every: int) -> list[int]:
    """The steps at which the blocks of an interleaved run end: every ``block_steps`` steps after ``start``,
    at every checkpoint step (both phases must be at the same step there) and at ``steps``.

    >>> block_ends(0, 25, 10, 0), block_ends(10, 40, 10, 15)
    ([10, 20, 25], [15, 20, 30, 40])
    """
    ends = set(range(start + block_steps, steps, block_steps)) if block_steps > 0 else set()
    if checkpoint_every:
        ends |= set(range(checkpoint_every, steps, checkpoint_every))
    return sorted(e for e in ends | {steps} if e > start)


def _start_phases(config, rank, workload, tables, resume, state, exporter) -> dict[str, TrainPipeline]:
    """A :class:`TrainPipeline` per phase, from the seed's weights or from the checkpoint ``resume`` (dense
    weights before the module is built, tables after: your model's tables exist once its pass has run)."""
    phases = [p for p in PHASES if p != "baseline" or config.phases.baseline]
    start = resume["step"] if resume is not None else 0
    trainers = {}
    for phase in phases:
        view = tables.view(phase)
        model = workload.build(view)
        optim_state = None
        if resume is not None:
            model.load_state_dict(resume["models"][phase], strict=False)
            optim_state = resume["optim"][phase]
        trainers[phase] = TrainPipeline(phase, model, view, workload, config, start_step=start, optim_state=optim_state,
                                       exporter=exporter)
        if resume is not None:  # by shard from the run folder, or whole tables of an older checkpoint
            restored = restore_tables(view, resume["tables"][phase], rank)
            if rank == 0:  # what the model and the (fresh) servers hold now, for the job's record
                state.restored.remote(phase, start, digest(trainers[phase].dense_state()), restored)
        if rank == 0:
            state.phase_started.remote(phase, start, config.job.steps)
    return trainers


def run_phases(config, rank, world, workload, tables, resume, state, exporter, model_dir=None) -> None:
    """Train every phase over the same batches, alternating blocks of ``[phases] block_steps`` steps (the
    order flips every block), each phase keeping its own model, optimizer and tables; then summarise. With
    ``[export] every_steps`` and ``model_dir`` (``RUN_DIR/model``), the last phase's deltas go there
    (:class:`jobs.trainer.deltas.DeltaWriter`)."""
    steps, every = config.job.steps, config.job.checkpoint_every
    if resume is not None and resume.get("final") and resume["step"] >= steps:
        return  # every phase finished before this restart (a completed run resumed for more steps goes on)
    shard_rows = max(gather(workload.rows))
    at = eval_step(config, shard_rows)
    trainers = _start_phases(config, rank, workload, tables, resume, state, exporter)
    early: dict[str, EarlyEval] = {p: EarlyEval(**(((resume or {}).get("eval") or {}).get(p) or {})) for p in trainers}
    last = list(trainers)[-1]
    deltas = None
    if config.export.every_steps and model_dir is not None:
        from jobs.trainer.deltas import DeltaWriter

        deltas = DeltaWriter(trainers[last], config.export.every_steps, rank, model_dir, state, exporter)
        deltas.start()

    def on_step(step, run, module, optimizer):
        phase = run.phase
        if rank == 0 and (step % 5 == 0 or step == steps):
            state.progress.remote(phase, step)
        if deltas is not None and phase == last:
            deltas.after_step(step)
        if step == at and step < steps:
            early[phase].update(evaluate_mid_phase(trainers[phase], step, snapshot=phase == last))
        poll_pending(config, trainers, phase, step, rank, state)  # a checkpoint whose tables are written now
        maybe_inject_faults(config, phase, step, rank, world, state, tables.servers)

    start = next(iter(trainers.values())).step
    for b, end in enumerate(block_ends(start, steps, config.phases.block_steps, every)):
        for phase in (list(trainers) if b % 2 == 0 else list(trainers)[::-1]):
            trainers[phase].train(end, on_step)
        if rank == 0 and exporter is not None and len(trainers) > 1:
            exporter.observe_gain(interleaved_gain([{p: t.run.blocks for p, t in trainers.items()}]))
        if every and end % every == 0 and end < steps:
            save_checkpoint(end, trainers, early, rank, final=False, state=state)
    if deltas is not None:
        deltas.close()   # every delta on disk before the model folder is written
    _finish_phases(config, rank, workload, trainers, early, state, shard_rows)


def reader_summary(stats: list[ReaderStats | None]) -> ReaderSummary | None:
    """The trainers' reader statistics (:meth:`recsys.criteo_stream.CriteoStream.stats`, one per rank) in one:
    ``lines_per_s`` (the mean per-worker parse rate), ``capacity_lines_per_s`` (all trainers' workers
    together), ``workers`` (per trainer), ``lines``, ``rows``, ``per_trainer``; None without a stream.

    >>> reader_summary([{"lines_per_s": 100.0, "capacity_lines_per_s": 200.0, "workers": 2, "lines": 5, "rows": 4},
    ...                 {"lines_per_s": 300.0, "capacity_lines_per_s": 600.0, "workers": 2, "lines": 5, "rows": 5}])
    ... # doctest: +NORMALIZE_WHITESPACE
    {'lines_per_s': 200.0, 'capacity_lines_per_s': 800.0, 'workers': 2, 'lines': 10, 'rows': 9,
     'per_trainer': [100.0, 300.0]}
    """
    given = [s for s in stats if s]
    if not given:
        return None
    return {"lines_per_s": sum(s["lines_per_s"] for s in given) / len(given),
            "capacity_lines_per_s": sum(s["capacity_lines_per_s"] for s in given), "workers": given[0]["workers"],
            "lines": sum(s["lines"] for s in given), "rows": sum(s["rows"] for s in given),
            "per_trainer": [s["lines_per_s"] for s in given]}


def _finish_phases(config, rank, workload, trainers, early, state, shard_rows: int) -> None:
    """Every phase's summary to the JobState (rank 0), then the final checkpoint; ``shard_rows``: the largest
    trainer's shard (0: a stream, ``[data] follow``, whose epochs are not counted)."""
    steps = config.job.steps
    reader = reader_summary(gather(workload.reader_stats()))
    for phase, t in trainers.items():
        t.tables.sync()
        runs = gather(t.run)  # also a barrier: every rank's updates are on the servers before evaluation
        dynamic = t.tables.dynamic_stats()  # rank 0: the dynamic tables as training left them, before evaluation
        end = evaluate(t.evaluated, workload, t.tables) if workload.has_eval else {}
        if rank == 0:
            quality_step = early[phase].get("step", steps)
            epochs = {"quality_epochs": quality_step * config.job.batch_size / shard_rows,
                      "epochs": steps * config.job.batch_size / shard_rows} if shard_rows else {}
            summary = phase_summary(runs, config.job.batch_size, quality=early[phase].get("quality", end),
                                    quality_step=quality_step, quality_end=end, optimize=t.info,
                                    resumed_from_step=t.run.start_step, **epochs,
                                    block_seconds=[r.blocks for r in runs], reader=reader,
                                    **({"dynamic_tables": dynamic} if dynamic is not None else {}))
            __import__("ray").get(state.phase_done.remote(phase, summary))
    save_checkpoint(steps, trainers, early, rank, final=True, state=state)

