"""Cache operations as a user runs them: real `raytuner` subprocesses over real files.

Two preprocess runs at once, a driver killed midway, `cache verify [--repair]` and `cache gc`.
Every CLI call starts its own local Ray (RAY_ADDRESS is removed from its environment) in a
session of its own, so that every process it started, Ray's included, can be found and,
if still alive when it should not be, killed by id. Other Ray clusters on the machine are
never touched (no `ray stop`).

Each such call costs an interpreter start, a torch import and a Ray start, so the tests share
work where that changes nothing they check: the committed cache (and its repairs) are made once
and copied, and commands whose process is not what a test checks (making a cache, a repair, a
re-run after a kill) run in this process through the CLI's own ``main`` (``here``), on the
session's local Ray. Two runs at once and a driver killed midway are real subprocesses.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import psutil
import pyarrow.parquet as pq
import pytest

from raytuner.config import load_job
from raytuner.data import cache
from raytuner.data.reader import CachedDataset, open_dataset
from raytuner.tools.demo_images import make_demo_images

REPO = Path(__file__).resolve().parents[2]
CLI_TIMEOUT_S = 400
_SESSIONS: list[int] = []  # session id (= pid of the CLI) of every command started here


# --- processes -----------------------------------------------------------------------------


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env.pop("RAY_ADDRESS", None)  # never join somebody else's cluster
    env["PYTHONFAULTHANDLER"] = "1"  # a native crash prints the Python stacks
    return env


def _alive(procs: list[psutil.Process]) -> list[psutil.Process]:
    out = []
    for p in procs:
        try:
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                out.append(p)
        except psutil.NoSuchProcess:
            pass
    return out


def _in_session(sid: int) -> list[psutil.Process]:
    """Live processes of the session a CLI call was started in (the CLI and all it spawned)."""
    found = []
    for p in psutil.process_iter():
        try:
            if os.getsid(p.pid) == sid:
                found.append(p)
        except (ProcessLookupError, PermissionError):
            pass
    return _alive(found)


def _names(procs: list[psutil.Process]) -> list[str]:
    out = []
    for p in procs:
        try:
            out.append(f"{p.pid} {p.name()}")
        except psutil.NoSuchProcess:
            out.append(f"{p.pid} (gone)")
    return out


def _kill(procs: list[psutil.Process]) -> None:
    for p in procs:
        with contextlib.suppress(psutil.NoSuchProcess):
            p.kill()
    psutil.wait_procs(procs, timeout=10)


def _reap(sid: int, grace_s: float) -> list[str]:
    """Wait up to ``grace_s`` for the session to empty, then kill what is left (by pid).

    Returns a description of every process that had to be killed.
    """
    deadline = time.monotonic() + grace_s
    while (left := _in_session(sid)) and time.monotonic() < deadline:
        time.sleep(0.2)
    described = _names(left)
    _kill(left)
    return described


@pytest.fixture(autouse=True)
def _kill_what_a_test_left_running():
    """A failing test may leave a CLI (and its Ray) running: end those, and only those."""
    first = len(_SESSIONS)
    yield
    for sid in _SESSIONS[first:]:
        _reap(sid, grace_s=1.0)


@dataclass
class Result:
    code: int
    out: str
    err: str

    def lines(self, prefix: str) -> list[str]:
        return [line for line in self.out.splitlines() if line.startswith(prefix)]


def start_cli(logs: Path, *args: str) -> subprocess.Popen:
    """``python -m raytuner ARGS`` from the repository root, output into files under ``logs``."""
    logs.mkdir(parents=True, exist_ok=True)
    n = len(list(logs.glob("*.out")))
    out, err = logs / f"{n:02d}.out", logs / f"{n:02d}.err"
    with out.open("w") as fo, err.open("w") as fe:
        proc = subprocess.Popen(
            [sys.executable, "-m", "raytuner", *args],
            cwd=REPO,
            env=_env(),
            stdout=fo,
            stderr=fe,
            start_new_session=True,
        )
    _SESSIONS.append(proc.pid)
    proc.logs = (out, err)  # type: ignore[attr-defined]
    return proc


def finish(proc: subprocess.Popen, timeout: float = CLI_TIMEOUT_S) -> Result:
    """Wait for the command; its Ray must be gone soon after it returns."""
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        _reap(proc.pid, grace_s=0)
        proc.wait()
        pytest.fail(f"{proc.args} ran longer than {timeout} s")
    leaked = _reap(proc.pid, grace_s=20)
    out, err = (p.read_text() for p in proc.logs)  # type: ignore[attr-defined]
    assert not leaked, f"{proc.args[3:]} left processes running after it returned: {leaked}"
    return Result(proc.returncode, out, err)


def here(*args: str) -> Result:
    """A command run in this process through the CLI's own ``main``: its exit code and output,
    without an interpreter start, a torch import and a Ray start per call. Commands that start
    no Ray (``cache gc``, ``cache verify`` without ``--repair``), and ones that need a Ray where
    the test holds the session's (``ray_local``): the CLI then uses that one."""
    from raytuner.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(list(args))
    return Result(code=code, out=out.getvalue(), err=err.getvalue())


