"""Prompts files as kohya's sd-scripts reads them (one prompt a line with --w --h --s --d --l --n):
parsed with their line numbers, refused where the family cannot render an option, and rendered
with each line's options by `raytuner sample` and by the validation actor."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

import numpy as np
import pyarrow.fs as pafs
import pytest
from PIL import Image
from run_checks import lora_checkpoint

from raytuner.cli import main
from raytuner.families import FAMILIES
from raytuner.render.prompts import (
    Defaults,
    PromptLine,
    PromptsError,
    check_line,
    parse_line,
    parse_prompts,
    read_prompts_file,
    resolve,
)
from raytuner.render.validation import RenderSpec, Validator

JOB = """
[model]
family = "{family}"
[data]
images = "{root}/images"
cache = "{root}/cache"
[train]
output = "{root}/runs"
"""
# one prompt at 48x32 px rendered with the same seed, another seed, --l 1 (no guidance) and a
# negative prompt; and at 32x64 px with 2 steps
LINES = """# kohya-style sample prompts
a red circle --w 48 --h 32 --s 1 --d 5

a red circle --W 48 --H 32 --S 1 --D 5
a red circle --w 48 --h 32 --s 1 --d 6
a red circle --w 32 --h 64 --s 2 --d 5
a red circle --w 48 --h 32 --s 1 --d 5 --l 1
a red circle --w 48 --h 32 --s 1 --d 5 --n blurry, ugly
"""


def test_a_line_and_its_options():
    line = "a cat, masterpiece --w 512 --h 768 --s 20 --d 42 --l 7.5 --n ugly, blurry"
    assert parse_line(line, 3) == PromptLine(
        prompt="a cat, masterpiece",
        line=3,
        width=512,
        height=768,
        steps=20,
        seed=42,
        scale=7.5,
        negative_prompt="ugly, blurry",
    )
    assert parse_line("a dog --g 3.5 --d 1 --d 2", 1) == PromptLine(
        prompt="a dog", line=1, guidance=3.5, seed=2
    )  # the last of a repeated option wins, as in sd-scripts
    assert parse_line("  # a comment --w 5") is None and parse_line("   ") is None


def test_blank_lines_and_comments_are_skipped_and_lines_keep_their_numbers():
    lines = parse_prompts(LINES)
    assert [p.line for p in lines] == [2, 4, 5, 6, 7, 8]
    assert lines[1] == lines[0].__class__(**(asdict(lines[0]) | {"line": 4}))  # case-blind


def test_a_sampler_line_is_read_and_noted_once(caplog):
    """sd-scripts' --ss (its users' files carry it) is kept on the line, and one log line says
    the pipeline's own scheduler renders instead."""
    with caplog.at_level("INFO", logger="raytuner.prompts"):
        lines = parse_prompts("a cat --ss euler_a --s 20\na dog\na fox --SS ddim")
    assert [p.sampler for p in lines] == ["euler_a", None, "ddim"]
    assert lines[0].steps == 20
    notes = [r.getMessage() for r in caplog.records if r.name == "raytuner.prompts"]
    assert notes == [
        "prompts: --ss euler_a (line 1, 3) is not used: the pipeline's own scheduler renders"
    ]


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("a\nb --w big", "line 2: --w 'big' is not a number"),
        ("a --x 1", "line 1: unknown option --x"),
        ("a --cn control.png", "line 1: --cn (a ControlNet image"),
        ("--w 512 --h 512", "line 1: no prompt before its options"),
        ("a --n", "line 1: --n needs a value"),
        ("a --s 0", "line 1: --s 0: must be an integer >= 1 and <= 1000"),
        ("a --s 1001", "line 1: --s 1001: must be an integer >= 1 and <= 1000"),
        ("a --l nan", "line 1: --l nan: must be a finite number >= 0 and <= 100"),
        ("a --g inf", "line 1: --g inf: must be a finite number >= 0 and <= 100"),
        ("a --w 8200", "line 1: --w 8200: must be an integer >= 8 and <= 8192"),
        ("a --h 4", "line 1: --h 4: must be an integer >= 8 and <= 8192"),
        ("a --d -1", "line 1: --d -1: must be an integer >= 0 and <= 9223372036854775807"),
        ("a\n\nb --d 99999999999999999999", "line 3: --d 99999999999999999999: must be an"),
        ("# only\n\n", "no prompts in it"),
    ],
)
def test_unreadable_lines_are_refused_with_their_number(text, message):
    with pytest.raises(PromptsError, match=message.replace("(", r"\(")):
        parse_prompts(text)


