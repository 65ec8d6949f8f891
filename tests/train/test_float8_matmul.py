"""``train.float8_matmul``: the frozen base linears of a transformer family's blocks multiply in
float8 (``Float8FrozenLinear``, emulated on the CPU), the LoRA stays as it was; the step does the
work a bfloat16 step does (no gradient of the frozen weights), with checkpointing and compiled;
what the worker refuses."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from raytuner.config import FlowObjective, LoraConfig, MemoryConfig, ModelConfig, TrainConfig
from raytuner.families import FAMILIES
from raytuner.observe.flops import counted
from raytuner.train import float8_matmul, optim
from raytuner.train.feed import RankSlice
from raytuner.train.float8_matmul import Float8FrozenLinear
from raytuner.train.model import trainable_model
from raytuner.train.step import train_step


def _trained(name: str, on: bool, checkpointing: bool = False):
    family = FAMILIES[name]
    train = TrainConfig(output="unused", global_batch_size=2, float8_matmul=on,
                        gradient_checkpointing=checkpointing)  # fmt: skip
    model = ModelConfig(family=name, pretrained="tiny")
    torch.manual_seed(0)
    cpu = torch.device("cpu")
    return family, train, trainable_model(model, train, LoraConfig(rank=4), family, cpu)


@pytest.mark.parametrize("name", ["flux", "sana", "z-image", "wan", "qwen-image", "flux2-klein"])
def test_the_blocks_frozen_linears_multiply_in_float8_and_the_lora_trains(name):
    family, train, trained = _trained(name, on=True)
    plain = _trained(name, on=False)[2].denoiser.state_dict()
    converted = {n for n, m in trained.denoiser.named_modules()
                 if isinstance(m, Float8FrozenLinear)}  # fmt: skip
    assert converted and all(n.endswith("base_layer") or "lora_" not in n for n in converted)
    assert not any("lora_" in n for n in converted)
    assert trained.denoiser.state_dict().keys() == plain.keys()  # every name as it was
    assert all(p.dtype == torch.float32 for p in trained.weights.params)  # the LoRA's own
    before = [p.detach().clone() for p in trained.weights.params]
    loss = _step(family, train, trained)
    assert torch.isfinite(loss)
    assert any(not torch.equal(a, b) for a, b in zip(before, trained.weights.params, strict=True))


def _step(family, train, trained) -> torch.Tensor:
    """One train step of the worker's own on ``_batch``; its loss."""
    return _stepper(family, train, trained)()


def _stepper(family, train, trained):
    """One train step of the worker's own on ``_batch``, ready to run (its loss)."""
    opt, sched = optim.for_run(train, trained.weights.param_groups())
    loss_fn = family.loss(trained.source, FlowObjective())
    step = train_step(trained, trained.denoiser, loss_fn, opt, sched, train, MemoryConfig(),
                      torch.device("cpu"))  # fmt: skip
    batch = RankSlice(0, 0, 1, _batch(family), [0, 1], [])
    return lambda: step(batch)


def _counted(on: bool, checkpointing: bool):
    """The FLOP counter of one train step of the tiny Flux."""
    family, train, trained = _trained("flux", on=on, checkpointing=checkpointing)
    step = _stepper(family, train, trained)
    with counted() as counter:
        assert torch.isfinite(step())
    return counter


def test_a_float8_step_does_the_work_of_a_step_without_float8():
    """The frozen weights get no gradient, so a float8 step counts the FLOPs of the same step
    without float8: the forward's and the input gradient's products, not the weights'
    gradients. Measured on the tiny Flux: 9,659,392 FLOPs both; torchao's float8 training,
    which computes them, counted 11,871,232 (its converted linears' 4.42 M became 6.63 M, 1.5x;
    Flux.1-dev at 1024 px on an H200: 290.0 against 171.3 TFLOP a sample)."""
    plain, float8 = (_counted(on, checkpointing=False).total for on in (False, True))
    assert abs(float8 - plain) <= 0.01 * plain, (plain, float8)


