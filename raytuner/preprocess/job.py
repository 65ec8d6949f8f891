"""The preprocess job: one Ray Data stream and a commit.

The stream (``pipeline.py``) probes every listed file (content hash, caption), decodes the
new ones, and encodes their latents and the captions not cached yet in one encoder actor pool;
then the index of trained rows (where each one's bytes lie) and the manifest, written last
(``index.commit``). Training ranks never write here.
"""

from __future__ import annotations

import logging
import time
import uuid
from dataclasses import dataclass

from raytuner import errors, storage
from raytuner.config import DataConfig, ModelConfig, PreprocessConfig
from raytuner.data import cache, datasets, index
from raytuner.data.keys import caption_key
from raytuner.observe import metrics
from raytuner.preprocess import pair_text, pairs, pipeline
from raytuner.preprocess.buckets import make_buckets
from raytuner.preprocess.clips import clip_report, is_clip
from raytuner.preprocess.decode import DecodeSpec, Known
from raytuner.preprocess.encode import FAILED
from raytuner.preprocess.images import ImagePolicy
from raytuner.preprocess.progress import ProgressLine, clock, since
from raytuner.preprocess.sources import (
    NOT_UTF8,
    caption_file,
    folder_report,
    image_repeats,
    list_source,
)
from raytuner.preprocess.worklist import (
    pair_regularization,
    plan,
    rejections,
    report,
    unusable_sources,
)

log = logging.getLogger(__name__)


def bucket_sizes(family, pre: PreprocessConfig) -> list[tuple[int, int]]:
    resolution = pre.resolution or family.geometry.default_resolution
    step = pre.bucket_step or family.geometry.pixel_multiple
    return make_buckets(resolution, step, pre.min_aspect, pre.max_aspect)


def _listing(data: DataConfig, located: index.Located, family) -> list[dict]:
    """Every image file of every source, with its key from a committed index if unchanged (a
    clip: its first sample's, and ``known_samples``, see ``_known_clip``); then the reference
    files of the paired sources (``pairs.py``: source ``n + i``), for a family that takes
    references (another trains every image alone)."""
    known, rejected, rows = located.trusted.listed, located.trusted.rejected, []
    sources = data.all_sources()
    roots = [storage.absolute(s.path) for s in pairs.with_reference_sources(sources)]
    for i, source in enumerate(sources):
        paired = len(sources) + i if family.references.most else None
        settings = datasets.source_frame_settings(source)
        for row in list_source(i, source, reference_index=paired):
            root = roots[row["source"]]
            size, mtime, key = known.get((root, row["path"]), (None, None, ""))
            unchanged = (size, mtime) == (row["size"], row["mtime_ns"])
            row = {**row, "known_key": key if unchanged else "", "known_samples": 0} | NOT_REJECTED
            if not unchanged:
                row |= _known_rejected(row, rejected.get((root, row["path"])))
            if is_clip(row["path"]) and row["role"] == pairs.ROLE_TARGET:
                row |= _known_clip(row, located.trusted.clips.get((root, row["path"], settings)))
            rows.append(row)
    return rows


# a listed file no committed dataset holds rejected (``_known_rejected``)
NOT_REJECTED = {
    "known_rejected": False,
    "known_failure": "",
    "known_settings": "",
    "known_clip": "",
}


def _known_rejected(row: dict, record) -> dict:
    """A listed file's key, and the decode's refusal of it and the settings it was refused
    under, when a committed dataset holds it rejected with the same size and mtime
    (``trust.Rejected``): not read again (``decode._stream_row``). Nothing otherwise."""
    if record is None or (record.size, record.mtime_ns) != (row["size"], row["mtime_ns"]):
        return {}
    return {
        "known_key": record.key,
        "known_rejected": True,
        "known_failure": record.failure,
        "known_settings": record.settings,
        "known_clip": record.clip,
    }


def _known_clip(row: dict, committed) -> dict:
    """A listed clip's first sample key and its count of samples (``known_samples``) when a
    committed index holds it with the same size and mtime under the source's frame settings
    (``Located.trusted``): its rows are then made from the index's, the clip not read again
    where every sample is cached (``decode._clip_rows``). Nothing otherwise: it is read."""
    if committed is None or committed[:2] != (row["size"], row["mtime_ns"]):
        return {}
    return {"known_key": committed[2], "known_samples": committed[3]}


