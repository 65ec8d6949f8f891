"""`raytuner bench gpu` on a machine without a GPU: its plan (groups within their time), and the
runner that must return figures from a short GPU window whatever a row does (junk on stdout, a
crash, a hang), with the results on disk after every row."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from raytuner.tools.bench import gpu, gpu_rows

REPO = Path(__file__).resolve().parents[2]


def test_every_group_fits_its_window_and_rows_name_their_commands(capsys):
    """`--dry-run` prints the plan: each group estimated within 8 minutes on an H100, every row
    a `raytuner bench` command with its estimate, the rows of 2026-11-23's micro-batches first,
    the work folder outside `--out`."""
    from raytuner.cli import main

    assert main(["bench", "gpu", "--dry-run", "--out", "results"]) == 0
    out = capsys.readouterr().out
    plan, report = out[: out.index("{")], json.loads(out[out.index("{") :])
    assert "group mfu: about" in plan and "group compile: about" in plan
    items = gpu_rows.rows(list(gpu_rows.FAMILIES), "jobs", "/tmp/w")
    for group, seconds in gpu_rows.groups(items).items():
        assert seconds <= gpu_rows.GROUP_LIMIT_S, (group, seconds)
    names = [i["name"] for i in report["items"]]
    assert names[:4] == ["step sd15", "step sdxl", "step flux", "step sana"]
    for f in gpu_rows.FAMILIES:
        assert {f"step {f}", f"step {f} compiled", f"train {f}"} <= set(names)
    assert {"step flux attention cudnn", "step sdxl channels-last off"} <= set(names)
    assert all(i["command"][:2] == ["raytuner", "bench"] for i in report["items"])
    assert "results" not in report["workdir"]
    train = next(i for i in report["items"] if i["name"] == "train sdxl")
    assert "checkpoint.max_failures=0" in train["command"]
    sd15 = next(i for i in report["items"] if i["name"] == "step sd15")["command"]
    assert "train.micro_batch_size=8" in sd15 and "--warmup" in sd15


def test_each_row_draws_random_weights_of_its_own_jobs_model():
    """A row's random weights have the architecture its job names: the 1.3B job's row builds
    Wan 2.1 1.3B (a plain "random" built the 14B on 2026-11-28: the row timed out at 108 s)."""
    import tomllib

    from raytuner.families import parts

    items = gpu_rows.rows(list(gpu_rows.FAMILIES), str(REPO / "jobs"), "/tmp/w")
    for item in items:
        job = next((a for a in item.args if a.endswith(".toml")), None)
        if job is None:
            continue
        model = tomllib.loads(Path(job).read_text())["model"]
        preset = parts.released(model["family"], model["pretrained"])
        assert f'model.pretrained="{preset}"' in item.args, (item.name, preset)
    wan = next(i for i in items if i.name == "step wan-1.3b")
    assert 'model.pretrained="random-1.3b"' in wan.args
    assert parts.Source("random-1.3b").full_size and not parts.Source("tiny").full_size


def test_only_picks_groups_and_rows_and_names_the_groups_when_wrong(capsys):
    from raytuner.cli import main

    assert main(["bench", "gpu", "--dry-run", "--only", "compile,compile-2,step flux"]) == 0
    out = capsys.readouterr().out
    names = [i["name"] for i in json.loads(out[out.index("{") :])["items"]]
    items = gpu_rows.rows(list(gpu_rows.FAMILIES), "jobs", "/tmp/w")
    picked = [i.name for i in items if i.group in ("compile", "compile-2")]
    assert names == ["step flux", *picked] and picked[0] == "step sd15 compiled"
    # the compiled rows past a group's 8 minutes run in the next group: every family once,
    # no group over the limit
    compiled = [i for i in items if i.group.startswith("compile")]
    assert [i.name for i in compiled] == [f"step {f} compiled" for f in gpu_rows.FAMILIES]
    for group in {i.group for i in compiled}:
        spent = sum(i.estimate_s for i in compiled if i.group == group)
        assert spent <= gpu_rows.GROUP_LIMIT_S, (group, spent)
    assert main(["bench", "gpu", "--dry-run", "--only", "nope"]) == 2
    err = capsys.readouterr().err
    assert "--only nope: not a group or a row" in err and "mfu, video, compile" in err


def _child(code: str) -> list[str]:
    return [sys.executable, "-c", code]


@pytest.mark.parametrize(
    ("code", "expect"),
    [
        ("print('{\"samples_per_s\": 2.5}'); print('(raylet) late line')", {"samples_per_s": 2.5}),
        ("print('junk'); print('{not json')", "printed no figures"),
        ("import sys; [print(f'line {i}', file=sys.stderr) for i in range(30)]; sys.exit(3)",
         "exit 3"),
        ("import os, signal; os.kill(os.getpid(), signal.SIGKILL)", "killed by SIGKILL"),
        ("import time; time.sleep(30)", "did not finish in 2 s"),
    ],
)
def test_a_row_that_misbehaves_is_recorded_not_fatal(code, expect):
    """A row's figures are the last JSON line on stdout, whatever comes after; junk, an exit
    code, a kill (the OOM killer's SIGKILL) or a hang each give an error and the stderr tail."""
    result = gpu.run_row(_child(code), 2.0)
    if isinstance(expect, dict):
        assert result.items() >= expect.items()
        return
    assert expect in result["error"], result
    if "exit 3" in expect:
        assert result["stderr"] == [f"line {i}" for i in range(10, 30)]


def test_a_failing_row_keeps_the_whole_message_of_its_error():
    """A raytuner command prints one line when it fails; a row's keeps the traceback and every
    line of the message (a CheckpointError names its tensors on the lines after the first)."""
    code = ("import sys; from raytuner.cli import failed; "
            "sys.exit(failed('bench', None, RuntimeError('first\\nsecond\\nthird')))")  # fmt: skip
    result = gpu.run_row(_child(code), 60.0)
    assert result["error"] == "exit 1", result
    assert "Traceback (most recent call last):" in result["stderr"], result["stderr"]
    assert result["stderr"][-2:] == ["second", "third"], result["stderr"]


def test_results_are_written_after_every_row(tmp_path, monkeypatch):
    """A window that ends mid-run keeps what was measured: after the first row the JSON and
    Markdown exist with its figures and the rest not yet run; a failing row is a recorded row and
    the next one runs; a row that cannot finish in what is left of the budget is skipped."""
    rows = [
        gpu_rows.Row(name="good", group="g", args=("x",), estimate_s=1),
        gpu_rows.Row(name="bad", group="g", args=("x",), estimate_s=1),
        gpu_rows.Row(name="long", group="g", args=("x",), estimate_s=10_000),
        gpu_rows.Row(name="after", group="g", args=("x",), estimate_s=1),
    ]
    seen = []

    def fake_run(argv, limit_s):
        if argv[1] == "-c":  # the smoke check
            return {"device": "fake", "matmul_ok": True}
        seen.append(len(seen))
        written = json.loads((tmp_path / "bench-gpu-2026-01-01.json").read_text())
        done = [i for i in written["items"] if "result" in i]
        assert len(done) == len(seen) - 1 + (len(seen) > 2)  # every earlier row is on disk
        return {"samples_per_s": 1.0} if len(seen) != 2 else {"error": "exit 1"}

    class Day:
        @staticmethod
        def today():
            return type("D", (), {"isoformat": lambda self: "2026-01-01"})()

    monkeypatch.setattr(gpu, "run_row", fake_run)
    monkeypatch.setattr(gpu, "rows", lambda *a: rows)
    monkeypatch.setattr(gpu.datetime, "date", Day)
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert gpu.bench_gpu(["sd15"], "jobs", str(tmp_path), 600, False) == 0
    report = json.loads((tmp_path / "bench-gpu-2026-01-01.json").read_text())
    results = {i["name"]: i["result"] for i in report["items"]}
    assert results["good"] == {"samples_per_s": 1.0} and results["bad"] == {"error": "exit 1"}
    assert "skipped" in results["long"] and results["after"] == {"samples_per_s": 1.0}
    md = (tmp_path / "bench-gpu-2026-01-01.md").read_text().splitlines()
    assert len(md) == 4 and "not measured: exit 1" in md[1]


def test_the_edit_families_train_on_pairs_of_the_drawn_images(tmp_path):
    """The train rows of the edit families (`bench train` of `jobs/flux-kontext.toml` and
    `jobs/qwen-image-edit.toml`) read the work folder's pairs: every drawn image a target with
    its caption, its mirror image the one reference its job's layout finds for it
    (`data.references = "control"`: the same name under `control/`); the other families read the
    drawn images alone."""
    from PIL import Image, ImageOps

    from raytuner.config import load_job
    from raytuner.preprocess.sources import list_source
    from raytuner.tools.demo_images import make_demo_images

    make_demo_images(tmp_path / gpu_rows.IMAGES, per_aspect=1)  # small: drawn at 1024 px else
    gpu._synthetic_images(str(tmp_path))
    drawn = sorted(p.relative_to(tmp_path / "images").as_posix()
                   for p in (tmp_path / "images").rglob("*.png"))  # fmt: skip
    items = gpu_rows.rows(list(gpu_rows.FAMILIES), str(REPO / "jobs"), str(tmp_path))
    for row in (i for i in items if i.name.startswith("train ")):
        f = row.name.removeprefix("train ")
        sets = [row.args[i + 1] for i, a in enumerate(row.args) if a == "--set"]
        job = load_job(row.args[2], sets)
        expected = gpu_rows.PAIRS if f in gpu_rows.PAIRED else gpu_rows.IMAGES
        assert job.data.images == str(tmp_path / expected), f
        if f not in gpu_rows.PAIRED:
            continue
        listed = list_source(0, job.data.all_sources()[0], reference_index=1)
        targets = [r for r in listed if r["source"] == 0]
        assert [(r["path"], r["references"]) for r in targets] == [(p, [p]) for p in drawn], f
    for p in drawn:  # each target's caption beside it, its reference the mirror image
        caption = (tmp_path / gpu_rows.PAIRS / p).with_suffix(".txt")
        assert caption.read_text() == (tmp_path / "images" / p).with_suffix(".txt").read_text()
        with Image.open(tmp_path / "images" / p) as image:
            mirror = ImageOps.mirror(image.convert("RGB"))
        with Image.open(tmp_path / gpu_rows.PAIRS / "control" / p) as reference:
            assert reference.convert("RGB").tobytes() == mirror.tobytes()
