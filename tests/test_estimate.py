"""``estimate_pool_bytes``: the arithmetic, and the H200 measurements it was chosen on."""

from __future__ import annotations

import pytest

import graphguard as gg
from graphguard.errors import ConfigError
from graphguard.estimate import estimate_pool_bytes

MIB = 1 << 20
LADDER = gg.capture_sizes(256)  # 35 sizes


def test_sampled_growth_is_summed_not_extrapolated_per_size():
    # A one-time 2 MiB (small segments opened at the smallest size) counts once, not
    # once per unsampled size as a mean-times-count would (2 MiB * 33 more).
    samples = [(256, 540 * MIB), (248, 0), (112, 2 * MIB), (1, 0)]
    assert estimate_pool_bytes(samples, LADDER) == 542 * MIB


def test_retained_bytes_are_added():
    samples = [(8, 100), (4, 10), (1, 0)]
    ladder = [1, 2, 4, 8]
    assert estimate_pool_bytes(samples, ladder) == 110
    # unshared outputs: the unsampled size 2 keeps 2 rows of 5 bytes
    assert estimate_pool_bytes(samples, ladder, retained_bytes_per_row=5) == 120


@pytest.mark.parametrize(
    ("arch", "samples", "real"),
    [
        # bench/results/pool-unowned_NVIDIA-H200_2026-11-30.json (profile vs real ladder)
        ("ref llama-1b", [(256, 540), (248, 0), (112, 2), (1, 0)], 544),
        ("gpt2", [(256, 312), (248, 0), (112, 0), (1, 0)], 314),
        ("moe, aux stream", [(256, 48), (248, 0), (112, 0), (1, 0)], 48),
        ("moe, inline", [(256, 24), (248, 2), (112, 0), (1, 0)], 26),
    ],
)
def test_within_target_on_the_measured_ladders(arch, samples, real):
    est = estimate_pool_bytes([(s, g * MIB) for s, g in samples], LADDER)
    err = (est - real * MIB) / (real * MIB)
    assert -0.05 <= err <= 0.10, (arch, err)


@pytest.mark.parametrize(
    ("samples", "ladder", "match"),
    [
        ([], [1, 2], "no sampled sizes"),
        ([(4, 1)], [1, 2, 8], "not the largest 8"),
        ([(8, 1), (2, 0), (4, 0)], [1, 2, 4, 8], "distinct and descending"),
        ([(8, 1), (3, 0)], [1, 2, 4, 8], r"\[3\] are not in the ladder"),
        ([(8, -1)], [8], "negative growth"),
    ],
)
def test_bad_samples_are_named(samples, ladder, match):
    with pytest.raises(ConfigError, match=match):
        estimate_pool_bytes(samples, ladder)


def test_negative_extras_are_refused():
    with pytest.raises(ConfigError, match=">= 0"):
        estimate_pool_bytes([(8, 1)], [8], retained_bytes_per_row=-1)
