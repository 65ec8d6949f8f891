"""The commands print nothing a raytuner user cannot act on: `raytuner check` and `raytuner plan`
of every shipped job write raytuner's own lines alone on stderr, and a short `raytuner run` and
`raytuner sample` (while another Ray runs on the machine) none of the noise raytuner used to
cause or let through: bitsandbytes' CPU kernel warning, transformers' torchvision fallback, Ray
Data's `ray_remote_args` deprecation of raytuner's own call, diffusers' "No LoRA keys" for the
text encoders, Ray Train's PlacementGroupCleaner tracebacks. `raytuner run` and `raytuner
sample` each run as a process of their own (`python -m raytuner`), as a user runs them. The
checks of all shipped jobs run one after the other in one process, and the plans in another,
each command through what `python -m raytuner` runs (`raytuner.cli.main`): most of a check is
its process's imports (torch's), ~2 s of CPU a job. Each command's exit code and lines are told
apart by marker lines and asserted per job; a line a library prints once, when a command first
imports it, lands with the first job whose command does (that job's test fails)."""

from __future__ import annotations

import json
import logging
import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import pytest
from PIL import Image

from raytuner import quiet, runtime

REPO = Path(__file__).resolve().parents[2]
JOBS = sorted(p.name for p in (REPO / "jobs").glob("*.toml"))

# a line of raytuner's own log (the CLI's format: "<date> <time> <logger>: <message>")
RAYTUNER_LINE = re.compile(r"^\d{4}-\d\d-\d\d [\d:,]+ raytuner(\.[\w.]+)?: ")
NOISE = re.compile(
    "|".join(
        [
            r"Failed to load CPU gemm_4bit_forward",
            r"requires torchvision \(not installed\)",
            r"`ray_remote_args` is deprecated",
            r"No LoRA keys associated to",
            r"Found multiple active Ray instances",
            r"PlacementGroupCleaner",
            r"Failed to query Ray Train Controller",
            r"Progress bars disabled",
            r"core_worker\.cc:\d+: Actor with class name",
            r"Starting execution of Dataset|Execution plan of Dataset|execution finished in",
            r"Data sink \w+ finished",
        ]
    )
)


def raytuner(*args: str, env: dict[str, str] | None = None, timeout: float = 300):
    started = time.monotonic()
    result = subprocess.run(
        [sys.executable, "-m", "raytuner", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **(env or {})},
    )
    print(f"raytuner {args[0]} {args[1]}: {time.monotonic() - started:.1f} s")
    return result


# one process, several raytuner commands: `raytuner.cli.main` for each, between marker lines on
# stdout and stderr; the marker after a command carries its exit code. What the process writes
# before the first command (its imports) is the first command's, after the last the last's.
ONE_PROCESS = """
import json, sys
from raytuner.cli import main

for i, args in enumerate(json.loads(sys.argv[1])):
    for stream in (sys.stdout, sys.stderr):
        print(f"<<<raytuner command {i}>>>", file=stream, flush=True)
    code = main(args)
    for stream in (sys.stdout, sys.stderr):
        print(f"<<<raytuner command {i} exit {code}>>>", file=stream, flush=True)
"""
MARKER = re.compile(r"^<<<raytuner command (\d+)(?: exit (-?\d+))?>>>$")


