"""The preprocess job: images -> decode/bucket -> VAE actor pool -> Parquet; distinct captions ->
text-encoder actor pool -> Parquet; then the manifest, written last.

Only Ray Data tasks and actors write data files; training ranks never write the cache.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections import Counter

import pyarrow.fs as pafs
import pyarrow.parquet as pq
import ray

from raytuner import storage
from raytuner.config import DataConfig, ModelConfig, PreprocessConfig
from raytuner.data import cache
from raytuner.data.buckets import make_buckets
from raytuner.data.decode import DecodeSpec, caption_key, decode_row
from raytuner.data.encode import CaptionEncoder, LatentEncoder
from raytuner.data.scan import scan_images
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
    )


def _parquet_files(fs, root: str, sub: str) -> list[dict]:
    selector = pafs.FileSelector(storage.join(root, sub), recursive=True, allow_not_found=True)
    files = sorted(i.path for i in fs.get_file_info(selector) if i.path.endswith(".parquet"))
    return [
        {"path": f[len(root) + 1 :], "rows": pq.ParquetFile(f, filesystem=fs).metadata.num_rows}
        for f in files
    ]


def _encode_images(files, model, data, pre, fs, out: str) -> None:
    spec = DecodeSpec(
        root=storage.absolute(data.images),
        buckets=bucket_sizes(model.family, pre),
        crop=pre.crop,
        seed=pre.seed,
        caption_fallback=data.caption_fallback,
    )
    args = (model.family, model.pretrained, model.revision, pre.dtype)
    (
        ray.data.from_items(files)
        .map(decode_row, fn_kwargs={"spec": spec})
        .map_batches(LatentEncoder, fn_constructor_args=args, **_pool(pre))
        .write_parquet(out, filesystem=fs, partition_cols=["status"])
    )


def _encode_captions(captions: dict[str, str], model, pre, fs, out: str) -> None:
    rows = [{"caption_key": k, "caption": c} for k, c in sorted(captions.items())]
    args = (model.family, model.pretrained, model.revision, pre.dtype)
    (
        ray.data.from_items(rows)
        .map_batches(CaptionEncoder, fn_constructor_args=args, **_pool(pre))
        .write_parquet(out, filesystem=fs)
    )


def _read(fs, root: str, files: list[dict], columns: list[str]) -> list[dict]:
    rows = []
    for f in files:
        rows += pq.read_table(
            storage.join(root, f["path"]), columns=columns, filesystem=fs
        ).to_pylist()
    return rows


def _report(n_files: int, ok: list[dict], skipped: list[dict], seconds: float) -> dict:
    return {
        "total": n_files,
        "encoded": len(ok),
        "skipped": sorted(skipped, key=lambda s: s["path"]),
        "captions": {"distinct": len({r["caption_key"] for r in ok})},
        "buckets": dict(sorted(Counter(f"{r['width']}x{r['height']}" for r in ok).items())),
        "seconds": round(seconds, 3),
        "images_per_s": round(len(ok) / max(seconds, 1e-9), 3),
    }


def preprocess(model: ModelConfig, data: DataConfig, pre: PreprocessConfig) -> dict:
    """Encode ``data.images`` into a new committed cache version; return the report."""
    start = time.monotonic()
    fp = cache.fingerprint(model, pre)
    fs, root = storage.resolve(cache.version_dir(data.cache, fp))
    files = scan_images(data.images, data.caption_extension)
    if not files:
        raise ValueError(f"data.images = {data.images!r} holds no images")
    part = f"parts/{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:8]}"
    log.info("preprocess: %d images -> %s/%s", len(files), root, part)
    _encode_images(files, model, data, pre, fs, storage.join(root, part, "latents"))

    ok_files = _parquet_files(fs, root, f"{part}/latents/status=ok")
    ok = _read(fs, root, ok_files, ["caption_key", "caption", "width", "height"])
    captions = {caption_key(""): ""} | {r["caption_key"]: r["caption"] for r in ok}
    _encode_captions(captions, model, pre, fs, storage.join(root, part, "text"))
    skipped_files = _parquet_files(fs, root, f"{part}/latents/status=skipped")
    skipped = _read(fs, root, skipped_files, ["path", "reason"])
    report = _report(len(files), ok, skipped, time.monotonic() - start)

    text_files = _parquet_files(fs, root, f"{part}/text")
    text_columns = pq.read_schema(storage.join(root, text_files[0]["path"]), filesystem=fs).names
    manifest = {
        "format_version": cache.FORMAT_VERSION,
        "fingerprint": fp,
        "family": model.family,
        "dtype": pre.dtype,
        "latents": ok_files,
        "text": text_files,
        "text_tensors": sorted(n[: -len("_shape")] for n in text_columns if n.endswith("_shape")),
        "report": report,
    }
    storage.write_json_atomic(fs, storage.join(root, cache.MANIFEST), manifest)
    return report