def decode_spec(family, data: DataConfig, pre: PreprocessConfig) -> DecodeSpec:
    return DecodeSpec(
        roots=[storage.absolute(s.path) for s in pairs.with_reference_sources(data.all_sources())],
        buckets=bucket_sizes(family, pre),
        crop=pre.crop,
        seed=pre.seed,
        min_aspect=pre.min_aspect,
        max_aspect=pre.max_aspect,
        aspect_policy=pre.aspect_policy,
        image=ImagePolicy(
            max_pixels=pre.max_pixels, min_size=pre.min_size, background=tuple(pre.background)
        ),
        frame_multiple=family.geometry.frame_multiple,
    )


def clips_failed(rows: list[dict]) -> list[dict]:
    """The stream's rows less the samples of a clip that failed after them (its stream broke
    at a later sample): the clip ends in its failure's category alone, nothing of it trained."""
    failed = {(r["source"], r["path"]) for r in rows if r["clip"] and r["status"] == FAILED}
    return [
        r for r in rows
        if not (r["clip"] and r["status"] != FAILED and (r["source"], r["path"]) in failed)
    ]  # fmt: skip


COMMIT_ATTEMPTS = 3  # a run that finds another's commit lists again (reusing every file)


@dataclass(frozen=True)
class _Pass:
    """One preprocess: the version and run folder it writes, and what it encodes with."""

    version: cache.Version
    run: str  # the part folder its data files go to (kept when it lists again)
    family: object
    model: ModelConfig
    data: DataConfig
    pre: PreprocessConfig
    tag: str  # the run name the dashboard's metrics carry


def update_cache(
    model: ModelConfig,
    data: DataConfig,
    pre: PreprocessConfig,
    tag: str = "preprocess",
    *,
    family,
) -> dict:
    """Bring the cache version of this model and encoding up to date with the sources;
    ``tag``: the run name the dashboard's metrics carry; ``family``: the model's Family. The
    version is leased meanwhile: ``cache gc`` leaves it alone."""
    version = cache.Version(data.cache, cache.fingerprint(model, pre))
    run = f"parts/{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:8]}"
    job = _Pass(version, run, family, model, data, pre, tag)
    with version.lease(f"preprocess-{tag}"):
        for attempt in range(COMMIT_ATTEMPTS):
            try:
                return _preprocess(job)
            except cache.StaleCommit:
                if attempt + 1 == COMMIT_ATTEMPTS:
                    raise
                log.info("preprocess: another run committed meanwhile; listing again")
            except BaseException as e:  # raised again, its stream's actors let go
                errors.release(e)
                raise
    raise AssertionError("unreachable")


def _stream(job: _Pass, listing, located) -> tuple[list, float, dict]:
    """The stream over every listed file: its rows (see ``pipeline.run``), the wall time of
    the first encoded image (None: nothing was encoded) and the time of its stages (decode,
    encode, write; each summed over its blocks)."""
    alpha = frozenset(k for k, r in located.latents.items() if r.get("alpha"))
    known = (Known(frozenset(located.latents), alpha), set(located.captions))
    new = [r for r in listing if not (r["refused"] or r["known_rejected"])]  # rejected: none
    todo = sum(1 for r in new if r["known_key"] not in known[0].keys)  # about this many new
    line = ProgressLine(len(listing), todo, job.tag, "raytuner_images_encoded")
    with line as progress:
        spec = decode_spec(job.family, job.data, job.pre)
        sources = pairs.with_reference_sources(job.data.all_sources())
        encoder = (job.family, job.model)
        args = (known, spec, encoder, job.pre, job.version, job.run, progress)
        rows = pipeline.run(listing, sources, *args)
    return rows, line.first_at, line.stages


