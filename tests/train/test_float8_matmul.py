"""``train.float8_matmul``: the frozen base linears of a transformer family's blocks multiply in
float8 (``Float8FrozenLinear``, emulated on the CPU), the LoRA stays as it was; the step does the
work a bfloat16 step does (no gradient of the frozen weights), with checkpointing and compiled;
what the worker refuses."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn
from torch._dynamo.utils import counters
from torch.utils.checkpoint import checkpoint

from raytuner.config import FlowObjective, LoraConfig, MemoryConfig, ModelConfig, TrainConfig
from raytuner.families import FAMILIES
from raytuner.observe.flops import counted
from raytuner.train import float8_matmul, optim
from raytuner.train.feed import RankSlice
from raytuner.train.float8_matmul import E4M3, E5M2, Float8FrozenLinear, to_float8
from raytuner.train.model import trainable_model
from raytuner.train.step import train_step

REPO = Path(__file__).resolve().parents[2]


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
    assert all(t.dtype != E4M3 for t in trained.denoiser.state_dict().values())  # no copy
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


def test_a_float8_linear_compiles_whole_and_checkpoints(monkeypatch):
    """Compiled with fullgraph (no graph break), under bfloat16 autocast and non-reentrant
    checkpointing, a block of two float8 linears and a trained one gives eager's output and
    gradients within float8's rounding (measured: 1.0 % for the output, 1.8 % for the input's
    gradient, 0.9 % for the trained weight's: inductor fuses the input's cast to bfloat16 into
    its cast to float8 without rounding in between, so some elements round the other way;
    with ``emulate_precision_casts`` they are equal). The compiled code takes the weights'
    float8 copies the eager run made, casts no weight, and compiles once: its second step
    neither compiles again nor differs."""
    torch.manual_seed(0)
    block = nn.ModuleDict({"a": nn.Linear(64, 128), "b": nn.Linear(128, 64),
                           "lora": nn.Linear(64, 64, bias=False)})  # fmt: skip
    for frozen in (block["a"], block["b"]):
        frozen.requires_grad_(False).__class__ = Float8FrozenLinear
    cast, weights = [], {(128, 64), (64, 128)}  # the weights to_float8 is given

    def counted_cast(t, dtype):
        if tuple(t.shape) in weights:  # not a side effect inside the autograd.Function
            cast.append(tuple(t.shape))
        return to_float8(t, dtype)

    monkeypatch.setattr(float8_matmul, "to_float8", counted_cast)

    def forward(x):
        return block["b"](nn.functional.gelu(block["a"](x))) + block["lora"](x)

    x = torch.randn(3, 10, 64, generator=torch.Generator().manual_seed(1))
    compiled = torch.compile(forward, fullgraph=True)
    runs, graphs = [], []
    for fn in (forward, compiled, compiled):
        given = x.clone().requires_grad_()
        block.zero_grad()
        cast.clear()
        with torch.autocast("cpu", torch.bfloat16):
            out = checkpoint(fn, given, use_reentrant=False)
        out.float().square().mean().backward()
        runs.append((out.detach(), given.grad, block["lora"].weight.grad.clone()))
        graphs.append(counters["stats"]["unique_graphs"])
        assert bool(cast) == (fn is forward), cast  # eager: the copies made, then kept
    for eager, compiled in zip(runs[0], runs[1], strict=True):
        assert _relative(compiled, eager) < 0.04
    assert all(torch.equal(a, b) for a, b in zip(runs[1], runs[2], strict=True))
    assert graphs[2] == graphs[1] == graphs[0] + 1  # compiled once
    assert block["a"].weight.grad is None


def _per_use(linear: nn.Linear, x: torch.Tensor, grad: torch.Tensor, autocast: bool):
    """The output and input gradient of a float8 linear as it was made before its weight's
    float8 copy was kept: the weight cast to float8 in forward (under autocast as asked) and
    again in backward."""
    dtype = torch.bfloat16 if autocast else x.dtype
    flat, g = x.reshape(-1, x.shape[-1]), grad.reshape(-1, grad.shape[-1]).to(dtype)
    with torch.autocast("cpu", torch.bfloat16, enabled=autocast):
        x8, x_inverse = to_float8(flat.to(dtype).contiguous(), E4M3)
        w8, w_inverse = to_float8(linear.weight.to(dtype), E4M3)
        fused = dtype != torch.float32
        bias = linear.bias.to(dtype)
        out = torch._scaled_mm(x8, w8.t(), scale_a=x_inverse, scale_b=w_inverse,
                               bias=bias if fused else None, out_dtype=dtype)  # fmt: skip
        out = out if fused else out + bias
    g8, g_inverse = to_float8(g.contiguous(), E5M2)
    w8, w_inverse = to_float8(linear.weight.to(dtype), E4M3)
    grad_x = torch._scaled_mm(g8, w8.t().contiguous().t(), scale_a=g_inverse,
                              scale_b=w_inverse, out_dtype=x.dtype)  # fmt: skip
    return out.reshape(*x.shape[:-1], -1), grad_x.reshape(x.shape)


def _run(linear, x, grad, autocast: bool):
    given = x.clone().requires_grad_()
    with torch.autocast("cpu", torch.bfloat16, enabled=autocast):
        out = linear(given)
    out.backward(grad.to(out.dtype))
    return out.detach(), given.grad


@pytest.mark.parametrize("ahead", [False, True], ids=["at-first-use", "ahead"])
@pytest.mark.parametrize("stored", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("autocast", [False, True])
def test_the_kept_float8_copy_gives_the_per_use_casts_values_bit_for_bit(stored, autocast, ahead):
    """The weight's float8 copy is made once (the same tensors at every use), at its first use
    or ahead (as ``convert`` does, outside autocast), and the output and input gradient are
    those of casting the weight on each use, bit for bit, whether the weight is stored in the
    compute dtype or cast to it first (float32 under bfloat16 autocast: the copy is of the
    bfloat16 cast)."""
    _, twin = _pair()
    twin.to(stored)
    x = torch.randn(2, 64, 256, generator=torch.Generator().manual_seed(1)).to(stored)
    grad = torch.randn(2, 64, 128, generator=torch.Generator().manual_seed(2))
    dtype = torch.bfloat16 if autocast else stored
    if ahead:
        twin.float8_weight(dtype)
    for _ in range(2):
        out, grad_x = _run(twin, x, grad, autocast)
        expected_out, expected_grad = _per_use(twin, x, grad, autocast)
        assert out.dtype == expected_out.dtype and torch.equal(out, expected_out)
        assert grad_x.dtype == expected_grad.dtype and torch.equal(grad_x, expected_grad)
        kept = twin.float8_weight(dtype)
        assert kept[0].dtype == E4M3
        assert all(a is b for a, b in zip(kept, twin.float8_weight(dtype), strict=True))


def test_a_changed_or_moved_weight_gets_a_new_float8_copy():
    """The copy is made again when the weight is written in place, replaced, moved or cast
    (``module.to``), or used in another dtype; never kept stale. (A write through ``.data``
    counts no version and is not seen.)"""
    plain, twin = _pair()
    x = torch.randn(2, 64, 256, generator=torch.Generator().manual_seed(1))
    grad = torch.randn(2, 64, 128, generator=torch.Generator().manual_seed(2))

    def fresh(dtype=torch.float32) -> bool:
        out, grad_x = _run(twin, x.to(dtype), grad, autocast=False)
        expected = _per_use(twin, x.to(dtype), grad, autocast=False)
        return torch.equal(out, expected[0]) and torch.equal(grad_x, expected[1])

    assert fresh()
    kept = twin.float8_weight(torch.float32)[0]
    with torch.no_grad():
        twin.weight.mul_(-0.5)  # in place: a new version
    assert fresh() and twin.float8_weight(torch.float32)[0] is not kept
    twin.weight.data = plain.weight.data.clone()  # another storage
    assert fresh()
    kept = twin.float8_weight(torch.float32)[0]
    twin.to("cpu")  # where it is: the same copy
    assert twin.float8_weight(torch.float32)[0] is kept
    twin.to(torch.bfloat16)  # cast (as moved): made again from the weight as it is now
    assert twin._float8[1] == (twin.weight.device, twin.weight.data_ptr(), twin.weight._version)
    assert fresh(torch.bfloat16)  # and for the dtype of its use
    assert twin.state_dict().keys() == {"weight", "bias"}  # the copy is no state


def test_the_float8_copies_are_made_once_for_the_steps_dtype_and_kept_through_steps():
    """``trainable_model`` makes each converted linear's copy for the step's compute dtype:
    steps with checkpointing (its recompute too) use them, making none again."""
    family, train, trained = _trained("flux", on=True, checkpointing=True)
    kept = float8_matmul.copies(trained.denoiser)
    converted = [m for m in trained.denoiser.modules() if isinstance(m, Float8FrozenLinear)]
    assert len(kept) == 2 * len(converted) > 0
    step = _stepper(family, train, trained)
    for _ in range(2):
        assert torch.isfinite(step())
    again = float8_matmul.copies(trained.denoiser)
    assert all(a is b for a, b in zip(kept, again, strict=True))


def test_plan_counts_the_float8_copies_in_the_weights_and_the_peak():
    """``raytuner plan`` of the tiny Flux with ``train.float8_matmul``: the converted linears'
    float8 copies (1 byte an element, and a float32 scale each) are weights, so the peak is
    larger by at least their bytes (measured: 26,112 + 160 bytes of copies, 42,412 bytes of
    peak without checkpointing, 40,204 with: the casts' temporaries besides). The step makes
    no copy again: its own peak rises by less than the copies' bytes (16,140 and 13,932)."""
    from raytuner.config import load_job
    from raytuner.tools.plan import trace as planner

    family, results = FAMILIES["flux"], {}
    for on in (False, True):
        sets = ['model.family="flux"', f"train.float8_matmul={str(on).lower()}",
                "scaling.use_gpu=true"]  # fmt: skip
        job = load_job(REPO / "jobs" / "tiny.toml", sets)
        size = planner.largest_bucket(job, family)
        shapes = planner.trace_encoders(job, family, size)[1]
        results[on] = [planner.trace_step(job, family, shapes, size, 1, c) for c in (False, True)]
    model = trainable_model(job.model, job.train, job.lora, family, torch.device("meta"))
    converted = [m for m in model.denoiser.modules() if isinstance(m, Float8FrozenLinear)]
    elements = sum(m.weight.numel() for m in converted)
    copies = elements + 4 * len(converted)
    for plain, float8 in zip(results[False], results[True], strict=True):
        assert float8["weights_by_dtype"]["float8_e4m3fn"] == elements
        assert float8["weights_bytes"] - plain["weights_bytes"] == copies
        assert float8["peak_bytes"] - plain["peak_bytes"] >= copies
        assert float8["backward_peak_bytes"] - plain["backward_peak_bytes"] < elements
