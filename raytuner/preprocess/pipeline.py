"""The preprocess pass as one Ray Data stream: every listed file flows through

    listing -> probe + decode (tasks) -> Encoder actor pool (VAE + text) -> PartSink

so the encoder actors start once, while the first files are still being probed, and a batch's
new captions are encoded beside its images. Each row keeps its probe fields (key, caption,
reason) to the end; the sink (``preprocess/sink.py``) writes the latents and text tensors as the
cache's data files and hands the driver every other column, from which the run's plan and
report are made.
"""

from __future__ import annotations

import math

import ray

from raytuner import quiet, runtime
from raytuner.data.keys import caption_key, flip_key
from raytuner.preprocess.clips import is_clip
from raytuner.preprocess.decode import DecodeSpec, probe_decode_blocks
from raytuner.preprocess.encode import Encoder
from raytuner.preprocess.pairs import text_sources
from raytuner.preprocess.sink import PartSink
from raytuner.preprocess.stream_rows import ENCODE, FAILED, PROBE_COLUMNS

BLOCK_PIXEL_BYTES = 64 * 1024**2  # decoded pixels per stream block, at most (about)
BLOCK_ROWS = 512  # rows per stream block, at most


def rows_per_block(files: int, batch_size: int, side: int, actors: int, frames: int = 1) -> int:
    """Rows of each stream block: a whole number of encoder batches, about 64 MiB of pixels at
    the bucket resolution ``side``, and at least two blocks per encoder actor and two more, so
    that decoding the next blocks overlaps encoding this one. Every block costs a task per step
    (~0.2 s of Ray overhead on a small machine): blocks of one batch made that the bottleneck.
    With clips listed (``frames``: the most frames a sample takes), a row is a sample of that
    many frames: the rows stay within the 64 MiB where they fit, one a block where one sample
    is more (81 frames at 832x480: 97 MB; each of a clip's samples is a block of its own)."""
    row_bytes = side * side * 3 * frames
    rows = min(BLOCK_ROWS, BLOCK_PIXEL_BYTES // row_bytes)
    rows = min(rows, math.ceil(files / (2 * actors + 2)))
    if frames > 1:  # no rounding up to a batch: a block's bytes stay rows x a sample's
        return max(1, rows)
    return max(1, math.ceil(rows / batch_size)) * batch_size


def run(
    listing: list[dict], sources, known, spec: DecodeSpec, encoder, pre, version, run_rel, progress
):
    """Stream every listed file of ``sources`` through probe, decode and encode into the data
    files of the run folder ``run_rel``; ``known``: (``decode.Known``, caption keys) the version
    holds already; ``encoder``: (family, ModelConfig) the encoder actors load; ``progress``: the
    counting actor of the files read and the images encoded (``preprocess/progress.py``).
    Returns one row per listed file: its probe columns, ``status`` and ``failure``."""
    latents, caption_keys = known
    paired = text_sources(listing, encoder[0])  # their captions: with their references
    side = max(max(w, h) for w, h in spec.buckets)
    frames = _most_frames(listing, sources, spec)
    rows = rows_per_block(len(listing), pre.batch_size, side, pre.max_actors, frames)
    preload = any(_likely_new(r, sources, latents.keys) for r in listing)  # images to encode
    probe = {"sources": sources, "spec": spec, "known": latents, "progress": progress}
    if not preload:  # every image unchanged: probe alone, no encoder starts unless a caption is new
        probed = _probed(listing, rows, probe)
        if _nothing_new(probed, caption_keys, paired):
            return probed
    wait_for_encoders(pre)
    sink = PartSink(version.fs, version.root, run_rel, progress)
    args = (*encoder, pre.dtype, pre.store_std, set(caption_keys), progress, preload)
    args += (pre.batch_size, True, pre.text_storage)  # own_process: a Ray actor's
    args += ((pre.text_encoder_offload, max(1, int(pre.gpus_per_actor))), paired)
    with quiet.ray_remote_args_accepted():  # max_restarts: no named parameter in Ray 2.60
        encoded = _probe_stream(listing, rows, probe).map_batches(
            Encoder, fn_constructor_args=args, **encoder_pool(pre, pre.min_actors, pre.max_actors)
        )
    encoded.write_datasink(sink, ray_remote_args={"num_cpus": 0.25})
    return sink.rows


def _most_frames(listing: list[dict], sources, spec) -> int:
    """The most frames a sample of a listed clip takes (1: no clip to decode)."""
    if not spec.frame_multiple:
        return 1
    listed = {r["source"] for r in listing if is_clip(r["path"])}
    return max((max(sources[i].frames) for i in listed), default=1)


def _likely_new(row: dict, sources, keys: frozenset) -> bool:
    """Whether a listed file has something to encode, as far as its listing tells: a changed
    file, or a flipped latent its source asks for and the cache lacks (a new mask file shows
    only once the probe hashed it). Not one the listing refused, nor an unchanged one a
    dataset holds rejected (a new caption or other settings that make it encodable show only
    once it is probed: the stream then runs again with the encoders)."""
    if row.get("refused") or row.get("known_rejected"):
        return False
    key, flips = row["known_key"], sources[row["source"]].flip == "random"
    return key not in keys or (flips and flip_key(key) not in keys)


def encoder_pool(pre, min_size: int, max_size: int) -> dict:
    """``map_batches``' options of an encoder actor pool of ``min_size`` to ``max_size``
    actors, each with ``preprocess``'s GPUs, CPUs and restarts (the stream's, and the edit
    pairs' text rows' of ``pair_text``)."""
    return {
        "compute": ray.data.ActorPoolStrategy(min_size=min_size, max_size=max_size),
        "num_gpus": pre.gpus_per_actor or None,
        "num_cpus": pre.cpus_per_actor,
        # one call per block: the actor batches its encoders itself (``pre.batch_size``) and
        # hands the block back whole, in one piece
        "batch_size": None,
        "batch_format": "pyarrow",
        # bounded: an encoder that dies each time (out of memory) fails the preprocess
        "max_restarts": pre.max_restarts,
        "max_task_retries": pre.max_restarts,
    }


def wait_for_encoders(pre) -> None:
    """The encoder pool's first ``preprocess.min_actors`` actors, each ``{CPU:
    cpus_per_actor, GPU: gpus_per_actor}``, must fit the cluster before the stream starts
    (``runtime.wait_for_resources``): what it can never hold (a GPU on a CPU-only cluster)
    fails at once, what an autoscaler may still add is waited for at most
    ``preprocess.resource_wait_s``. Ray Data would otherwise wait for the actors without end."""
    bundle = {"CPU": pre.cpus_per_actor, "GPU": pre.gpus_per_actor}
    runtime.wait_for_resources(
        [bundle] * pre.min_actors,
        pre.resource_wait_s,
        f"the encoder actors (preprocess.min_actors = {pre.min_actors})",
        setting="preprocess.resource_wait_s",
        lower="preprocess.min_actors / cpus_per_actor / gpus_per_actor",
    )


def _probe_stream(listing: list[dict], rows: int, probe: dict) -> ray.data.Dataset:
    # half a CPU: decode tasks run beside the encoder actors, not fused into them
    return ray.data.from_items(
        listing, override_num_blocks=math.ceil(len(listing) / rows)
    ).map_batches(
        probe_decode_blocks,
        fn_kwargs=probe,
        batch_size=None,  # one call per block
        batch_format="pyarrow",
        num_cpus=0.5,
    )


def _probed(listing: list[dict], rows: int, probe: dict) -> list[dict]:
    """The probe step alone (a rerun over unchanged images): every file's probe columns."""
    refs = _probe_stream(listing, rows, probe).select_columns(PROBE_COLUMNS).to_arrow_refs()
    return [r for ref in refs for r in ray.get(ref).to_pylist()]


def _nothing_new(probed: list[dict], caption_keys, paired=frozenset()) -> bool:
    """No image to decode (a file changed since it was listed) and every caption cached (but
    those of the ``paired`` sources, encoded with their references: ``pair_text``, and those
    of the files the decode refused, which the encoder leaves alone: ``encode_captions``)."""
    usable = [r for r in probed if not r["reason"] and r["status"] != FAILED]
    need = {r["caption_key"] for r in usable if r["source"] not in paired}
    need |= {caption_key("")}
    return all(r["status"] != ENCODE for r in probed) and need <= set(caption_keys)