# --- jobs and caches -----------------------------------------------------------------------


def write_job(path: Path, images: Path, cache_dir: Path, resolution: int = 64) -> Path:
    q = json.dumps  # a JSON string of a plain path is a TOML basic string
    path.write_text(
        "[model]\n"
        'family = "sdxl"\n'
        'pretrained = "tiny"\n'
        "[data]\n"
        f"images = {q(str(images))}\n"
        f"cache = {q(str(cache_dir))}\n"
        "[preprocess]\n"
        f"resolution = {resolution}\n"
        "bucket_step = 16\n"
        "batch_size = 2\n"
        "[train]\n"
        f"output = {q(str(path.parent / 'runs'))}\n"
    )
    return path


def version_of(job: Path) -> cache.Version:
    config = load_job(job)
    return cache.Version(config.data.cache, cache.fingerprint(config.model, config.preprocess))


def dataset_of(job: Path) -> CachedDataset:
    config = load_job(job)
    return open_dataset(config.data.cache, cache.fingerprint(config.model, config.preprocess))


def indexed(job: Path) -> list[dict]:
    """The committed index's rows."""
    version = version_of(job)
    return version.read(version.manifest()["index"]["path"]).to_pylist()


def distinct_images(folder: Path) -> dict[str, str]:
    """content hash -> first relative path (what one trained row per content means)."""
    out: dict[str, str] = {}
    for p in sorted(folder.rglob("*.png")):
        out.setdefault(hashlib.sha256(p.read_bytes()).hexdigest(), p.relative_to(folder).as_posix())
    return out


def check_report(report: dict) -> None:
    assert report["total"] == (
        report["encoded"] + report["already_cached"] + report["duplicates"] + len(report["skipped"])
    ), report


def run_folders(version: cache.Version) -> set[str]:
    return {p.name for p in Path(version.path("parts")).iterdir()}


def referenced_runs(manifest: dict) -> set[str]:
    files = manifest["latents"] + manifest["text"] + [manifest["index"], manifest["captions"]]
    return {f["path"].split("/")[1] for f in files}


def complete_new_part(version: cache.Version, old_runs: set[str]) -> Path | None:
    """A latents part file of a run not in ``old_runs`` whose Parquet footer is written."""
    for p in sorted(Path(version.path("parts")).glob("*/latents/status=ok/*.parquet")):
        if p.parts[-4] in old_runs:
            continue
        try:
            pq.read_metadata(p)
        except Exception:  # still being written
            continue
        return p
    return None


def latent_of(job: Path, key: str) -> bytes:
    """The latent bytes of ``key`` where the committed index says they are."""
    (row,) = [r for r in indexed(job) if r["key"] == key]
    data = Path(version_of(job).path(row["latent_file"])).read_bytes()
    size = math.prod(row["latent_shape"]) * 2  # bfloat16
    return data[row["latent_at"] : row["latent_at"] + size]


def corrupt_latent(version: cache.Version, rel: str) -> tuple[str, bytes]:
    """Zero 32 bytes in the middle of the first latent of a part file: bit rot that Parquet
    still reads (zeros are finite values), which only the manifest's sha256 and the cell's
    checksum can notice.

    Returns the row's key and its latent bytes before the damage.
    """
    path = Path(version.path(rel))
    table = pq.read_table(path)
    key, cell = table.column("key")[0].as_py(), table.column("latent")[0].as_py()
    data = bytearray(path.read_bytes())
    at = data.find(cell)
    assert at > 0 and data.find(cell, at + 1) == -1, "latent bytes not found once in the file"
    middle = at + len(cell) // 2
    data[middle : middle + 32] = bytes(32)
    path.write_bytes(bytes(data))
    damaged = pq.read_table(path)
    assert damaged.column("latent")[0].as_py() != cell  # the damage is real ...
    assert damaged.num_rows == table.num_rows  # ... and the file still reads
    return key, cell