def test_a_missing_file_is_refused(tmp_path):
    with pytest.raises(PromptsError, match="cannot read it"):
        read_prompts_file(str(tmp_path / "none.txt"))


@pytest.mark.parametrize(
    ("family", "line", "message"),
    [
        ("flux", "a --n ugly", "line 1: --n: flux's pipeline takes no negative prompt"),
        ("flux", "a --l 4", "line 1: --l 4.0: flux has no classifier-free guidance.*--g"),
        ("sd15", "a --g 3.5", "line 1: --g 3.5: sd15 has no guidance embedding"),
        ("sdxl", "a --w 100", "line 1: --w 100: sdxl renders sides that are multiples of 8"),
        ("sana", "a --h 48", "line 1: --h 48: sana renders sides that are multiples of 32"),
    ],
)
def test_options_the_family_cannot_use_are_refused(family, line, message):
    with pytest.raises(PromptsError, match=message):
        check_line(parse_line(line, 1), FAMILIES[family])


def test_options_settle_line_then_job_then_family():
    defaults = Defaults(size=(64, 48), seeds=(0, 1), steps=3)
    sdxl, flux = FAMILIES["sdxl"], FAMILIES["flux"]
    plain, own = resolve(parse_prompts("a\nb --l 9 --n bad --w 16 --s 2 --d 7"), sdxl, defaults)
    assert (plain.width, plain.height, plain.steps, plain.seeds) == (64, 48, 3, (0, 1))
    assert (plain.guidance_scale, plain.negative_prompt) == (sdxl.guidance.default_scale, "")
    assert (own.width, own.height, own.steps, own.seeds) == (16, 48, 2, (7,))
    assert own.call() == {
        "width": 16,
        "height": 48,
        "guidance_scale": 9.0,
        "num_inference_steps": 2,
        "negative_prompt": "bad",
    }
    job = Defaults(size=(64, 64), seeds=(0,), steps=None, guidance_scale=3.0, negative_prompt="x")
    assert resolve([PromptLine(prompt="a")], sdxl, job)[0].call()["negative_prompt"] == "x"
    # guidance-distilled: --g (or the job's scale) is the guidance embedding; --l 1 is no CFG
    distilled = resolve(parse_prompts("a\nb --g 2.5 --l 1"), flux, job)
    assert [(r.guidance_scale, r.negative_prompt) for r in distilled] == [(3.0, ""), (2.5, "")]


def _job(tmp_path: Path, family: str = "sd15") -> Path:
    path = tmp_path / "job.toml"
    path.write_text(JOB.format(family=family, root=tmp_path.as_posix()))
    return path


@pytest.mark.parametrize(
    ("family", "overrides", "shown"),
    [
        ("sd15", ["validation.prompts_file=none.txt"], "prompts_file = 'none.txt': cannot read"),
        ("sd15", ["validation.prompts_file={file}"], "line 2: --w 'x' is not a number"),
        ("flux", ["validation.prompts_file={ok}"], "line 1: --n: flux"),
        ("flux", ["validation.negative_prompt=blurry"], "validation.negative_prompt = 'blurry'"),
    ],
)
def test_check_refuses_a_bad_prompts_file(tmp_path, capsys, family, overrides, shown):
    (tmp_path / "bad.txt").write_text("a cat\na dog --w x\n")
    (tmp_path / "ok.txt").write_text("a cat --n ugly\n")
    args = ["check", str(_job(tmp_path, family))]
    for o in overrides:
        args += ["--set", o.format(file=tmp_path / "bad.txt", ok=tmp_path / "ok.txt")]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert shown in err and len(err.strip().splitlines()) == 1, err


BIG_SEED = "a cat\n# a comment\na dog --d 99999999999999999999\n"


def test_check_refuses_a_prompts_file_line_out_of_range_naming_file_and_line(tmp_path, capsys):
    """Before, `check` took the line and `sample` failed at the render, naming no line."""
    (tmp_path / "big.txt").write_text(BIG_SEED)
    job = _job(tmp_path)
    assert main(["check", str(job), "--set", f"validation.prompts_file={tmp_path}/big.txt"]) == 2
    err = capsys.readouterr().err
    assert f"validation.prompts_file = '{tmp_path}/big.txt': line 3: --d 9999" in err, err
    assert "must be an integer >= 0 and <= 9223372036854775807 (seed)" in err