def _indexed(rows: list[dict], located: index.Located, sources) -> list[dict]:
    """The trained rows: the cached or encoded images with their bucket, repeats (their
    source's or kohya folder's) and whether they are regularization images. A caption,
    flipped latent or mask the stream should have made and the cache lacks fails the run."""
    indexed = []
    for r in rows:
        if (latent := located.latents.get(r["key"])) is not None:
            bucket = index.bucket_name(latent["width"], latent["height"], latent["latent_shape"])
            source = sources[r["source_index"]]
            repeats = image_repeats(source, r["path"])
            reg = source.regularization
            indexed.append(r | {"bucket": bucket, "repeats": repeats, "regularization": reg})
    cells = [k for r in indexed for k in (r["flip_key"], r["mask_key"]) if k]
    cells += [k for r in indexed for k in r.get("reference_keys", ())]
    captions = {r["caption_key"] for r in indexed} | {caption_key("")}
    for what, missing in (
        ("caption", sorted(captions - set(located.captions))),
        ("flipped latent, mask or reference", [k for k in cells if k not in located.latents]),
    ):
        if missing:
            raise RuntimeError(
                f"{len(missing)} {what}(s) were not encoded (their file is damaged or gone, "
                f"e.g. {missing[0]}): run the preprocess again, it encodes only what is missing"
            )
    return indexed


def _refuse_unusable(p, indexed: list[dict], sources, roots: list[str]) -> None:
    """A source that ends with no usable image, or a caption file that is not UTF-8 in a
    source with ``caption_errors = "strict"``, fails the preprocess before its commit: the
    run would train without that source (a regularization source: without prior
    preservation), or on captions with U+FFFD in them. Its files stay encoded for the rerun."""
    kinds = ["regularization source" if s.regularization else "source" for s in sources]
    if empty := unusable_sources(p, indexed, roots, kinds):
        raise ValueError(
            "a data source has no usable image, so the run would train without it: "
            + " | ".join(empty)
            + ". Replace or fix those files, or remove the source from the job"
        )
    strict = [
        storage.join(r["source"], caption_file(sources[r["source_index"]], r["path"]))
        for r in indexed
        if r["caption_from"] == NOT_UTF8 and sources[r["source_index"]].caption_errors == "strict"
    ]
    if strict:
        shown = ", ".join(strict[:10]) + (
            f", ... {len(strict) - 10} more" if len(strict) > 10 else ""
        )
        raise ValueError(
            f'{len(strict)} caption file(s) are not UTF-8 (caption_errors = "strict"): {shown}. '
            'Save them as UTF-8, or set caption_errors = "replace" (bad bytes become '
            'U+FFFD) or "skip" (their images are left out)'
        )


def text_bytes(located, keys, dtype: str) -> dict:
    """The report's ``text``: the text tensors' storage dtype and the bytes a caption of
    ``keys`` takes in the cache, on average and at most."""
    sizes = [
        sum(cache.cell_bytes(row[f"{n}_shape"], dtype) for n in located.text_tensors)
        for row in (located.captions[k] for k in keys)
    ]
    mean = round(sum(sizes) / max(len(sizes), 1))
    most = max(sizes, default=0)
    return {"dtype": dtype, "bytes_per_caption": mean, "max_bytes_per_caption": most}


def stage_report(stages: dict) -> dict:
    """The report's ``stages``: each step's wall seconds and CPU seconds (of the threads that
    ran it), summed over its blocks for the stream's steps (decode and write tasks, encoder
    actors: they overlap), the driver's for the others: ``list`` (the cache's files and the
    sources), ``locate`` (after the stream: every new file's cells located and checked
    against their checksums, the index's rows made). The commit's writes come after the
    report (``bench preprocess`` times them from outside)."""
    return {name: {k: round(v, 4) for k, v in t.items()} for name, t in stages.items()}


def _pair_texts(job: _Pass, p, located, sources: int) -> int:
    """For a family whose text encoder sees the references (``References.text``): the plan's
    pairs keyed by their caption and references, and the text rows the cache lacks encoded
    (``pair_text``; ``located`` refreshed after). Returns how many were encoded."""
    if not job.family.references.text:
        return 0
    p.cached, p.new = pair_text.keyed(p.cached), pair_text.keyed(p.new)
    todo = pair_text.missing(p.cached + p.new, located, job.family, sources)
    if todo:
        spec = decode_spec(job.family, job.data, job.pre)
        encoder = (job.family, job.model)
        pair_text.encode(todo, spec, encoder, job.pre, job.version, job.run)
        located.refresh()
    return len(todo)