@pytest.fixture(scope="module")
def committed(ray_local, tmp_path_factory) -> Path:
    """A folder with images/ (6 images) and cache/ holding their committed 64 px version.

    Tests copy the cache (never change this one) and point their job at these images. It is
    made by `raytuner preprocess` in this process on the session's Ray (see ``here``): the
    tests start their own CLIs where a CLI's process is what they check.
    """
    root = tmp_path_factory.mktemp("committed")
    images = make_demo_images(root / "images", per_aspect=2)
    job = write_job(root / "job.toml", images, root / "cache")
    done = here("preprocess", str(job))
    assert done.code == 0, done.err[-3000:]
    return root


def copy_committed(committed: Path, tmp_path: Path, images: Path | None = None) -> Path:
    """A copy of the committed cache under ``tmp_path``; the job reads ``images`` (default:
    the committed images, which no test changes)."""
    shutil.copytree(committed / "cache", tmp_path / "cache")
    images = images or committed / "images"
    return write_job(tmp_path / "job.toml", images, tmp_path / "cache")


# --- 1. two runs at once -------------------------------------------------------------------


@pytest.mark.slow  # two runs on 2 cores: 70-120 s
@pytest.mark.timeout(900)
def test_two_preprocess_runs_at_once_both_commit_a_valid_cache(tmp_path):
    images = make_demo_images(tmp_path / "images", per_aspect=2)
    wanted = distinct_images(images)
    job = write_job(tmp_path / "job.toml", images, tmp_path / "cache")
    logs = tmp_path / "logs"
    reports = [tmp_path / "report-a.json", tmp_path / "report-b.json"]

    start = time.monotonic()
    runs = [start_cli(logs, "preprocess", str(job), "--report", str(r)) for r in reports]
    results = [finish(p) for p in runs]
    print(f"two runs at once took {time.monotonic() - start:.0f} s")
    for r in results:
        assert r.code == 0, r.err[-3000:]
    written = [json.loads(r.read_text()) for r in reports]
    for report in written:
        check_report(report)
        assert report["total"] == len(wanted) and not report["skipped"]
    print("encoded by each run:", [r["encoded"] for r in written])

    version = version_of(job)
    manifest = version.manifest()
    assert manifest is not None
    assert manifest["report"] in written  # the commit of one of the two runs, whole
    assert len(run_folders(version)) == 2  # both runs wrote their own parts

    verify = here("cache", "verify", str(job))
    assert verify.code == 0, verify.out + verify.err[-2000:]
    assert not verify.lines("bad ")
    assert f"{version.root}: ok" in verify.out

    dataset = dataset_of(job)
    assert len(dataset) == len(wanted)
    assert sorted(dataset.paths) == sorted(wanted.values())
    assert sorted(r["key"] for r in indexed(job)) == sorted(wanted)
    buckets = dataset.buckets
    for bucket in set(buckets):  # every row has its latent and its caption's embeddings
        rows = [i for i, b in enumerate(buckets) if b == bucket]
        batch = dataset.batch(rows)
        assert batch["latent"].shape[0] == len(rows)
        assert all(batch[n].shape[0] == len(rows) for n in dataset.manifest["text_tensors"])


