"""recsys.criteo_follow: a stream of Criteo files read as they appear: rows in order, exactly once, never wrapping;
a partial last line waits for its newline; new files picked up; ownership by line with 2 trainers; a restart at
batch s; the wait reported once per wait; held-out rows and the first pass over what is there."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from recsys.criteo_follow import FollowStream, follow_chunks, follow_files, held_out_rows, present_rows, scan_present
from recsys.criteo_format import DataError
from recsys.criteo_parse import parse_chunk
from tests.recsys._lines import SIZES, criteo_line


def _line(n: int) -> str:
    """Criteo line number ``n`` of the test stream: its 13 ints are ``n`` (dense = log1p(n)), label n % 2."""
    return criteo_line(str(n % 2), ints=[str(n)] * 13)


def _ids(batch) -> list[int]:
    """The line numbers of a batch's rows (inverting :func:`_line`'s dense = log1p(n))."""
    return torch.expm1(batch.dense[:, 0].double()).round().long().tolist()


class _Script:
    """Actions on the stream's folder, one per wait of the reader (``on_wait(True)`` or an injected ``sleep``),
    so the test runs the same interleaving of reads and writes every time, without threads or timing."""

    def __init__(self, actions: list[Callable[[], None]]) -> None:
        self.actions, self.calls = list(actions), 0

    def __call__(self, *args: object) -> None:
        self.calls += 1
        if self.actions:
            self.actions.pop(0)()


def _append(path: Path, text: str) -> Callable[[], None]:
    def act() -> None:
        with path.open("a") as f:
            f.write(text)
    return act


class _Stop(Exception):
    pass


def _stop() -> None:
    raise _Stop


def _chunk_ids(buf: bytes) -> list[int]:
    parsed = parse_chunk(buf)
    return torch.expm1(torch.from_numpy(parsed.dense[:, 0]).double()).round().long().tolist()


def test_partial_lines_wait_new_files_are_picked_up_each_line_once_in_order(tmp_path):
    day0, day1 = tmp_path / "day_0", tmp_path / "day_1"
    day0.write_text("".join(_line(n) for n in range(5)) + _line(5)[:40])       # line 5 half written
    script = _Script([
        _append(day0, _line(5)[40:]),                                          # line 5 complete
        _append(day0, _line(6)[:30]),                                          # half of line 6: waits
        lambda: (_append(day0, _line(6)[30:-1])(), day1.write_text(_line(7))),  # no '\n', but a later file: done
        _append(day1, _line(8) + _line(9)),
        _stop,
    ])
    seen, markers = [], 0
    with pytest.raises(_Stop):
        for item in follow_chunks(tmp_path, poll_s=0.0, sleep=script, chunk_bytes=300):
            if item is None:
                markers += 1
            else:
                seen += _chunk_ids(item[1])
    assert seen == list(range(10))  # in order, each once, line 6's missing newline tolerated once day_1 came
    assert (markers, script.calls) == (4, 5)  # 5 polls; half of line 6 is no new line: that wait goes on


def test_a_wait_is_reported_once_not_per_poll(tmp_path):
    (tmp_path / "day_0").write_text(_line(0))
    polls = _Script([lambda: None, lambda: None, _append(tmp_path / "day_0", _line(1)), lambda: None, _stop])
    items = []
    with pytest.raises(_Stop):
        for item in follow_chunks(tmp_path, poll_s=0.0, sleep=polls):
            items.append(item)
    assert [i is None for i in items] == [False, True, False, True]  # 5 polls, 2 waits
    assert polls.calls == 5


def test_no_file_yet_waits_and_a_file_that_arrives_out_of_order_is_refused(tmp_path):
    script = _Script([lambda: (tmp_path / "day_2").write_text(_line(0)), lambda: None,
                      lambda: (tmp_path / "day_1").write_text(_line(1))])
    stream = follow_chunks(tmp_path, poll_s=0.0, sleep=script)
    assert next(stream) is None  # nothing there: the reader waits
    assert _chunk_ids(next(stream)[1]) == [0]
    assert next(stream) is None
    with pytest.raises(DataError, match="day_1: arrived after a file that sorts after it"):
        next(stream)


def test_follow_needs_a_folder_or_a_glob(tmp_path):
    (tmp_path / "f.tsv").write_text(_line(0))
    with pytest.raises(DataError, match="must be a folder or a glob"):
        follow_files(tmp_path / "f.tsv")
    with pytest.raises(DataError, match="must be a folder or a glob"):
        follow_files(tmp_path / "missing")
    assert follow_files(tmp_path / "*.gz") == []
    assert follow_files(tmp_path / "*.tsv") == [tmp_path / "f.tsv"]


def _stream_folder(tmp_path: Path) -> tuple[Path, list[Callable[[], None]]]:
    """day_0 with lines 0..36 now; then its lines 37..59 (the last in two halves), day_1 (60..99), day_10 (100..129)."""
    tmp_path.mkdir(exist_ok=True)
    day0 = tmp_path / "day_0"
    day0.write_text("".join(_line(n) for n in range(37)))
    rest = "".join(_line(n) for n in range(37, 59)) + _line(59)
    return tmp_path, [
        _append(day0, rest[:-20]),
        _append(day0, rest[-20:]),
        lambda: (tmp_path / "day_1").write_text("".join(_line(n) for n in range(60, 100))),
        lambda: (tmp_path / "day_10").write_text("".join(_line(n) for n in range(100, 130))),
    ]


def _training_ids(rank: int, world: int, every: int) -> list[int]:
    """Line numbers of ``rank``'s training rows of :func:`_stream_folder`: held out ``i % every == every - 1`` in
    each file, the rest dealt round-robin by their index among the file's training lines."""
    out = []
    for lines in (range(60), range(60, 100), range(100, 130)):
        train = [n for i, n in enumerate(lines) if not every or i % every != every - 1]
        out += [n for t, n in enumerate(train) if t % world == rank]
    return out


