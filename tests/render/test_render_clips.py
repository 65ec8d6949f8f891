"""A video family renders clips: `raytuner sample` and the validation actor write each as an mp4
that PyAV decodes back to the frames asked for at the size asked for, and a poster (evenly
spaced frames side by side) as a PNG, in the grid and in TensorBoard; a line of one frame is
still an image; `raytuner check` refuses a clip length the family cannot render. Tiny Wan."""

from __future__ import annotations

import io
import json
from dataclasses import asdict
from pathlib import Path

import av
import numpy as np
import pyarrow.fs as pafs
import pytest
from PIL import Image
from run_checks import lora_checkpoint
from test_jobcheck import check

from raytuner.cli import main
from raytuner.render import clips
from raytuner.render.validation import RenderSpec, Validator

JOB = """
[model]
family = "wan"
pretrained = "tiny"
[data]
images = "{root}/images"
cache = "{root}/cache"
frames = [5, 9]
[train]
output = "{root}/runs"
"""
W, H = 32, 48  # on Wan's 16-pixel grid, and not square: a swapped side shows
# a clip's first frame as the mp4 holds it against the lossless PNG poster: H.264 at CRF 18 in
# yuv420p (colour at half size) of the tiny random model's busy pixels, mean levels of 255
LOSSY = 12.0


def decode(path: Path) -> tuple[list[np.ndarray], str, float]:
    """Every frame of the mp4 (RGB), its codec and its frame rate."""
    with av.open(str(path)) as container:
        stream = container.streams.video[0]
        name, rate = stream.codec_context.name, float(stream.average_rate)
        frames = [frame.to_ndarray(format="rgb24") for frame in container.decode(stream)]
    return frames, name, rate


def assert_clip(path: Path, frames: int, fps: float, poster: np.ndarray) -> None:
    """The mp4 at ``path`` decodes to ``frames`` frames of W x H at ``fps``, its first and last
    frames those of the ``poster`` strip (its first and last cells)."""
    decoded, codec, rate = decode(path)
    assert len(decoded) == frames and {f.shape for f in decoded} == {(H, W, 3)}, path
    assert codec == {"libx264": "h264"}.get(clips.codec(), clips.codec()) and rate == fps
    cells = min(frames, clips.POSTER_FRAMES)
    assert poster.shape == (H, W * cells, 3)
    for frame, cell in ((decoded[0], poster[:, :W]), (decoded[-1], poster[:, -W:])):
        assert np.abs(frame.astype(int) - cell).mean() < LOSSY
    assert not np.array_equal(decoded[0], decoded[-1])  # it moves: not one frame repeated


def test_sample_writes_playable_mp4s_of_the_jobs_largest_frame_bucket(tmp_path):
    """Two seeds, no --frames: clips of 9 frames (data.frames' largest) at 16 fps, each an mp4
    and its poster, and a grid of the posters."""
    job = tmp_path / "job.toml"
    job.write_text(JOB.format(root=tmp_path.as_posix()))
    out = tmp_path / "out"
    args = ["sample", str(job), "--checkpoint", "base", "--prompt", "a red circle"]
    args += ["--seed", "0", "--seed", "1", "--steps", "2", "--width", str(W), "--height", str(H)]
    assert main([*args, "--out", str(out)]) == 0
    record = json.loads((out / "samples.json").read_text())
    stems = ["00-a-red-circle-seed0", "00-a-red-circle-seed1"]
    assert record["files"] == [f"{s}.mp4" for s in stems] + [f"{s}.png" for s in stems] + [
        "grid.png"
    ]
    assert record["fps"] == 16.0 and record["codec"] == clips.codec()
    assert record["lines"][0]["frames"] == 9
    posters = [np.asarray(Image.open(out / f"{s}.png")) for s in stems]
    for stem, poster in zip(stems, posters, strict=True):
        assert_clip(out / f"{stem}.mp4", 9, 16.0, poster)
    grid = np.asarray(Image.open(out / "grid.png"))
    assert np.array_equal(grid, np.concatenate(posters, axis=1))  # a column per seed
    assert not np.array_equal(*posters)  # seeds differ


