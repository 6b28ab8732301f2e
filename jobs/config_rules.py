"""The config checks between keys that concern one feature each (:meth:`jobs.config.JobConfig.validate` calls
them and raises ``ConfigError`` with the config file's name in front of each message): the table optimizer keys and
``[model] plan`` (:func:`train_errors`), dynamic tables (:func:`dynamic_errors`), training from a stream
(:func:`follow_errors`), and what a job serves to the network: the metrics exporters (:func:`exposure_errors`) and,
once the launcher knows the job runs on a cluster, the ``torch_rpc`` transport (:func:`torch_rpc_error`).

Source: the ``[model]`` / ``[train]`` / ``[cluster]`` / ``[metrics]`` keys of :mod:`jobs.config`; prometheus
client_python's ``start_http_server`` (``certfile``, ``keyfile``, ``client_cafile``, ``client_auth_required``); the
PyTorch documentation of ``torch.distributed.rpc`` and ``TCPStore`` (no authentication).
"""

from __future__ import annotations

from typing import Any

from jobs.cluster import is_loopback

__all__ = ["train_errors", "dynamic_errors", "exposure_errors", "torch_rpc_error", "follow_errors"]


def train_errors(t: Any, plan: dict, user_model: bool = True) -> list[str]:
    """The optimizer keys and ``[model] plan`` ("local" only for your model: the built-in DLRM's tables are made on
    the servers, the meta device on the trainers); a ``"pkg.mod:fn"`` optimizer is resolved by preflight."""
    import torch

    errors = []
    name = t.optimizer.removeprefix("torch.optim.")
    if ":" not in name and not (isinstance(getattr(torch.optim, name, None), type)
                                and issubclass(getattr(torch.optim, name), torch.optim.Optimizer)):
        errors.append(f"[train] optimizer = {t.optimizer!r}: not a torch.optim class (e.g. \"Adam\") or "
                      "\"package.module:function\"")
    if t.table_optimizer not in ("rowwise_adagrad", "adagrad", "sgd"):
        errors.append(f'[train] table_optimizer = {t.table_optimizer!r}: must be "rowwise_adagrad", "adagrad" or '
                      '"sgd" (the optimizers the parameter servers run)')
    if t.table_grad_reduction not in ("mean", "sum"):
        errors.append(f'[train] table_grad_reduction = {t.table_grad_reduction!r}: must be "mean" or "sum"')
    for table, how in plan.items():
        if how not in ("table_wise", "row_wise", "local") and not (isinstance(how, int) and how >= 0):
            errors.append(f'[model] plan: {table} = {how!r}: must be "table_wise", "row_wise", "local" or a server index')
        elif how == "local" and not user_model:
            errors.append(f'[model] plan: {table} = "local": only your model\'s tables ([model] factory) can stay on '
                          "the trainers; for the built-in DLRM's set [cluster] parameter_servers = 0")
    return errors


def dynamic_errors(m: Any, c: Any, user_model: bool) -> list[str]:
    """``[model] table_sizes = "dynamic"``: the built-in DLRM's 26 tables as collisionless dynamic tables on the
    parameter servers, so it needs servers (``[cluster] parameter_servers >= 1``), the built-in model (your
    model's tables are yours to declare: the ``parameter_servers`` pass's ``dynamic=``), and table-wise placement
    (raw ids have no row ranges: no ``"row_wise"`` in ``[model] plan``). ``m``, ``c``: the ``[model]`` and
    ``[cluster]`` sections; ``dynamic_capacity`` and the other ``dynamic_*`` keys are range-checked with every key."""
    if m.table_sizes != "dynamic":
        return []
    errors = []
    if c.parameter_servers < 1:
        errors.append('[model] table_sizes = "dynamic" needs [cluster] parameter_servers >= 1 (dynamic tables live on '
                      "the parameter servers; got parameter_servers = 0)")
    if user_model:
        errors.append('[model] table_sizes = "dynamic" is for the built-in DLRM, not [model] factory = '
                      f'{m.factory!r}: declare your dynamic tables with the parameter_servers pass\'s dynamic= argument')
    rows = [t for t, how in m.plan.items() if how == "row_wise"]
    if rows:
        errors.append(f'[model] plan: {rows[0]} = "row_wise": dynamic tables ([model] table_sizes = "dynamic") are '
                      "placed table-wise only (raw ids have no row ranges)")
    return errors


