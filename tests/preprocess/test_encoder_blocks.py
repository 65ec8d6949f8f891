"""The preprocess stream's encoder actor takes a whole block per call (Ray Data ships a table
piece by piece: one of a few hundred rows in one piece per column costs little to send, the
same rows as a table of many small pieces cost more than their encoding) and runs its VAE on
batches of ``preprocess.batch_size`` images of one bucket, and its process does without
diffusers' quantization backends (about 2 s of an encoder actor's start). Here the actor's own
class runs in this process, on the demo's images at their three buckets, with the tiny SDXL."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pytest
import torch

from raytuner.config import DataConfig, PreprocessConfig, load_job
from raytuner.data.cache import checksum
from raytuner.data.keys import caption_key, flip_key
from raytuner.data.tensors import DTYPES, cell_column
from raytuner.families import FAMILIES
from raytuner.preprocess.decode import Known, probe_decode
from raytuner.preprocess.encode import Encoder
from raytuner.preprocess.job import decode_spec
from raytuner.preprocess.sources import list_source
from raytuner.preprocess.stream_rows import ENCODE, LATENT, PROBE_COLUMNS, TEXT
from raytuner.tools.bench.preprocess import _stage_figures
from raytuner.tools.demo_images import make_demo_images

REPO = Path(__file__).resolve().parents[2]
SDXL = FAMILIES["sdxl"]


class RecordingFamily:
    """The tiny SDXL, whose image encoder notes the shape of every batch it is given."""

    def __init__(self, family) -> None:
        self.family, self.batches = family, []

    def __getattr__(self, name):
        return getattr(self.family, name)

    def image_encoder(self, source, device):
        encode = self.family.image_encoder(source, device)

        def noted(pixels: torch.Tensor):
            self.batches.append(tuple(pixels.shape))
            return encode(pixels)

        return noted


def _block(images: Path, pre: PreprocessConfig, flip: bool = False) -> pa.Table:
    """The images as one decoded stream block (``probe_decode``: what the encoder gets)."""
    data = DataConfig(images=str(images), cache="unused", flip="random" if flip else "none")
    sources = data.all_sources()
    listing = [{**r, "known_key": ""} for i, s in enumerate(sources) for r in list_source(i, s)]
    nothing = Known(frozenset(), frozenset())
    spec = decode_spec(SDXL, data, pre)
    return probe_decode(pa.Table.from_pylist(listing), sources, spec, nothing)


def test_a_block_is_encoded_in_batches_of_one_bucket_and_returned_in_one_piece(tmp_path):
    job = load_job(str(REPO / "jobs" / "tiny.toml"))
    pre = job.preprocess
    images = make_demo_images(tmp_path / "images", per_aspect=7)  # 7 in each of three buckets
    block = _block(images, pre, flip=True)
    family = RecordingFamily(SDXL)
    encoder = Encoder(family, job.model, pre.dtype, pre.store_std, batch_size=3)
    out = encoder(block)
    # never more images than batch_size in one VAE forward, and one bucket's in each: a GPU
    # actor given a block of hundreds of rows holds batch_size images' activations at a time
    assert family.batches and all(b[0] <= 3 for b in family.batches), family.batches
    sizes = {tuple(b[2:]) for b in family.batches}
    assert sizes == {(64, 64), (48, 80), (80, 48)}, sizes
    # the latents of 21 images and of their mirror images: 7 per bucket in batches of 3, 3, 1
    assert sorted(b[0] for b in family.batches) == [1] * 6 + [3] * 12
    assert all(column.num_chunks == 1 for column in out.columns)  # one piece per column
    status = out.column("status").to_pylist()
    assert status[: block.num_rows] == block.column("status").to_pylist()
    assert out.slice(0, block.num_rows).select(PROBE_COLUMNS).equals(block.select(PROBE_COLUMNS))
    latents = out.filter(pc.equal(out.column("status"), LATENT)).to_pylist()
    images = [r for r in block.to_pylist() if r["status"] == ENCODE]
    assert {r["key"] for r in latents} == {r["key"] for r in images} | {
        flip_key(r["key"]) for r in images
    }
    for row in latents:  # each cell exactly one latent, with the checksum of its bytes
        assert len(row["latent"]) == np.prod(row["latent_shape"]) * 2  # bfloat16
        assert row["latent_xxh3"] == checksum(row["latent"])
    captions = {r["caption_key"] for r in images} | {caption_key("")}
    assert {r["caption_key"] for r in out.to_pylist() if r["status"] == TEXT} == captions


def test_cells_are_the_tensors_own_bytes_with_their_checksums():
    batch = torch.randn(5, 4, 3, 2)
    for dtype in ("bfloat16", "float32"):
        cells, shape, sums = cell_column(batch, dtype)
        assert shape == [4, 3, 2] and len(cells) == 5
        rows = batch.to(DTYPES[dtype])
        for i, cell in enumerate(cells.to_pylist()):
            assert cell == rows[i].contiguous().view(torch.uint8).numpy().tobytes()
            assert sums[i].as_py() == checksum(cell)


def test_stage_figures_are_medians_per_image_and_shares():
    commit = {"seconds": 1.0, "cpu_seconds": None}
    runs = [{"decode": {"seconds": s, "cpu_seconds": s / 2}, "commit": commit} for s in (1, 3, 2)]
    figures = _stage_figures(runs, images=100)
    assert figures["decode"] == {
        "seconds": 2.0,
        "cpu_seconds": 1.0,
        "ms_per_image": 20.0,
        "share": round(2 / 3, 4),
    }
    assert figures["commit"]["cpu_seconds"] is None  # timed from outside: wall time only
    load = _stage_figures([{"load": {"seconds": 3.0, "cpu_seconds": 0.0}}, {}, {}], images=1)
    assert load["load"]["seconds"] == 0  # waited for in one round of three
    assert abs(sum(f["share"] for f in figures.values()) - 1) < 1e-3


ACTOR = """
import json, sys
from raytuner import quantizers
from raytuner.preprocess import encode
quantizers.go_without()
import torch
from raytuner.config import ModelConfig
from raytuner.families import FAMILIES, parts
family = FAMILIES["sdxl"]
source = parts.model_source(ModelConfig(family="sdxl", pretrained="tiny"), "cpu")
mean, _ = family.image_encoder(source, "cpu")(torch.zeros(1, 3, 64, 64))
text = family.text_encoder(source, "cpu")(["a red circle"])
quantized = parts.model_source(ModelConfig(family="sdxl", pretrained=sys.argv[1]), "cpu")
try:
    encode._built(family.image_encoder, quantized, "cpu")
    refusal = ""
