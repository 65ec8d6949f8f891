"""`raytuner bench preprocess`: the whole preprocess (probe, decode, encode, commit) against
the stream's own steps called in one process without Ray, alternated in rounds; and the time of
each stage of both, so that a slower preprocess names the stage that got slower. Its video mode
(``--clips N``: a video family's job) does the same on N drawn clips (``--frames`` each, a
sample of each): clips/s of the stream against the bare decode + encode loop."""

from __future__ import annotations

import dataclasses
import math
import os
import statistics
import tempfile
import time

import pyarrow as pa
import pyarrow.parquet as pq

from raytuner import runtime
from raytuner.config import DataConfig, JobConfig
from raytuner.data import cache
from raytuner.preprocess.decode import Known, probe_decode
from raytuner.preprocess.encode import Encoder
from raytuner.preprocess.job import decode_spec, update_cache
from raytuner.preprocess.pipeline import rows_per_block
from raytuner.preprocess.progress import clock, since
from raytuner.preprocess.sources import list_source
from raytuner.preprocess.stream_rows import ENCODE
from raytuner.tools.bench.common import (
    alternate,
    load_average,
    print_figures,
    round_figures,
    torch_threads,
    wait_for_quiet,
)


def _bench_data(job: JobConfig, images: int, workdir: str, clips=(0, 0)) -> DataConfig:
    """The job's data, or ``images`` drawn images (three aspect ratios) in a fresh folder, or
    ``clips`` = (count, frames) drawn clips (a sample of ``frames`` frames each)."""
    count, frames = clips
    if count > 0:
        from raytuner.tools.demo_clips import make_demo_clips

        folder = make_demo_clips(os.path.join(workdir, "clips"), count, frames)
        cache_dir = os.path.join(workdir, "cache")
        return DataConfig(images=str(folder), cache=cache_dir, frames=[frames])
    if images <= 0:
        return dataclasses.replace(job.data, cache=os.path.join(workdir, "cache"))
    from raytuner.tools.demo_images import make_demo_images

    folder = make_demo_images(os.path.join(workdir, "images"), per_aspect=math.ceil(images / 3))
    return DataConfig(images=str(folder), cache=os.path.join(workdir, "cache"))


def _bare(job: JobConfig, family, data: DataConfig) -> tuple[int, float, dict]:
    """Probe, decode and encode every image in this process, with the stream's own steps
    (``probe_decode``, then one ``Encoder``) called directly on the stream's blocks, without
    Ray: (images encoded, seconds, the time of each of the two steps)."""
    pre = job.preprocess
    encoder = Encoder(
        family,
        job.model,
        pre.dtype,
        pre.store_std,
        batch_size=pre.batch_size,
        text_dtype=pre.text_storage,
        spread=(pre.text_encoder_offload, max(1, int(pre.gpus_per_actor))),
    )
    sources = data.all_sources()
    listing = [{**r, "known_key": ""} for i, s in enumerate(sources) for r in list_source(i, s)]
    spec = decode_spec(family, data, pre)
    side = max(max(w, h) for w, h in spec.buckets)
    rows = rows_per_block(len(listing), pre.batch_size, side, pre.max_actors)
    # the Encoder builds its models on first use: one image first, off the clock, builds both
    # (as the bare loop always did before timing); then it forgets the captions it encoded
    nothing = Known(frozenset(), frozenset())  # the cache holds nothing yet
    encoder(probe_decode(pa.Table.from_pylist(listing[:1]), sources, spec, nothing))
    encoder.seen = set()
    stages = {name: {"seconds": 0.0, "cpu_seconds": 0.0} for name in ("decode", "encode")}
    start, done = time.perf_counter(), 0
    for i in range(0, len(listing), rows):
        began = clock()
        block = probe_decode(pa.Table.from_pylist(listing[i : i + rows]), sources, spec, nothing)
        decoded, began = since(began), clock()
        done += block.column("status").to_pylist().count(ENCODE)
        encoder(block)
        for name, took in (("decode", decoded), ("encode", since(began))):
            stages[name] = {k: stages[name][k] + took[k] for k in took}
    return done, time.perf_counter() - start, stages


def _stage_figures(runs: list[dict], images: int) -> dict:
    """Each stage's median seconds and CPU seconds over the rounds (a round without the stage:
    0), its milliseconds per encoded image and its share of all the stages' seconds."""
    out, none = {}, {"seconds": 0.0, "cpu_seconds": 0.0}
    for name in dict.fromkeys(name for r in runs for name in r):
        times = [r.get(name, none) for r in runs]
        seconds = statistics.median(t["seconds"] for t in times)
        cpus = [t["cpu_seconds"] for t in times if t["cpu_seconds"] is not None]
        cpu = round(statistics.median(cpus), 3) if cpus else None  # None: timed from outside
        out[name] = {"seconds": round(seconds, 3), "cpu_seconds": cpu}
        out[name]["ms_per_image"] = round(1000 * seconds / max(images, 1), 4)
    total = sum(s["seconds"] for s in out.values()) or 1.0
    return {name: s | {"share": round(s["seconds"] / total, 4)} for name, s in out.items()}


