"""A family's sharded LoRA against one process: three LoRA steps of its tiny model on 4 captions of
several lengths, in one process on the whole batch and over two gloo workers sharded
(``scaling.strategy = "fsdp"``, each rank's batch padded to its own longest caption), must end at
the same LoRA (float rounding apart: the reduce-scatter sums in another order). A mixture's
experts trained in turn (``"wan22:both"``) take the steps in turn, each with its noise levels."""

from __future__ import annotations

import os
from pathlib import Path

import torch

CAPTIONS = ["a red circle", "a much longer caption: a blue square on a grey ground", "", "a square"]


def _rows(family, source) -> dict[str, torch.Tensor]:
    """The 4 samples as the cache holds them: latents, each caption's rows, the conditioning."""
    pixels = torch.rand(4, 3, 64, 64, generator=torch.Generator().manual_seed(0)) * 2 - 1
    text = family.text_encoder(source, "cpu")(CAPTIONS)
    sizes = torch.tensor([[64, 64]] * 4)
    return {"latent": family.image_encoder(source, "cpu")(pixels)[0], **text,
            "original_size": sizes, "crop_top_left": sizes * 0, "target_size": sizes}  # fmt: skip


def _trimmed(rows: dict[str, torch.Tensor], ragged: tuple[str, ...]) -> dict[str, torch.Tensor]:
    """A rank's batch as the feed pads it: each ragged text tensor to its longest caption."""
    for key in ragged:
        kept = rows[key].reshape(*rows[key].shape[:2], -1).any(-1)  # [B, rows]
        longest = max(1, int(kept.nonzero()[:, 1].max()) + 1) if kept.any() else 1
        rows[key] = rows[key][:, :longest]
    return rows


def lora_after_steps(rank: int, world: int, port: int, out: str, name: str) -> None:
    """Three LoRA steps of the tiny ``name`` family on this rank's share of the 4 samples;
    ``world`` 2: sharded over two gloo workers. Rank 0 writes the LoRA (gathered) to ``out``."""
    import torch.distributed as dist
    from safetensors.torch import save_file

    from raytuner.config import LoraConfig, MemoryConfig, ModelConfig, ObjectiveConfig, TrainConfig
    from raytuner.families import get_family
    from raytuner.families.parts import Source
    from raytuner.placement.strategy import SHARDED
    from raytuner.train import optim
    from raytuner.train.feed import RankSlice
    from raytuner.train.model import trainable_model
    from raytuner.train.step import train_step

    name, _, expert = name.partition(":")  # "wan22:low": a mixture's expert
    family, source = get_family(name, expert), Source("tiny")
    if world > 1:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        dist.init_process_group("gloo", rank=rank, world_size=world)
    rows, n = _rows(family, source), 4 // world
    ragged = getattr(family.text_encoder(source, "meta", weights=False), "ragged", ())
    mine = _trimmed({k: v[n * rank : n * (rank + 1)] for k, v in rows.items()}, ragged)
    cpu, model = torch.device("cpu"), ModelConfig(family=name, pretrained="tiny", expert=expert)
    train = TrainConfig(output="unused", global_batch_size=4, max_steps=4, learning_rate=1e-2)
    kw = {"strategy": SHARDED} if world > 1 else {}
    trained = trainable_model(model, train, LoraConfig(rank=4, alpha=4.0), family, cpu, **kw)
    opt, sched = optim.for_run(train, trained.weights.params)
    loss_fn = family.loss(trained.source, ObjectiveConfig().for_family(family))
    step = train_step(trained, trained.denoiser, loss_fn, opt, sched, train, MemoryConfig(), cpu,
                      world)  # fmt: skip
    seeds = list(range(n * rank, n * (rank + 1)))
    if world == 1:  # the LoRA before training: what the steps changed is measured against it
        save_file(_gathered(trained.weights), f"{out}/lora-start.safetensors")
    for i in range(3):
        turn = i % len(family.turns) if family.turns else 0  # experts in turn: high, low, high
        step(RankSlice(0, i, 4, mine | _drawn(loss_fn, turn, mine, seeds), seeds, [], turn=turn))
    state = _gathered(trained.weights)
    if rank == 0:
        save_file(state, f"{out}/lora-{world}.safetensors")
    if world > 1:
        dist.destroy_process_group()


def _drawn(loss_fn, turn: int, rows: dict, seeds: list[int]) -> dict[str, torch.Tensor]:
    """The noise and levels the feed draws for a step of expert ``turn`` of a mixture (each
    sample's own generator: the same on any rank); none for one denoiser (the loss draws)."""
    if not getattr(loss_fn, "turns", ()):
        return {}
    generators = [torch.Generator().manual_seed(s) for s in seeds]
    return loss_fn.draw_of(turn)(tuple(rows["latent"].shape), generators)


def _gathered(weights) -> dict[str, torch.Tensor]:
    """The LoRA's tensors, whole (a sharded tensor gathered), in float32."""
    state = {}
    for key, tensor in weights.state().items():
        full = tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor
        state[key] = full.detach().float().contiguous()
    return state


def assert_sharded_lora_matches(name: str, out: Path) -> None:
    """One process, then two sharded gloo workers: the same LoRA, float rounding apart
    (``name``: a family, or ``family:expert``)."""
    import torch.multiprocessing as mp
    from ray_head import free_ports
    from safetensors.torch import load_file

    lora_after_steps(0, 1, 0, str(out), name)
    mp.spawn(lora_after_steps, args=(2, free_ports(1)[0], str(out), name), nprocs=2)
    start, one, two = (load_file(out / f"lora-{w}.safetensors") for w in ("start", 1, 2))
    assert one.keys() == two.keys() and any("lora_B" in k for k in one)
    # The reduce-scatter sums in another order: float rounding apart. AdamW's first steps move
    # an element whose gradient is near zero by about the learning rate whatever its sign, so
    # rounding shows there as ~1e-4 of the weight (more on some CPUs' kernels); what the steps
    # changed is compared instead: a wrong gradient on a rank changes it by tens of percent.
    for key in one:
        change = (one[key] - start[key]).norm()
        assert change > 0, f"{key}: three steps did not change it"
        apart = float((two[key] - one[key]).norm() / change)
        assert apart <= 1e-2, f"{key}: the sharded change is {apart:.1e} of the change apart"
