"""`raytuner bench …`: throughput of raytuner's pipelines against bare in-process loops."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator

import psutil
import pyarrow as pa
import pyarrow.parquet as pq
import torch

from raytuner import runtime
from raytuner.config import DataConfig, JobConfig
from raytuner.data import cache
from raytuner.data.decode import ENCODE, probe_decode
from raytuner.data.encode import Encoder
from raytuner.data.preprocess import decode_spec, preprocess
from raytuner.data.sources import list_source


def _bench_data(job: JobConfig, images: int, workdir: str) -> DataConfig:
    """The job's data, or ``images`` drawn images (three aspect ratios) in a fresh folder."""
    if images <= 0:
        return dataclasses.replace(job.data, cache=os.path.join(workdir, "cache"))
    from raytuner.demo_data import make_demo_images

    folder = make_demo_images(os.path.join(workdir, "images"), per_aspect=math.ceil(images / 3))
    return DataConfig(images=str(folder), cache=os.path.join(workdir, "cache"))


def _bare(job: JobConfig, data: DataConfig) -> tuple[int, float]:
    """Probe, decode and encode every image in this process, with the stream's own steps
    (``probe_decode``, then one ``Encoder`` over the same batches) called directly, without
    Ray: (images encoded, seconds)."""
    pre = job.preprocess
    encoder = Encoder(job.model, pre.dtype, pre.store_std)
    sources = data.all_sources()
    listing = [{**r, "known_key": ""} for i, s in enumerate(sources) for r in list_source(i, s)]
    spec = decode_spec(job.model, data, pre)
    # the Encoder builds its models on first use: one image first, off the clock, builds both
    # (as the bare loop always did before timing); then it forgets the captions it encoded
    encoder(probe_decode(pa.Table.from_pylist(listing[:1]), sources, spec, frozenset()))
    encoder.seen = set()
    start, done = time.perf_counter(), 0
    for i in range(0, len(listing), pre.batch_size):
        batch = pa.Table.from_pylist(listing[i : i + pre.batch_size])
        encoded = encoder(probe_decode(batch, sources, spec, frozenset()))
        done += encoded.column("status").to_pylist().count(ENCODE)
    return done, time.perf_counter() - start


def _latent_bytes(version: cache.Version, manifest: dict) -> tuple[int, int]:
    """(bytes the latent column takes in the Parquet files, bytes of the tensors it holds)."""
    stored = tensor = 0
    itemsize = cache.itemsize(manifest["dtype"])
    for entry in manifest["latents"]:
        meta = pq.read_metadata(version.path(entry["path"]), filesystem=version.fs)
        names = [meta.schema.column(j).name for j in range(meta.num_columns)]
        col = names.index("latent")
        stored += sum(
            meta.row_group(g).column(col).total_compressed_size for g in range(meta.num_row_groups)
        )
        shapes = version.read(entry["path"], ["latent_shape"]).column(0).to_pylist()
        tensor += sum(math.prod(s) * itemsize for s in shapes)
    return stored, tensor


@contextlib.contextmanager
def torch_threads(n: int) -> Iterator[None]:
    """torch's intra-op threads set to ``n`` for a measurement, then put back."""
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def bench_preprocess(job: JobConfig, images: int, as_json: bool, rounds: int = 3) -> dict:
    """``rounds`` rounds, each a whole preprocess into a fresh cache folder and then the bare
    loop over the same images; the figures are the medians over the rounds."""
    runtime.connect()
    # one thread, like one encoder actor (Ray gives it OMP_NUM_THREADS=1)
    with torch_threads(1), tempfile.TemporaryDirectory(prefix="raytuner-bench-") as workdir:
        data = _bench_data(job, images, workdir)

        def pipeline(r: int) -> dict:
            cache_r = os.path.join(workdir, f"cache-{r}")
            return preprocess(job.model, dataclasses.replace(data, cache=cache_r), job.preprocess)

        def bare(r: int) -> tuple[int, float]:
            return _bare(job, data)

        load_before = load_average()
        sides = alternate(rounds, {"pipeline": pipeline, "bare": bare}, wait_for_quiet)
        load_after = load_average()
        first = os.path.join(workdir, "cache-0")  # every round's cache holds the same rows
        version = cache.Version(first, cache.fingerprint(job.model, job.preprocess))
        stored, tensor = _latent_bytes(version, version.manifest())
    reports = sides["pipeline"]
    rates = {
        "pipeline": [r["encoded"] / r["seconds"] for r in reports],
        "bare": [done / seconds for done, seconds in sides["bare"]],
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
        "encoder_actors": [job.preprocess.min_actors, job.preprocess.max_actors],
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


def alternate(
    rounds: int,
    sides: dict[str, Callable[[int], object]],
    settle: Callable[[], object] | None = None,
) -> dict[str, list]:
    """Each side called once a round, in turn (A B A B …): {side: [its result each round]}.
    Alternating spreads the machine's slow and fast spells over both sides; ``settle``, called
    before each side, waits for what the previous side left running (e.g. ``wait_for_quiet``)."""
    if rounds < 1:
        raise ValueError(f"rounds must be at least 1, not {rounds}")
    out: dict[str, list] = {name: [] for name in sides}
    for r in range(rounds):
        for name, side in sides.items():
            if settle is not None:
                settle()
            out[name].append(side(r))
    return out


def wait_for_quiet(busy_percent: float = 25.0, max_s: float = 5.0) -> float:
    """Wait until the machine's CPUs are less than ``busy_percent`` busy over half a second
    (Ray workers of the side before still exiting, an export finishing), at most ``max_s``;
    returns the seconds waited. A shared machine may never be quiet: then it goes on."""
    start = time.monotonic()
    while time.monotonic() - start < max_s:
        if psutil.cpu_percent(interval=0.5) < busy_percent:
            break
    return time.monotonic() - start


def spread(values: list[float]) -> float:
    """(max - min) / median: how far apart the rounds of one side landed, as a fraction."""
    return (max(values) - min(values)) / statistics.median(values)


def load_average() -> list[float]:
    """The 1, 5 and 15 minute load averages."""
    return [round(x, 2) for x in os.getloadavg()]


def round_figures(rounds: int, rates: dict[str, list[float]], before, after) -> dict:
    """The figures every alternating bench adds: its rounds, each side's spread, the load."""
    return {
        "rounds": rounds,
        "spread": {name: round(spread(values), 4) for name, values in rates.items()},
        "load_before": before,
        "load_after": after,
    }


def print_figures(result: dict, as_json: bool) -> dict:
    """One JSON object, or one aligned ``name value`` line per figure."""
    if as_json:
        print(json.dumps(result))
    else:
        width = max(map(len, result)) + 2
        for key, value in result.items():
            print(f"{key:<{width}}{value}")
    return result
