"""A text encoder too large for one GPU of an encoder actor: placed over the actor's GPUs
(``preprocess.gpus_per_actor`` > 1: its layers split over them) or with its layers in host
memory streamed to the GPU (``preprocess.text_encoder_offload``), never failing an hour in.
Here: which placement sizes choose, and that a split or streamed tiny encoder (on the host's
CPU as its "GPUs": the same hooks and streamer) gives exactly the plain encoder's features."""

from __future__ import annotations

import pytest
import torch

from raytuner.families import FAMILIES, parts, text
from raytuner.placement import encoders

GB = 10**9
# Flux.2 [dev]'s Mistral-Small-3.1 24 B in bfloat16: 40 decoder layers of ~1.15 GB, ~1.3 GB
# of embeddings and head; a batch of 8 captions of 512 tokens, every hidden state kept
MISTRAL = {"weights": 47.3 * GB, "blocks": [1.15 * GB] * 40, "activations": 2.5 * GB}


def _layout(gpus: int, offload: bool = False, gpu=24 * GB) -> encoders.EncoderLayout:
    m = MISTRAL
    return encoders.layout(
        int(m["weights"]), [int(b) for b in m["blocks"]], int(m["activations"]), gpu, gpus, offload
    )


def test_a_24b_text_encoder_is_split_over_enough_24gb_gpus_or_streamed():
    assert not _layout(1).fits  # whole: 50 GB on a 24 GB card
    assert _layout(1).how == encoders.WHOLE
    assert not _layout(2).fits  # two halves of 24+ GB and the activations
    three = _layout(3)
    assert (three.how, three.gpus, three.fits) == (encoders.SPLIT, 3, True)
    assert list(three.assign) == sorted(three.assign)  # each GPU a run of layers, in order
    streamed = _layout(1, offload=True)
    assert streamed.how == encoders.OFFLOAD and streamed.fits
    assert streamed.per_gpu_bytes < 10 * GB
    # an 80 GB card holds it whole, however many GPUs the actor has
    assert _layout(2, gpu=80 * GB).how == encoders.WHOLE


CAPTIONS = ["a red circle on a blue ground", "", "two cats"]


def _features(encoder) -> dict[str, torch.Tensor]:
    with torch.no_grad():
        return encoder(CAPTIONS)


ENCODED = ["flux", "z-image", "sdxl", "wan", "qwen-image", "flux2-klein", "flux2-dev"]


@pytest.mark.parametrize("name", ENCODED)
@pytest.mark.parametrize("offload", [False, True], ids=["split", "offload"])
def test_a_split_or_streamed_encoder_gives_the_plain_encoders_features(name, offload):
    family, source = FAMILIES[name], parts.Source("tiny")
    plain = _features(family.text_encoder(source, "cpu"))
    placed = family.text_encoder(source, "cpu")
    # GPUs too small for any encoder whole: each one's layers split over both
    layouts = text.place(placed, offload, ["cpu", "cpu"], gpu_bytes=1)
    assert {how.how for how in layouts} == {encoders.OFFLOAD if offload else encoders.SPLIT}
    if not offload:  # the second "GPU"'s layers take their inputs over and hand them back
        assert all(how.gpus == 2 and 1 in how.assign for how in layouts)
    assert placed.placed  # the hooks (split) or the streamer (offload) that keep it so
    got = _features(placed)
    assert set(got) == set(plain)
    for key, tensor in plain.items():
        assert torch.equal(got[key], tensor), key


def _check(tmp_path, *overrides: str) -> int:
    """`raytuner check`'s exit code for full-size Flux.1's encoder pool: T5-XXL, 9.1 GiB
    in bfloat16, on GPUs of 8 GiB."""
    from PIL import Image

    from raytuner.cli import main

    (tmp_path / "images").mkdir(exist_ok=True)
    Image.new("RGB", (64, 64)).save(tmp_path / "images" / "a.png")
    path = tmp_path / "job.toml"
    path.write_text(
        f'[model]\nfamily = "flux"\npretrained = "random"\n[data]\nimages = "{tmp_path}/images"'
        f'\ncache = "{tmp_path}/cache"\n[train]\noutput = "{tmp_path}/runs"\n'
        "[preprocess]\ngpu_memory_gib = 8\nbatch_size = 4\n"
    )
    args = ["check", str(path)]
    for text_ in overrides:
        args += ["--set", text_]
    return main(args)


def test_check_refuses_an_encoder_pool_too_big_for_its_gpus_and_takes_enough_of_them(
    tmp_path, capsys
):
    code = _check(tmp_path, "preprocess.gpus_per_actor=1")
    err = capsys.readouterr().err
    assert code == 2
    assert "preprocess.gpus_per_actor = 1:" in err
    assert "set preprocess.gpus_per_actor = 2" in err and "text_encoder_offload = true" in err
    for more in ("preprocess.gpus_per_actor=2", "preprocess.text_encoder_offload=true"):
        assert _check(tmp_path, "preprocess.gpus_per_actor=1", more) == 0, more
