"""The ``fxdist`` command line.

Usage::

    fxdist launch [CONFIG.toml] [--set TABLE.KEY=VALUE ...] [--run-dir DIR] [--quiet]
    fxdist config [CONFIG.toml]          # print the effective config as TOML-like text

Without ``CONFIG`` the bundled ``jobs/default.toml`` runs: DLRM on the Criteo sample
(../shared/data/criteo/train_examples.txt, or generated Criteo-format data when absent), 2 trainers,
1 parameter server, a baseline and an optimized phase, then fp32-vs-int8 inference. ``--set`` overrides
single keys, e.g. ``--set job.steps=20 --set cluster.parameter_servers=0``; values are parsed as TOML
(``20``, ``true``, ``"text"``, ``["fuse"]``), or taken as a string when they do not parse.

Exit status: 0 on success, 2 for a bad config or command line, 1 when the job fails, 3 when the optimized
phase's loss or AUC differs from the baseline's by more than the baseline's own spread (``[phases] parity =
"error"``; the results are written all the same).
"""

from __future__ import annotations

import argparse
import sys
import tomllib
from collections.abc import Sequence
from typing import Any

from jobs.config import ConfigError, JobConfig, load_config, to_dict

__all__ = ["main", "apply_overrides"]


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
    sub = parser.add_subparsers(dest="command", required=True)
    launch = sub.add_parser("launch", help="run a job (default: the bundled DLRM-on-Criteo job)")
    launch.add_argument("config", nargs="?", help="job config (TOML); default: jobs/default.toml")
    launch.add_argument("--set", dest="overrides", action="append", default=[], metavar="TABLE.KEY=VALUE",
                        help="override one config key (repeatable)")
    launch.add_argument("--run-dir", help="run folder (default: <[job] run_dir>/<name>-<timestamp>)")
    launch.add_argument("--quiet", action="store_true", help="no progress bars or table")
    show = sub.add_parser("config", help="print the effective job config")
    show.add_argument("config", nargs="?")
    show.add_argument("--set", dest="overrides", action="append", default=[], metavar="TABLE.KEY=VALUE")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``fxdist`` console script."""
    args = _parser().parse_args(argv)
    try:
        config = apply_overrides(load_config(args.config), args.overrides)
    except (ConfigError, FileNotFoundError) as e:
        print(f"fxdist: {e}", file=sys.stderr)
        return 2
    if args.command == "config":
        for table, values in to_dict(config).items():
            print(f"[{table}]")
            for key, value in values.items():
                print(f"{key} = {value!r}")
            print()
        return 0
    from jobs.launch import ParityError, launch

    try:
        launch(config, run_dir=args.run_dir, quiet=args.quiet)
    except (ConfigError, FileNotFoundError) as e:
        print(f"fxdist: {e}", file=sys.stderr)
        return 2
    except ParityError as e:
        print(f"fxdist: {e}", file=sys.stderr)
        return 3
    except KeyboardInterrupt:
        print("fxdist: interrupted", file=sys.stderr)
        return 130
    except Exception as e:
        print(f"fxdist: job failed: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