def exposure_errors(m: Any) -> list[str]:
    """The ``[metrics]`` section ``m``: a ``host`` other than loopback (``"node"``, ``"0.0.0.0"``, an address or a
    name) serves every exporter's metrics to the network, without authentication unless TLS with client certificates
    is on, so it needs ``expose = true``; ``certfile`` and ``keyfile`` go together, ``client_cafile`` needs them, and
    ``client_auth_required`` needs ``client_cafile``. (HTTP basic auth is not offered: ``start_http_server`` has none.)"""
    if not m.enabled:
        return []
    errors = []
    if not is_loopback(m.host) and not m.expose:
        errors.append(f"[metrics] host = {m.host!r} is not a loopback address: every trainer and server would serve its "
                      "metrics to the network, to anyone who connects; set [metrics] expose = true to allow it (and "
                      "consider certfile/keyfile and client_cafile with client_auth_required = true: HTTPS with client "
                      'certificates), or keep host = "127.0.0.1"')
    if bool(m.certfile) != bool(m.keyfile):
        errors.append("[metrics] certfile and keyfile go together (HTTPS needs the certificate and its key); got "
                      f"certfile = {m.certfile!r}, keyfile = {m.keyfile!r}")
    if m.client_cafile and not m.certfile:
        errors.append("[metrics] client_cafile needs certfile and keyfile: client certificates are checked over HTTPS")
    if m.client_auth_required and not m.client_cafile:
        errors.append("[metrics] client_auth_required = true needs client_cafile (the CA that signs the scrapers' "
                      "certificates)")
    return errors


def torch_rpc_error(c: Any, on_cluster: bool) -> str | None:
    """Why the ``[cluster]`` section ``c`` may not run on a cluster (``on_cluster``: the launcher's rule), or None:
    ``transport = "torch_rpc"`` with parameter servers needs ``allow_unauthenticated = true`` there, since
    ``torch.distributed.rpc`` authenticates nobody and its rendezvous store (a ``TCPStore``) listens on every
    interface, so any host that reaches the nodes could join the group or call the servers."""
    if not on_cluster or c.transport != "torch_rpc" or not c.parameter_servers or c.allow_unauthenticated:
        return None
    return ('[cluster] transport = "torch_rpc" on a Ray cluster: torch.distributed.rpc has no authentication, and its '
            "rendezvous store listens on every interface of trainer rank 0's node, so anyone on the network could "
            'join the group or call the parameter servers. Use transport = "socket" (authenticated connections) or '
            '"ray", or set [cluster] allow_unauthenticated = true if the network is trusted and you accept the risk')


def follow_errors(d: Any, table_sizes: Any) -> list[str]:
    """``[data] follow`` (training from a stream, :mod:`recsys.criteo_follow`): it reads the Criteo files of a folder or
    glob ``[data] path`` as they appear, so it needs such a path (not "", not a file: synthetic data and the shared
    sample are files of a fixed size), the Criteo reader (not ``[data] batches``), and table sizes that do not come
    from a first pass over all the data (``[model] table_sizes = "data"``). ``d``: the ``[data]`` section."""
    if not d.follow:
        return []
    from pathlib import Path

    errors = []
    if d.batches:
        errors.append(f"[data] follow = true reads Criteo files as they appear; it cannot follow [data] batches = "
                      f"{d.batches!r} (your batches): set follow = false, or use the Criteo reader")
    if not d.path.strip():
        errors.append('[data] follow = true needs [data] path = a folder or a glob of Criteo files (e.g. "stream/" or '
                      '"stream/part-*.tsv"), not "" (synthetic data or the shared sample)')
    elif not any(c in d.path for c in "*?[") and Path(d.path).expanduser().is_file():
        errors.append(f"[data] follow = true needs [data] path = a folder or a glob of Criteo files, not the file "
                      f"{d.path!r}: new files arrive in a folder")
    if table_sizes == "data":
        errors.append('[data] follow = true with [model] table_sizes = "data": the sizes come from a first pass over '
                      'all the data, which a stream does not have; use "uniform", "dynamic" or a list of 26 sizes')
    return errors
