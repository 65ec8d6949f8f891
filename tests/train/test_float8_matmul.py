"""``train.float8_matmul``: the frozen base linears of a transformer family's blocks multiply in
float8 through torchao (emulated on the CPU), the LoRA stays as it was; what check refuses."""

from __future__ import annotations

import pytest
import torch

from raytuner.config import FlowObjective, LoraConfig, MemoryConfig, ModelConfig, TrainConfig
from raytuner.families import FAMILIES
from raytuner.train import float8_matmul, optim
from raytuner.train.feed import RankSlice
from raytuner.train.model import trainable_model
from raytuner.train.step import train_step

pytest.importorskip("torchao")


def _trained(name: str, on: bool):
    family = FAMILIES[name]
    train = TrainConfig(output="unused", global_batch_size=2, float8_matmul=on)
    model = ModelConfig(family=name, pretrained="tiny")
    torch.manual_seed(0)
    cpu = torch.device("cpu")
    return family, train, trainable_model(model, train, LoraConfig(rank=4), family, cpu)


@pytest.mark.parametrize("name", ["flux", "sana", "z-image", "wan", "qwen-image", "flux2-klein"])
def test_the_blocks_frozen_linears_multiply_in_float8_and_the_lora_trains(name):
    from torchao.float8.float8_linear import Float8Linear

    family, train, trained = _trained(name, on=True)
    converted = {n for n, m in trained.denoiser.named_modules() if isinstance(m, Float8Linear)}
    assert converted and all(n.endswith("base_layer") or "lora_" not in n for n in converted)
    assert not any("lora_" in n for n in converted)
    assert all(p.dtype == torch.float32 for p in trained.weights.params)  # the LoRA's own
    before = [p.detach().clone() for p in trained.weights.params]
    opt, sched = optim.for_run(train, trained.weights.param_groups())
    loss_fn = family.loss(trained.source, FlowObjective())
    step = train_step(trained, trained.denoiser, loss_fn, opt, sched, train, MemoryConfig(),
                      torch.device("cpu"))  # fmt: skip
    batch = _batch(family)
    loss = step(RankSlice(0, 0, 1, batch, [0, 1], []))
    assert torch.isfinite(loss)
    assert any(not torch.equal(a, b) for a, b in zip(before, trained.weights.params, strict=True))


def _batch(family) -> dict[str, torch.Tensor]:
    """Two samples encoded by the tiny encoders, as the feed hands them."""
    from raytuner.families.parts import Source

    pixels = torch.rand(2, 3, 64, 64, generator=torch.Generator().manual_seed(0)) * 2 - 1
    mean, _ = family.image_encoder(Source("tiny"), "cpu")(pixels)
    text = family.text_encoder(Source("tiny"), "cpu")(["a red circle", "a blue square"])
    sizes = torch.tensor([[64, 64], [64, 64]])
    return {"latent": mean, **text, "original_size": sizes, "crop_top_left": sizes * 0,
            "target_size": sizes}  # fmt: skip


def test_a_gpu_without_fp8_is_refused_at_the_worker():
    float8_matmul.refuse_device(torch.device("cpu"))  # the CPU emulates (tests)
    with pytest.raises(Exception, match="no FP8 tensor cores"):
        float8_matmul.refuse_device(torch.device("mps"))
