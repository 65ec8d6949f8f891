"""What the cache holds for an image is what the family's encoders make of that image: every
row the reader returns for the session's skewed job (13 noise images, each with its own
caption) equals the tiny SDXL's VAE and text encoders run here, directly, on the same file's
pixels (decoded, resized and cropped to its bucket as ``preprocess/decode.py`` does) and on the
caption in its .txt file. Every image and caption differs, so a row given another image's
latent or another caption's embedding fails."""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from raytuner.config import load_job
from raytuner.data import cache
from raytuner.data.reader import open_dataset
from raytuner.data.tensors import DTYPES
from raytuner.families import get_family, parts
from raytuner.preprocess.decode import decode_row
from raytuner.preprocess.job import decode_spec


def _close(cached: torch.Tensor, direct: torch.Tensor, dtype: torch.dtype) -> bool:
    """Equal in the storage dtype, up to one step of its rounding: the encoders ran on other
    batches here (one image, one caption), which changes float32 results in their last bits,
    and a value near a rounding boundary then rounds to the neighbouring bfloat16 (measured:
    at most one element in 256 of a latent, none of the text tensors)."""
    rounded = direct.to(dtype).float()
    return torch.allclose(cached, rounded, rtol=torch.finfo(dtype).eps, atol=1e-6)


def test_every_cached_latent_and_caption_embedding_is_its_own_files_encoding(job_file):
    job = load_job(job_file)
    family = get_family(job.model.family)
    data = open_dataset(job.data.cache, cache.fingerprint(job.model, job.preprocess))
    store = DTYPES[data.manifest["dtype"]]
    source = parts.model_source(job.model, "cpu")
    vae, text = family.image_encoder(source, "cpu"), family.text_encoder(source, "cpu")
    spec = decode_spec(family, job.data, job.preprocess)
    images = Path(job.data.images)
    assert len(data) == 13
    direct_latents, cached_latents = [], []
    try:
        for i, path in enumerate(data.paths):
            content = (images / path).read_bytes()
            row = {"source": 0, "path": path, "key": hashlib.sha256(content).hexdigest()}
            decoded = decode_row(row, spec, content)
            w, h = decoded["width"], decoded["height"]
            pixels = np.frombuffer(decoded["pixels"], np.uint8).reshape(h, w, 3)
            with Image.open(images / path) as image:
                if image.size == (w, h):  # already its bucket's size: the file's own pixels
                    assert np.array_equal(pixels, np.asarray(image.convert("RGB")))
            x = torch.from_numpy(pixels.copy()).permute(2, 0, 1)[None].float() / 127.5 - 1.0
            caption = (images / path).with_suffix(".txt").read_text()
            with torch.no_grad():
                mean, _ = vae(x)
                embedded = text([caption])
            got = data.batch([i])
            assert got["latent"].shape == mean.shape, path
            assert _close(got["latent"], mean, store), f"{path}: not its own latent"
            assert set(embedded) == set(data.tensors), path
            for name, tensor in embedded.items():
                assert got[name].shape == tensor.shape, (path, name)
                assert _close(got[name], tensor, store), f"{path}: not the embedding of {caption!r}"
            direct_latents.append(mean)
            cached_latents.append(got["latent"])
    finally:
        data.close()
    # the tolerance tells rows apart: another image's latent of the same bucket never passes
    for i, mine in enumerate(cached_latents):
        for j, other in enumerate(direct_latents):
            if i != j and other.shape == mine.shape:
                assert not _close(mine, other, store), (data.paths[i], data.paths[j])
