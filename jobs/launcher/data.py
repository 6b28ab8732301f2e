"""Where a job's Criteo data comes from: the configured ``[data] path``, else the shared Criteo sample, else
synthetic data written into the run folder.

The format, the checks of a data file and the readers are :mod:`recsys`'s (:mod:`recsys.criteo_format`,
:mod:`recsys.criteo_shard`, :mod:`recsys.criteo_stream`; the generator :mod:`recsys.criteo_synth`); this module
holds what is about the job: its config key and its run folder.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from recsys.criteo_follow import follow_files
from recsys.criteo_format import DataError, check_data_file, data_files
from recsys.criteo_synth import write_synthetic_criteo
from recsys.shared_data import default_criteo_path  # the shared Criteo sample (re-exported)

__all__ = ["locate_data", "default_criteo_path", "resolve_data_path"]


def locate_data(configured: str, table_size: int | Sequence[int] = 20000, *, follow: bool = False) -> Path | None:
    """The job's data, checked (:func:`recsys.criteo_format.check_data_file`, on each file of a directory or glob): the
    configured path, else the shared Criteo sample when present; None when synthetic data has to be generated.
    With ``follow`` (``[data] follow``, a stream: :mod:`recsys.criteo_follow`) the configured folder or glob, which
    may hold no file yet; its files are not checked here (the last one may be half written).

    Raises:
        DataError: the configured data (or the shared sample) cannot be used; the message names the key.
    """
    if configured:
        where = f"[data] path = {configured!r}"
        path = Path(configured).expanduser()
        if follow:
            try:
                follow_files(configured)
            except DataError as e:
                raise DataError(f"{where}: {str(e).removeprefix(f'{configured}: ')}") from None
            return path
        try:
            files = data_files(configured)
        except DataError as e:
            reason = str(e).removeprefix(f"{path}: ").removeprefix(f"{configured}: ")
            raise DataError(f"{where}: {reason}") from None
        for file in files:
            check_data_file(file, table_size, where=where if files == [path] else f"{where}: {file}")
        return path
    shared = default_criteo_path()
    if shared.is_file():
        check_data_file(shared, table_size, where=f"the shared Criteo sample {shared}")
        return shared
    return None


def resolve_data_path(configured: str, run_dir: Path, synthetic_rows: int, *, seed: int = 0,
                      table_size: int = 20000) -> tuple[Path, str]:
    """Find the job's data: the configured path, else the shared Criteo sample, else synthetic data
    (written into ``run_dir``).

    Returns:
        (path, note): ``note`` says where the data came from, for the log and the report.

    Raises:
        DataError: ``configured`` is set but cannot be used (see :func:`locate_data`).
    """
    path = locate_data(configured, table_size)
    if path is not None:
        return path, (f"Criteo data from {path}" if configured else f"Criteo sample from {path}")
    shared = default_criteo_path()
    path = run_dir / "synthetic_criteo.tsv"
    write_synthetic_criteo(path, synthetic_rows, seed=seed)
    return path, (
        f"no Criteo data found (looked for {shared}; set [data] path to use your own); "
        f"generated {synthetic_rows} rows of synthetic Criteo-format data at {path}"
    )