def in_one_process(commands: dict[str, list[str]], timeout: float = 540) -> dict:
    """The raytuner commands ``commands`` (a job -> its command's arguments), one after the
    other in one process: a job -> its command's CompletedProcess (exit code, and the stdout
    and stderr it wrote); exit code -1 for a command the process never finished."""
    if not commands:
        return {}
    started, jobs = time.monotonic(), list(commands)
    result = subprocess.run(
        [sys.executable, "-c", ONE_PROCESS, json.dumps([commands[j] for j in jobs])],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    print(f"{len(jobs)} commands in one process: {time.monotonic() - started:.1f} s")
    out = {j: subprocess.CompletedProcess(commands[j], -1, "", "") for j in jobs}
    for stream in ("stdout", "stderr"):
        current = jobs[0]
        for line in getattr(result, stream).splitlines(keepends=True):
            if m := MARKER.match(line.rstrip("\n")):
                current = jobs[int(m.group(1))]
                if m.group(2) is not None and stream == "stdout":
                    out[current].returncode = int(m.group(2))
            else:
                done = out[current]
                setattr(done, stream, getattr(done, stream) + line)
    for done in out.values():  # the process's own end (a crash) where a command did not end
        if done.returncode == -1:
            done.stderr += f"(the process exited {result.returncode}):\n{result.stderr[-3000:]}"
    return out


def foreign(stderr: str) -> list[str]:
    """The lines of stderr that are not raytuner's own log lines."""
    return [line for line in stderr.splitlines() if line.strip() and not RAYTUNER_LINE.match(line)]


@pytest.fixture(scope="module")
def images(tmp_path_factory) -> Path:
    """One image: the GPU jobs' `/data/images` placeholder pointed at a folder that exists,
    with the edit jobs' references folder (`references = "control"`) holding its reference."""
    folder = tmp_path_factory.mktemp("quiet") / "images"
    (folder / "control").mkdir(parents=True)
    Image.new("RGB", (64, 64)).save(folder / "a.png")
    Image.new("RGB", (64, 64)).save(folder / "control" / "a.png")
    return folder


def image_set(job: str, images: Path) -> list[str]:
    return [] if job == "tiny.toml" else ["--set", f"data.images={images}"]


PLANS = ["tiny.toml", pytest.param("sdxl.toml", marks=pytest.mark.slow)]  # sdxl: 20-50 s


@pytest.fixture(scope="module")
def commands(images, request) -> Iterator[dict[str, Future]]:
    """The commands of this module's selected `plan` and `check` tests: the checks in one
    process, the plans in another, the two processes at once (one a core)."""
    selected = {item.nodeid for item in request.session.items}

    def chosen(test, jobs: list[str]) -> list[str]:
        return [j for j in jobs if f"{request.node.nodeid}::{test.__name__}[{j}]" in selected]

    plans = {
        job: ["plan", f"jobs/{job}", "--gpu-memory", "80GiB", *image_set(job, images)]
        for job in chosen(test_plan_writes_only_raytuner_lines, ["sdxl.toml", "tiny.toml"])
    }
    checks = {
        job: ["check", f"jobs/{job}", *image_set(job, images)]
        for job in chosen(test_check_of_every_shipped_job_writes_only_raytuner_lines, JOBS)
    }
    with ThreadPoolExecutor(max_workers=2) as pool:
        yield {
            "plan": pool.submit(in_one_process, plans),
            "check": pool.submit(in_one_process, checks),
        }


@pytest.mark.parametrize("job", JOBS)
def test_check_of_every_shipped_job_writes_only_raytuner_lines(job, commands):
    result = commands["check"].result()[job]
    assert result.returncode == 0, result.stderr
    assert foreign(result.stderr) == []


@pytest.mark.parametrize("job", PLANS)
def test_plan_writes_only_raytuner_lines(job, commands):
    result = commands["plan"].result()[job]
    assert result.returncode == 0, result.stderr
    assert "the training worker fits in" in result.stdout
    assert foreign(result.stderr) == []


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_run_and_sample_print_none_of_the_noise(ray_local, tmp_path):
    """`ray_local` is a second Ray on the machine while the run starts its own: Ray Train's
    PlacementGroupCleaner used to fail there ("Found multiple active Ray instances"). The run
    has its dashboard, as a user's local run has (the state API the cleaner asks)."""
    sets = ["--set", f"train.output={tmp_path / 'runs'}", "--set", f"data.cache={tmp_path}/cache"]
    run = raytuner(
        "run", "jobs/tiny.toml", *sets, "--set", "train.max_steps=4",
        env={"RAYTUNER_LOCAL_DASHBOARD": "1"}, timeout=540,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    assert "trained 4 steps" in run.stdout
    assert (tmp_path / "runs" / "tiny" / "validation" / "step_000004.png").is_file()
    out = tmp_path / "samples"
    sample = raytuner(
        "sample", "jobs/tiny.toml", *sets, "--prompt", "a red circle", "--steps", "2",
        "--out", str(out),
    )  # fmt: skip
    assert sample.returncode == 0, sample.stderr[-3000:]
    assert (out / "00-a-red-circle-seed0.png").is_file()
    for result in (run, sample):
        assert [line for line in result.stderr.splitlines() if NOISE.search(line)] == []


def test_each_filter_drops_its_message_and_nothing_else():
    kept: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record):
            kept.append(record.getMessage())

    quiet.install()
    quiet.install()  # twice: one filter each
    cases = [
        (
            "bitsandbytes.backends.cpu.ops",
            "Failed to load CPU gemm_4bit_forward from kernels-community: %s. Please make sure",
            "bitsandbytes: another warning",
        ),
        (
            "transformers.utils.import_utils",
            "`CLIPImageProcessor` requires torchvision (not installed); falling back to "
            "`CLIPImageProcessorPil` for backward compatibility.",
            "`CLIPImageProcessor` requires something else",
        ),
        (
            "diffusers.loaders.lora_base",
            "No LoRA keys associated to CLIPTextModelWithProjection found with the "
            "prefix='text_encoder_2'. This is safe to ignore",
            "No LoRA keys associated to UNet2DConditionModel found with the prefix='unet'.",
        ),
        (
            "ray.data._internal.progress",
            "Progress bars disabled. To enable, set `ray.data.DataContext...`",
            "Progress bars for operators disabled.",
        ),
        (
            "ray.data._internal.execution.streaming_executor",
            "\u2714\ufe0f  Dataset dataset_0354Js6zWihl_0 execution finished in 16.85 seconds",
            "\u26a0\ufe0f  Dataset dataset_0354Js6zWihl_0 execution failed",
        ),
        (
            "ray.data.dataset",
            "Data sink RaytunerCacheParts finished. 37 rows and 142.2KiB data written.",
            "Data sink RaytunerCacheParts failed.",
        ),
    ]
    for name, dropped, other in cases:
        logger = logging.getLogger(name)
        assert sum(isinstance(f, quiet.Drop) for f in logger.filters) == 1
        handler = Keep()
        logger.addHandler(handler)
        try:
            logger.warning(dropped, *(["No module named 'kernels'"] * ("%s" in dropped)))
            logger.warning(other)
            logger.error(dropped.replace("%s", "x"))  # a level is no way through
        finally:
            logger.removeHandler(handler)
    assert kept == [other for _, _, other in cases]
    for name, _ in quiet.WITHOUT_STATE_API:  # only where Ray has no state API
        assert not any(isinstance(f, quiet.Drop) for f in logging.getLogger(name).filters)


# what Ray's C++ logging writes on stderr, in the driver and (forwarded) from an actor
CORE_WORKER_LINES = [
    "[2026-11-26 14:04:39,516 E 5502 5502] core_worker.cc:2465: Actor with class name: "
    "'MapWorker(MapBatches(Encoder))' and ID: 'd2dd91e0027a081d47d7402701000000' has "
    "constructor arguments in the object store and max_restarts > 0. If the arguments in the "
    "object store go out of scope or are lost, the actor restart will fail. See "
    "https://github.com/ray-project/ray/issues/53727 for more details.",
    "\x1b[36m(TrainController pid=6442)\x1b[0m [2026-11-26 14:05:30,673 E 6442 6501] "
    "core_worker.cc:2465: Actor with class name: 'PreemptionWatcher' and ID: "
    "'e9fecc6e35e707a32e77a89201000000' has constructor arguments in the object store and "
    "max_restarts > 0. If the arguments in the object store go out of scope or are lost, the "
    "actor restart will fail.",
]


def test_the_stderr_filter_drops_rays_core_worker_lines_and_passes_every_other_line():
    """A process that writes straight to its file descriptor 2, as Ray's C++ logging does:
    the two lines are gone, every other line arrives whole and in order (a partial line too,
    once the process ends), also an error of the same kind about another actor."""
    other = CORE_WORKER_LINES[0].replace("MapWorker(MapBatches(Encoder))", "Validator")
    writes = [
        "one\n",
        CORE_WORKER_LINES[0] + "\n",
        "[2026-11-26 14:05:30,673 E 6442 6501] core_worker.cc:99: Failed to connect to GCS\n",
        CORE_WORKER_LINES[1] + "\n",
        other + "\n",
        "two, then a partial line",
    ]
    code = (
        "import os, sys\n"
        "from raytuner import quiet\n"
        "with quiet.stderr_filtered():\n"
        f"    for text in {writes!r}:\n"
        "        os.write(2, text.encode())\n"
        "print('after', file=sys.stderr)\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=REPO
    )
    assert result.returncode == 0, result.stderr
    expected = [writes[0], writes[2], other + "\n", writes[5] + "after\n"]
    assert result.stderr == "".join(expected)


def test_every_worker_knows_its_cluster_and_has_the_filters(ray_local):
    """The job's worker setup hook (``runtime.setup_worker``): Ray's state API in any worker
    finds this cluster, not another Ray on the machine. The session's Ray has no dashboard:
    it advertises a port of its own, not Ray's default 8265 (another Ray's dashboard may be
    there), and its workers drop Ray Train's state actor's warning about the missing API."""
    from ray._private import ray_constants

    @ray_local.remote(num_cpus=0)
    def probe():
        loggers = [name for name, _ in quiet.DROPPED + quiet.WITHOUT_STATE_API]
        has = [
            any(isinstance(f, quiet.Drop) for f in logging.getLogger(n).filters) for n in loggers
        ]
        return os.environ.get("RAY_ADDRESS"), has

    address, has = ray_local.get(probe.remote())
    assert address == ray_local.get_runtime_context().gcs_address
    assert all(has), has
    gcs = ray_local._private.worker.global_worker.gcs_client
    key, space = ray_constants.DASHBOARD_ADDRESS, ray_constants.KV_NAMESPACE_DASHBOARD
    advertised = gcs.internal_kv_get(key.encode(), space)
    assert advertised and not advertised.endswith(b":8265"), advertised
    assert os.environ.get(runtime.NO_STATE_API) is None  # set in the workers only
