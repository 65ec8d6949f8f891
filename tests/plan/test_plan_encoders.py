"""`raytuner plan`'s encoder pool at full size (the ``random`` presets, on the meta device): the
text encoder's parameters and weights in its dtype, a batch's activations, where it goes on the
GPUs an actor gets, and the bytes a caption's text takes in the cache, in bfloat16 and in
float8 (``preprocess.text_dtype``)."""

from __future__ import annotations

import pytest
from test_plan import REPO

from raytuner.config import load_job
from raytuner.families import FAMILIES
from raytuner.tools.plan import encoders
from raytuner.tools.plan.report import parse_size

GiB = 2**30


def _pool(family: str, gpu: str, *sets: str) -> dict:
    job = load_job(str(REPO / "jobs" / f"{family}.toml"), list(sets))
    return encoders.pool(job, FAMILIES[family], parse_size(gpu))


def test_flux_text_encoders_and_their_bytes_per_caption_at_full_size():
    p = _pool("flux", "24GiB", "preprocess.batch_size=4")
    # T5-XXL's encoder (4.76 B) and CLIP-L's text model (123 M), 2 bytes a parameter
    assert p["params"] == pytest.approx(4.886e9, rel=0.01)
    assert p["weights_bytes"] == pytest.approx(2 * p["params"], rel=0.001)
    assert (p["dtype"], p["tokens"], p["layout"], p["fits"]) == ("bfloat16", 512, "whole", True)
    assert 0 < p["activations_bytes"] < p["weights_bytes"]
    # T5's 512 x 4096 and CLIP's pooled 768, stored padded: 4.2 MB a caption in bfloat16
    assert p["text_bytes_per_caption"] == 512 * 4096 * 2 + 768 * 2
    f8 = _pool("flux", "24GiB", "preprocess.batch_size=4", 'preprocess.text_dtype="float8"')
    assert f8["text_bytes_per_caption"] == 512 * (4096 + 4) + 768 + 4  # a scale per row
    lines = "\n".join(encoders.lines(f8))
    assert "2.100 MB a caption in float8 (210.0 GB for 100,000 captions" in lines


def test_a_text_encoder_too_big_for_one_gpu_is_given_what_fits():
    p = _pool("flux", "8GiB", "preprocess.batch_size=4")
    assert not p["fits"] and p["fewest_gpus"] == 2 and p["offload_fits"]
    assert "preprocess.gpus_per_actor = 2" in encoders.advice(p)
    split = _pool("flux", "8GiB", "preprocess.batch_size=4", "preprocess.gpus_per_actor=2")
    assert (split["layout"], split["fits"]) == ("split", True)


@pytest.mark.slow  # two traces of the full-size Flux.1 step (about 12 s each)
def test_plan_says_the_encoder_actor_fits_when_its_text_encoder_is_split():
    """Full-size Flux.1 on 8 GiB cards: the encoder actor on one GPU does not fit; with its
    text encoder split over 2 GPUs, plan's verdict for the actor is its busiest GPU's."""
    from raytuner.tools.plan.measure import measure

    job = load_job(str(REPO / "jobs" / "flux.toml"), ["preprocess.batch_size=4"])
    one = measure(job, FAMILIES["flux"], parse_size("8GiB"), compare=False)["encoder_actor"]
    assert not one["fits"] and not one.get("per_gpu")
    two = load_job(str(REPO / "jobs" / "flux.toml"),
                   ["preprocess.batch_size=4", "preprocess.gpus_per_actor=2"])  # fmt: skip
    split = measure(two, FAMILIES["flux"], parse_size("8GiB"), compare=False)
    actor = split["encoder_actor"]
    assert actor["fits"] and actor["per_gpu"]
    assert actor["peak_bytes"] == split["text_encoder"]["per_gpu_bytes"] < one["peak_bytes"]
