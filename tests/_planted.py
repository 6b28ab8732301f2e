"""A hostile pickle for the tests of every loader that must not run code: :class:`Planted` unpickles as a call
of :func:`write_marker`, so a loader that runs what a file names leaves the marker file behind."""

from __future__ import annotations

from pathlib import Path


def write_marker(path: str) -> None:
    """What a full unpickle of :class:`Planted` calls: writes ``path``."""
    Path(path).write_text("code ran")


class Planted:
    """Pickles as a call of :func:`write_marker` (``__reduce__``): a full unpickle (``weights_only=False``, plain
    ``pickle.loads``) writes the marker file; a safe loader refuses it, naming ``tests._planted.write_marker``."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (write_marker, (str(self.marker),))
