"""Run folders for the serving tests, written without a job (``write_model_dir`` of a small model), and the eager
references the served answers are compared with."""

from __future__ import annotations

from pathlib import Path

import torch

from jobs import criteo
from jobs.config import JobConfig
from jobs.launcher.model_export import write_model_dir
from jobs.table_sizes import reader_sizes
from recsys.criteo_format import parse_line
from tests.jobs.test_later_stages import TupleTwoTower
from tests.jobs.test_later_stages import _config as later_config

SMALL = {"table_size": 50, "bottom_mlp": [8], "top_mlp": [8], "embedding_dim": 4}
T_C1 = "sparse_arch.embedding_bag_collection.embedding_bags.t_C1"
ROWS = [  # Criteo lines (label, I1..I13, C1..C26): two with every field, one with empty fields
    "1\t5\t110\t\t16\t\t1\t0\t14\t7\t1\t\t306\t\t62770d79\te21f5d58\tafea442f\t945c7fcf\t38b02748\t6fcd6dcb\t3580aa21"
    "\t28808903\t46dedfa6\t2e027dc1\t0c7c4231\t95981d1f\t00c5ffb7\tbe4ee537\t8a0b74cc\t4cdc3efa\td20856aa\tb8170bba"
    "\t9512c20b\tc38e2f28\t14f65a5d\t25b1b089\td7c1fc0b\t7caf609c\t30436bfc\ted10571d",
    "0\t32\t3\t5\t\t1\t0\t0\t61\t5\t0\t1\t3157\t5\te5f3fd8d\ta0aaffa6\t6faa15d5\tda8a3421\t3cd69f23\t6fcd6dcb\tab16ed81"
    "\t43426c29\t1df5e154\t7de9c0a9\t6652dc64\t99eb4e27\t00c5ffb7\tbe4ee537\tf3bbfe99\t4cdc3efa\td20856aa\ta1eb1511"
    "\t9512c20b\tfebfd863\ta3323ca1\tc8e1ee56\t1752e9e8\t75350c8a\t991321ea\tb757e957",
    "0\t\t-1\t\t\t\t\t\t\t\t\t\t\t\t\t\t\t\t\t\t\t\t\t\t\t\t\t\t\t\t\t\t\t\t\t\t\t\t\t",
]


def dlrm_config(**model) -> JobConfig:
    """The bundled DLRM, small (50 rows a table, dim 4), tables in the trainers."""
    return JobConfig().replace(model={**SMALL, **model}, cluster={"parameter_servers": 0})


def dlrm_run(run: Path, step: int = 3) -> tuple[JobConfig, torch.nn.Module]:
    """A run folder of the bundled DLRM (random weights) at ``step``; the config and the eager model."""
    config = dlrm_config()
    model = criteo.dlrm(config).eval()
    run.mkdir(parents=True, exist_ok=True)
    write_model_dir(run, config, {"model": model.state_dict(), "tables": {}, "step": step, "phase": "optimized"})
    return config, model


def dynamic_run(run: Path, capacity: int = 8) -> tuple[JobConfig, torch.nn.Module, dict[int, int]]:
    """A run folder of the DLRM with dynamic tables (``capacity`` slots), where table ``t_C1`` maps the raw ids of
    :data:`ROWS`' first row to slot 5 and its second row's to slot 2 (the third row's C1 is missing, id 0: no row);
    the config, the eager model (tables by slot) and ``{raw id: slot}`` of ``t_C1``."""
    config = JobConfig().replace(model={**SMALL, "table_sizes": "dynamic", "dynamic_capacity": capacity},
                                 cluster={"parameter_servers": 1})
    model = criteo.dlrm(config).eval()
    sd = model.state_dict()
    tables = {k: sd.pop(k) for k in list(sd) if ".embedding_bags." in k}
    raw = [parse_line(r, reader_sizes(config))[1][0] for r in ROWS[:2]]
    slots = {raw[0]: 5, raw[1]: 2}
    for name in [k.removesuffix(".weight") for k in tables]:
        ids = torch.tensor(list(slots) if name == T_C1 else [], dtype=torch.int64)
        tables[f"{name}.dynamic"] = {"map_ids": ids, "map_slots": torch.tensor(
            list(slots.values()) if name == T_C1 else [], dtype=torch.int64)}
    run.mkdir(parents=True, exist_ok=True)
    write_model_dir(run, config, {"model": sd, "tables": tables, "step": 0, "phase": "optimized"})
    return config, model, slots


def two_tower_run(run: Path, monkeypatch, step: int = 7) -> torch.nn.Module:
    """A run folder of a user model returning a tuple (``tests.jobs.test_later_stages:tuple_two_tower``) with a
    sample input (no torch.export program: the export is refused, to keep the test quick); the eager model."""
    config = later_config("tuple_two_tower", "pairs")
    torch.manual_seed(11)
    model = TupleTwoTower().eval()
    sample = (torch.randint(0, 40, (4, 2)), torch.randint(0, 30, (4, 2)))

    def refused(*args, **kwargs):
        raise NotImplementedError("not exported in this test")

    monkeypatch.setattr(torch.export, "export", refused)
    run.mkdir(parents=True, exist_ok=True)
    write_model_dir(run, config, {"model": model.state_dict(), "tables": {}, "step": step, "phase": "optimized"},
                    sample=sample)
    monkeypatch.undo()
    return model


def dlrm_reference(config: JobConfig, model: torch.nn.Module, rows: list[str]) -> torch.Tensor:
    """The eager model's logits ``(B,)`` for Criteo ``rows``, parsed line by line with ``parse_line``."""
    parsed = [parse_line(r, reader_sizes(config)) for r in rows]
    dense = torch.tensor([p[0] for p in parsed], dtype=torch.float32)
    ids = torch.tensor([p[1] for p in parsed], dtype=torch.int64)
    with torch.no_grad():
        return model(dense, criteo.to_kjt(ids)).reshape(-1)
