"""`raytuner bench …` prints the figures the README records (no timing assertions here). The
commands run in this process on the session's local Ray: the same code as the CLI, without a
Ray start and a torch import of their own."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch

from raytuner.cli import main

REPO = Path(__file__).resolve().parents[2]


def _figures(capsys, *args: str) -> dict:
    threads = torch.get_num_threads()
    assert main(["bench", *args, "--json"]) == 0
    assert torch.get_num_threads() == threads  # a bench puts torch's threads back
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def _check_rounds(figures: dict, rounds: int) -> None:
    """The figures every alternating bench adds: the rounds asked for, each side's spread over
    them, the load average before and after."""
    assert figures["rounds"] == rounds
    assert set(figures["spread"]) == {"pipeline", "bare"}
    assert all(0 <= s < 10 for s in figures["spread"].values()), figures["spread"]
    for key in ("load_before", "load_after"):
        assert len(figures[key]) == 3 and all(x >= 0 for x in figures[key]), key


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_bench_preprocess_prints_one_json_object(ray_local, capsys, monkeypatch):
    monkeypatch.chdir(REPO)
    # one round: the alternation itself is tested below without a bench around it
    args = ("--images", "12", "--rounds", "1")
    figures = _figures(capsys, "preprocess", "jobs/tiny.toml", *args)
    for key in ("pipeline_images_per_s", "bare_images_per_s", "ratio", "bytes_per_latent_ratio"):
        assert figures[key] > 0, key
    assert figures["images"] == 12
    _check_rounds(figures, 1)
    # from the preprocess report's "first_encoded_s" (the seconds to the first encoded image)
    for key in ("startup_s", "marginal_ratio"):
        assert isinstance(figures[key], (int, float)) and figures[key] >= 0, key
    # the time of each stage, of the pipeline and of the bare loop, and its share
    pipeline = {"list", "decode", "encode", "write", "locate", "commit"}  # and "load", if it
    for key, names in (("stages", pipeline), ("bare_stages", {"decode", "encode"})):
        assert names <= set(figures[key]) <= names | {"load"}, key
        for name, stage in figures[key].items():
            assert stage["seconds"] >= 0 and 0 <= stage["share"] <= 1, (key, name)
            assert stage["ms_per_image"] >= 0, (key, name)
        assert abs(sum(s["share"] for s in figures[key].values()) - 1) < 0.01, key
    # each latent is stored as exactly its own bytes plus its length prefix and its page's
    # header: ~30 bytes (6 % of the tiny job's 512-byte latents, 0.02 % of an SDXL one)
    stored, tensor = figures["latent_bytes_stored"], figures["latent_tensor_bytes"]
    assert tensor <= stored <= tensor + 40 * figures["images"]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_bench_preprocess_has_a_video_mode_on_drawn_clips(ray_local, capsys, monkeypatch):
    """``--clips 6 --frames 9`` with the tiny Wan: 6 clip samples through the stream and the
    bare decode + encode loop, rated in clips/s."""
    monkeypatch.chdir(REPO)
    args = ("--clips", "6", "--frames", "9", "--rounds", "1", "--set", "model.family=wan")
    figures = _figures(capsys, "preprocess", "jobs/tiny.toml", *args)
    assert figures["images"] == 6 and figures["clip_frames"] == 9
    assert figures["pipeline_images_per_s"] > 0 and figures["bare_images_per_s"] > 0
    _check_rounds(figures, 1)


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_bench_train_prints_one_json_object(ray_local, capsys, monkeypatch, tmp_path):
    shutil.copytree(REPO / "jobs", tmp_path / "jobs")  # its cache lands in tmp_path/runs
    monkeypatch.chdir(tmp_path)
    # one round: the alternation (``bench.alternate``) is tested below; a second train() run
    # here would add ~25 s to the suite
    figures = _figures(capsys, "train", "jobs/tiny.toml", "--steps", "5", "--rounds", "1")
    for key in ("samples_per_s", "bare_samples_per_s", "ratio"):
        assert figures[key] > 0, key
    _check_rounds(figures, 1)
    assert 0 <= figures["data_wait_fraction"] < 1
    assert figures["measured_steps"] == 5 and figures["global_batch_size"] == 4
    assert (tmp_path / "runs" / "cache").is_dir()  # the cache it trained on was made first
    assert not (tmp_path / "runs" / "bench").exists()  # the bench run stays out of the job's runs


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_bench_feed_prints_one_json_object(ray_local, capsys, monkeypatch):
    monkeypatch.chdir(REPO)
    args = ("--rows", "200", "--workers", "2", "--steps", "10")
    figures = _figures(capsys, "feed", "jobs/tiny.toml", *args)
    assert figures["rows"] == 200 and figures["workers"] == 2
    # the full-size SDXL text tensors at the tiny job's 64 px buckets
    assert figures["shapes"]["prompt_embeds"] == [77, 2048]
    assert figures["cache_bytes"] > 200 * 77 * 2048 * 2
    assert 1.0 <= figures["read_amplification"] <= 2.0
    assert figures["rows_per_s_per_worker"] > 0
    assert figures["peak_worker_rss_bytes"] >= figures["baseline_worker_rss_bytes"] // 2 > 0
    per_rank = figures["global_batch_size"] / figures["workers"]
    # a latent and a caption per row; the measured window may also hold the reads of the
    # batches assembled ahead (train.prefetch = 2): up to 2 more of the 10 steps' batches
    assert figures["requests_per_batch"] <= 2 * per_rank * (10 + 2) / 10


def test_the_benches_time_the_training_step_itself():
    """`bench train`'s bare loop, `bench step` and the worker's loop build one step object from
    one function; no bench takes a step of its own (backward, clipping, optimizer calls)."""
    import ast
    import inspect

    from raytuner.tools.bench import step as step_bench
    from raytuner.tools.bench import train as bench
    from raytuner.train import loop, step

    assert loop.train_step is bench.train_step is step.train_step
    assert step_bench.step is step
    for module in (bench, step_bench, loop):
        calls = {
            node.func.attr
            for node in ast.walk(ast.parse(inspect.getsource(module)))
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
        }
        own = calls & {"backward", "clip_grad_norm_", "zero_grad", "autocast"}
        assert not own, f"{module.__name__} takes a step of its own: {own}"


def test_rounds_alternate_the_two_sides_and_report_their_spread():
    from raytuner.tools.bench.common import alternate, round_figures

    calls = []
    rates = alternate(3, {"pipeline": lambda r: calls.append(("A", r)) or 10.0 + r,
                          "bare": lambda r: calls.append(("B", r)) or 20.0})  # fmt: skip
    assert calls == [("A", 0), ("B", 0), ("A", 1), ("B", 1), ("A", 2), ("B", 2)]
    figures = round_figures(3, rates, [1.0, 1.0, 1.0], [2.0, 2.0, 2.0])
    assert figures["spread"] == {"pipeline": round(2 / 11, 4), "bare": 0.0}
    with pytest.raises(ValueError, match="at least 1"):
        alternate(0, {"a": lambda r: r})


def test_bench_step_of_both_experts_times_each_experts_steps(capsys):
    """`bench step` of a run of both Wan 2.2 A14B experts (``model.expert = "both"``): the
    steps go to each expert in turn, as training's do, so the figures hold both experts' steps
    and optimizer state (before, every step was the first expert's). Its progress goes to
    stderr, what `bench gpu` keeps of a row ended at its limit: the model built (a row that
    built the 14B for the 1.3B job said nothing in 108 s), then each warm-up step."""
    from diffusers import WanTransformer3DModel
    from torch.nn.modules.module import register_module_forward_hook

    from raytuner.config import load_job
    from raytuner.families import get_family
    from raytuner.tools.bench.step import bench_step

    settings = ['model.pretrained="tiny"', 'model.expert="both"', "preprocess.resolution=64"]
    settings += ["data.frames=[5]", 'model.dtype="float32"', "memory.blocks_to_swap=0"]
    job = load_job(Path(__file__).resolve().parents[2] / "jobs" / "wan22-a14b.toml", settings)
    ran = []
    hook = register_module_forward_hook(
        lambda m, *_: ran.append(id(m)) if isinstance(m, WanTransformer3DModel) else None
    )
    try:
        result = bench_step(job, get_family("wan22", "both"), steps=2, as_json=True,
                            warmup=1, planned=False)  # fmt: skip
    finally:
        hook.remove()
    assert result["experts"] == 2 and result["samples_per_s"] > 0
    err = capsys.readouterr().err.splitlines()
    said = [line for line in err if line.startswith("bench step: ")]
    assert re.fullmatch(r"bench step: wan22 \(tiny\): [\d.,]+ M parameters, [\d.,]+ M trained, "
                        r"built in [\d.]+ s", said[0]), said  # fmt: skip
    assert re.fullmatch(r"bench step: warm-up step 1 of 1: [\d.]+ s in", said[1]), said
    assert said[2:] == ["bench step: timing 2 steps"], said
    turns = [m for i, m in enumerate(ran) if i == 0 or ran[i - 1] != m]  # a step's forwards: one
    assert len(turns) == 3 and turns[0] == turns[2] != turns[1], "the experts did not take turns"


@pytest.mark.slow
def test_bench_step_shards_over_a_process_group_of_one():
    """`bench step` with ``scaling.strategy = "fsdp"`` (a process of its own: it starts a
    process group): the sharded step trains, and plan's sharded worker is what it compares."""
    import subprocess
    import sys

    args = ["bench", "step", "jobs/tiny.toml", "--steps", "2", "--json"]
    args += ["--set", 'scaling.strategy="fsdp"', "--set", 'train.mode="full"']
    done = subprocess.run(
        [sys.executable, "-m", "raytuner", *args],
        cwd=Path(__file__).resolve().parents[2],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    figures = json.loads(done.stdout.strip().splitlines()[-1])
    assert figures["strategy"] == "fsdp" and figures["samples_per_s"] > 0
    assert figures["planned_bytes"] > 0


def test_bench_gpu_says_it_needs_a_gpu(capsys):
    """Without CUDA, `bench gpu` refuses in one line (exit 2), and an unknown family is named
    (the plan and the runner: tests/bench/test_bench_gpu.py)."""
    from raytuner.cli import main

    assert main(["bench", "gpu"]) == 2
    err = capsys.readouterr().err
    assert "needs a CUDA GPU" in err and len(err.strip().splitlines()) == 1
    assert main(["bench", "gpu", "--families", "sd15,nope"]) == 2
    assert "unknown families ['nope']" in capsys.readouterr().err
