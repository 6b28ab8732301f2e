"""The first pass over the Criteo data, before Ray starts (:func:`first_pass`): the lines, each trainer's rows
and held-out rows (a :class:`recsys.criteo_shard.DataPlan`, which the trainers' readers follow) and, with
``[model] table_sizes = "data"``, the per-feature table sizes (:func:`jobs.table_sizes.resolve`), whose memory is
then checked on this machine (:func:`jobs.launcher.checks.check_memory`).

Source: the DLRM / torchrec Criteo preprocessing (a counting pass before training).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from jobs import table_sizes
from jobs.config import JobConfig
from jobs.launcher import checks
from jobs.records import TableSizes
from recsys.criteo_follow import scan_present
from recsys.criteo_shard import DataPlan, scan

__all__ = ["first_pass"]


def first_pass(config: JobConfig, data: Path, *, local: bool,
               log: Any = None) -> tuple[JobConfig, DataPlan, TableSizes | None]:
    """The first pass over the Criteo data (:func:`recsys.criteo_shard.scan`): lines, each trainer's rows,
    and with ``[model] table_sizes = "data"`` the distinct values per feature, which resolve the table sizes
    (:func:`jobs.table_sizes.resolve`); then, on this machine, the memory check with those sizes. With ``[data]
    follow`` (a stream), the pass over the complete lines there now (:func:`recsys.criteo_follow.scan_present`).

    Returns:
        (the config with the table sizes resolved, the :class:`recsys.criteo_shard.DataPlan`, the table-size
        record for ``cardinalities.json`` or None).

    Raises:
        recsys.criteo_format.DataError: a file cannot be read; ConfigError: the plan does not fit in memory.
    """
    per_feature = config.model.table_sizes == "data"
    if config.data.follow:  # a stream: the complete lines there now (no "data" table sizes: jobs.config_rules)
        found = scan_present(data, config.cluster.trainers, config.data.eval_fraction)
    else:
        found = scan(data, config.cluster.trainers, config.data.eval_fraction,
                     distinct_cap=config.model.max_table_size if per_feature else None)
    if log is not None:
        log(f"first pass over {len(found.files)} file(s): {found.lines} lines in {found.seconds:.1f} s "
            f"({found.lines_per_s:,.0f} lines/s), rows per trainer {found.rows}, {found.eval_rows} held out")
    config, record = table_sizes.resolve(config, found)
    if record is not None and log is not None:
        log(f"table sizes from the data (capped at {config.model.max_table_size}): {record['sizes']}")
    if local and per_feature:
        checks.log_memory(checks.check_memory(config), log)
    return config, found, record
