"""`raytuner bench …`: throughput of raytuner's pipelines against bare in-process loops."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import tempfile
import time
from collections.abc import Iterator

import numpy as np
import pyarrow.parquet as pq
import torch

from raytuner import runtime
from raytuner.config import DataConfig, JobConfig
from raytuner.data import cache
from raytuner.data.decode import decode_row
from raytuner.data.encode import CaptionEncoder, LatentEncoder
from raytuner.data.preprocess import decode_spec, preprocess
from raytuner.data.sources import list_source, probe_row
from raytuner.data.tensors import DTYPES


def _bench_data(job: JobConfig, images: int, workdir: str) -> DataConfig:
    """The job's data, or ``images`` drawn images (three aspect ratios) in a fresh folder."""
    if images <= 0:
        return dataclasses.replace(job.data, cache=os.path.join(workdir, "cache"))
    from raytuner.demo_data import make_demo_images

    folder = make_demo_images(os.path.join(workdir, "images"), per_aspect=math.ceil(images / 3))
    return DataConfig(images=str(folder), cache=os.path.join(workdir, "cache"))


def _bare(job: JobConfig, data: DataConfig) -> tuple[int, float]:
    """Probe, decode and encode every image in this process, with the pipeline's own encoder
    classes called directly (no Ray): (images encoded, seconds)."""
    m, pre = job.model, job.preprocess
    encode_images = LatentEncoder(m, pre.dtype, pre.store_std)
    encode_text = CaptionEncoder(m, pre.dtype)
    sources = data.all_sources()
    listing = [{**r, "known_key": ""} for i, s in enumerate(sources) for r in list_source(i, s)]
    spec = decode_spec(job.model, data, pre)
    start, done = time.perf_counter(), 0
    for i in range(0, len(listing), pre.batch_size):
        probed = [probe_row(r, sources) for r in listing[i : i + pre.batch_size]]
        probed = [r for r in probed if not r["reason"]]
        rows = [decode_row(r, spec) for r in probed]
        if rows:
            encoded = encode_images(_columns(rows))
            done += sum(1 for status in encoded.column("status").to_pylist() if status == "ok")
            captions = sorted({r["caption"] for r in probed})
            encode_text(
                {"caption_key": np.array(captions, object), "caption": np.array(captions, object)}
            )
    return done, time.perf_counter() - start


def _columns(rows: list[dict]) -> dict[str, np.ndarray]:
    """Rows as the numpy column batch Ray Data hands the encoder actors."""
    return {k: np.array([r[k] for r in rows], dtype=object) for k in rows[0]}


def _latent_bytes(version: cache.Version, manifest: dict) -> tuple[int, int]:
    """(bytes the latent column takes in the Parquet files, bytes of the tensors it holds)."""
    stored = tensor = 0
    itemsize = torch.empty(0, dtype=DTYPES[manifest["dtype"]]).element_size()
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


def bench_preprocess(job: JobConfig, images: int, as_json: bool) -> dict:
    runtime.connect()
    # one thread, like one encoder actor (Ray gives it OMP_NUM_THREADS=1)
    with torch_threads(1), tempfile.TemporaryDirectory(prefix="raytuner-bench-") as workdir:
        data = _bench_data(job, images, workdir)
        report = preprocess(job.model, data, job.preprocess)
        version = cache.Version(data.cache, cache.fingerprint(job.model, job.preprocess))
        stored, tensor = _latent_bytes(version, version.manifest())
        bare_images, bare_s = _bare(job, data)
    result = {
        "images": report["encoded"],
        "pipeline_images_per_s": round(report["encoded"] / report["seconds"], 2),
        "bare_images_per_s": round(bare_images / bare_s, 2),
        "bytes_per_latent_ratio": round(stored / tensor, 4),
        "latent_bytes_stored": stored,
        "latent_tensor_bytes": tensor,
        "encoder_actors": [job.preprocess.min_actors, job.preprocess.max_actors],
        "cpus": os.cpu_count(),
    }
    result["ratio"] = round(result["pipeline_images_per_s"] / result["bare_images_per_s"], 3)
    return print_figures(result, as_json)


def print_figures(result: dict, as_json: bool) -> dict:
    """One JSON object, or one aligned ``name value`` line per figure."""
    if as_json:
        print(json.dumps(result))
    else:
        width = max(map(len, result)) + 2
        for key, value in result.items():
            print(f"{key:<{width}}{value}")
    return result