@pytest.mark.parametrize("world", [1, 2])
def test_stream_batches_in_order_exactly_once_without_wrapping_and_by_line_with_two_trainers(tmp_path, world):
    per_rank = {}
    for rank in range(world):
        _, actions = _stream_folder(tmp_path / f"r{rank}")  # each trainer reads its own copy, written as it waits
        script = _Script(actions)
        stream = FollowStream(tmp_path / f"r{rank}", SIZES, rank=rank, world_size=world, every=10, workers=0,
                              poll_s=0.0, on_wait=lambda waiting, s=script: s() if waiting else None)
        want = _training_ids(rank, world, 10)
        batches = stream.batches(8)
        per_rank[rank] = [n for _ in range(len(want) // 8) for n in _ids(next(batches))]
        assert per_rank[rank] == want[: len(want) // 8 * 8]
        assert stream.waits >= 2 and not stream.waiting and len(stream) == 0
    if world == 2:  # the trainers' rows are disjoint, and their counts differ by at most one per file
        assert not set(per_rank[0]) & set(per_rank[1])
        assert abs(len(_training_ids(0, 2, 10)) - len(_training_ids(1, 2, 10))) <= 3


def test_a_restart_at_batch_s_sees_the_batches_of_an_uninterrupted_stream(tmp_path):
    _, actions = _stream_folder(tmp_path)
    for act in actions:  # everything written: the restarted reader reads the files again from the first
        act()
    uninterrupted = FollowStream(tmp_path, SIZES, every=10, workers=0).batches(16)
    first = [_ids(next(uninterrupted)) for _ in range(7)]
    for start in (1, 4, 6):
        resumed = FollowStream(tmp_path, SIZES, every=10, workers=0).batches(16, start=start)
        assert [_ids(next(resumed)) for _ in range(7 - start)] == first[start:]
    assert [n for b in first for n in b] == _training_ids(0, 1, 10)[:112]  # no wrap-around: 117 rows in all


def test_a_worker_process_gives_the_same_batches(tmp_path):
    _, actions = _stream_folder(tmp_path)
    script = _Script(actions)
    stream = FollowStream(tmp_path, SIZES, every=10, workers=3, poll_s=0.01,
                          on_wait=lambda waiting: script() if waiting else None)
    try:
        batches = stream.batches(10)
        got = [n for _ in range(11) for n in _ids(next(batches))]
        assert got == _training_ids(0, 1, 10)[:110]
        assert stream.stats()["workers"] == 1 and stream.waits >= 1  # capped at one worker process
    finally:
        stream.close()


def test_held_out_rows_and_first_pass_take_the_complete_lines_there_now(tmp_path):
    _, actions = _stream_folder(tmp_path)
    actions[0]()  # day_0 holds 59 complete lines and half of line 59
    held = held_out_rows(tmp_path, SIZES, 10, 100)
    assert held is not None and torch.expm1(held.dense[:, 0].double()).round().long().tolist() == [9, 19, 29, 39, 49]
    assert [b.labels.shape[0] for b in held.all_batches(2)] == [2, 2, 1]
    assert held_out_rows(tmp_path, SIZES, 10, 3) is not None and len(held_out_rows(tmp_path, SIZES, 10, 3)) == 3
    assert held_out_rows(tmp_path, SIZES, 0, 100) is None
    plan = scan_present(tmp_path, 2, 0.1)
    assert (plan.lines, plan.eval_rows, plan.rows, plan.sharding) == (59, 5, [27, 27], "by line (follow)")
    assert plan.files == [str(tmp_path / "day_0")]
    empty = scan_present(tmp_path / "*.gz", 2, 0.1)
    assert (empty.files, empty.rows, empty.lines) == ([], [0, 0], 0)


def test_present_rows_take_the_complete_lines_of_either_split_never_a_half_written_last_line(tmp_path):
    (tmp_path / "day_0").write_text("".join(_line(n) for n in range(20)))
    (tmp_path / "day_1").write_text("".join(_line(n) for n in range(20, 33)) + _line(33)[:-9])  # 33: half written
    line_ids = lambda rows: torch.expm1(rows.dense[:, 0].double()).round().long().tolist()  # noqa: E731
    train = present_rows(tmp_path, SIZES, 10, 1000, split="train")
    assert train is not None and line_ids(train) == [n for n in range(20) if n % 10 != 9] + list(range(20, 29)) + [
        30, 31, 32]  # day_1's held-out line is its 10th (29); 33 is not there yet
    assert line_ids(present_rows(tmp_path, SIZES, 10, 1000, split="eval")) == [9, 19, 29]
    assert line_ids(present_rows(tmp_path, SIZES, 0, 1000, split="train")) == list(range(33))  # nothing held out
    assert present_rows(tmp_path, SIZES, 0, 1000, split="eval") is None
    assert line_ids(present_rows(tmp_path, SIZES, 10, 5, split="train", chunk_bytes=200)) == [0, 1, 2, 3, 4]
    assert present_rows(tmp_path / "*.gz", SIZES, 10, 5) is None  # no file yet
    (tmp_path / "day_1").write_text((tmp_path / "day_1").read_text() + _line(33)[-9:])
    assert line_ids(present_rows(tmp_path, SIZES, 0, 1000, split="train"))[-1] == 33  # complete now
    with pytest.raises(ValueError, match="split must be 'train' or 'eval'"):
        present_rows(tmp_path, SIZES, 10, 5, split="test")
