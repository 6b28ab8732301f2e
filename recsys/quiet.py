"""Known noise of torch and Ray, dropped where it is made; every other line still shows.

Each filter names one message by a regular expression and applies where we call the API that makes it:

* :data:`FX_TRACING_NOTICE`: torch logs ``is_fx_tracing will return true for both fx.symbolic_trace and
  torch.export ...`` (logger ``torch.fx._symbolic_trace``, once per process) the first time anything asks
  ``torch.fx._symbolic_trace.is_fx_tracing()``; torchrec's ``KeyedJaggedTensor`` does on construction (its
  metaclass is torch.fx's ``ProxyableClassMeta``), so every process that builds a batch printed it. Importing
  :mod:`recsys` installs :func:`quiet_fx_tracing_notice` (a ``logging.Filter`` on that logger for that message).
* :data:`GLOO_AS_PROCESS_GROUP`: ``torch.distributed.rpc.init_rpc`` (TensorPipe) exchanges device maps over a
  ``ProcessGroupGloo`` it builds itself, and torch warns ``You are using a Backend ... as a ProcessGroup. This
  usage is deprecated since PyTorch 2.0`` in each member; :func:`rpc_init_warnings_filtered` ignores that
  ``UserWarning`` around our ``init_rpc`` calls (``scheduling.ps``).
* :data:`TENSORPIPE_SHUTDOWN`: when a member of an RPC group leaves, TensorPipe's C++ logging prints ``RPC agent
  for ps0 encountered error when reading incoming request from trainer: EOF: end of file`` (or ``pipe closed``)
  in every other member. :func:`filtered_stderr` passes this process's file descriptor 2 through a filter that
  drops those lines while a group is shut down (``scheduling.ps.lifecycle``; a server child runs its whole
  life in it). C++ errors, tracebacks and every other line are written on at once.
* :data:`RAY_TOKEN_AUTH_ENABLED`: Ray 2.60 warns ``Token authentication is enabled for this Ray cluster`` (logger
  ``ray._private.authentication.authentication_token_setup``) when ``ray.init()`` starts a local cluster;
  ``jobs.launcher.launch`` drops it with :func:`drop_log_records` for the cluster it starts itself (authentication stays on).

Source: Python ``logging.Filter``, ``warnings.catch_warnings``; POSIX ``dup2`` and ``pipe``.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import sys
import threading
import warnings
from collections.abc import Iterator

__all__ = ["FX_TRACING_NOTICE", "GLOO_AS_PROCESS_GROUP", "TENSORPIPE_SHUTDOWN", "RAY_TOKEN_AUTH_ENABLED",
           "RAY_TOKEN_AUTH_LOGGER", "drop_log_records", "quiet_fx_tracing_notice", "rpc_init_warnings_filtered",
           "filtered_stderr"]

FX_TRACING_NOTICE = r"^is_fx_tracing will return true for both fx\.symbolic_trace and torch\.export"
"""torch.fx's one-time notice on ``is_fx_tracing()`` (logger ``torch.fx._symbolic_trace``)."""

GLOO_AS_PROCESS_GROUP = (r"You are using a Backend <class '[\w.]*ProcessGroupGloo'> as a ProcessGroup\. "
                         r"This usage is deprecated since PyTorch 2\.0")
"""The ``UserWarning`` torch's ``init_rpc`` causes in each member (its own gloo group in an object collective)."""

TENSORPIPE_SHUTDOWN = re.compile(
    r"tensorpipe_agent\.cpp:\d+\] RPC agent for \S+ encountered error when reading incoming request from \S+: "
    r"(EOF: end of file|pipe closed)\b")
"""A line TensorPipe logs in each member of an RPC group when another one leaves it."""

RAY_TOKEN_AUTH_ENABLED = r"^Token authentication is enabled for this Ray cluster\."
"""Ray's warning when a local ``ray.init()`` turns token authentication on by default."""

RAY_TOKEN_AUTH_LOGGER = "ray._private.authentication.authentication_token_setup"
"""The logger of :data:`RAY_TOKEN_AUTH_ENABLED` (Ray 2.60)."""


class _Drop(logging.Filter):
    def __init__(self, pattern: str) -> None:
        super().__init__()
        self.pattern = pattern
        self._re = re.compile(pattern)

    def filter(self, record: logging.LogRecord) -> bool:
        return not self._re.search(record.getMessage())


def drop_log_records(logger_name: str, pattern: str) -> None:
    """Drop the records of logger ``logger_name`` whose message matches ``pattern`` (``re.search``); its other
    records pass. Installing the same pair again does nothing."""
    logger = logging.getLogger(logger_name)
    if not any(isinstance(f, _Drop) and f.pattern == pattern for f in logger.filters):
        logger.addFilter(_Drop(pattern))


def quiet_fx_tracing_notice() -> None:
    """Drop torch.fx's ``is_fx_tracing will return true ...`` notice (:data:`FX_TRACING_NOTICE`) in this process."""
    drop_log_records("torch.fx._symbolic_trace", FX_TRACING_NOTICE)


@contextlib.contextmanager
def rpc_init_warnings_filtered() -> Iterator[None]:
    """Around ``torch.distributed.rpc.init_rpc``: ignore torch's deprecation warning about its own gloo group
    (:data:`GLOO_AS_PROCESS_GROUP`); other warnings are shown as usual."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=GLOO_AS_PROCESS_GROUP, category=UserWarning)
        yield


def _write_all(fd: int, data: bytes) -> None:
    while data:
        data = data[os.write(fd, data):]


@contextlib.contextmanager
def filtered_stderr(noise: re.Pattern[str] = TENSORPIPE_SHUTDOWN) -> Iterator[None]:
    """Pass what this process writes to file descriptor 2 (Python's ``sys.stderr`` and C++ logging alike) through
    a thread that drops the lines matching ``noise`` and writes every other line on to the real stderr at once.

    Child processes started inside inherit the filter's pipe; leave it before they exit (or it waits for them at
    most 5 s on leaving). Where fd 2 cannot be redirected, runs the block unfiltered.
    """
    try:
        sys.stderr.flush()
        saved = os.dup(2)
    except (OSError, ValueError, AttributeError):
        yield
        return
    read_end, write_end = os.pipe()
    os.dup2(write_end, 2)
    os.close(write_end)

    def pump() -> None:
        with os.fdopen(read_end, "rb") as lines:
            for line in lines:
                if not noise.search(line.decode(errors="replace")):
                    _write_all(saved, line)

    thread = threading.Thread(target=pump, name="fxdist-stderr-filter", daemon=True)
    thread.start()
    try:
        yield
    finally:
        with contextlib.suppress(Exception):
            sys.stderr.flush()
        os.dup2(saved, 2)  # the pipe's last write end here: the pump sees its end
        thread.join(timeout=5)
        if not thread.is_alive():
            os.close(saved)