def _latent_bytes(version: cache.Version, manifest: dict) -> tuple[int, int]:
    """(bytes the latent column takes in the Parquet files, bytes of the tensors it holds)."""
    stored = tensor = 0
    itemsize = cache.itemsize(manifest["dtype"])
    for entry in manifest["latents"]:
        meta = pq.read_metadata(version.path(entry["path"]), filesystem=version.fs)
        names = [meta.schema.column(j).name for j in range(meta.num_columns)]
        if "latent" not in names:
            continue  # a file of masks (data.mask)
        col = names.index("latent")
        stored += sum(
            meta.row_group(g).column(col).total_compressed_size for g in range(meta.num_row_groups)
        )
        shapes = version.read(entry["path"], ["latent_shape"]).column(0).to_pylist()
        tensor += sum(math.prod(s) * itemsize for s in shapes)
    return stored, tensor


def bench_preprocess(
    job: JobConfig, family, images: int, as_json: bool, rounds: int = 3, clips=(0, 0)
) -> dict:
    """``rounds`` rounds, each a whole preprocess into a fresh cache folder and then the bare
    loop over the same images (``clips`` = (count, frames): drawn clips); the figures are the
    medians over the rounds (a clip's sample counts as an image: clips/s)."""
    if clips[0] and not family.geometry.frame_multiple:
        raise ValueError(f"bench preprocess --clips: {family.name} trains images only")
    runtime.connect()
    # one thread, like one encoder actor (Ray gives it OMP_NUM_THREADS=1)
    with torch_threads(1), tempfile.TemporaryDirectory(prefix="raytuner-bench-") as workdir:
        data = _bench_data(job, images, workdir, clips)

        def pipeline(r: int) -> dict:
            cache_r = os.path.join(workdir, f"cache-{r}")
            data_r = dataclasses.replace(data, cache=cache_r)
            start = time.perf_counter()
            rep = update_cache(job.model, data_r, job.preprocess, family=family)
            # what follows the report: the index, captions, report and manifest written
            commit = {"seconds": time.perf_counter() - start - rep["seconds"], "cpu_seconds": None}
            return rep | {"stages": rep["stages"] | {"commit": commit}}

        def bare(r: int) -> tuple[int, float, dict]:
            return _bare(job, family, data)

        load_before = load_average()
        sides = alternate(rounds, {"pipeline": pipeline, "bare": bare}, wait_for_quiet)
        load_after = load_average()
        first = os.path.join(workdir, "cache-0")  # every round's cache holds the same rows
        version = cache.Version(first, cache.fingerprint(job.model, job.preprocess))
        stored, tensor = _latent_bytes(version, version.manifest())
    reports = sides["pipeline"]
    rates = {
        "pipeline": [r["encoded"] / r["seconds"] for r in reports],
        "bare": [done / seconds for done, seconds, _ in sides["bare"]],
    }
    bare = statistics.median(rates["bare"])
    startup, marginal = _startup(reports)
    result = {
        "images": reports[0]["encoded"],
        "pipeline_images_per_s": round(statistics.median(rates["pipeline"]), 2),
        "bare_images_per_s": round(bare, 2),
        "ratio": round(statistics.median(rates["pipeline"]) / bare, 3),
        "startup_s": None if startup is None else round(startup, 2),
        "marginal_ratio": None if marginal is None else round(marginal / bare, 3),
        "bytes_per_latent_ratio": round(stored / tensor, 4),
        "latent_bytes_stored": stored,
        "latent_tensor_bytes": tensor,
        # the pipeline's stages (decode, encode, write: summed over the tasks and actors that
        # ran them, which overlap; list, locate, commit: the driver's) and the bare loop's
        # (decode, encode): the stage whose milliseconds an image grew is the one to look at
        "stages": _stage_figures([r["stages"] for r in reports], reports[0]["encoded"]),
        "bare_stages": _stage_figures([b[2] for b in sides["bare"]], reports[0]["encoded"]),
        "encoder_actors": [job.preprocess.min_actors, job.preprocess.max_actors],
        "clip_frames": clips[1] if clips[0] else 0,  # video mode: images are clip samples
        "cpus": os.cpu_count(),
        **round_figures(rounds, rates, load_before, load_after),
    }
    return print_figures(result, as_json)


def _startup(reports: list[dict]) -> tuple[float | None, float | None]:
    """(median seconds to the first encoded image, median marginal images/s after it) over the
    rounds' preprocess reports; (None, None) where the reports do not carry
    ``first_encoded_s``."""
    firsts = [r.get("first_encoded_s") for r in reports]
    if any(f is None for f in firsts):
        return None, None
    marginal = [
        r["encoded"] / (r["seconds"] - f)
        for r, f in zip(reports, firsts, strict=True)
        if r["seconds"] > f
    ]
    return statistics.median(firsts), statistics.median(marginal) if marginal else None
