"""Low-VRAM training on the CPU, through the very code a GPU worker runs: block swap (evicted
weights are empty placeholders, so any forward, recompute or backward that touches a block
that is not in place raises), the placement check, float8 frozen weights, activation offload,
every optimizer and schedule with an exact resume, and what `raytuner check` refuses."""

from __future__ import annotations

import dataclasses
import functools

import numpy as np
import pytest
import torch

from raytuner import placement
from raytuner.checkpoint import files
from raytuner.cli import main
from raytuner.config import LoraConfig, MemoryConfig, ModelConfig, TrainConfig
from raytuner.families import FAMILIES
from raytuner.train import optim
from raytuner.train.model import trainable_model
from raytuner.train.step import forward_backward

CPU = torch.device("cpu")
LORA = LoraConfig(rank=4, alpha=4.0)


def _train(**overrides) -> TrainConfig:
    keys = dict(output="unused", gradient_checkpointing=True, learning_rate=1e-2, max_steps=6)
    return TrainConfig(**(keys | overrides))


@functools.cache
def _batch(name: str, n: int = 2) -> dict[str, torch.Tensor]:
    """Cached tensors of ``n`` 64x64 images for the tiny preset, drawn from a seed."""
    family = FAMILIES[name]
    from raytuner.families.parts import Source

    g = torch.Generator().manual_seed(1)
    pixels = torch.rand(n, 3, 64, 64, generator=g) * 2 - 1
    encode = family.image_encoder(Source("tiny"), "cpu")
    mean, _ = encode(pixels)
    text = family.text_encoder(Source("tiny"), "cpu")(["a red circle", "a blue square"][:n])
    text |= {"fps": torch.full((n,), 24.0)}  # each row's source's frame rate, as the feed's
    if not family.references.most:
        return {"latent": mean, **text}
    # an edit family: each sample with one reference, as the reader hands a pair
    reference, _ = encode(torch.rand(n, 3, 64, 64, generator=g) * 2 - 1)
    pair = {"reference_latent": reference[:, None], "reference_count": torch.ones(n, dtype=int)}
    return {"latent": mean, **text, **pair}


class _Slice:
    def __init__(self, tensors, seeds):
        self.tensors, self.seeds = tensors, seeds


def _trained(name: str, memory: MemoryConfig, train=None, dtype="float32"):
    torch.manual_seed(0)
    model = ModelConfig(family=name, dtype=dtype)
    return trainable_model(model, train or _train(), LORA, FAMILIES[name], CPU, memory)


def _loss_and_grads(name: str, memory: MemoryConfig, probe=None):
    trained = _trained(name, memory)
    loss_fn = FAMILIES[name].loss(trained.source, _objective())
    batch = _Slice(_batch(name), [3, 4])
    offload = memory.activation_offload
    loss = forward_backward(trained.denoiser, loss_fn, batch, CPU, 0, 0.5, trained.amp, offload)
    grads = {
        n: p.grad.clone()
        for n, p in zip(trained.weights.names, trained.weights.params, strict=True)
    }
    return loss, grads, trained


def _objective():  # the families that stream blocks (flux, sana, z-image, wan, qwen-image,
    # flux2): flow matching
    from raytuner.config import ObjectiveConfig

    return ObjectiveConfig().flow


@pytest.mark.parametrize(
    "name",
    [
        "flux", "sana", "z-image", "wan", "wan22", "wan22-5b", "qwen-image", "flux2-klein",
        "flux-kontext", "qwen-image-edit", "ltx2",
    ],
)  # fmt: skip
def test_swapping_blocks_gives_the_same_loss_and_lora_gradients(name):
    loss0, grads0, plain = _loss_and_grads(name, MemoryConfig())
    blocks = len(placement.blocks(plain.denoiser, FAMILIES[name]))
    assert blocks >= 3
    cases = [(1, 2, False), (blocks - 1, 2, True), (blocks - 1, 1, False)]
    for n, ring, offload in cases:
        memory = MemoryConfig(blocks_to_swap=n, swap_ring=ring, activation_offload=offload)
        loss, grads, trained = _loss_and_grads(name, memory)
        streamer = trained.placement.streamer
        assert streamer.peak_resident <= ring
        # more swapped blocks than the ring holds: each uploaded for forward, again to recompute
        assert streamer.uploads == (n if n <= ring else 2 * n - ring)
        torch.testing.assert_close(loss, loss0, rtol=0, atol=0)
        assert grads.keys() == grads0.keys()
        for key in grads0:
            torch.testing.assert_close(grads[key], grads0[key], rtol=1e-6, atol=1e-7, msg=key)
        trained.placement.check()


