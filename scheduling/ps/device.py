"""Rows between CPU parameter servers and a trainer on any device.

The servers and the RPC group are CPU-only (TensorPipe refuses CUDA tensors without device maps), while
the trainer's dense layers may run on a GPU (the hybrid layout of Persia, Monolith and HugeCTR's parameter
server). So everything the client sends is first copied to the host (:func:`to_host`), and every lookup's
rows are brought to the trainer's device by :class:`Lookup`:

* on the CPU it only decodes the answer (FBGEMM fused 8-bit rows -> float32) when waited;
* on CUDA, as soon as the answer arrives (a callback of the transport's Future, on the RPC thread), it is
  decoded, copied into pinned host memory and sent to the device with a ``non_blocking`` copy on a side
  CUDA stream; waiting the lookup makes the caller's current stream wait for that copy (an event), so the
  host-to-device copy of a prefetched batch overlaps the step that runs meanwhile, as the copy stage of
  torchrec's ``TrainPipelineSparseDist`` does. A transport whose Future has no callbacks (Ray) copies when
  the lookup is waited.

Errors keep their class: a server's ``ValueError`` is raised by :meth:`Lookup.wait` as it was raised there
(``torch.futures.Future.then`` would wrap it in a ``RuntimeError``).
"""

from __future__ import annotations

import threading
from typing import Any

import torch

__all__ = ["to_host", "Lookup", "RowCopyError", "decode"]


class RowCopyError(RuntimeError):
    """Bringing a lookup's rows to the trainer's device failed (decoding, pinning or the copy itself).

    See docs/troubleshooting.md#rowcopyerror.
    """


def to_host(t: Any) -> Any:
    """``t`` on the CPU (detached), unchanged when it is not a tensor or already there (no copy)."""
    if isinstance(t, torch.Tensor) and t.device.type != "cpu":
        return t.detach().to("cpu")
    return t


def decode(rows: torch.Tensor, compress: str | None) -> torch.Tensor:
    """A lookup's answer as float32 ``(B, D)``: FBGEMM's fused 8-bit rows dequantized when ``compress``."""
    if compress == "fused8bit":
        import fbgemm_gpu  # noqa: F401  (registers torch.ops.fbgemm)

        return torch.ops.fbgemm.Fused8BitRowwiseQuantizedToFloat(rows)
    return rows


_STREAMS: dict[torch.device, Any] = {}
_STREAMS_LOCK = threading.Lock()


def _side_stream(device: torch.device) -> Any:
    """One side CUDA stream per device for the rows' host-to-device copies."""
    with _STREAMS_LOCK:
        if device not in _STREAMS:
            _STREAMS[device] = torch.cuda.Stream(device)
        return _STREAMS[device]


class _OnDevice:
    """Rows copied to a CUDA device on the side stream, with the event that marks the copy's end."""

    def __init__(self, rows: torch.Tensor, device: torch.device) -> None:
        stream = _side_stream(device)
        pinned = rows.pin_memory()
        with torch.cuda.stream(stream):
            self.rows = pinned.to(device, non_blocking=True)
            self.event = torch.cuda.Event()
            self.event.record(stream)

    def take(self) -> torch.Tensor:
        """The rows, once the caller's current stream has waited the copy (and owns the memory)."""
        current = torch.cuda.current_stream(self.rows.device)
        current.wait_event(self.event)
        self.rows.record_stream(current)
        return self.rows


def _copy_error(err: Exception, device: torch.device) -> RowCopyError:
    copy = RowCopyError(f"copying a lookup's rows to {device} failed: {type(err).__name__}: {err}")
    copy.__cause__ = err
    return copy


class Lookup:
    """A lookup in flight, waited like a ``torch.futures.Future``; its value is the rows on ``device``.

    Args:
        future: the transport's Future (``torch.futures.Future`` or any object with ``wait()``/``done()``).
        device: where the rows go (CPU: decoded only; CUDA: pinned, ``non_blocking`` copy on a side stream).
        compress: the answer's encoding (:func:`decode`).
        index: the rows are element ``index`` of the Future's tuple value (a push that carried the lookup).
    """

    def __init__(self, future: Any, device: torch.device, compress: str | None = None,
                 index: int | None = None) -> None:
        self.future, self.device, self.compress, self.index = future, device, compress, index
        self._lock = threading.Lock()
        self._staged: Any = None
        self._error: BaseException | None = None
        if device.type == "cuda" and hasattr(future, "add_done_callback"):
            future.add_done_callback(self._arrived)

    def _stage(self, value: Any) -> Any:
        rows = decode(value if self.index is None else value[self.index], self.compress)
        return _OnDevice(rows, self.device) if self.device.type == "cuda" else rows.to(self.device)

    def _arrived(self, future: Any) -> None:
        with self._lock:
            if self._staged is not None or self._error is not None:
                return
            try:
                value = future.value()
            except BaseException:  # noqa: BLE001  (wait() raises the transport's error as it is)
                return
            try:
                self._staged = self._stage(value)
            except Exception as e:  # noqa: BLE001  (raised by wait(), in the caller's thread)
                self._error = _copy_error(e, self.device)

    def wait(self) -> torch.Tensor:
        """The rows ``(B, D)`` float32 on ``device``.

        Raises:
            RuntimeError: the transport failed; the server's own exception as raised there.
            RowCopyError: the rows could not be decoded or copied to ``device`` (the cause is chained).
        """
        value = self.future.wait()
        with self._lock:
            if self._staged is None and self._error is None:
                try:
                    self._staged = self._stage(value)
                except Exception as e:  # noqa: BLE001
                    self._error = _copy_error(e, self.device)
            if self._error is not None:
                raise self._error
            staged = self._staged
        return staged.take() if isinstance(staged, _OnDevice) else staged

    def done(self) -> bool:
        return self.future.done()
