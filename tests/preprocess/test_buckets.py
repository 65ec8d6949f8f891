"""Aspect bucket math (pure functions)."""

from __future__ import annotations

import pytest

from raytuner.preprocess.buckets import fit_to_bucket, make_buckets, nearest_bucket


def test_tiny_buckets_are_three_aspect_ratios():
    assert make_buckets(64, 16, 0.5, 2.0) == [(48, 80), (64, 64), (80, 48)]


@pytest.mark.parametrize("resolution,step", [(1024, 64), (512, 32), (768, 16)])
def test_buckets_are_multiples_within_area_and_symmetric(resolution, step):
    buckets = make_buckets(resolution, step, 0.5, 2.0)
    assert (resolution, resolution) in buckets
    for w, h in buckets:
        assert w % step == 0 and h % step == 0
        assert w * h <= resolution * resolution
        assert 0.5 <= w / h <= 2.0
        assert (h, w) in buckets


def test_nearest_bucket_follows_aspect_ratio():
    buckets = make_buckets(64, 16, 0.5, 2.0)
    assert nearest_bucket(1920, 1080, buckets) == (80, 48)
    assert nearest_bucket(1080, 1920, buckets) == (48, 80)
    assert nearest_bucket(500, 510, buckets) == (64, 64)


@pytest.mark.parametrize("mode", ["center", "random"])
def test_fit_covers_bucket_and_crop_stays_inside(mode):
    (rw, rh), (top, left) = fit_to_bucket(300, 200, (64, 64), mode, seed=5)
    assert rw >= 64 and rh >= 64 and min(rw, rh) == 64
    assert 0 <= top <= rh - 64 and 0 <= left <= rw - 64


def test_center_and_none_crops():
    assert fit_to_bucket(128, 64, (64, 64), "center", 0) == ((128, 64), (0, 32))
    assert fit_to_bucket(128, 64, (64, 64), "none", 0) == ((64, 64), (0, 0))


def test_random_crop_is_reproducible_per_seed():
    picks = {fit_to_bucket(1000, 64, (64, 64), "random", s)[1] for s in range(20)}
    assert len(picks) > 1
    assert fit_to_bucket(1000, 64, (64, 64), "random", 3) == fit_to_bucket(
        1000, 64, (64, 64), "random", 3
    )


def test_no_bucket_is_a_clear_error():
    with pytest.raises(ValueError, match="smaller than the bucket step"):
        make_buckets(32, 64, 0.5, 2.0)
