"""The ``fxdist`` command line.

Usage::

    fxdist --version
    fxdist launch [CONFIG.toml] [--set TABLE.KEY=VALUE ...] [--run-dir DIR] [--quiet]
    fxdist launch --resume RUN_DIR [--set TABLE.KEY=VALUE ...] [--quiet]
    fxdist config [CONFIG.toml]          # print the effective config as TOML-like text
    fxdist data synth --lines N --out DIR [--files K] [--gzip] [--seed S] [--max-cardinality C]
    fxdist export RUN_DIR [--checkpoint PATH]   # rebuild RUN_DIR/model/ (the trained model) from a checkpoint
    fxdist serve RUN_DIR [--host H] [--port P] [--metrics-port M] [--poll-s S]   # serve it over HTTP (Ray Serve)

Without ``CONFIG`` the bundled ``jobs/default.toml`` runs: DLRM on the Criteo sample
(../shared/data/criteo/train_examples.txt, or generated Criteo-format data when absent), 2 trainers,
1 parameter server, a baseline and an optimized phase, then fp32-vs-int8 inference. ``fxdist launch
jobs/movielens.toml`` runs the second bundled job (matrix factorization of MovieLens-100K, found from any
folder); a config with ``[model] factory`` / ``[data] batches`` trains your own model (:mod:`jobs.entry`). ``--set``
overrides single keys, e.g. ``--set job.steps=20 --set cluster.parameter_servers=0``; values are parsed as TOML
(``20``, ``true``, ``"text"``, ``["fuse"]``), or taken as a string when they do not parse.

``--run-dir DIR`` must not hold a run yet: a run is never overwritten. ``--resume RUN_DIR`` continues an
interrupted or failed run from its last checkpoint with the config it was started with (``--set`` may
change only the keys of :data:`jobs.launcher.runs.RESUMABLE_KEYS`); a completed run continues only for more
steps (``--set job.steps=N``). ``--set cluster.parameter_servers=M`` resumes on ``M`` servers, fewer or more:
every table, with its optimizer state (and a dynamic table's id map), is resharded onto them.

Exit status: 0 on success; 2 for a bad config, command line, data file or run folder (found before Ray
starts, or a trainer's deterministic config/data error: the message names the key or file); 1 when the
job fails; 3 when the optimized phase's loss or AUC differs from the baseline's by more than the
baseline's own spread (``[phases] parity = "error"``; the results are written all the same); 130 when
interrupted (Ctrl-C), after writing ``results.json`` with ``"status": "interrupted"``.

An error of the packages ends with a pointer to its section of the troubleshooting page
(``fxdist: troubleshooting: docs/troubleshooting.md#configerror``): :func:`troubleshooting_section`.
"""

from __future__ import annotations

import argparse
import sys
import tomllib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from fxdist import __version__
from jobs.config import ConfigError, JobConfig, load_config, to_dict

__all__ = ["main", "apply_overrides", "troubleshooting_section"]

TROUBLESHOOTING = "docs/troubleshooting.md"
"""The troubleshooting page, from the repository root: one ``### ClassName`` section per exception class."""
_PACKAGES = frozenset({"fxdist", "recsys", "scheduling", "quant", "jobs"})


def _parse_value(text: str) -> Any:
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