except RuntimeError as e:
    refusal = str(e)
print(json.dumps({
    "latent": list(mean.shape),
    "text": sorted(text),
    "imported": [m for m in ("diffusers", "transformers", "bitsandbytes", "torchao")
                 if sys.modules.get(m) is not None],
    "refusal": refusal,
}))
"""


@pytest.mark.slow
def test_an_encoder_process_does_without_quantization_backends(tmp_path):
    """In a process of its own (an encoder actor's), the encoders build and encode without
    bitsandbytes and torchao ever imported; a model whose encoder asks for one fails saying
    so."""
    from diffusers import AutoencoderKL

    from raytuner.families import parts

    vae = AutoencoderKL(**parts.preset("sdxl", "tiny")["vae"]["config"])
    vae.save_pretrained(tmp_path / "vae")
    config = json.loads((tmp_path / "vae" / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "torchao", "quant_type": "int8_weight_only"}
    (tmp_path / "vae" / "config.json").write_text(json.dumps(config))
    run = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(ACTOR), str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    got = json.loads(run.stdout.strip().splitlines()[-1])
    assert got["latent"] == [1, 4, 8, 8]
    assert got["text"] == ["pooled_prompt_embeds", "prompt_embeds"]
    assert got["imported"] == ["diffusers", "transformers"]
    assert "quantization_config" in got["refusal"] and "torchao" in got["refusal"], got
