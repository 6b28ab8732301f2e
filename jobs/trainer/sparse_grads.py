"""Sparse table gradients averaged across the trainers without DDP's sparse all-reduce.

``DistributedDataParallel`` all-reduces a sparse gradient (``nn.EmbeddingBag(sparse=True)``, the built-in DLRM's
tables with ``[cluster] parameter_servers = 0``) with gloo's sparse all-reduce, launched from an autograd hook
while backward is still running. With torch 2.13 on CPU that corrupts the heap: two trainers of torchrec's DLRM
(26 sparse tables, batch 128, 200-300 steps, no Ray) failed in 10 of 15 runs: glibc's ``malloc(): unaligned
tcache chunk detected``, a SIGSEGV, or a trainer gone and the other hung (26 ``nn.EmbeddingBag(sparse=True)``:
3 of 3 hung); with dense gradients, or with the sparse gradients all-reduced after backward on the training
thread, none of 6 failed (measured on a 2-core machine, November 2026).

So the trainer keeps those parameters out of DDP (:func:`sparse_parameters`, given to
``DistributedDataParallel._set_params_and_buffers_to_ignore_for_model``) and averages their gradients itself
after backward (:func:`average_sparse_grads`): one all-gather of the row counts, one of the row ids and one of
the rows, for every table at once, with dense tensors only (gloo's sparse all-reduce also fails when a trainer's
gradient has no row: pytorch/pytorch issue 87497). The result equals DDP's: the sum over trainers divided by
their number, as a coalesced sparse gradient.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import cast

import torch
import torch.distributed as dist
from torch import nn

__all__ = ["sparse_parameters", "average_sparse_grads", "data_parallel"]


def sparse_parameters(model: nn.Module) -> dict[str, nn.Parameter]:
    """``{name: parameter}`` of the embedding modules that give sparse gradients (``sparse=True``)."""
    found: dict[str, nn.Parameter] = {}
    for prefix, module in model.named_modules():
        if isinstance(module, (nn.Embedding, nn.EmbeddingBag)) and module.sparse and module.weight.requires_grad:
            found[f"{prefix}.weight" if prefix else "weight"] = cast(nn.Parameter, module.weight)  # stubs: Tensor
    return found


def _rows(param: nn.Parameter) -> tuple[torch.Tensor, torch.Tensor]:
    """(row ids ``(n,)`` int64, rows ``(n, D)``) of the parameter's sparse gradient (none when it has none)."""
    grad = param.grad
    if grad is None:
        return torch.empty(0, dtype=torch.long, device=param.device), param.new_zeros(0, *param.shape[1:])
    if not grad.is_sparse:
        raise TypeError(f"average_sparse_grads: a parameter of shape {tuple(param.shape)} has a dense gradient; "
                        "only sparse ones are averaged here")
    grad = grad.coalesce()
    return grad.indices()[0], grad.values()


def _gather(flat: torch.Tensor, counts: list[int], world: int, group: dist.ProcessGroup | None,
            ) -> list[torch.Tensor]:
    """Every trainer's ``flat`` (``counts[r]`` elements on trainer ``r``), through one padded all-gather."""
    longest = max(counts)
    padded = torch.cat([flat, flat.new_zeros(longest - flat.numel())])
    out = [torch.empty_like(padded) for _ in range(world)]
    dist.all_gather(out, padded, group=group)
    return [t[:n] for t, n in zip(out, counts)]


def average_sparse_grads(params: Sequence[nn.Parameter], group: dist.ProcessGroup | None = None) -> None:
    """Replace each parameter's sparse gradient by its mean over the trainers of ``group`` (every trainer calls
    this with the same parameters in the same order). A parameter without a gradient counts as a zero one.

    Shapes: a parameter ``(N, D)``; its gradient sparse with ``n`` rows on each trainer.

    Raises:
        TypeError: a parameter has a dense gradient.
    """
    world = dist.get_world_size(group)
    device = params[0].device                  # the tables' device: the collectives' (gloo: CPU, nccl: CUDA)
    rows = [_rows(p) for p in params]
    counts = torch.tensor([ids.numel() for ids, _ in rows], dtype=torch.long, device=device)
    all_counts = [torch.empty_like(counts) for _ in range(world)]
    dist.all_gather(all_counts, counts, group=group)
    widths = [max(1, p[0].numel()) for p in params]
    per_rank = [c.tolist() for c in all_counts]
    id_totals = [sum(c) for c in per_rank]
    row_totals = [sum(n * w for n, w in zip(c, widths)) for c in per_rank]
    ids = _gather(torch.cat([i.to(device) for i, _ in rows]), id_totals, world, group)
    values = _gather(torch.cat([v.reshape(-1).to(device) for _, v in rows]).float(), row_totals, world, group)
    for j, param in enumerate(params):
        parts_ids, parts_rows = [], []
        for r in range(world):
            before = sum(per_rank[r][:j])
            n = per_rank[r][j]
            start = sum(k * w for k, w in zip(per_rank[r][:j], widths[:j]))
            parts_ids.append(ids[r][before:before + n])
            parts_rows.append(values[r][start:start + n * widths[j]].view(n, *param.shape[1:]))
        index = torch.cat(parts_ids).unsqueeze(0)
        total = torch.sparse_coo_tensor(index, torch.cat(parts_rows).to(param.dtype), param.shape,
                                        check_invariants=True).coalesce()
        param.grad = total / world


def data_parallel(module: nn.Module, device: torch.device) -> tuple[nn.Module, Callable[[], None]]:
    """``(DistributedDataParallel(module) without its sparse tables, a function averaging their gradients)`` to
    call after each backward; ``(module, a no-op)`` when no process group of more than one trainer runs."""
    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        return module, lambda: None
    sparse = sparse_parameters(module)
    if sparse:
        nn.parallel.DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(module, list(sparse))
    ids = [device.index] if device.type == "cuda" else None
    params = list(sparse.values())
    return nn.parallel.DistributedDataParallel(module, device_ids=ids), (
        (lambda: average_sparse_grads(params)) if params else (lambda: None))
