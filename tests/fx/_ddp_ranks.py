"""Process bodies for the two-rank DDP tests of tests/fx/test_pipeline.py (``fxdist.optimize`` on a DDP module is a
collective): spawned processes, so these functions must be importable."""

from __future__ import annotations

import gc
import os
import time
from typing import Any

import torch
import torch.distributed as dist
from torch import nn


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))


def _finish(queue: Any, result: dict[str, Any]) -> None:
    """Report and leave at once: a gloo group after a failed barrier can hang in its destructor."""
    queue.put(result)
    queue.close()
    queue.join_thread()
    os._exit(0)


def rank_main(rank: int, store: str, calls: bool, delay_s: float, timeout_s: float, queue: Any) -> None:
    """Rank ``rank`` of 2 (gloo): wrap a small model in DDP, wait ``delay_s``, then (if ``calls``) run
    ``fxdist.optimize`` on it; reports what happened to ``queue``."""
    import fxdist

    result: dict[str, Any] = {"rank": rank}
    try:
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
        ddp = nn.parallel.DistributedDataParallel(_model())
        time.sleep(delay_s)
        if calls:
            start = time.monotonic()
            try:
                out = fxdist.optimize(ddp, passes=("dce",), ddp_timeout_s=timeout_s)
            except Exception as e:  # reported to the test
                result.update(error=type(e).__name__, message=str(e), seconds=time.monotonic() - start)
            else:
                result["seconds"] = time.monotonic() - start
                out(torch.randn(3, 4)).sum().backward()
                result["new_is_ddp"] = isinstance(out, nn.parallel.DistributedDataParallel)
                result["grad"] = out.module.get_submodule("0").weight.grad.tolist()
                try:
                    ddp(torch.randn(3, 4))
                except RuntimeError as e:
                    result["old_error"] = str(e)
                ddp = out = None
                gc.collect()
                dist.barrier()
        else:
            time.sleep(timeout_s + 3)
    except BaseException as e:  # anything else goes to the test too
        result.update(unexpected=f"{type(e).__name__}: {e}")
    _finish(queue, result)