def _preprocess(job: _Pass) -> dict:
    """One listing, encoding and commit into the run folder ``job.run`` (kept when it retries)."""
    version, data, pre = job.version, job.data, job.pre
    start, wall, manifest = time.monotonic(), time.time(), version.manifest()
    generation = (manifest or {}).get("generation", 0)
    sources = data.all_sources()
    roots = [storage.absolute(s.path) for s in sources]
    began = clock()
    located = index.Located(version, pre.dtype, manifest, roots, pre.text_storage)
    located.refresh()
    listing = _listing(data, located, job.family)
    listed = since(began)
    if not listing:
        raise ValueError("the data sources hold no images: check data.images / [[data.sources]]")
    log.info("preprocess: %d files -> %s/%s", len(listing), version.root, job.run)
    available = set(located.latents)
    rows, first_at, streamed = _stream(job, listing, located)
    rows = clips_failed(rows)
    stream_roots = [storage.absolute(s.path) for s in pairs.with_reference_sources(sources)]
    rejected = rejections(rows, stream_roots)  # remembered for the next run: data/trust.py
    encoded = {r["key"] for r in rows if r["status"] == pipeline.ENCODE}
    rows, references = pairs.join_references(rows, listing, stream_roots)
    p = plan([{**r, "source_index": r["source"]} for r in rows], available, roots)
    p.failed({r["key"]: r["failure"] for r in rows if r["status"] == FAILED})
    began = clock()
    located.refresh()
    texts = _pair_texts(job, p, located, len(sources))
    indexed = _indexed(p.cached + p.new, located, sources)
    indexed, mismatched = pairs.matched(indexed, located.latents, job.family)
    for r, why in mismatched:  # skipped, not cached or new: each file in one list
        p.skip(r, why)
    gone = {(r["source"], r["path"]) for r, _ in mismatched}
    p.new = [r for r in p.new if (r["source"], r["path"]) not in gone]
    p.cached = [r for r in p.cached if (r["source"], r["path"]) not in gone]
    _refuse_unusable(p, indexed, sources, roots)
    need = {r["caption_key"] for r in indexed} | {caption_key("")}
    truncated = sum(located.captions[k]["truncated"] for k in need)
    folders = folder_report(indexed, sources)  # the kohya folders' N, taken or not
    indexed = pair_regularization(indexed)
    targets = sum(1 for r in listing if r["source"] < len(sources))  # references: pairs.py
    rep = report(targets, p, indexed, truncated, time.monotonic() - start)
    rep["first_encoded_s"] = None if first_at is None else round(first_at - wall, 3)
    rep["folders"] = folders
    if any(r["clip"] for r in rows):
        rep["clips"] = clip_report(rows, indexed)
    rep |= pairs.pair_report(indexed, references, encoded)
    if job.family.references.text and "pairs" in rep:
        rep["pairs"]["texts_encoded"] = texts
    rep["not_utf8_files"] = [
        {"source": r["source"], "path": caption_file(sources[r["source_index"]], r["path"])}
        for r in indexed
        if r["caption_from"] == NOT_UTF8
    ]
    rep["stages"] = stage_report({"list": listed, **streamed, "locate": since(began)})
    rep["text"] = text_bytes(located, need, pre.text_storage)
    extra = {"family": job.family.name, "dtype": pre.dtype, "report": rep}
    extra["text_dtype"] = pre.text_storage
    extra["rejected"] = rejected
    index.commit(version, job.run, indexed, located, generation, sources=sources, **extra)
    metrics.gauge("raytuner_cache_hits", len(p.cached), job.tag)
    metrics.gauge("raytuner_skipped_inputs", len(rep["skipped"]), job.tag)
    metrics.gauge("raytuner_images_encoded_per_s", rep["images_per_s"], job.tag)
    return rep