@pytest.mark.parametrize(
    ("args", "shown"),
    [
        (["--prompts-file", "{root}/big.txt"], "prompts file {root}/big.txt: line 3: --d 9999"),
        (["--prompt", "a", "--seed", "-1"], "sample: --seed -1: must be an integer >= 0"),
        (["--prompt", "a", "--steps", "0"], "sample: --steps 0: must be an integer >= 1"),
        (["--prompt", "a", "--width", "100"], "sample: --width 100: sd15 renders sides that"),
        (["--prompt", "a", "--height", "9000"], "sample: --height 9000: must be an integer"),
    ],
)
def test_sample_refuses_options_out_of_range_before_rendering(tmp_path, capsys, args, shown):
    (tmp_path / "big.txt").write_text(BIG_SEED)
    args = [a.format(root=tmp_path) for a in args]
    assert main(["sample", str(_job(tmp_path)), *args, "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert shown.format(root=tmp_path) in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "out").exists()


def _rendered(images: list[np.ndarray], lines: list[dict]) -> None:
    """What LINES must give: the sizes each line asks, the same image for the same options,
    another for another seed, guidance scale or negative prompt."""
    assert [i.shape[:2] for i in images] == [(32, 48)] * 3 + [(64, 32)] + [(32, 48)] * 2
    first, same, seed6, _, no_cfg, negative = images
    assert np.array_equal(first, same)
    for other in (seed6, no_cfg, negative):
        assert not np.array_equal(first, other)
    assert [r["line"] for r in lines] == [2, 4, 5, 6, 7, 8]
    assert [r["seeds"] for r in lines] == [[5], [5], [6], [5], [5], [5]]
    assert [r["steps"] for r in lines] == [1, 1, 1, 2, 1, 1]
    assert [r["guidance_scale"] for r in lines] == [7.5] * 4 + [1.0, 7.5]  # sd15's default
    assert [r["negative_prompt"] for r in lines] == [""] * 5 + ["blurry, ugly"]


def test_sample_renders_each_line_with_its_options(tmp_path, capsys):
    (tmp_path / "prompts.txt").write_text(LINES)
    out = tmp_path / "out"
    args = ["sample", str(_job(tmp_path)), "--checkpoint", "base", "--out", str(out)]
    assert main([*args, "--prompts-file", str(tmp_path / "prompts.txt")]) == 0
    record = json.loads((out / "samples.json").read_text())
    files = record["files"]
    assert files[0] == "00-a-red-circle-seed5.png" and files[-1] == "grid.png"
    _rendered([np.asarray(Image.open(out / f)) for f in files[:-1]], record["lines"])
    grid = np.asarray(Image.open(out / "grid.png"))
    assert grid.shape == (6 * 64, 48, 3)  # cells as large as the largest image, a row a line
    assert np.array_equal(grid[3 * 64 : 4 * 64, 8:40], np.asarray(Image.open(out / files[3])))
    assert (grid[:16] == 255).all()  # a 48x32 image centred in its 48x64 cell on white

    bad = tmp_path / "bad.txt"
    bad.write_text("a red circle --s 1\na red circle --g 3\n")
    assert main([*args, "--prompts-file", str(bad)]) == 2
    assert "line 2: --g 3.0: sd15 has no guidance embedding" in capsys.readouterr().err


def test_validation_renders_the_prompts_file_and_records_each_lines_options(tmp_path):
    checkpoint = lora_checkpoint(tmp_path / "ckpt", "sd15", jitter=0.5)
    spec = RenderSpec(
        family="sd15",
        pretrained="tiny",
        revision="",
        dtype="auto",
        prompts=[],
        seeds=[0],
        steps=20,
        size=(64, 64),
        run_dir=str(tmp_path / "run"),
        tensorboard=False,
        prompt_lines=[asdict(p) for p in parse_prompts(LINES)],
    )
    validator = Validator(asdict(spec))
    validator.enqueue(4, str(checkpoint), pafs.LocalFileSystem())
    (done,) = validator.drain()
    assert "error" not in done, done
    folder = tmp_path / "run" / "validation"
    record = json.loads((folder / "step_000004.json").read_text())
    grid = np.asarray(Image.open(folder / "step_000004.png"))
    cells = [grid[i * 64 : (i + 1) * 64] for i in range(6)]
    images = [c[16:48] if i != 3 else c[:, 8:40] for i, c in enumerate(cells)]  # uncentred
    _rendered(images, record["lines"])