def test_an_evicted_block_cannot_be_used_and_resident_weights_stay_bounded():
    """At every block boundary of forward and recompute, at most the frozen weights of the
    blocks that stay plus ``swap_ring`` streamed blocks are resident; a block run without its
    hook (what a missed upload would be) raises instead of computing with stale weights."""
    memory = MemoryConfig(blocks_to_swap=2, swap_ring=1)
    trained = _trained("sana", memory)
    placed, seen = trained.placement, []
    units = placed.streamer.units
    streamed = sum(sum(nbytes for *_, nbytes in u.shapes) for u in units.values())
    frozen = sum(
        p.numel() * p.element_size()
        for p in _trained("sana", MemoryConfig())[0].parameters()
        if not p.requires_grad
    )
    bound = frozen - streamed + max(u.nbytes for u in units.values())
    for block in placed.blocks:
        block.register_forward_pre_hook(lambda *_: seen.append(placed.resident_frozen_bytes()))
    loss_fn = FAMILIES["sana"].loss(trained.source, _objective())
    forward_backward(
        trained.denoiser, loss_fn, _Slice(_batch("sana"), [3, 4]), CPU, 0, 0.5, trained.amp
    )
    assert len(seen) == 2 * len(placed.blocks) and max(seen) <= bound
    assert min(seen) < frozen - streamed + 1  # blocks left: nothing streamed was kept

    placed.streamer.evict_all()
    for hook in placed.streamer.hooks:
        hook.remove()
    with pytest.raises(RuntimeError):
        forward_backward(
            trained.denoiser, loss_fn, _Slice(_batch("sana"), [3, 4]), CPU, 0, 0.5, None
        )


def _steps(trained, opt, sched, seeds: list[int]):
    loss_fn = FAMILIES["sana"].loss(trained.source, _objective())
    for seed in seeds:
        forward_backward(
            trained.denoiser, loss_fn, _Slice(_batch("sana"), [seed, seed + 1]), CPU, 0, 0.5
        )
        torch.nn.utils.clip_grad_norm_(trained.weights.params, 1.0)
        opt.step(), sched.step(), opt.zero_grad(set_to_none=True)


PAIRS = [("adamw", s) for s in ("constant", "linear", "cosine", "cosine_with_restarts")]
PAIRS += [("adamw8bit", "polynomial"), ("adafactor", "cosine"), ("prodigy", "linear")]


@pytest.mark.parametrize(("optimizer", "schedule"), PAIRS)
def test_every_optimizer_and_schedule_resumes_exactly_with_blocks_swapped(
    optimizer, schedule, tmp_path
):
    """Two steps, a checkpoint, a new worker (block swap on) restoring it, two more steps: the
    same weights as four uninterrupted steps; restored optimizer state sits beside its
    parameter."""
    train = _train(optimizer=optimizer, lr_scheduler=schedule, warmup_steps=1, max_steps=4)
    lr = 1.0 if optimizer == "prodigy" else train.learning_rate
    train = dataclasses.replace(train, learning_rate=lr)
    if optimizer == "adamw8bit":  # LoRA matrices over bitsandbytes' 4096-element threshold
        train = dataclasses.replace(train, learning_rate=1e-3)
    lora = LoraConfig(rank=256 if optimizer == "adamw8bit" else 4, alpha=4.0)

    def worker(memory=None):
        memory = memory or MemoryConfig()
        torch.manual_seed(0)
        model = ModelConfig(family="sana")
        trained = trainable_model(model, train, lora, FAMILIES["sana"], CPU, memory)
        return (trained, *optim.for_run(train, trained.weights.params))

    whole, opt, sched = worker()
    _steps(whole, opt, sched, [0, 2, 4, 6])
    first, opt, sched = worker()
    _steps(first, opt, sched, [0, 2])
    state = files.TrainState(step=2)
    export = lambda folder: first.weights.export_lora(folder, FAMILIES["sana"], {})  # noqa: E731
    files.save_checkpoint(str(tmp_path), first.weights, opt, sched, state, {}, export)
    resumed, opt, sched = worker(MemoryConfig(blocks_to_swap=2))
    assert files.load_checkpoint(str(tmp_path), resumed.weights, opt, sched).step == 2
    resumed.placement.check(opt)
    _steps(resumed, opt, sched, [4, 6])
    resumed.placement.check(opt)
    assert sched.get_last_lr() != [train.learning_rate] or schedule == "constant"
    for a, b, name in zip(
        whole.weights.params, resumed.weights.params, whole.weights.names, strict=True
    ):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7, msg=name)
    moved = [
        not torch.equal(a, b)
        for a, b in zip(whole.weights.params, first.weights.params, strict=True)
    ]
    assert any(moved)