def test_sample_frames_and_fps_options_and_a_one_frame_line_an_image(tmp_path):
    """--frames 5 --fps 8 with a LoRA checkpoint; a prompts file's line with --f 1 renders an
    image (a PNG of the size, no mp4) beside it."""
    job = tmp_path / "job.toml"
    job.write_text(JOB.format(root=tmp_path.as_posix()))
    checkpoint = lora_checkpoint(tmp_path / "ckpt", "wan", jitter=0.5)
    lines = tmp_path / "prompts.txt"
    lines.write_text(f"a blue square --f 1 --w {W} --h {H} --s 2 --d 3\n")
    out = tmp_path / "out"
    args = ["sample", str(job), "--checkpoint", str(checkpoint), "--prompt", "a red circle"]
    args += ["--prompts-file", str(lines), "--frames", "5", "--fps", "8", "--steps", "2"]
    assert main([*args, "--width", str(W), "--height", str(H), "--out", str(out)]) == 0
    record = json.loads((out / "samples.json").read_text())
    clip, image = "00-a-red-circle-seed0", "01-a-blue-square-seed3"
    assert record["files"] == [f"{clip}.mp4", f"{clip}.png", f"{image}.png", "grid.png"]
    assert [line["frames"] for line in record["lines"]] == [5, 1]
    assert_clip(out / f"{clip}.mp4", 5, 8.0, np.asarray(Image.open(out / f"{clip}.png")))
    assert np.asarray(Image.open(out / f"{image}.png")).shape == (H, W, 3)


def test_validation_writes_each_clip_and_a_grid_of_posters_to_the_run_and_tensorboard(
    ray_local, tmp_path
):
    run = tmp_path / "run"
    spec = RenderSpec(
        family="wan", pretrained="tiny", revision="", dtype="auto", prompts=["a red circle"],
        seeds=[0, 1], steps=2, size=(W, H), run_dir=str(run), tensorboard=True, frames=5,
    )  # fmt: skip
    checkpoint = lora_checkpoint(tmp_path / "ckpt", "wan", jitter=0.5)
    validator = Validator(asdict(spec))
    validator.enqueue(2, str(checkpoint), pafs.LocalFileSystem())
    (done,) = validator.drain()
    assert "error" not in done, done

    folder = run / "validation"
    record = json.loads((folder / "step_000002.json").read_text())
    names = ["step_000002/00-a-red-circle-seed0.mp4", "step_000002/00-a-red-circle-seed1.mp4"]
    assert record["clips"] == names and record["fps"] == 16.0
    assert record["codec"] == clips.codec() and record["lines"][0]["frames"] == 5
    sheet = np.asarray(Image.open(folder / "step_000002.png"))
    strip = W * clips.POSTER_FRAMES
    assert sheet.shape == (H, 2 * strip, 3)  # a row per prompt, a poster per seed
    for i, name in enumerate(names):
        assert_clip(folder / name, 5, 16.0, sheet[:, i * strip : (i + 1) * strip])
    validator.close()

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run / "tensorboard"), size_guidance={"images": 0}).Reload()
    (logged,) = events.Images("validation")
    assert (logged.step, logged.width, logged.height) == (2, 2 * strip, H)