# --- 2. the driver killed midway -----------------------------------------------------------


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_killed_driver_keeps_the_committed_version_and_its_parts_are_reused(
    ray_local, committed, tmp_path
):
    # The committed version of the 6 images, over a copy of them that can grow.
    images = shutil.copytree(committed / "images", tmp_path / "images")
    job = copy_committed(committed, tmp_path, images)
    logs = tmp_path / "logs"
    version = version_of(job)
    v1_manifest = Path(version.path(cache.MANIFEST)).read_bytes()
    v1_rows = len(dataset_of(job))
    assert v1_rows == len(distinct_images(images)) == 6
    v1_runs = run_folders(version)

    make_demo_images(images / "more", per_aspect=4, seed=1)  # 12 new images
    wanted = distinct_images(images)
    new_images = len(wanted) - v1_rows
    assert new_images == 12

    # batch_size=1 (not part of the fingerprint: same version) writes one part per image; the
    # driver is killed as soon as the first of them is complete, with most images still to do
    proc = start_cli(logs, "preprocess", str(job), "--set", "preprocess.batch_size=1")
    driver = psutil.Process(proc.pid)
    deadline = time.monotonic() + 300
    while (part := complete_new_part(version, v1_runs)) is None:
        assert proc.poll() is None, (
            "preprocess ended before a new part appeared: " + proc.logs[1].read_text()[-3000:]
        )
        assert time.monotonic() < deadline, "no new part file within 300 s"
        time.sleep(0.05)
    ours = [driver, *driver.children(recursive=True)]  # its local Ray: ours to clean up
    assert proc.poll() is None, "preprocess finished before it could be killed"
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    deadline = time.monotonic() + 3
    while _alive(ours) and time.monotonic() < deadline:
        time.sleep(0.1)
    survivors = _alive(ours) + [p for p in _in_session(proc.pid) if p not in ours]
    for p in list(survivors):
        with contextlib.suppress(psutil.NoSuchProcess):
            survivors += p.children(recursive=True)
    survivors = _alive(survivors)
    print(f"killed the driver; these of its processes outlived it by 3 s: {_names(survivors)}")
    _kill(survivors)
    assert not _alive(ours) and not _in_session(proc.pid)

    # The commit is the old one, whole (the `cache verify` at the end re-hashes every file).
    assert Path(version.path(cache.MANIFEST)).read_bytes() == v1_manifest
    assert len(dataset_of(job)) == v1_rows
    assert part.is_file()
    pq.read_metadata(part)  # the killed run left complete part files
    killed_run = part.parts[-4]

    # the run after the kill: in this process, on the session's Ray (the killed driver's
    # processes are all gone, checked above; which Ray encodes changes nothing here)
    report_path = tmp_path / "report.json"
    again = here("preprocess", str(job), "--report", str(report_path))
    assert again.code == 0, again.err[-3000:]
    report = json.loads(report_path.read_text())
    print("re-run after the kill:", {k: report[k] for k in ("encoded", "already_cached")})
    check_report(report)
    assert report["total"] == len(wanted) and report["duplicates"] == 0 and not report["skipped"]
    assert report["already_cached"] > v1_rows  # it reused what the killed run had finished
    assert report["encoded"] < new_images

    dataset = dataset_of(job)
    assert len(dataset) == len(wanted)
    assert sorted(r["key"] for r in indexed(job)) == sorted(wanted)
    manifest = version.manifest()
    assert killed_run in referenced_runs(manifest)
    verify = here("cache", "verify", str(job))
    assert verify.code == 0, verify.out + verify.err[-2000:]
    assert not _alive(ours)


# --- 3. verify and repair ------------------------------------------------------------------


@dataclass
class Repair:
    """A copy of the committed cache with one file damaged, then `cache verify --repair` of it."""

    job: Path  # the job over the committed images and this cache (tests copy the cache)
    entry: dict  # the damaged file's manifest entry, from before the repair
    total: int  # rows of the committed version
    fixed: Result | None = None  # `cache verify --repair`
    bad: Result | None = None  # `cache verify` before it
    key: str = ""  # for a damaged latent: its row ...
    original: bytes = b""  # ... and the latent before the damage