@pytest.mark.parametrize("on", [False, True], ids=["plain", "float8"])
def test_with_checkpointing_the_model_work_is_a_plain_steps_and_the_recompute_apart(on):
    """Gradient checkpointing adds the forward again as recompute (tiny Flux: 3,782,656
    FLOPs on 9,659,392), the model's work (``counter.model``) stays the step's without it.
    With float8 the recomputed products run in ``_FrozenMatmul.forward``, with gradients off:
    before raytuner's checkpoint function marked its recompute, they counted as model work
    (12,049,408 model, 1,392,640 recompute; Flux.1-dev on an H200: 230.8 TFLOP a sample for
    171.3)."""
    plain = _counted(on=False, checkpointing=False).total
    checkpointed = _counted(on=on, checkpointing=True)
    assert abs(checkpointed.model - plain) <= 0.01 * plain, (plain, checkpointed.model)
    assert checkpointed.total > 1.2 * plain, (plain, checkpointed.total)


def test_float8_trains_with_gradient_checkpointing():
    family, train, trained = _trained("flux", on=True, checkpointing=True)
    assert any(isinstance(m, Float8FrozenLinear) for m in trained.denoiser.modules())
    before = [p.detach().clone() for p in trained.weights.params]
    assert torch.isfinite(_step(family, train, trained))
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


def _pair(bias: bool = True) -> tuple[nn.Linear, nn.Linear]:
    """A frozen linear and its float8 twin (the same parameters)."""
    torch.manual_seed(0)
    plain = nn.Linear(256, 128, bias=bias).requires_grad_(False)
    twin = nn.Linear(256, 128, bias=bias).requires_grad_(False)
    twin.load_state_dict(plain.state_dict())
    twin.__class__ = Float8FrozenLinear
    return plain, twin


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@pytest.mark.parametrize("autocast", [False, True])
def test_a_float8_linear_is_the_linear_within_float8s_rounding(autocast):
    """Output and input gradient of a 256 -> 128 linear on 2 x 64 tokens against the same
    linear's in the same dtype: measured 3.7 % relative (e4m3's 3 mantissa bits) for the output
    and 5.9 % for the input gradient (the output gradient in e5m2: 2 bits), in float32 and
    under bfloat16 autocast alike (torchao's float8 linear: the same 3.7 % and 5.9 %). The
    output is the compute dtype, the input gradient the input's; the weight and the bias get
    no gradient."""
    plain, twin = _pair()
    x = torch.randn(2, 64, 256, generator=torch.Generator().manual_seed(1))
    grad = torch.randn(2, 64, 128, generator=torch.Generator().manual_seed(2))
    outs, grads = [], []
    for linear in (plain, twin):
        given = x.clone().requires_grad_()
        with torch.autocast("cpu", torch.bfloat16, enabled=autocast):
            out = linear(given)
        out.backward(grad.to(out.dtype))
        outs.append(out)
        grads.append(given.grad)
    assert outs[1].dtype == (torch.bfloat16 if autocast else torch.float32)
    assert outs[1].shape == outs[0].shape and grads[1].dtype == torch.float32
    assert _relative(outs[1], outs[0]) < 0.075
    assert _relative(grads[1], grads[0]) < 0.12
    assert twin.weight.grad is None and twin.bias.grad is None


def test_a_float8_linear_compiles_whole_and_checkpoints():
    """Compiled with fullgraph (no graph break), under bfloat16 autocast and non-reentrant
    checkpointing, a block of two float8 linears and a trained one gives eager's output and
    gradients within float8's rounding (measured: 1.0 % for the output, 1.8 % for the input's
    gradient, 0.9 % for the trained weight's: inductor fuses the input's cast to bfloat16 into
    its cast to float8 without rounding in between, so some elements round the other way;
    with ``emulate_precision_casts`` they are equal)."""
    torch.manual_seed(0)
    block = nn.ModuleDict({"a": nn.Linear(64, 128), "b": nn.Linear(128, 64),
                           "lora": nn.Linear(64, 64, bias=False)})  # fmt: skip
    for frozen in (block["a"], block["b"]):
        frozen.requires_grad_(False).__class__ = Float8FrozenLinear

    def forward(x):
        return block["b"](nn.functional.gelu(block["a"](x))) + block["lora"](x)

    x = torch.randn(3, 10, 64, generator=torch.Generator().manual_seed(1))
    runs = []
    for fn in (forward, torch.compile(forward, fullgraph=True)):
        given = x.clone().requires_grad_()
        block.zero_grad()
        with torch.autocast("cpu", torch.bfloat16):
            out = checkpoint(fn, given, use_reentrant=False)
        out.float().square().mean().backward()
        runs.append((out.detach(), given.grad, block["lora"].weight.grad.clone()))
    for eager, compiled in zip(*runs, strict=True):
        assert _relative(compiled, eager) < 0.04
    assert block["a"].weight.grad is None
