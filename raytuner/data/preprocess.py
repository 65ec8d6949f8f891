"""The preprocess job, in three Ray Data passes and a commit:

1. probe (tasks): content hash and caption of every listed file;
2. encode (decode tasks -> VAE actor pool -> Parquet): only images whose key is not cached yet;
3. text (text-encoder actor pool -> Parquet): only captions not cached yet, plus "";
then the index of trained rows and the manifest, written last. Training ranks never write here.
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
from raytuner.data import cache
from raytuner.data.buckets import make_buckets
from raytuner.data.decode import DecodeSpec, decode_row
from raytuner.data.encode import CaptionEncoder, LatentEncoder
from raytuner.data.images import ImagePolicy
from raytuner.data.plan import plan, report
from raytuner.data.progress import ProgressLine
from raytuner.data.sources import caption_key, list_source, probe_row
from raytuner.families import get_family

log = logging.getLogger(__name__)
# Tensor bytes do not compress, each cell is unique, and min/max statistics of a binary column
# would store two whole tensors per page: plain pages keep every latent within a
# few bytes of its tensor size (the cell's length prefix and the page headers).
PARQUET = {"use_dictionary": False, "compression": "none", "write_statistics": False}
INDEX_COLUMNS = [
    "source",
    "path",
    "key",
    "caption",
    "caption_key",
    "caption_from",
    "repeats",
    "size",
    "mtime_ns",
]


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
    )


def _listing(data: DataConfig, version: cache.Version) -> list[dict]:
    """Every image file of every source, with its key from the last index if unchanged."""
    known = {}
    if (manifest := version.manifest()) is not None:
        try:
            index = version.read(manifest["index"]["path"]).to_pylist()
        except (OSError, pa.ArrowInvalid) as e:  # lost or damaged: every file is re-hashed
            log.warning("cache index unreadable (%s): re-hashing every image", e)
            index = []
        for r in index:
            known[(r["source"], r["path"])] = (r["size"], r["mtime_ns"], r["key"])
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


def _key_info(version: cache.Version, files: list[str], columns: list[str]) -> dict[str, dict]:
    """key (the first column) -> its row and the first file (in sorted order) that holds it."""
    info = {}
    for rel in files:
        for row in version.read(rel, columns).to_pylist():
            info.setdefault(row[columns[0]], {**row, "file": rel})
    return info


def _encode_images(rows, spec: DecodeSpec, model, pre, out: str, fs, progress) -> None:
    args = (model.family, model.pretrained, model.revision, pre.dtype, pre.store_std, progress)
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
        .write_parquet(out, filesystem=fs, partition_cols=["status"], **PARQUET)
    )


def _encode_captions(captions: dict[str, str], model, pre, out: str, fs, progress) -> None:
    rows = [{"caption_key": k, "caption": c} for k, c in sorted(captions.items())]
    args = (model.family, model.pretrained, model.revision, pre.dtype, progress)
    (
        ray.data.from_items(rows)
        .map_batches(CaptionEncoder, fn_constructor_args=args, **_pool(pre))
        .write_parquet(out, filesystem=fs, **PARQUET)
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


def _entries(version: cache.Version, files: list[str], old: dict | None) -> list[dict]:
    """Manifest entries, reusing the checksums of files the last manifest already holds."""
    known = {f["path"]: f for f in (old or {}).get("latents", []) + (old or {}).get("text", [])}
    return [known.get(rel) or version.describe(rel) for rel in files]


def _appearances(indexed: list[dict]) -> dict[str, int]:
    """Samples per bucket in one epoch of the schedule: every row times its source's repeats."""
    counts: dict[str, int] = {}
    for row in indexed:
        counts[row["bucket"]] = counts.get(row["bucket"], 0) + row["repeats"]
    return dict(sorted(counts.items()))


def _text_tensors(version: cache.Version, rel: str) -> list[str]:
    names = pq.read_schema(version.path(rel), filesystem=version.fs).names
    return sorted(n[: -len("_shape")] for n in names if n.endswith("_shape"))


def _write_index(version: cache.Version, run: str, rows: list[dict]) -> dict:
    table = pa.Table.from_pylist([{k: r[k] for k in INDEX_COLUMNS} for r in rows])
    sink = pa.BufferOutputStream()
    pq.write_table(table, sink)
    rel = f"{run}/index.parquet"
    storage.write_atomic(version.fs, version.path(rel), sink.getvalue().to_pybytes())
    return version.describe(rel)


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


def preprocess(
    model: ModelConfig,
    data: DataConfig,
    pre: PreprocessConfig,
    tag: str = "preprocess",
) -> dict:
    """Bring the cache version of this model and encoding up to date with the sources;
    ``tag``: the run name the dashboard's metrics carry."""
    start = time.monotonic()
    version = cache.Version(data.cache, cache.fingerprint(model, pre))
    old = version.manifest()
    listing = _listing(data, version)
    if not listing:
        raise ValueError("the data sources hold no images: check data.images / [[data.sources]]")
    sources = data.all_sources()
    roots = [storage.absolute(s.path) for s in sources]
    repeats = [s.repeats for s in sources]
    probed = [{**r, "source_index": r["source"]} for r in _probe(listing, data)]
    available = _key_info(version, version.part_files("latents"), ["key", "width", "height"])
    p = plan(probed, set(available), roots)
    run = f"parts/{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:8]}"
    log.info(
        "preprocess: %d files, %d cached, %d to encode -> %s/%s",
        len(listing),
        len(p.cached),
        len(p.new),
        version.root,
        run,
    )
    _encode_new(p, decode_spec(model, data, pre), model, pre, version, run, tag)

    available = _key_info(version, version.part_files("latents"), ["key", "width", "height"])
    indexed = [
        {
            **r,
            "caption_key": caption_key(r["caption"]),
            "bucket": f"{available[r['key']]['width']}x{available[r['key']]['height']}",
            "repeats": repeats[r["source_index"]],
        }
        for r in p.cached + p.new
        if r["key"] in available
    ]
    need = {r["caption_key"]: r["caption"] for r in indexed} | {caption_key(""): ""}
    have = _key_info(version, version.part_files("text"), ["caption_key", "truncated"])
    missing = {k: c for k, c in need.items() if k not in have}
    if missing:
        with ProgressLine("captions encoded", len(missing), tag) as progress:
            out = version.path(f"{run}/text")
            _encode_captions(missing, model, pre, out, version.fs, progress)
        have = _key_info(version, version.part_files("text"), ["caption_key", "truncated"])

    rep = report(
        len(listing), p, indexed, sum(have[k]["truncated"] for k in need), time.monotonic() - start
    )
    live_latents = sorted({available[r["key"]]["file"] for r in indexed})
    live_text = sorted({have[k]["file"] for k in need})
    manifest = {
        "format_version": cache.FORMAT_VERSION,
        "fingerprint": version.fp,
        "family": model.family,
        "dtype": pre.dtype,
        "latents": _entries(version, live_latents, old),
        "text": _entries(version, live_text, old),
        "index": _write_index(version, run, indexed),
        "appearances": _appearances(indexed),
        "text_tensors": _text_tensors(version, live_text[0]),
        "report": rep,
    }
    version.commit(manifest)
    metrics.gauge("raytuner_cache_hits", len(p.cached), tag)
    metrics.gauge("raytuner_skipped_inputs", len(rep["skipped"]), tag)
    metrics.gauge("raytuner_images_encoded_per_s", rep["images_per_s"], tag)
    return rep