@pytest.mark.parametrize("encoders", [("libx264", "mpeg4"), ("no-such-encoder", "mpeg4")])
def test_an_odd_sized_clip_is_padded_to_even_sides_with_either_encoder(monkeypatch, encoders):
    """yuv420p needs even sides: 47x33 frames play as 48x34, their pixels kept; a PyAV whose
    FFmpeg lacks libx264 writes with FFmpeg's own mpeg4 encoder."""
    monkeypatch.setattr(clips, "CODECS", encoders)
    clips.codec.cache_clear()
    try:
        y, x = np.mgrid[0:33, 0:47]
        frames = np.stack([np.stack([x * 4 + t, y * 7, x + y], -1) for t in range(0, 50, 10)])
        data = clips.mp4_bytes(frames.astype(np.uint8), 12.0)
        used = clips.codec()
    finally:
        clips.codec.cache_clear()
    assert used == next(e for e in encoders if e != "no-such-encoder")
    with av.open(io.BytesIO(data)) as container:
        stream = container.streams.video[0]
        assert stream.codec_context.name == {"libx264": "h264"}.get(used, used)
        decoded = [f.to_ndarray(format="rgb24") for f in container.decode(stream)]
    assert len(decoded) == 5 and {f.shape for f in decoded} == {(34, 48, 3)}
    for got, made in zip(decoded, frames, strict=True):
        assert np.abs(got[:33, :47].astype(int) - made).mean() < LOSSY


@pytest.mark.parametrize(
    ("family", "setting", "said"),
    [
        ("wan", "validation.frames=8", "validation.frames = 8: wan renders clips of 4n + 1 "
         "frames (1, 5, 9, ...); use e.g. 9"),
        ("sdxl", "validation.frames=5", "validation.frames = 5: sdxl renders images"),
        ("wan", "validation.fps=0", "validation.fps"),
    ],
)  # fmt: skip
def test_check_refuses_a_clip_length_the_family_cannot_render(
    tmp_path, capsys, family, setting, said
):
    code, err = check(tmp_path, capsys, setting, family=family)
    assert code == 2 and said in err, err
    assert check(tmp_path, capsys, "validation.frames=9", family="wan")[0] == 0


def test_sample_refuses_a_bad_frame_count_before_rendering(tmp_path, capsys):
    job = tmp_path / "job.toml"
    job.write_text(JOB.format(root=tmp_path.as_posix()))
    args = ["sample", str(job), "--checkpoint", "base", "--out", str(tmp_path / "out")]
    assert main([*args, "--prompt", "a red circle", "--frames", "6"]) == 2
    assert "--frames 6: wan renders clips of 4n + 1 frames" in capsys.readouterr().err
    lines = tmp_path / "prompts.txt"
    lines.write_text("a red circle\na blue square --f 2000\n")
    assert main([*args, "--prompts-file", str(lines)]) == 2
    assert "line 2: --f 2000: must be an integer >= 1 and <= 1025" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


TRAIN_JOB = """
[model]
family = "wan"
pretrained = "tiny"
[data]
images = "{images}"
cache = "{root}/cache"
frames = [9]
[preprocess]
resolution = 64
bucket_step = 32
[train]
output = "{root}/runs"
max_steps = 2
global_batch_size = 1
learning_rate = 1e-2
[scaling]
workers = 1
cpus_per_worker = 1
[checkpoint]
every_steps = 2
[validation]
every_steps = 2
prompts = ["a red circle"]
steps = 2
width = {w}
height = {h}
frames = 5
fps = 24
"""


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_short_wan_run_validates_with_clips_in_its_run_folder(ray_local, tmp_path):
    """Preprocess and train the tiny Wan 2 steps on images; the validation at step 2 writes its
    clip (validation.frames = 5 at 24 fps) and the posters' grid into the run folder."""
    from raytuner.api import preprocess, train
    from raytuner.config import load_job
    from raytuner.tools.demo_images import make_demo_images

    images = make_demo_images(tmp_path / "images", per_aspect=1)
    text = TRAIN_JOB.format(images=images, root=tmp_path.as_posix(), w=W, h=H)
    (tmp_path / "job.toml").write_text(text)
    job = load_job(tmp_path / "job.toml")
    assert preprocess(job)["encoded"] == 3
    assert train(job)["step"] == 2
    folder = tmp_path / "runs" / "job" / "validation"
    record = json.loads((folder / "step_000002.json").read_text())
    assert "error" not in record and record["clips"] == ["step_000002/00-a-red-circle-seed0.mp4"]
    sheet = np.asarray(Image.open(folder / "step_000002.png"))
    assert_clip(folder / record["clips"][0], 5, 24.0, sheet)
