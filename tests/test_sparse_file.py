"""What a node holds of a file copied in part: byte-range sets, a GGUF file's pieces, and
the record of the ranges present (tables; pure but for the record's round trip on disk)."""

from __future__ import annotations

import pytest

from shardline.models.byte_ranges import added, covers, merged, missing, total
from shardline.models.file_pieces import HEADER_PIECE, Piece, check_pieces, piece_bounds
from shardline.models.sparse_file import SparseRecord, read_record, record_path, write_record

pytestmark = pytest.mark.fast

SHA = "a" * 64


@pytest.mark.parametrize(
    "ranges, expected",
    [
        ([], []),
        ([(0, 0), (5, 5)], []),
        ([(4, 8), (0, 2)], [(0, 2), (4, 8)]),
        ([(0, 4), (4, 8)], [(0, 8)]),  # touching ranges join
        ([(0, 5), (3, 8), (10, 12)], [(0, 8), (10, 12)]),
        ([(2, 9), (3, 4)], [(2, 9)]),  # one inside another
    ],
)
def test_ranges_merge(ranges, expected):
    assert merged(ranges) == expected


@pytest.mark.parametrize("bad", [(5, 4), (-1, 3)])
def test_a_range_that_is_none_is_refused(bad):
    with pytest.raises(ValueError):
        merged([bad])


@pytest.mark.parametrize(
    "held, wanted, expected",
    [
        ([], (0, 1), False),
        ([], (3, 3), True),  # nothing wanted
        ([(0, 10)], (0, 10), True),
        ([(0, 10)], (5, 11), False),
        ([(0, 5), (5, 10)], (2, 8), True),  # held in two ranges that touch
        ([(0, 5), (6, 10)], (2, 8), False),  # a gap of one byte
    ],
)
def test_covers(held, wanted, expected):
    assert covers(held, wanted) is expected


@pytest.mark.parametrize(
    "wanted, held, expected",
    [
        ([(0, 10)], [], [(0, 10)]),
        ([(0, 10)], [(0, 10)], []),
        ([(0, 10)], [(2, 4), (6, 7)], [(0, 2), (4, 6), (7, 10)]),
        ([(0, 4), (8, 12)], [(3, 9)], [(0, 3), (9, 12)]),
        ([(5, 6)], [(0, 5), (6, 9)], [(5, 6)]),
        ([(0, 10), (20, 30)], [(0, 100)], []),
    ],
)
def test_missing(wanted, held, expected):
    assert missing(wanted, held) == expected
    assert not any(covers(held, r) for r in expected)  # none of it held
    assert total(expected) + total(missing(wanted, expected)) == total(wanted)


def test_total_and_added():
    assert total([(0, 4), (2, 6), (10, 11)]) == 7
    assert added([(0, 4)], (4, 6)) == [(0, 6)]


@pytest.mark.parametrize(
    "tensors, size, expected",
    [
        # header before the first tensor; each tensor runs to the next one's start (its padding)
        ([("a", 100, 30), ("b", 132, 8)], 140, [(HEADER_PIECE, 0, 100), ("a", 100, 132), ("b", 132, 140)]),
        # the file's order is the offsets', not the table's
        ([("b", 132, 8), ("a", 100, 30)], 150, [(HEADER_PIECE, 0, 100), ("a", 100, 132), ("b", 132, 150)]),
        ([], 64, [(HEADER_PIECE, 0, 64)]),
    ],
)
def test_pieces_tile_the_file(tensors, size, expected):
    bounds = piece_bounds(tensors, size)
    assert bounds == expected
    assert all(end == start for (_, _, end), (_, start, _) in zip(bounds, bounds[1:]))
    assert merged((s, e) for _, s, e in bounds) == [(0, size)]


@pytest.mark.parametrize(
    "tensors, size",
    [
        ([("a", 100, 40), ("b", 132, 8)], 140),  # a runs into b
        ([("a", 100, 50)], 140),  # past the file's end
        ([("a", 100, 1), ("a", 110, 1)], 140),  # a name twice
        ([(HEADER_PIECE, 100, 1)], 140),
    ],
)
def test_pieces_of_a_bad_table_are_refused(tensors, size):
    with pytest.raises(ValueError):
        piece_bounds(tensors, size)


def piece(name, offset, size, sha=SHA) -> dict:
    return {"name": name, "offset": offset, "size": size, "sha256": sha}


@pytest.mark.parametrize(
    "pieces, size, error",
    [
        ([piece("h", 0, 10), piece("a", 10, 5)], 15, None),
        ([piece("h", 0, 10), piece("a", 11, 4)], 15, "start at byte 10"),  # a gap
        ([piece("h", 0, 10), piece("a", 8, 7)], 15, "start at byte 10"),  # an overlap
        ([piece("h", 0, 10)], 15, "end at byte 10"),  # short of the file
        ([piece("h", 0, 10), piece("h", 10, 5)], 15, "repeats"),
        ([piece("h", 0, 15, sha="xyz")], 15, "64 hex"),
        ([{"name": "h", "offset": 0, "size": 15}], 15, "keys"),
        ([], 0, "non-empty"),
        ([piece("h", 0, True)], 1, "start at"),  # a bool is no byte count
    ],
)
def test_a_manifests_pieces_must_tile_its_file(pieces, size, error):
    if error is None:
        assert check_pieces(pieces, size) == [Piece(**p) for p in pieces]
    else:
        with pytest.raises(ValueError, match=error):
            check_pieces(pieces, size)


def test_a_record_gains_pieces_until_the_file_is_whole():
    record = SparseRecord(SHA, 100)
    assert not record.complete and record.present_bytes == 0
    steps = [  # (what happens, present after, writing after, complete)
        (lambda r: r.holding((0, 10)), ((0, 10),), None, False),
        (lambda r: r.writing_to(50, 60), ((0, 10),), (50, 60), False),
        (lambda r: r.holding((50, 100)), ((0, 10), (50, 100)), None, False),
        (lambda r: r.writing_to(10, 20), ((0, 10), (50, 100)), (10, 20), False),
        (lambda r: r.not_writing(), ((0, 10), (50, 100)), None, False),
        (lambda r: r.holding((10, 50)), ((0, 100),), None, True),
    ]
    for step, present, writing, complete in steps:
        record = step(record)
        assert (record.present, record.writing, record.complete) == (present, writing, complete)
    assert record.holds((20, 80)) and record.present_bytes == 100


@pytest.mark.parametrize(
    "text, expected",
    [
        (None, None),  # no record: a whole file (or none)
        (
            '{"sha256": "%s", "size": 9, "present": [[4, 9], [0, 2]], "writing": [2, 3]}' % SHA,
            SparseRecord(SHA, 9, ((0, 2), (4, 9)), (2, 3)),
        ),
        ("not json", SparseRecord("", 0)),  # unreadable: held in part, nothing of it
        ('{"sha256": "%s", "size": 9, "present": [[0, 10]]}' % SHA, SparseRecord("", 0)),  # past the end
    ],
)
def test_a_record_on_disk(tmp_path, text, expected):
    file = tmp_path / "model.gguf"
    if text is not None:
        record_path(file).write_text(text)
    assert read_record(file) == expected
    if expected is not None:
        write_record(file, expected)
        assert read_record(file) == expected
    assert record_path(file).name == "model.gguf.ranges.json"
