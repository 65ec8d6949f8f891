"""``train.compile``: the denoiser's repeated blocks compiled with inductor (its CPU backend),
each on its own, train what eager training trains. On the tiny Flux (LoRA, gradient
checkpointing) and the tiny SDXL (full fine-tune), steps alternate two buckets: the losses equal
eager's within float rounding (inductor fuses and reorders the blocks' arithmetic; the bound,
1e-4 relative, is the one the DDP tests allow for another reduction order), no block compiles
again once both buckets were compiled (dynamo's graph count, reset for each case, stays put),
and a checkpoint of the compiled run, loaded into a newly compiled model, continues to the
uninterrupted compiled run's weights within the same bound (its first step of each bucket runs
eagerly while its FLOPs are counted). The other families' blocks (Z-Image, Qwen-Image, FLUX.2,
Flux.1 Kontext, Qwen-Image-Edit) are checked compiled against eager the same way on one bucket
(four steps: none compiles again after the second), without the resume: going back and forth
between buckets and resuming are the same code for every family (the compile wrapper, the
weights' and optimizer's state), checked on a LoRA with checkpointing and on a full fine-tune;
a second bucket would double each family's compile time (cold, on this CPU) for no other
check. Both Wan 2.2 A14B experts in turn (``model.expert = "both"``, two steps each, both
buckets) share their blocks' graphs: the other expert's steps compile nothing. Each run is in
this process, with the worker's own setup and step (``trainable_model``, ``train_step``),
without Ray.

Compile time on the 2-core CPU (cold caches): the tiny Flux 56 s at the first bucket and 36 s at
the second, SDXL's transformer blocks 25 s, once; inductor's cache makes later processes faster.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch._dynamo.utils import counters

from raytuner.checkpoint import files
from raytuner.config import LoraConfig, MemoryConfig, ModelConfig, ObjectiveConfig, TrainConfig
from raytuner.families import get_family
from raytuner.families.parts import Source
from raytuner.train import optim
from raytuner.train.feed import RankSlice
from raytuner.train.model import trainable_model
from raytuner.train.step import train_step

BOTH = [(64, 64), (96, 64)] * 3  # (width, height), back and forth
ONE = [(64, 64)] * 4
TOLERANCE = 1e-4


def _family(name: str):
    """``name``: a family, or ``family:expert`` (``wan22:both``: its experts in turn)."""
    family, _, expert = name.partition(":")
    return get_family(family, expert)


def _batches(family, buckets) -> list[RankSlice]:
    """A batch of 2 samples of the family's cached tensors for each of ``buckets`` ((width,
    height) in turn); experts in turn: two steps each (low, low after the first two, then high
    again), so an expert's steps meet both buckets, each with its noise levels drawn."""
    tiny = Source("tiny")
    encode_image, encode_text = family.image_encoder(tiny, "cpu"), family.text_encoder(tiny, "cpu")
    clip = (1,) if family.turns else ()  # a video family's one-frame clip
    loss_fn = family.loss(tiny, ObjectiveConfig().for_family(family))
    out = []
    for i, (w, h) in enumerate(buckets):
        latent = encode_image(torch.zeros(1, 3, *clip, h, w))[0]
        text = encode_text(["a caption"])
        shapes = {"latent": tuple(latent.shape[1:])} | {k: v.shape[1:] for k, v in text.items()}
        torch.manual_seed(i)
        batch = family.example_batch(shapes, 2, (w, h), "cpu", torch.float32)
        turn = i // 2 % len(family.turns) if family.turns else 0
        if family.turns:
            generators = [torch.Generator().manual_seed(2 * i + j) for j in range(2)]
            batch |= loss_fn.draw_of(turn)(tuple(batch["latent"].shape), generators)
        out.append(RankSlice(0, i, len(buckets), batch, [2 * i, 2 * i + 1], [], turn=turn))
    return out


