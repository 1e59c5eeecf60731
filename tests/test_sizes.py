from __future__ import annotations

import itertools

import pytest

from graphguard import capture_sizes
from graphguard.errors import ConfigError
from graphguard.sizes import PaddingTable, validate_sizes


def test_default_ladder_for_512_has_51_sizes_dense_then_8_then_16():
    s = capture_sizes(512)
    assert len(s) == 51
    assert s[:5] == [1, 2, 4, 8, 16]
    assert s[s.index(256) - 1] == 248
    assert s[s.index(256) + 1] == 272
    assert s[-1] == 512


@pytest.mark.parametrize("top", [1, 3, 7, 100, 257, 300, 1000])
def test_ladder_is_sorted_unique_and_ends_at_the_max(top):
    s = capture_sizes(top)
    assert s == sorted(set(s))
    assert s[-1] == top
    assert all(1 <= x <= top for x in s)


def test_ladder_steps():
    s = capture_sizes(600)
    small = [x for x in s if x <= 256]
    assert [b - a for a, b in itertools.pairwise(small[3:])] == [8] * (len(small) - 4)
    big = [x for x in s if x > 256 and x != 600]
    assert all(b - a == 16 for a, b in itertools.pairwise(big))


def test_ladder_multiple_of_speculative_tokens():
    s = capture_sizes(64, multiple_of=3)
    assert all(x % 3 == 0 for x in s)
    assert s[0] == 3 and s[-1] == 63


@pytest.mark.parametrize("bad", [0, -1, 2.5, "8", True])
def test_ladder_rejects_bad_max(bad):
    with pytest.raises(ConfigError):
        capture_sizes(bad)


def test_validate_sorts_and_accepts():
    assert validate_sizes([8, 1, 4]) == (1, 4, 8)


def test_validate_names_every_problem():
    with pytest.raises(ConfigError) as ei:
        validate_sizes([4, 0, 4, -2, 1.5])
    msg = str(ei.value)
    assert "entry 1 is 0" in msg and "entry 3 is -2" in msg
    assert "entry 4 is 1.5" in msg and "duplicates [4]" in msg


def test_validate_rejects_empty():
    with pytest.raises(ConfigError, match="empty"):
        validate_sizes([])


def test_padding_table_pads_to_next_captured_size():
    t = PaddingTable([1, 2, 4, 8, 16])
    assert [t.padded(n) for n in range(1, 17)] == [1, 2, 4, 4, 8, 8, 8, 8] + [16] * 8
    assert t.padded(17) is None
    assert t.padded(0) is None
    assert t.max_size == 16


def test_empty_padding_table_pads_nothing():
    t = PaddingTable([])
    assert t.padded(1) is None and t.max_size == 0