CHECKED = """
[model]
family = "{family}"
pretrained = "tiny"
dtype = "{dtype}"
[data]
images = "/nowhere/images"
cache = "/nowhere/cache"
[train]
output = "/nowhere/runs"
mode = "{mode}"
gradient_checkpointing = {checkpointing}
[memory]
blocks_to_swap = {swap}
activation_offload = {offload}
"""

KEYS = ("family", "dtype", "mode", "checkpointing", "swap", "offload")
REFUSED = [
    # (family, dtype, mode, checkpointing, swap, offload), what the message must name
    (("sdxl", "auto", "lora", "true", 1, "false"), "transformer families"),
    (("flux", "auto", "lora", "true", 4, "false"), "allowed: 0 to 3"),
    (("sana", "auto", "lora", "false", 1, "false"), "train.gradient_checkpointing = true"),
    (("sana", "auto", "lora", "false", 0, "true"), "memory.activation_offload"),
    (("flux", "auto", "full", "true", 1, "false"), 'train.mode = "lora"'),
    (("flux", "float8", "full", "true", 0, "false"), 'model.dtype = "float8"'),
]


@pytest.mark.parametrize(("values", "named"), REFUSED)
def test_check_refuses_what_the_model_cannot_run(values, named, tmp_path, capsys):
    path = tmp_path / "job.toml"
    path.write_text(CHECKED.format(**dict(zip(KEYS, values, strict=True))))
    assert main(["check", str(path)]) == 2
    err = capsys.readouterr().err
    assert named in err and str(path) in err, err


def test_check_accepts_every_supported_combination(tmp_path, capsys):
    from PIL import Image

    (tmp_path / "images").mkdir()  # `check` lists the image folder: one image in it
    Image.new("RGB", (8, 8)).save(tmp_path / "images" / "a.png")
    images = ["--set", f"data.images={tmp_path / 'images'}"]
    path = tmp_path / "job.toml"
    for values in [
        ("flux", "float8", "lora", "true", 3, "true"),
        ("sana", "auto", "lora", "true", 2, "false"),
        ("sdxl", "float8", "lora", "false", 0, "false"),
    ]:
        path.write_text(CHECKED.format(**dict(zip(KEYS, values, strict=True))))
        assert main(["check", str(path), *images]) == 0, capsys.readouterr().err


@pytest.mark.parametrize(
    "name",
    [
        "flux", "sana", "z-image", "wan", "wan22", "qwen-image", "flux2-klein", "flux-kontext",
        # its pipeline encodes the reference at 1024 x 1024 whatever its size: 80-140 s
        pytest.param("qwen-image-edit", marks=pytest.mark.slow),
    ],
)  # fmt: skip
def test_sampling_with_blocks_swapped_then_training_keeps_every_tensor_in_place(name, tmp_path):
    """In one process, as the validation actor and `raytuner sample` do it: a streamed
    pipeline renders what a resident one renders, before and after a LoRA is loaded into it,
    and training afterwards still finds every block where its plan puts it."""
    from PIL import Image
    from run_checks import pipeline_image

    from raytuner.families.parts import Source
    from raytuner.lora.find import find_weights
    from raytuner.render.sample import apply_weights, load_pipeline

    family = FAMILIES[name]
    trained = _trained(name, MemoryConfig(blocks_to_swap=2))
    loss_fn = family.loss(trained.source, _objective())
    opt, _ = optim.for_run(_train(), trained.weights.params)
    forward_backward(trained.denoiser, loss_fn, _Slice(_batch(name), [3, 4]), CPU, 0, 0.5)
    opt.step()
    trained.weights.export_lora(str(tmp_path), family, {})
    lora = find_weights(str(tmp_path))

    extra = {}  # an edit family renders from a reference image
    if family.references.most:
        extra[family.references.argument] = Image.new("RGB", (64, 64), (200, 40, 40))
    images = {}
    for swap in (0, 2):
        pipe = load_pipeline(family, Source("tiny"), None, "cpu", swap)
        base = pipeline_image(pipe, **extra)
        apply_weights(pipe, family, lora, "cpu", None, swap)
        images[swap] = (base, pipeline_image(pipe, **extra))
    assert not np.allclose(images[0][0], images[0][1])  # the LoRA changes the image
    for a, b in zip(images[0], images[2], strict=True):
        np.testing.assert_allclose(a, b, atol=1e-6)

    forward_backward(trained.denoiser, loss_fn, _Slice(_batch(name), [5, 6]), CPU, 0, 0.5)
    opt.step()
    trained.placement.check(opt)