def apply_overrides(config: JobConfig, overrides: Sequence[str]) -> JobConfig:
    """Apply ``TABLE.KEY=VALUE`` overrides.

    Raises:
        ConfigError: an override without ``=`` or ``.``, or an unknown table/key, or a bad value.
    """
    changes: dict[str, dict[str, Any]] = {}
    for item in overrides:
        key, sep, value = item.partition("=")
        table, dot, name = key.strip().partition(".")
        if not sep or not dot or not table or not name:
            raise ConfigError(f"--set {item!r}: expected TABLE.KEY=VALUE, e.g. job.steps=20")
        changes.setdefault(table, {})[name] = _parse_value(value.strip())
    return config.replace(**changes) if changes else config


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fxdist", description="fxdist jobs: optimized distributed training")
    parser.add_argument("--version", action="version", version=f"fxdist {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    launch = sub.add_parser("launch", help="run a job (default: the bundled DLRM-on-Criteo job)")
    launch.add_argument("config", nargs="?", help="job config (TOML); default: jobs/default.toml")
    launch.add_argument("--set", dest="overrides", action="append", default=[], metavar="TABLE.KEY=VALUE",
                        help="override one config key (repeatable)")
    launch.add_argument("--run-dir", help="run folder, which must not hold a run yet "
                                          "(default: <[job] run_dir>/<name>-<timestamp>)")
    launch.add_argument("--resume", metavar="RUN_DIR",
                        help="continue a run from its last checkpoint, with its config (a completed run: for more "
                             "job.steps; cluster.parameter_servers may change: the tables are resharded)")
    launch.add_argument("--quiet", action="store_true", help="no progress bars or table")
    show = sub.add_parser("config", help="print the effective job config")
    show.add_argument("config", nargs="?")
    show.add_argument("--set", dest="overrides", action="append", default=[], metavar="TABLE.KEY=VALUE")
    export = sub.add_parser("export", help="rebuild RUN_DIR/model/ (state_dict.pt, model.pt2, model.json) from "
                                           "the run's latest checkpoint, without Ray")
    export.add_argument("run", metavar="RUN_DIR", help="a run folder of fxdist launch")
    export.add_argument("--checkpoint", metavar="PATH", help="a checkpoint of the run (a state.pt, or the "
                                                            "ray/train/checkpoint_* folder holding one); default: "
                                                            "the latest")
    serve = sub.add_parser("serve", help="serve RUN_DIR/model/ over HTTP with Ray Serve (POST /predict, GET /step), "
                                         "applying the run's deltas as the job commits them")
    serve.add_argument("run", metavar="RUN_DIR", help="a run folder of fxdist launch (or its model/ folder)")
    serve.add_argument("--host", default="127.0.0.1", help="address of the HTTP proxy and the metrics (default: "
                                                          "loopback; another address is reachable from the network)")
    serve.add_argument("--port", type=int, default=8000, help="HTTP port of the predictions")
    serve.add_argument("--metrics-port", type=int, default=None, help="Prometheus /metrics port of the replica "
                                                                     "(default: --port + 1; 0: a free one)")
    serve.add_argument("--poll-s", type=float, default=1.0, help="seconds between looks for new deltas")
    data = sub.add_parser("data", help="data tools").add_subparsers(dest="data_command", required=True)
    synth = data.add_parser("synth", help="write synthetic Criteo-format data (Zipf ids, Criteo Kaggle's "
                                          "per-feature cardinalities, learnable labels; see recsys/criteo_synth.py)")
    synth.add_argument("--lines", type=int, required=True, help="lines to write (all files together)")
    synth.add_argument("--out", required=True, help="output folder (train_<i>.tsv files)")
    synth.add_argument("--files", type=int, default=1, help="number of files (like Criteo's day_0..day_23)")
    synth.add_argument("--gzip", action="store_true", help="write .tsv.gz files")
    synth.add_argument("--seed", type=int, default=0)
    synth.add_argument("--max-cardinality", type=int, default=10_000_000, help="cap on each feature's distinct ids")
    return parser


def _config(args: argparse.Namespace) -> JobConfig:
    """The effective config: CONFIG (or the run's own with --resume) plus the --set overrides.

    Raises:
        ConfigError, FileNotFoundError: see :func:`load_config`, :func:`jobs.launcher.runs.load_config`.
    """
    if getattr(args, "resume", None):
        from jobs.launcher import runs

        if args.config:
            raise ConfigError(f"--resume uses the config the run was started with; drop {args.config!r} "
                              "(--set may change some keys)")
        if args.run_dir and Path(args.run_dir).resolve() != Path(args.resume).resolve():
            raise ConfigError("--resume RUN_DIR and --run-dir name different folders; give only --resume")
        saved = runs.load_config(args.resume)
        config = apply_overrides(saved, args.overrides)
        runs.check_resume_changes(saved, config)
        runs.choose(config, args.resume, resume=True)  # a completed run: only for more steps
        return config
    return apply_overrides(load_config(args.config), args.overrides)


def troubleshooting_section(e: BaseException) -> str | None:
    """``docs/troubleshooting.md#<class>`` for ``e``: the first public class of the packages in its MRO (a Ray
    error wrapping one, ``RayTaskError(PSUnavailableError)``, has it there), else in its ``__cause__`` chain
    (``raise ... from``); None when no exception of the packages is involved. Every such class has a section
    (``tests/jobs/test_launcher_cli.py`` checks it against the generated exceptions reference)."""
    seen: set[int] = set()
    error: BaseException | None = e
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        for cls in type(error).__mro__:
            if cls.__module__.partition(".")[0] in _PACKAGES and not cls.__name__.startswith("_"):
                return f"{TROUBLESHOOTING}#{cls.__name__.lower()}"
        error = error.__cause__
    return None


def _error(e: BaseException, prefix: str = "") -> None:
    print(f"fxdist: {prefix}{e}", file=sys.stderr)
    for note in getattr(e, "__notes__", []):
        print(f"fxdist: {note}", file=sys.stderr)
    if section := troubleshooting_section(e):
        print(f"fxdist: troubleshooting: {section}", file=sys.stderr)


def _data_synth(lines: int, out: str, *, files: int = 1, gzip_output: bool = False, seed: int = 0,
                max_cardinality: int = 10_000_000) -> int:
    """``fxdist data synth``: write the files (:func:`recsys.criteo_synth.write_synthetic`) and print what was
    written and how fast."""
    import time

    from recsys.criteo_synth import SynthSpec, write_synthetic

    t0 = time.perf_counter()
    paths = write_synthetic(out, lines, files=files, gzip_output=gzip_output,
                            spec=SynthSpec(seed=seed, max_cardinality=max_cardinality))
    seconds = time.perf_counter() - t0
    size = sum(p.stat().st_size for p in paths)
    print(f"wrote {lines} synthetic Criteo lines to {len(paths)} file(s) in {out} ({size / 2**20:.1f} MiB) in "
          f"{seconds:.1f} s ({lines / seconds:,.0f} lines/s); per-feature cardinalities: Criteo Kaggle's, capped at "
          f"{max_cardinality}")
    return 0


def _export(run: str, checkpoint: str | None) -> int:
    """``fxdist export``: :func:`jobs.launcher.model_export.export_run`; 2 for a folder or checkpoint it cannot use,
    1 when the model cannot be rebuilt from it."""
    from jobs.launcher.model_export import ExportError, export_run
    from scheduling.ps.safe_load import CheckpointRefused

    try:
        export_run(run, checkpoint)
    except (ExportError, ConfigError, CheckpointRefused, OSError) as e:
        _error(e)
        return 2
    except Exception as e:
        _error(e, f"export failed: {type(e).__name__}: ")
        return 1
    return 0


def _serve(args: argparse.Namespace) -> int:
    """``fxdist serve``: :func:`jobs.launcher.serving.serve_run` until interrupted; 2 for a run it cannot serve, 130
    when interrupted (the normal end), 1 when serving fails."""
    from jobs.launcher.serving import ServeError, serve_run

    if args.poll_s <= 0:
        _error(ValueError(f"--poll-s must be positive, got {args.poll_s}"))
        return 2
    try:
        serve_run(args.run, host=args.host, port=args.port, metrics_port=args.metrics_port, poll_s=args.poll_s)
    except (ServeError, ConfigError, OSError) as e:
        _error(e)
        return 2
    except KeyboardInterrupt:
        return 130
    except Exception as e:
        _error(e, f"serving failed: {type(e).__name__}: ")
        return 1
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``fxdist`` console script (exit status: see the module docstring)."""
    from recsys.criteo_format import DataError

    args = _parser().parse_args(argv)
    if args.command == "data":
        try:
            return _data_synth(args.lines, args.out, files=args.files, gzip_output=args.gzip, seed=args.seed,
                               max_cardinality=args.max_cardinality)
        except (ValueError, OSError) as e:
            _error(e)
            return 2
    if args.command == "export":
        return _export(args.run, args.checkpoint)
    if args.command == "serve":
        return _serve(args)
    try:
        config = _config(args)
    except (ConfigError, FileNotFoundError) as e:
        _error(e)
        return 2
    if args.command == "config":
        for table, values in to_dict(config).items():
            print(f"[{table}]")
            for key, value in values.items():
                print(f"{key} = {value!r}")
            print()
        return 0
    from jobs.launcher.launch import ParityError, launch

    try:
        launch(config, run_dir=args.resume or args.run_dir, quiet=args.quiet, resume=bool(args.resume))
    except (ConfigError, DataError, FileNotFoundError) as e:
        _error(e)
        return 2
    except ParityError as e:
        _error(e)
        return 3
    except KeyboardInterrupt as e:
        _error(e, "interrupted")
        return 130
    except Exception as e:
        _error(e, f"job failed: {type(e).__name__}: ")
        return 1
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
