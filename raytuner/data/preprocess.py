"""The preprocess job, in three Ray Data passes and a commit:

1. probe (tasks): content hash and caption of every listed file;
2. encode (decode tasks -> VAE actor pool -> Parquet): only images whose key is not cached yet;
3. text (text-encoder actor pool -> Parquet): only captions not cached yet, plus "";
then the index of trained rows (where each one's bytes lie) and the manifest, written last
(``index.commit``). Training ranks never write here.
"""

from __future__ import annotations

import logging
import time
import uuid

import pyarrow as pa
import pyarrow.parquet as pq
import ray

from raytuner import metrics, storage
from raytuner.config import DataConfig, ModelConfig, PreprocessConfig
from raytuner.data import cache, index
from raytuner.data.buckets import make_buckets
from raytuner.data.decode import DecodeSpec, decode_row
from raytuner.data.encode import CaptionEncoder, LatentEncoder
from raytuner.data.images import ImagePolicy
from raytuner.data.plan import plan, report
from raytuner.data.progress import ProgressLine
from raytuner.data.sources import caption_key, list_source, probe_row
from raytuner.families import get_family

log = logging.getLogger(__name__)


def bucket_sizes(family_name: str, pre: PreprocessConfig) -> list[tuple[int, int]]:
    family = get_family(family_name)
    resolution = pre.resolution or family.default_resolution
    step = pre.bucket_step or family.pixel_multiple
    return make_buckets(resolution, step, pre.min_aspect, pre.max_aspect)


def _pool(pre: PreprocessConfig) -> dict:
    return dict(
        compute=ray.data.ActorPoolStrategy(min_size=pre.min_actors, max_size=pre.max_actors),
        num_gpus=pre.gpus_per_actor or None,
        batch_size=pre.batch_size,
        batch_format="numpy",
        zero_copy_batch=False,
        # bounded: an encoder that dies each time (out of memory) fails the preprocess
        max_restarts=pre.max_restarts,
        max_task_retries=pre.max_restarts,
    )


def _listing(data: DataConfig, located: index.Located) -> list[dict]:
    """Every image file of every source, with its key from the last index if unchanged."""
    known = {
        (r["source"], r["path"]): (r["size"], r["mtime_ns"], r["key"]) for r in located.indexed
    }
    rows = []
    for i, source in enumerate(data.all_sources()):
        root = storage.absolute(source.path)
        for row in list_source(i, source):
            size, mtime, key = known.get((root, row["path"]), (None, None, ""))
            unchanged = (size, mtime) == (row["size"], row["mtime_ns"])
            rows.append({**row, "known_key": key if unchanged else ""})
    return rows


def _probe_batch(batch, sources) -> list[dict]:
    return pa.Table.from_pylist([probe_row(r, sources) for r in batch.to_pylist()])


def _decode_batch(batch, spec: DecodeSpec) -> pa.Table:
    return pa.Table.from_pylist([decode_row(r, spec) for r in batch.to_pylist()])


def _probe(listing: list[dict], data: DataConfig) -> list[dict]:
    ds = ray.data.from_items(listing).map_batches(
        _probe_batch,
        fn_kwargs={"sources": data.all_sources()},
        batch_size=64,
        batch_format="pyarrow",
    )
    return ds.take_all()


def _encode_images(rows, spec: DecodeSpec, model, pre, out: str, fs, progress) -> None:
    args = (model, pre.dtype, pre.store_std, progress)
    items = [{"source": r["source_index"], "path": r["path"], "key": r["key"]} for r in rows]
    (
        ray.data.from_items(items)
        # half a CPU: decode tasks run beside the encoder actors, not fused into them
        .map_batches(
            _decode_batch,
            fn_kwargs={"spec": spec},
            batch_size=pre.batch_size,
            batch_format="pyarrow",
            num_cpus=0.5,
        )
        .map_batches(LatentEncoder, fn_constructor_args=args, **_pool(pre))
        .write_parquet(out, filesystem=fs, partition_cols=["status"], **cache.PARQUET)
    )


def _encode_captions(captions: dict[str, str], model, pre, out: str, fs, progress) -> None:
    rows = [{"caption_key": k, "caption": c} for k, c in sorted(captions.items())]
    args = (model, pre.dtype, progress)
    (
        ray.data.from_items(rows)
        .map_batches(CaptionEncoder, fn_constructor_args=args, **_pool(pre))
        .write_parquet(out, filesystem=fs, **cache.PARQUET)
    )