@pytest.fixture(scope="module")
def repairs(ray_local, committed, tmp_path_factory) -> dict[str, Repair]:
    """Two repaired copies of the committed cache: "part", whose first part file had a latent
    damaged (and was verified before the repair too), and "index", whose index file was lost.
    The repairs run in this process on the session's Ray, one after the other. Tests only read
    these caches, or copy them."""
    found = {}
    for name in ("part", "index"):
        job = copy_committed(committed, tmp_path_factory.mktemp(f"repair-{name}"))
        manifest = version_of(job).manifest()
        entry = manifest["latents"][0] if name == "part" else manifest["index"]
        found[name] = Repair(job, entry, len(dataset_of(job)))
    part, index = found["part"], found["index"]
    part.key, part.original = corrupt_latent(version_of(part.job), part.entry["path"])
    Path(version_of(index.job).path(index.entry["path"])).unlink()
    part.bad = here("cache", "verify", str(part.job))
    part.fixed, index.fixed = [
        here("cache", "verify", str(r.job), "--repair") for r in found.values()
    ]
    return found


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_verify_finds_a_corrupt_part_and_repair_reencodes_only_its_rows(repairs, tmp_path):
    repaired = repairs["part"]
    job, entry, total = repaired.job, repaired.entry, repaired.total
    version = version_of(job)

    bad = repaired.bad
    assert bad.code == 1, bad.out + bad.err[-2000:]
    found = (  # the file, and the cell: its row and column
        f"bad {entry['path']}: sha256 differs from the manifest; row 0, column latent: its "
        "checksum differs from the one written with it"
    )
    assert bad.lines("bad ") == [found]
    assert f"{version.root}: 1 bad file(s)" in bad.out

    fixed = repaired.fixed
    assert fixed.code == 0, fixed.out + fixed.err[-3000:]
    assert fixed.lines("bad ") == [found]
    assert fixed.out.rstrip().endswith(f"{version.root}: ok")
    printed = re.search(r"^\s+encoded\s+(\d+)$", fixed.out, re.MULTILINE)
    assert printed and int(printed.group(1)) == entry["rows"]
    report = json.loads(Path(version.path(cache.REPORT)).read_text())
    check_report(report)
    assert report["encoded"] == entry["rows"]
    assert report["already_cached"] == total - entry["rows"]
    assert entry["path"] not in {f["path"] for f in version.manifest()["latents"]}

    again = here("cache", "verify", str(job))  # reads, never writes
    assert again.code == 0, again.out + again.err[-2000:]
    assert len(dataset_of(job)) == total
    assert latent_of(job, repaired.key) == repaired.original  # re-encoded, not the damage


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_preprocess_after_repair_does_not_bring_the_damaged_part_back(
    ray_local, committed, repairs, tmp_path
):
    """Repair must take the damaged file out for good: a later run lists part files anew,
    and a damaged file still on the list would be committed again with a fresh sha256
    (verify ok) and trained on."""
    repaired = repairs["part"]
    shutil.copytree(repaired.job.parent / "cache", tmp_path / "cache")  # with the .corrupt file
    job = write_job(tmp_path / "job.toml", committed / "images", tmp_path / "cache")
    version = version_of(job)
    entry, key, original = repaired.entry, repaired.key, repaired.original
    fixed = repaired.fixed
    assert fixed.code == 0, fixed.out + fixed.err[-3000:]
    assert latent_of(job, key) == original

    again = here("preprocess", str(job))  # nothing changed: nothing to do
    assert again.code == 0, again.err[-3000:]
    verify = here("cache", "verify", str(job))
    assert verify.code == 0, verify.out + verify.err[-2000:]
    assert latent_of(job, key) == original
    assert entry["path"] not in {f["path"] for f in version.manifest()["latents"]}


@pytest.mark.slow  # only for the committed cache it copies; the commands here start no Ray
@pytest.mark.timeout(300)
def test_verify_names_a_deleted_index(committed, tmp_path):
    job = copy_committed(committed, tmp_path)
    version = version_of(job)
    index = version.manifest()["index"]["path"]
    Path(version.path(index)).unlink()
    bad = here("cache", "verify", str(job))
    assert bad.code == 1, bad.out + bad.err[-2000:]
    assert bad.lines("bad ") == [f"bad {index}: missing"]
    assert f"{version.root}: 1 bad file(s)" in bad.out


# `cache verify` and a preprocess's driver read every data file of a version into memory. A
# reader on Arrow's worker threads could drop its last reference to that memory after the read
# returned; at interpreter exit the worker could not take the GIL and the process aborted
# (exit 134, about 1 run in 30 under load). The readers now start no worker thread at all.
ARROW_THREADS = """
import os, sys
from raytuner.data import cache, cells, verify
version = cache.Version(sys.argv[1], sys.argv[2])
before = len(os.listdir("/proc/self/task"))
bad = verify.verify(version)
for rel in version.part_files(cache.LATENTS) + version.part_files(cache.TEXT):
    cells.describe(version, rel, version.manifest()["dtype"])
print(before, len(os.listdir("/proc/self/task")), len(bad))
"""


