"""The step's random inputs made by the feed: each sample's noise and timestep (or noise level)
drawn from its own seed in the feed's thread, the rows in the cache's dtype, made float32 on the
device. Training on them must be bit for bit what training was when the loss drew them itself
from the same seeds on rows read in float32 (issue 37: the step without host stalls)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from raytuner.config import DdpmObjective, FlowObjective, LoraConfig, MemoryConfig, TrainConfig
from raytuner.families import FAMILIES
from raytuner.families.parts import Source
from raytuner.train import optim
from raytuner.train.feed import RankSlice
from raytuner.train.model import trainable_model
from raytuner.train.step import train_step

TINY = Source("tiny")
OBJECTIVES = {  # settings that draw more than noise and a timestep
    "ddpm": DdpmObjective(noise_offset=0.05, weighting="min_snr"),
    "flow": FlowObjective(resolution_shift=True, timestep_sampling="logit_normal"),
}


def _cached(family, n: int = 4) -> dict[str, torch.Tensor]:
    """``n`` encoded samples as the cache holds them: bfloat16 tensors, int64 sizes."""
    pixels = torch.rand(n, 3, 64, 64, generator=torch.Generator().manual_seed(0)) * 2 - 1
    mean, _ = family.image_encoder(TINY, "cpu")(pixels)
    text = family.text_encoder(TINY, "cpu")([f"caption {i}" for i in range(n)])
    sizes = torch.tensor([[64, 64]] * n)
    rows = {"latent": mean, **text}
    rows = {k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in rows.items()}
    fps = torch.full((n,), 24.0)  # each row's source's frame rate
    return rows | {"original_size": sizes, "crop_top_left": sizes * 0, "target_size": sizes,
                   "fps": fps}  # fmt: skip


def _train(family, cached, feed_draws: bool) -> tuple[list[float], list[torch.Tensor]]:
    """3 steps of 2 micro-batches of 2; the seeds change every step."""
    train = TrainConfig(output="unused", global_batch_size=4, micro_batch_size=2, seed=0)
    model = dataclasses.replace(_model(family), pretrained="tiny")
    cpu = torch.device("cpu")
    torch.manual_seed(0)
    trained = trainable_model(model, train, LoraConfig(rank=4), family, cpu, MemoryConfig())
    opt, sched = optim.for_run(train, trained.weights.param_groups())
    loss_fn = family.loss(trained.source, OBJECTIVES[family.objective_kind])
    step = train_step(trained, trained.denoiser, loss_fn, opt, sched, train, MemoryConfig(), cpu)
    losses = []
    for i in range(3):
        seeds = [1000 * i + j for j in range(4)]
        if feed_draws:  # the feed: rows as cached, the draws made beside them
            gens = [torch.Generator().manual_seed(s) for s in seeds]
            tensors = cached | loss_fn.draw(tuple(cached["latent"].shape), gens)
        else:  # before: rows read in float32, the loss drawing from the seeds
            tensors = {k: v.float() if v.is_floating_point() else v for k, v in cached.items()}
        losses.append(step(RankSlice(0, i, 3, tensors, seeds, [])).item())
    return losses, [p.detach().clone() for p in trained.weights.params]


def _model(family):
    from raytuner.config import ModelConfig

    return ModelConfig(family=family.name, pretrained="tiny")


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_feed_made_draws_train_the_same_weights_bit_for_bit(name):
    family = FAMILIES[name]
    cached = _cached(family)
    before_losses, before = _train(family, cached, feed_draws=False)
    losses, after = _train(family, cached, feed_draws=True)
    assert losses == before_losses
    assert all(torch.equal(a, b) for a, b in zip(after, before, strict=True))
    assert any(not torch.equal(a, torch.zeros_like(a)) for a in after)
