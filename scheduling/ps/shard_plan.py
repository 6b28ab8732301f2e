"""Table and shard descriptions shared by the parameter-server client and servers.

Tables are declared with torchrec's ``EmbeddingBagConfig``; :func:`table_specs` turns them into the small
picklable :class:`TableSpec` records that travel to the servers (so a server never needs torchrec), and
:func:`plan_shards` places them on ``N`` servers, table-wise or row-wise.

Source: torchrec ``EmbeddingBagConfig`` / ``ShardingType.TABLE_WISE`` and ``ROW_WISE`` (placement only; the
storage and the lookup are ours, in :mod:`scheduling.ps.server`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from .dynamic import DynamicSpec

__all__ = ["TableSpec", "ShardSpec", "table_specs", "plan_shards", "Sharding"]

Sharding = Literal["table_wise", "row_wise"]


@dataclass(frozen=True)
class TableSpec:
    """One embedding table, as the servers see it."""

    name: str
    """Table name, unique in the collection."""
    num_embeddings: int
    """Rows of the table (ids are ``0 <= id < num_embeddings``)."""
    embedding_dim: int
    """Columns ``D`` of the table."""
    feature_names: tuple[str, ...]
    """KeyedJaggedTensor keys looked up in this table (one pooled output ``(B, D)`` each)."""
    pooling: Literal["sum", "mean"] = "sum"
    """Pooling of a bag: weighted sum, or sum divided by the bag length (done on the client)."""
    dynamic: DynamicSpec | None = None
    """A dynamic (collisionless) table: raw 64-bit ids, rows made on admission, at most ``capacity`` of them
    (:mod:`scheduling.ps.dynamic`; ``num_embeddings`` is then the capacity). None: a fixed table."""


@dataclass(frozen=True)
class ShardSpec:
    """Rows ``[row_start, row_end)`` of ``table``, stored on server ``server``."""

    table: TableSpec
    """The table this shard belongs to."""
    server: int
    """Index of the server holding it (0-based, in the client's server list)."""
    row_start: int
    """First global row id held."""
    row_end: int
    """One past the last global row id held."""

    @property
    def key(self) -> str:
        """Unique name of the shard: ``"<table>@<row_start>"``."""
        return f"{self.table.name}@{self.row_start}"

    @property
    def num_rows(self) -> int:
        """Rows held by this shard."""
        return self.row_end - self.row_start


def table_specs(configs: Iterable[Any]) -> list[TableSpec]:
    """Convert torchrec ``EmbeddingBagConfig``s (or :class:`TableSpec`s) into :class:`TableSpec`s.

    Raises:
        ValueError: a table name or a feature name appears twice, a size is not positive, or the pooling
            is neither SUM nor MEAN.
    """
    specs: list[TableSpec] = []
    for cfg in configs:
        if isinstance(cfg, TableSpec):
            specs.append(cfg)
            continue
        pooling = getattr(cfg, "pooling", "sum")
        pooling = str(getattr(pooling, "name", pooling)).lower()
        if pooling not in ("sum", "mean"):
            raise ValueError(f"table {cfg.name!r}: pooling {pooling!r} is not supported (use SUM or MEAN)")
        specs.append(TableSpec(cfg.name, int(cfg.num_embeddings), int(cfg.embedding_dim),
                               tuple(cfg.feature_names), pooling))  # type: ignore[arg-type]
    seen_tables: set[str] = set()
    seen_features: set[str] = set()
    for spec in specs:
        if spec.name in seen_tables:
            raise ValueError(f"table name {spec.name!r} appears twice")
        seen_tables.add(spec.name)
        if spec.num_embeddings <= 0 or spec.embedding_dim <= 0:
            raise ValueError(f"table {spec.name!r}: num_embeddings and embedding_dim must be positive, got "
                             f"{spec.num_embeddings} x {spec.embedding_dim}")
        if not spec.feature_names:
            raise ValueError(f"table {spec.name!r} has no feature_names")
        for feat in spec.feature_names:
            if feat in seen_features:
                raise ValueError(f"feature {feat!r} is looked up in two tables")
            seen_features.add(feat)
    return specs


def plan_shards(tables: Sequence[TableSpec], num_servers: int,
                sharding: Sharding | Mapping[str, Sharding] = "table_wise") -> list[ShardSpec]:
    """Place ``tables`` on ``num_servers`` servers.

    Table-wise: each whole table goes to the server with the fewest rows*dim so far (greedy, in declaration
    order, ties to the lower index). Row-wise: table rows are cut into ``num_servers`` contiguous blocks of
    ``ceil(num_embeddings / num_servers)`` rows, block ``i`` on server ``i`` (empty blocks are dropped).

    Args:
        tables: the tables, in declaration order.
        num_servers: how many servers (>= 1).
        sharding: one scheme for all tables, or a mapping table name -> scheme (missing tables: table-wise).

    Returns:
        The shards, in table order then server order; every global row belongs to exactly one shard.

    Raises:
        ValueError: ``num_servers < 1``, an unknown sharding scheme, or a dynamic table sharded row-wise
            (raw ids have no row ranges; dynamic tables are placed table-wise).
    """
    if num_servers < 1:
        raise ValueError(f"plan_shards: need at least one server, got num_servers={num_servers}")
    load = [0] * num_servers
    shards: list[ShardSpec] = []
    for table in tables:
        scheme = sharding.get(table.name, "table_wise") if isinstance(sharding, Mapping) else sharding
        if scheme == "table_wise":
            server = min(range(num_servers), key=lambda s: (load[s], s))
            shards.append(ShardSpec(table, server, 0, table.num_embeddings))
            load[server] += table.num_embeddings * table.embedding_dim
        elif scheme == "row_wise" and table.dynamic is not None:
            raise ValueError(f"table {table.name!r} is dynamic: it can only be placed table-wise")
        elif scheme == "row_wise":
            block = -(-table.num_embeddings // num_servers)
            for server in range(num_servers):
                lo, hi = server * block, min((server + 1) * block, table.num_embeddings)
                if lo < hi:
                    shards.append(ShardSpec(table, server, lo, hi))
                    load[server] += (hi - lo) * table.embedding_dim
        else:
            raise ValueError(f"table {table.name!r}: unknown sharding {scheme!r} (use 'table_wise' or 'row_wise')")
    return shards