@pytest.mark.slow  # only for the committed cache it reads; no Ray
@pytest.mark.timeout(300)
def test_verify_and_locate_read_on_no_arrow_worker_thread(committed, tmp_path):
    job = copy_committed(committed, tmp_path)
    version = version_of(job)
    args = [sys.executable, "-c", ARROW_THREADS, str(Path(version.root).parent), version.fp]
    done = subprocess.run(args, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    before, after, bad = map(int, done.stdout.split())
    assert bad == 0
    assert after == before, f"reading the cache started {after - before} native thread(s)"


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_repair_rebuilds_a_deleted_index(repairs, tmp_path):
    """A lost index only costs re-hashing the images: nothing is re-encoded."""
    repaired = repairs["index"]
    job, total = repaired.job, repaired.total
    version = version_of(job)
    fixed = repaired.fixed
    assert fixed.code == 0, fixed.out + fixed.err[-3000:]
    assert fixed.lines("bad ") == [f"bad {repaired.entry['path']}: missing"]
    report = json.loads(Path(version.path(cache.REPORT)).read_text())
    check_report(report)
    assert report["encoded"] == 0 and report["already_cached"] == total
    again = here("cache", "verify", str(job))  # reads, never writes
    assert again.code == 0, again.out + again.err[-2000:]
    assert len(dataset_of(job)) == total


# --- 4. gc ---------------------------------------------------------------------------------


def _deleted(result: Result) -> set[str]:
    return {line[len("deleted ") :] for line in result.lines("deleted ")}


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_gc_deletes_other_versions_and_unreferenced_runs_only(ray_local, committed, tmp_path):
    # The version to keep: the committed 64 px one, over a copy of its images that can change.
    images = shutil.copytree(committed / "images", tmp_path / "images")
    job = copy_committed(committed, tmp_path, images)
    keep = version_of(job)
    (base,) = run_folders(keep)
    # Another version in the same cache: 96 px, over one image of each aspect.
    few = make_demo_images(tmp_path / "images96", per_aspect=1)
    job96 = write_job(tmp_path / "job96.toml", few, tmp_path / "cache", resolution=96)
    other = version_of(job96)
    assert other.fp != keep.fp

    # The run that encodes 3 extra images, and the other version's first run (in this process,
    # on the session's Ray: these only make what gc then works on).
    make_demo_images(images / "extra", per_aspect=1, seed=5)
    done = [here("preprocess", str(job)), here("preprocess", str(job96))]
    for r in done:
        assert r.code == 0, r.err[-3000:]
    assert other.manifest() is not None
    (extra,) = run_folders(keep) - {base}
    manifest = keep.manifest()
    assert manifest["report"]["encoded"] == 3  # only the extra images
    assert referenced_runs(manifest) == {base, extra}
    rows = len(dataset_of(job))
    assert rows == len(distinct_images(images))

    # An unreferenced run folder written just now (a run may be writing it) and the other
    # version committed just now are young: the default minimum age (1 h) leaves both alone;
    # --min-age-s 0 deletes them, and never a referenced run, however young (the extra
    # images' run). (Old versions, leases, foreign folders: tests/data/test_gc.py.)
    fresh = Path(keep.path("parts/zz-still-writing/latents/status=ok"))
    fresh.mkdir(parents=True)
    shutil.copy(keep.path(manifest["latents"][0]["path"]), fresh / "x.parquet")
    kept = here("cache", "gc", str(job))
    assert kept.code == 0, kept.out + kept.err[-2000:]
    assert _deleted(kept) == set()
    assert Path(other.root).is_dir() and (fresh / "x.parquet").is_file()
    assert run_folders(keep) == {base, extra, "zz-still-writing"}
    swept = here("cache", "gc", str(job), "--min-age-s", "0")
    assert swept.code == 0, swept.out + swept.err[-2000:]
    assert _deleted(swept) == {other.root, keep.path("parts/zz-still-writing")}
    assert not Path(other.root).exists()
    assert run_folders(keep) == {base, extra}
    verify = here("cache", "verify", str(job))
    assert verify.code == 0, verify.out + verify.err[-2000:]
    assert len(dataset_of(job)) == rows


@pytest.mark.slow  # only for the committed cache it copies; gc starts no Ray
@pytest.mark.timeout(300)
def test_gc_leaves_a_long_run_that_is_still_writing_alone(committed, tmp_path):
    """A run folder's own mtime changes only when a direct child is added: a run encoding for
    longer than the minimum age is still writing deeper down, and must not be deleted."""
    job = copy_committed(committed, tmp_path)
    version = version_of(job)
    manifest = version.manifest()
    # A run that started 2 h ago and wrote its latest part file just now.
    run = Path(version.path("parts/20260101-000000-0123abcd"))
    writing = run / "latents" / "status=ok"
    writing.mkdir(parents=True)
    shutil.copy(version.path(manifest["latents"][0]["path"]), writing / "part-0001.parquet")
    two_hours_ago = time.time() - 7200
    for folder in (run, run / "latents"):
        os.utime(folder, (two_hours_ago, two_hours_ago))

    gc = here("cache", "gc", str(job))
    assert gc.code == 0, gc.out + gc.err[-2000:]
    assert _deleted(gc) == set()
    assert (writing / "part-0001.parquet").is_file()