def test_plan_counts_streamed_blocks_float8_weights_and_the_optimizer_state(tmp_path):
    from raytuner.config import load_job
    from raytuner.tools.plan.measure import measure
    from raytuner.tools.plan.trace import MARGIN, swapped_peak

    path = tmp_path / "job.toml"
    path.write_text(
        CHECKED.format(
            **dict(zip(KEYS, ("flux",) + ("auto", "lora", "true", 0, "false"), strict=True))
        )
    )
    rank = ["lora.rank=256"]  # LoRA matrices over bitsandbytes' 8-bit threshold
    plain = measure(load_job(path, rank), FAMILIES["flux"], 2**40, compare=False)
    worker = plain["worker"]
    assert len(worker["block_bytes"]) == 4 and min(worker["block_bytes"]) > 0
    swapped = measure(
        load_job(path, rank + ["memory.blocks_to_swap=3"]), FAMILIES["flux"], 2**40, compare=False
    )
    streamed = worker["block_bytes"][1:]
    expected = plain["peak_bytes"] - sum(streamed) + sum(sorted(streamed)[-2:])
    assert swapped["peak_bytes"] == expected < plain["peak_bytes"]
    assert swapped["worker"]["resident_weights_bytes"] == worker["weights_bytes"] - (
        plain["peak_bytes"] - expected
    )

    # float8: every linear weight at one byte instead of bfloat16's two (norms, biases stay)
    fp8 = measure(
        load_job(path, rank + ['model.dtype="float8"']), FAMILIES["flux"], 2**40, compare=False
    )
    half = measure(
        load_job(path, rank + ['model.dtype="bfloat16"']), FAMILIES["flux"], 2**40, compare=False
    )
    fp8_bytes, bf16_bytes = fp8["worker"]["weights_by_dtype"], half["worker"]["weights_by_dtype"]
    assert fp8_bytes["float8_e4m3fn"] > bf16_bytes["bfloat16"] / 4
    linear = bf16_bytes["bfloat16"] - fp8_bytes["bfloat16"]
    assert fp8_bytes["float8_e4m3fn"] * 2 == linear

    eight = measure(
        load_job(path, rank + ['train.optimizer="adamw8bit"']),
        FAMILIES["flux"],
        2**40,
        compare=False,
    )
    assert eight["worker"]["optimizer_bytes"] < worker["optimizer_bytes"] / 3

    # a GPU just too small for two streamed blocks (with plan's margin kept free): plan names
    # three, the fewest that fit
    gpu = int(swapped_peak(worker, 3, 2) / (1 - MARGIN)) + 1
    assert swapped_peak(worker, 2, 2) > gpu * (1 - MARGIN)
    suggested = measure(load_job(path, rank), FAMILIES["flux"], gpu, compare=False)["suggestions"]
    swaps = [s for s in suggested if "blocks_to_swap" in s["set"] and "float8" not in s["set"]]
    assert swaps[0]["set"].endswith("memory.blocks_to_swap = 3") and swaps[0]["fits"]


@pytest.mark.slow
def test_the_shipped_12gb_flux_job_fits_12gib():
    """jobs/flux-12gb.toml (Flux.1-dev's released architecture, float8, 29 blocks streamed,
    1024 px): plan's training worker fits the card its comment names, with plan's margin."""
    from pathlib import Path

    from raytuner.config import load_job
    from raytuner.tools.plan.trace import MARGIN, GiB, largest_bucket, micro_batch, trace_step

    path = Path(__file__).resolve().parents[2] / "jobs" / "flux-12gb.toml"
    job = load_job(path)
    size = largest_bucket(job, FAMILIES["flux"])
    shapes = FAMILIES["flux"].cache_shapes(*size)  # the released encoders' outputs
    worker = trace_step(job, FAMILIES["flux"], shapes, size, micro_batch(job), True)
    assert worker["blocks_to_swap"] == 29 and worker["peak_bytes"] <= 12 * GiB * (1 - MARGIN)
    assert f"{worker['peak_bytes'] / GiB:.1f} GiB" in path.read_text()  # its comment says so
    assert worker["weights_by_dtype"]["float8_e4m3fn"] > 10 * GiB  # the linear weights
