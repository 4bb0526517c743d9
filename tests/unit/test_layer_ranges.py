"""Layer ranges: parsing one range and a route's splits, bounds, even splits (pure; no model)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvpool.shard.errors import ShardError
from kvpool.shard.ranges import LayerRange, even_splits, parse_layers, parse_splits, validate_range

SPLITS = [LayerRange(0, 10), LayerRange(10, 20), LayerRange(20, 30)]


@pytest.mark.parametrize(
    ("text", "expected"),
    [("0:10", LayerRange(0, 10)), (" 3:7 ", LayerRange(3, 7)), ("29:30", LayerRange(29, 30)), ("007:8", LayerRange(7, 8))],
)
def test_parse_layers_accepts_start_stop(text: str, expected: LayerRange) -> None:
    assert parse_layers(text) == expected
    assert str(expected) == f"{expected.start}:{expected.stop}"


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("", "bad layer range"),
        ("10", "bad layer range"),
        ("a:b", "bad layer range"),
        ("1:2:3", "bad layer range"),
        ("-1:5", "bad layer range"),
        ("1.5:3", "bad layer range"),
        ("0 : 10", "bad layer range"),
        ("10:5", "is empty"),
        ("5:5", "is empty"),
    ],
)
def test_parse_layers_rejects_junk(text: str, message: str) -> None:
    with pytest.raises(ShardError, match=message):
        parse_layers(text)


def test_layer_range_cannot_be_built_empty_or_negative() -> None:
    with pytest.raises(ShardError, match="is empty"):
        LayerRange(4, 4)
    with pytest.raises(ShardError, match="below 0"):
        LayerRange(-1, 4)


def test_validate_range_checks_upper_bound() -> None:
    validate_range(LayerRange(0, 30), 30)
    validate_range(LayerRange(29, 30), 30)
    with pytest.raises(ShardError, match=r"out of bounds: the model has 30 layers \(0:30\)"):
        validate_range(LayerRange(0, 31), 30)


def test_parse_splits_good_cases() -> None:
    assert parse_splits("0:10,10:20,20:30", 30) == SPLITS
    assert parse_splits("20:30, 0:10 ,10:20", 30) == SPLITS
    assert parse_splits("0:30", 30) == [LayerRange(0, 30)]


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("0:10,5:30", r"splits overlap: 0:10 and 5:30 share layers 5:10"),
        ("0:10,0:10,10:30", r"splits overlap"),
        ("0:10,11:30", r"splits leave a gap: layers 10:11 are in no range"),
        ("5:30", r"splits leave a gap: layers 0:5 are in no range"),
        ("0:10,10:20", r"splits leave a gap: layers 20:30 are in no range"),
        ("0:10,10:31", r"out of bounds"),
        ("0:10,,10:30", r"bad splits"),
        ("0:10,10:30,", r"bad splits"),
        ("", r"bad splits"),
        ("0:10;10:30", r"bad layer range"),
        ("0:10,20:10", r"is empty"),
    ],
)
def test_parse_splits_rejects_bad_cover(text: str, message: str) -> None:
    with pytest.raises(ShardError, match=message):
        parse_splits(text, 30)


def test_even_splits_examples() -> None:
    assert even_splits(30, 3) == SPLITS
    assert [r.n_layers for r in even_splits(30, 4)] == [8, 8, 7, 7]
    assert even_splits(30, 30)[-1] == LayerRange(29, 30)
    assert even_splits(1, 1) == [LayerRange(0, 1)]


@pytest.mark.parametrize(("total", "parts", "message"), [(30, 0, "at least 1"), (30, -2, "at least 1"), (30, 31, "at most 30")])
def test_even_splits_rejects_impossible_counts(total: int, parts: int, message: str) -> None:
    with pytest.raises(ShardError, match=message):
        even_splits(total, parts)


@given(st.integers(1, 200).flatmap(lambda total: st.tuples(st.just(total), st.integers(1, total))))
def test_even_splits_properties(total_and_parts: tuple[int, int]) -> None:
    total, parts = total_and_parts
    ranges = even_splits(total, parts)
    sizes = [r.n_layers for r in ranges]
    assert len(ranges) == parts
    assert ranges[0].start == 0 and ranges[-1].stop == total
    assert all(a.stop == b.start for a, b in zip(ranges, ranges[1:]))
    assert max(sizes) - min(sizes) <= 1
    assert sizes == sorted(sizes, reverse=True)
    assert parse_splits(",".join(map(str, ranges)), total) == ranges


@given(st.data())
def test_parse_splits_accepts_any_partition_and_rejects_a_moved_boundary(data: st.DataObject) -> None:
    total = data.draw(st.integers(2, 100))
    cuts = sorted(data.draw(st.sets(st.integers(1, total - 1), max_size=10)))
    bounds = [0, *cuts, total]
    ranges = [LayerRange(a, b) for a, b in zip(bounds, bounds[1:])]
    shuffled = data.draw(st.permutations(ranges))
    assert parse_splits(",".join(map(str, shuffled)), total) == ranges
    if len(ranges) >= 2:
        index = data.draw(st.integers(0, len(ranges) - 2))
        delta = data.draw(st.sampled_from([-1, 1]))
        moved = ranges[index].stop + delta
        if ranges[index].start < moved:
            broken = [*ranges[:index], LayerRange(ranges[index].start, moved), *ranges[index + 1 :]]
            with pytest.raises(ShardError, match="overlap" if delta > 0 else "gap"):
                parse_splits(",".join(map(str, broken)), total)
