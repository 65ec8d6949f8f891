"""Memory savers must not change what is learned: for every family, gradient checkpointing
gives the loss and gradients of a plain pass (LoRA and full fine-tune), and bf16 autocast on a
GPU keeps float32 weights and a loss close to float32's."""

from __future__ import annotations

import pytest
import torch

from raytuner.config import LoraConfig, ObjectiveConfig
from raytuner.families import FAMILIES
from raytuner.families.parts import Source
from raytuner.train import recompute
from raytuner.train.model import autocast_dtype
from raytuner.train.step import forward_backward

TINY = Source("tiny")


def _batch(family) -> dict[str, torch.Tensor]:
    """Two encoded samples, as the cache stores them: latents, caption tensors and the
    per-image size conditioning and frame rate."""
    pixels = torch.rand(2, 3, 64, 64, generator=torch.Generator().manual_seed(0)) * 2 - 1
    mean, _ = family.image_encoder(TINY, "cpu")(pixels)
    sizes = torch.tensor([[64, 64], [64, 64]])
    conditioning = {"original_size": sizes, "crop_top_left": sizes * 0, "target_size": sizes,
                    "fps": torch.full((2,), 24.0)}  # fmt: skip
    text = family.text_encoder(TINY, "cpu")(["a red circle", "a blue square"])
    return {"latent": mean, **text, **conditioning}


def _gradients(family, batch, mode: str, checkpointing: bool):
    """(per-sample loss, name -> gradient) of one backward pass in train mode."""
    from raytuner.train.model import adapt

    torch.manual_seed(0)  # the same LoRA init both times
    denoiser = family.denoiser(TINY)
    if checkpointing:
        denoiser.enable_gradient_checkpointing(recompute.checkpointed)
    weights = adapt(
        denoiser, mode=mode, lora=LoraConfig(rank=4), targets=family.adapters.targets, ema_decay=0
    )
    denoiser.train()
    assert denoiser.is_gradient_checkpointing == checkpointing
    generators = [torch.Generator().manual_seed(i) for i in range(2)]
    loss = family.loss(TINY, ObjectiveConfig().for_family(family))(denoiser, batch, generators)
    loss.sum().backward()
    grads = {n: p.grad for n, p in zip(weights.names, weights.params, strict=True)}
    return loss.detach(), grads


@pytest.mark.parametrize("mode", ["lora", "full"])
@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_gradient_checkpointing_gives_the_same_loss_and_gradients(name, mode):
    family = FAMILIES[name]
    batch = _batch(family)
    plain_loss, plain = _gradients(family, batch, mode, checkpointing=False)
    saved_loss, saved = _gradients(family, batch, mode, checkpointing=True)
    torch.testing.assert_close(saved_loss, plain_loss)
    assert plain.keys() == saved.keys() and any(
        g is not None and g.abs().sum() > 0 for g in plain.values()
    )
    for key, grad in plain.items():
        if grad is None:
            assert saved[key] is None, key
        else:
            torch.testing.assert_close(saved[key], grad, rtol=1e-4, atol=1e-6, msg=key)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_bf16_autocast_keeps_float32_weights_and_a_close_loss(name):
    family = FAMILIES[name]
    device = torch.device("cuda")
    batch = {k: v.to(device) for k, v in _batch(family).items()}

    class Slice:  # what the feed hands to a step: tensors and per-sample seeds
        tensors, seeds = batch, [0, 1]

    losses = {}
    for precision in ("no", "bf16"):  # train.mixed_precision: the step's autocast dtype
        amp = autocast_dtype(precision, device, torch.float32)
        assert amp == {"no": None, "bf16": torch.bfloat16}[precision]
        torch.manual_seed(0)
        denoiser = family.denoiser(TINY).to(device).train()
        loss_fn = family.loss(TINY, ObjectiveConfig().for_family(family))
        losses[precision] = forward_backward(denoiser, loss_fn, Slice, device, 0, 0.5, amp).item()
        assert all(p.dtype == torch.float32 for p in denoiser.parameters())
        assert all(p.grad is None or torch.isfinite(p.grad).all() for p in denoiser.parameters())
    assert losses["bf16"] == pytest.approx(losses["no"], rel=0.05)
