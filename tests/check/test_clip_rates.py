"""The video rules of `raytuner check`. It refuses, for a family whose denoiser places
frames in time by seconds (``geometry.seconds_positions``: LTX-2's), a source that samples each
clip at its own rate (fps 0, after -1 takes data.fps): training gives each row its source's rate
(the batch's "fps"), and a clip's own is not known there; and a clean first frame
(objective.flow.first_frame_p) for a family whose denoiser takes one noise level a sample."""

from __future__ import annotations

import pytest
from test_jobcheck import check, refused

from raytuner.config import ConfigError, DataConfig, SourceConfig
from raytuner.families import FAMILIES
from raytuner.jobcheck import model

LTX2 = FAMILIES["ltx2"]


def data(fps: float = 0.0, images: str = "in", **rates: float) -> DataConfig:
    """A dataset of ``images`` (data.images) and a source per ``rates`` (its fps)."""
    sources = [SourceConfig(path=name, fps=rate) for name, rate in rates.items()]
    return DataConfig(images=images, cache="cache", fps=fps, sources=sources)


@pytest.mark.parametrize(
    "job, shown",
    [
        (data(), "data.fps = 0: "),
        (data(24.0, a=16.0, b=0.0), "data.sources[1].fps = 0: "),  # b sets its own 0
        (data(0.0, "", a=16.0, b=-1.0), "data.fps = 0 (data.sources[1] takes it: its fps is -1)"),
    ],
)
def test_a_source_at_each_clips_own_rate_is_refused_naming_the_key(job, shown):
    with pytest.raises(ConfigError) as e:
        model.clip_rates(job, LTX2)
    message = str(e.value)
    assert message.startswith(shown), message
    key = shown.split(" = ")[0]
    assert f"set {key} to the rate to train at (e.g. 24)" in message
    assert "places frames in time by seconds" in message


@pytest.mark.parametrize(
    "job", [data(24.0), data(24.0, a=16.0, b=-1.0), data(0.0, "", a=16.0, b=30.0)]
)
def test_every_source_at_a_rate_of_its_own_passes(job):
    model.clip_rates(job, LTX2)


def test_a_family_placing_frames_by_index_takes_each_clips_own_rate():
    assert {n for n, f in FAMILIES.items() if f.geometry.seconds_positions} == {"ltx2"}
    model.clip_rates(data(0.0, a=0.0), FAMILIES["wan"])


def test_check_exits_2_naming_data_fps_and_passes_with_a_rate(tmp_path, capsys):
    code, err = check(tmp_path, capsys, family="ltx2")
    assert code == 2 and "data.fps = 0: " in err and "(e.g. 24)" in err, err
    assert len(err.strip().splitlines()) == 1, err
    assert check(tmp_path, capsys, "data.fps=24", family="ltx2", name="rated")[0] == 0


def test_a_clean_first_frame_is_refused_where_the_denoiser_takes_one_level_a_sample(
    tmp_path, capsys
):
    err = refused(tmp_path, capsys, "objective.flow.first_frame_p=0.1", family="wan")
    assert "objective.flow.first_frame_p = 0.1" in err and "(allowed for wan22-5b, ltx2)" in err
