"""The embedding table sizes of the built-in DLRM, all in one place: the 26 sizes a config resolves to
(:func:`sizes`: ``[model] table_sizes`` "uniform", a list, "dynamic", or "data" once resolved), the sizes the
reader hashes into (:func:`reader_sizes`), the dynamic tables of the ``parameter_servers`` pass (:func:`dynamic`),
and the per-feature sizes from the data (``[model] table_sizes = "data"``, :func:`resolve`, with the first pass's
counts).

With ``table_sizes = "dynamic"`` each table is a collisionless dynamic table on the parameter servers
(:mod:`scheduling.ps.dynamic`): the reader keeps each value's raw 64-bit mix (no modulo,
:data:`recsys.criteo_format.RAW_IDS`), the model's tables are made with ``[model] dynamic_capacity`` rows (the
memory check counts those), and the servers give an id a row once it was looked up ``dynamic_min_count`` times,
evicting the least recently used row when the table is full.

The launcher's first pass over the data (:func:`recsys.criteo_shard.scan`) counts the distinct values of each
categorical feature ``C1..C26``; table ``j`` then gets ``min(distinct_j + 1, [model] max_table_size)`` rows
(row 0 holds the missing value) and ids are hashed into each feature's own table
(:func:`recsys.criteo_format.hash_ids`). The counts and the chosen sizes go to ``<run>/cardinalities.json`` and
results.json (``tables``); the resolved list replaces "data" in the config the trainers get, so a resumed
run keeps its sizes.

Source: the DLRM / torchrec Criteo preprocessing (per-feature ``num_embeddings`` from the data's
cardinalities, capped: torchrec's ``--num_embeddings_per_feature`` with a max ids per table); Liu et al. 2022,
"Monolith: Real Time Recommendation System With Collisionless Embedding Table" §2.1-2.2 (dynamic tables).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, cast

from jobs.config import ConfigError, JobConfig
from jobs.records import DynamicSpec, TableSizes

__all__ = ["CARDINALITIES", "sizes", "reader_sizes", "dynamic", "sizes_from_counts", "resolve", "write_record"]

CARDINALITIES = "cardinalities.json"


def sizes(config: JobConfig) -> list[int]:
    """Rows of each of the 26 embedding tables of the built-in DLRM (``[model] table_sizes``, resolved), in the
    Criteo feature order ``C1..C26``: what the model, the reader's hash buckets, the parameter servers and the
    memory plan use, e.g. ``EmbeddingBagConfig(num_embeddings=sizes(config)[j], ...)`` for feature ``C<j+1>``.

    Raises:
        ConfigError: ``table_sizes = "data"`` not resolved yet (the launcher resolves it from the data before
            anything is built: :func:`resolve`).
    """
    given = config.model.table_sizes
    if given == "uniform":
        return [config.model.table_size] * 26
    if given == "dynamic":
        return [config.model.dynamic_capacity] * 26
    if given == "data":
        raise ConfigError(f'{config.source}: [model] table_sizes = "data" has not been resolved from the data '
                          "yet (jobs.table_sizes.resolve)")
    return list(cast(list[int], given))  # the config check admits no other string


def reader_sizes(config: JobConfig) -> list[int]:
    """What the Criteo reader hashes each feature into (:func:`recsys.criteo_format.hash_ids`): :func:`sizes`, or
    :data:`recsys.criteo_format.RAW_IDS` for every table with ``table_sizes = "dynamic"`` (raw ids, no modulo).

    Raises:
        ConfigError: ``table_sizes = "data"`` not resolved yet.
    """
    from recsys.criteo_format import RAW_IDS

    return [RAW_IDS] * 26 if config.model.table_sizes == "dynamic" else sizes(config)


def dynamic(config: JobConfig, names: list[str]) -> dict[str, DynamicSpec] | None:
    """The ``dynamic=`` argument of the ``parameter_servers`` pass for the tables ``names`` (the built-in DLRM's
    ``t_C1 .. t_C26``) with ``table_sizes = "dynamic"``: ``{name: {"capacity", "min_count", "expire_steps"}}``
    (``expire_steps`` None for 0, never); None otherwise.

    >>> from jobs.config import parse_config
    >>> dynamic(parse_config({"model": {"table_sizes": "dynamic", "dynamic_capacity": 8}}), ["t_C1"])
    {'t_C1': {'capacity': 8, 'min_count': 1, 'expire_steps': None}}
    """
    m = config.model
    if m.table_sizes != "dynamic":
        return None
    spec: DynamicSpec = {"capacity": m.dynamic_capacity, "min_count": m.dynamic_min_count,
            "expire_steps": m.dynamic_expire_steps or None}
    return {name: spec.copy() for name in names}


def sizes_from_counts(distinct: list[int], cap: int) -> list[int]:
    """Rows per table: ``min(distinct_j + 1, cap)`` (at least 2): a row per value and row 0 for missing.

    >>> sizes_from_counts([0, 3, 10**8], cap=10**7)
    [2, 4, 10000000]
    """
    return [max(2, min(d + 1, cap)) for d in distinct]


def resolve(config: JobConfig, plan: Any) -> tuple[JobConfig, TableSizes | None]:
    """``config`` with ``[model] table_sizes`` resolved from ``plan`` (a :class:`recsys.criteo_shard.DataPlan`
    with ``distinct`` counted) when it is "data", and the record of the choice (None otherwise).

    Raises:
        ValueError: "data" sizes but ``plan`` has no distinct counts.
    """
    m = config.model
    if m.table_sizes != "data":
        return config, None
    if plan is None or plan.distinct is None:
        raise ValueError('[model] table_sizes = "data" needs the first pass to count distinct values')
    sizes = sizes_from_counts(plan.distinct, m.max_table_size)
    record: TableSizes = {"features": [f"C{j + 1}" for j in range(len(sizes))], "distinct": plan.distinct,
              "distinct_exact": plan.distinct_exact, "max_table_size": m.max_table_size, "sizes": sizes,
              "rows": sum(sizes), "lines": plan.lines, "files": plan.files}
    return config.replace(model={"table_sizes": sizes}), record


def write_record(run_dir: Path, record: TableSizes) -> Path:
    """Write ``<run_dir>/cardinalities.json``."""
    path = Path(run_dir) / CARDINALITIES
    path.write_text(json.dumps(record, indent=1) + "\n")
    return path