def _run(name: str, train: TrainConfig, batches, steps, restored=None):
    """Train ``steps`` (indices into ``batches``); ``restored``: a checkpoint folder to start
    from. Returns the losses, dynamo's graph count after each step, the trained tensors and the
    run's weights, optimizer and schedule."""
    family, cpu = _family(name), torch.device("cpu")
    family_name, _, expert = name.partition(":")
    model = ModelConfig(family=family_name, pretrained="tiny", expert=expert)
    lora = LoraConfig(rank=4, alpha=4.0)
    trained = trainable_model(model, train, lora, family, cpu)
    opt, sched = optim.for_run(train, trained.weights.params)
    if restored is not None:
        files.load_checkpoint(restored, trained.weights, opt, sched)
    loss_fn = family.loss(trained.source, ObjectiveConfig().for_family(family))
    step = train_step(trained, trained.denoiser, loss_fn, opt, sched, train, MemoryConfig(), cpu)
    losses, graphs = [], []
    for i in steps:
        losses.append(step(batches[i]).item() / 2)
        graphs.append(counters["stats"]["unique_graphs"])
    return losses, graphs, trained.weights.state(), (trained.weights, opt, sched)


def _close(a: dict, b: dict, tolerance: float) -> float:
    worst = max(((a[k] - b[k]).norm() / a[k].norm().clamp_min(1e-12)).item() for k in a)
    assert worst <= tolerance, worst
    return worst


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize(
    "name, mode, checkpointing, resume, buckets",
    [
        ("flux", "lora", True, True, BOTH),
        ("sdxl", "full", False, True, BOTH),
        ("z-image", "lora", True, False, ONE),
        ("qwen-image", "lora", True, False, ONE),
        ("flux2-klein", "lora", True, False, ONE),
        ("flux-kontext", "lora", True, False, ONE),  # the example batch's reference tokens
        ("qwen-image-edit", "lora", True, False, ONE),
        # both Wan 2.2 A14B experts in turn: their blocks share the graphs compiled on either
        ("wan22:both", "lora", True, False, BOTH),
    ],
    ids=lambda v: "both" if v is BOTH else "one" if v is ONE else None,
)
def test_compiled_blocks_train_as_eager_and_resume_exactly(
    name, mode, checkpointing, resume, buckets, tmp_path
):
    family = _family(name)
    train = TrainConfig(
        output=str(tmp_path),
        mode=mode,
        learning_rate=1e-3,
        gradient_checkpointing=checkpointing,
        global_batch_size=2,
        max_steps=10,
    )
    batches, steps = _batches(family, buckets), range(len(buckets))
    # as in a fresh process: no graph of an earlier case compiled, none counted
    torch._dynamo.reset()
    counters.clear()
    eager, _, eager_weights, _ = _run(name, train, batches, steps)
    compiled = dataclasses.replace(train, compile=True)
    losses, graphs, weights, _ = _run(name, compiled, batches, steps)
    # a bucket's first step runs eagerly while its FLOPs are counted (observe/flops.py), its
    # second compiles; after that, going back and forth compiles nothing
    first = len(set(buckets))  # the steps that meet a bucket for the first time
    assert graphs[:first] == [0] * first, f"compiled while counting FLOPs: {graphs}"
    assert graphs[first] > 0, f"nothing was compiled: {graphs}"
    assert len(set(graphs[2 * first - 1 :])) == 1, f"a bucket seen before compiled again: {graphs}"
    for a, b in zip(eager, losses, strict=True):
        assert abs(a - b) <= TOLERANCE * abs(a), (eager, losses)
    worst = _close(eager_weights, weights, TOLERANCE)
    print(f"{name}: compiled against eager: weights {worst:.1e}; graphs after each step {graphs}")
    if resume:
        _assert_resumes(name, compiled, batches, losses, weights, tmp_path / "checkpoint")


def _assert_resumes(name: str, compiled: TrainConfig, batches, losses, weights, folder) -> None:
    """A checkpoint of the compiled run at step 2, loaded into a newly compiled model, continues
    to the uninterrupted compiled run's ``losses`` and ``weights``."""
    family, steps = _family(name), range(len(batches))
    _, _, _, (w, opt, sched) = _run(name, compiled, batches, range(2))
    folder.mkdir()
    export = lambda d: w.export_lora(d, family, {}) if w.mode == "lora" else None  # noqa: E731
    state = files.TrainState(step=2)
    files.save_checkpoint(str(folder), w, opt, sched, state, {}, export)
    rest, _, resumed, _ = _run(name, compiled, batches, steps[2:], restored=str(folder))
    for a, b in zip(losses[2:], rest, strict=True):  # its first steps eager again (counted)
        assert abs(a - b) <= TOLERANCE * abs(a), (losses, rest)
    _close(weights, resumed, TOLERANCE)