def decode_spec(model: ModelConfig, data: DataConfig, pre: PreprocessConfig) -> DecodeSpec:
    return DecodeSpec(
        roots=[storage.absolute(s.path) for s in data.all_sources()],
        buckets=bucket_sizes(model.family, pre),
        crop=pre.crop,
        seed=pre.seed,
        min_aspect=pre.min_aspect,
        max_aspect=pre.max_aspect,
        aspect_policy=pre.aspect_policy,
        image=ImagePolicy(
            max_pixels=pre.max_pixels, min_size=pre.min_size, background=tuple(pre.background)
        ),
    )


def _encode_new(p, spec, model, pre, version, run: str, tag: str) -> None:
    """Pass 2: decode and VAE-encode the new images; their decode failures join p.skipped."""
    if not p.new:
        return
    out = version.path(f"{run}/latents")
    with ProgressLine("images encoded", len(p.new), tag, "raytuner_images_encoded") as progress:
        _encode_images(p.new, spec, model, pre, out, version.fs, progress)
    bad = version.path(f"{run}/latents/status=skipped")
    if storage.exists(version.fs, bad):
        rows = pq.read_table(bad, columns=["key", "reason"], filesystem=version.fs).to_pylist()
        p.failed({r["key"]: r["reason"] for r in rows})


COMMIT_ATTEMPTS = 3  # a run that finds another's commit lists again (reusing every file)


def preprocess(
    model: ModelConfig,
    data: DataConfig,
    pre: PreprocessConfig,
    tag: str = "preprocess",
) -> dict:
    """Bring the cache version of this model and encoding up to date with the sources;
    ``tag``: the run name the dashboard's metrics carry. The version is leased meanwhile:
    ``cache gc`` leaves it alone."""
    version = cache.Version(data.cache, cache.fingerprint(model, pre))
    run = f"parts/{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:8]}"
    with version.lease(f"preprocess-{tag}"):
        for attempt in range(COMMIT_ATTEMPTS):
            try:
                return _preprocess(version, run, model, data, pre, tag)
            except cache.StaleCommit:
                if attempt + 1 == COMMIT_ATTEMPTS:
                    raise
                log.info("preprocess: another run committed meanwhile; listing again")
    raise AssertionError("unreachable")


def _preprocess(version, run: str, model, data, pre, tag: str) -> dict:
    """One listing, encoding and commit into the run folder ``run`` (kept when it retries)."""
    start, generation = time.monotonic(), version.generation()
    located = index.Located(version, pre.dtype, version.manifest())
    listing = _listing(data, located)
    if not listing:
        raise ValueError("the data sources hold no images: check data.images / [[data.sources]]")
    sources = data.all_sources()
    roots = [storage.absolute(s.path) for s in sources]
    repeats = [s.repeats for s in sources]
    probed = [{**r, "source_index": r["source"]} for r in _probe(listing, data)]
    located.refresh()
    p = plan(probed, set(located.latents), roots)
    log.info(
        "preprocess: %d files, %d cached, %d to encode -> %s/%s",
        len(listing),
        len(p.cached),
        len(p.new),
        version.root,
        run,
    )
    _encode_new(p, decode_spec(model, data, pre), model, pre, version, run, tag)
    located.refresh()
    indexed = []
    for r in p.cached + p.new:
        if (latent := located.latents.get(r["key"])) is not None:
            bucket = f"{latent['width']}x{latent['height']}"
            extra = {"caption_key": caption_key(r["caption"]), "bucket": bucket}
            indexed.append({**r, **extra, "repeats": repeats[r["source_index"]]})
    need = {r["caption_key"]: r["caption"] for r in indexed} | {caption_key(""): ""}
    missing = {k: c for k, c in need.items() if k not in located.captions}
    if missing:
        with ProgressLine("captions encoded", len(missing), tag) as progress:
            out = version.path(f"{run}/text")
            _encode_captions(missing, model, pre, out, version.fs, progress)
        located.refresh()
    truncated = sum(located.captions[k]["truncated"] for k in need)
    rep = report(len(listing), p, indexed, truncated, time.monotonic() - start)
    index.commit(
        version, run, indexed, located, generation, family=model.family, dtype=pre.dtype, report=rep
    )
    metrics.gauge("raytuner_cache_hits", len(p.cached), tag)
    metrics.gauge("raytuner_skipped_inputs", len(rep["skipped"]), tag)
    metrics.gauge("raytuner_images_encoded_per_s", rep["images_per_s"], tag)
    return rep
