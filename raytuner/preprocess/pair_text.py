"""The text rows of edit pairs, for a family whose text encoder sees the reference images too
(``References.text``: Qwen-Image-Edit's Qwen2.5-VL). Such a row is of a caption *and* its
references, so it cannot be encoded in the stream beside its caption (a target's references are
rows of their own, in other blocks, known only once the stream is done): the stream leaves the
captions of the paired sources alone (``pairs.text_sources``), and once the pairs are joined each
trained pair's row is keyed by its caption and its references' content keys
(``keys.pair_caption_key``) and the keys the cache lacks are encoded here, in an actor pool of
their own (the encoder actors' settings), each reference decoded again to its bucket's pixels as
the stream decoded it for its latent. A pair cached once is never encoded again; a reference
whose bytes change makes another key, so its pair's row is encoded anew."""

from __future__ import annotations

import logging
import math

import numpy as np
import pyarrow as pa
import ray
from PIL import Image

from raytuner import quiet
from raytuner.data.keys import pair_caption_key
from raytuner.preprocess.decode import DecodeSpec, decode_row
from raytuner.preprocess.encode import Encoder
from raytuner.preprocess.pipeline import encoder_pool, wait_for_encoders
from raytuner.preprocess.sink import PartSink

log = logging.getLogger(__name__)


def keyed(rows: list[dict]) -> list[dict]:
    """The trained rows, a pair's ``caption_key`` made its pair key (its caption and its
    references' keys, in order)."""
    return [
        r | {"caption_key": pair_caption_key(r["caption"], r["reference_keys"])}
        if r.get("reference_keys") else r
        for r in rows
    ]  # fmt: skip


def missing(rows: list[dict], located, family, sources: int) -> list[dict]:
    """What this pass encodes: one item per pair key the cache lacks, of a pair that trains
    (as many references as the family takes, each cached in its target's bucket:
    ``pairs.matched``), with where each reference lies in the stream (source ``sources + i``
    of the job's source ``i``) and its content key."""
    todo: dict[str, dict] = {}
    for r in rows:
        keys = r.get("reference_keys") or []
        if not keys or r["caption_key"] in located.captions or r["caption_key"] in todo:
            continue
        target, refs = located.latents.get(r["key"]), [located.latents.get(k) for k in keys]
        if target is None or len(keys) > family.references.most or None in refs:
            continue
        if any((x["width"], x["height"]) != (target["width"], target["height"]) for x in refs):
            continue  # skipped by pairs.matched: another bucket
        references = [
            {"source": sources + r["source_index"], "path": path, "key": key}
            for path, key in zip(r["reference_paths"], keys, strict=True)
        ]
        todo[r["caption_key"]] = {
            "caption_key": r["caption_key"], "caption": r["caption"], "references": references,
        }  # fmt: skip
    return list(todo.values())


def reference_image(ref: dict, spec: DecodeSpec) -> Image.Image:
    """A reference's pixels as the stream decoded them for its latent (its bucket's crop: the
    same file, spec and key), as an RGB image."""
    decoded = decode_row(ref, spec)
    if decoded["status"] != "ok":
        raise ValueError(f"reference {ref['path']!r} cannot be decoded again: {decoded['reason']}")
    pixels = np.frombuffer(decoded["pixels"], np.uint8)
    return Image.fromarray(pixels.reshape(decoded["height"], decoded["width"], 3))


class PairTexts(Encoder):
    """``PairTexts(family, model, spec, dtype, batch_size, text_dtype, spread)(block) ->
    block``: the TEXT rows of a block of ``missing``'s items, each caption encoded with its
    references' images (``text_encoder(captions, references=...)``)."""

    def __init__(self, family, model, spec: DecodeSpec, dtype, batch_size, text_dtype, spread):
        super().__init__(
            family, model, dtype, False, batch_size=batch_size, own_process=True,
            text_dtype=text_dtype, spread=spread,
        )  # fmt: skip
        self.spec = spec

    def __call__(self, block: pa.Table) -> pa.Table:
        items = block.to_pylist()
        encode = self._ready("text")
        out = []
        for i in range(0, len(items), self.batch_size):
            chunk = items[i : i + self.batch_size]
            keys = [x["caption_key"] for x in chunk]
            captions = {x["caption_key"]: x["caption"] for x in chunk}
            images = [[reference_image(ref, self.spec) for ref in x["references"]] for x in chunk]
            out.append(self._text(encode, keys, captions, images))
        return pa.concat_tables(out, promote_options="default").combine_chunks()


def encode(items: list[dict], spec: DecodeSpec, encoder, pre, version, run_rel: str) -> None:
    """Encode ``items`` (``missing``) into text files of the run folder ``run_rel``:
    ``encoder``, (family, ModelConfig); the actors as the stream's (``preprocess.*``)."""
    log.info("preprocess: encoding %d edit pairs' text rows with their references", len(items))
    wait_for_encoders(pre)
    blocks = math.ceil(len(items) / pre.batch_size)
    args = (*encoder, spec, pre.dtype, pre.batch_size, pre.text_storage)
    args += ((pre.text_encoder_offload, max(1, int(pre.gpus_per_actor))),)
    actors = max(1, min(pre.max_actors, blocks))
    with quiet.ray_remote_args_accepted():
        encoded = ray.data.from_items(items, override_num_blocks=blocks).map_batches(
            PairTexts,
            fn_constructor_args=args,
            **encoder_pool(pre, min(pre.min_actors, actors), actors),
        )
    encoded.write_datasink(PartSink(version.fs, version.root, run_rel))
