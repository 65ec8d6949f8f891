"""A sharded checkpoint (``train/sharded_checkpoints.py``) holds every piece of the training
state a resume needs, and a run on another number of workers reads it back whole: a LoRA on the
tiny Flux sharded over 2 gloo workers, with an EMA, AdamW, a cosine LR schedule, gradient
checkpointing and activation offload, trains two steps and checkpoints; one worker
loads the checkpoint and holds the same weights, EMA, optimizer state and LR schedule to the
bit. A damaged shard (8 flipped bytes in one worker's rows, or the file cut short) fails the
load on every worker alike (no worker waits for another in a collective), as a
``CheckpointError`` naming the file, which the restore skips. No Ray needed."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from ray_head import free_ports
from safetensors.torch import load_file, save_file

from raytuner.checkpoint import layout

STEPS = 2


def _setup(world: int, port: int):
    """The run's model, optimizer, schedule and step on this worker."""
    import torch.distributed as dist

    from raytuner.config import LoraConfig, MemoryConfig, ModelConfig, ObjectiveConfig, TrainConfig
    from raytuner.families import FAMILIES
    from raytuner.placement.strategy import SHARDED
    from raytuner.train import optim
    from raytuner.train.model import trainable_model
    from raytuner.train.step import train_step

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=int(os.environ["RANK"]), world_size=world)
    family, cpu = FAMILIES["flux"], torch.device("cpu")
    train = TrainConfig(
        output="unused",
        max_steps=10,
        lr_scheduler="cosine",
        warmup_steps=1,
        learning_rate=1e-2,
        ema_decay=0.9,
        gradient_checkpointing=True,
        global_batch_size=4,
    )
    memory = MemoryConfig(activation_offload=True)
    model = ModelConfig(family="flux", pretrained="tiny")
    trained = trainable_model(model, train, LoraConfig(rank=4, alpha=4.0), family, cpu, memory,
                              strategy=SHARDED)  # fmt: skip
    opt, sched = optim.for_run(train, trained.weights.params)
    loss_fn = family.loss(trained.source, ObjectiveConfig().for_family(family))
    step = train_step(trained, trained.denoiser, loss_fn, opt, sched, train, memory, cpu, world)
    return trained.weights, opt, sched, step


def _state(weights, opt, sched) -> dict[str, torch.Tensor]:
    """Everything a resume restores, gathered whole (a collective)."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    from raytuner.placement import sharding

    out = {f"weights/{k}": v for k, v in weights.gathered().items()}
    out |= {f"ema/{k}": sharding.gather(v) for k, v in weights.ema_tensors().items()}
    for name, entries in get_optimizer_state_dict(weights.denoiser, opt)["state"].items():
        out |= {f"optimizer/{name}/{k}": sharding.gather(v) for k, v in entries.items()}
    out["lr"] = torch.tensor(sched.get_last_lr())
    out["ema_step"] = torch.tensor(weights.ema.optimization_step)
    return {k: v.detach().cpu().contiguous() for k, v in out.items()}


def _slice(i: int, rank: int, world: int):
    """This worker's 2 samples of global batch ``i`` of the tiny Flux's cached tensors."""
    from raytuner.families import FAMILIES
    from raytuner.families.parts import Source
    from raytuner.train.feed import RankSlice

    flux, tiny = FAMILIES["flux"], Source("tiny")
    latent = flux.image_encoder(tiny, "cpu")(torch.zeros(1, 3, 64, 64))[0]
    text = flux.text_encoder(tiny, "cpu")(["a caption"])
    shapes = {"latent": tuple(latent.shape[1:])} | {k: tuple(v.shape[1:]) for k, v in text.items()}
    torch.manual_seed(100 * i + rank)
    batch = flux.example_batch(shapes, 2, (64, 64), "cpu", torch.float32)
    seeds = [4 * i + 2 * rank, 4 * i + 2 * rank + 1]
    return RankSlice(0, i, STEPS, batch, seeds, [])


def _train_save_and_load(rank: int, world: int, folder: str, port: int) -> None:
    """Train, save the checkpoint, keep an intact copy of it (for the load on 1 worker), then
    load it back on these workers and damage it (``_load_into``): one start of the workers
    (their imports and model) for both."""
    import torch.distributed as dist

    from raytuner.checkpoint import files

    os.environ["RANK"] = str(rank)
    weights, opt, sched, step = _setup(world, port)
    for i in range(STEPS):
        step(_slice(i, rank, world))
    state = files.TrainState(step=STEPS)
    export = lambda d: weights.export_lora(None, None, {})  # noqa: E731 (gathered, not written)
    files.save_checkpoint(folder, weights, opt, sched, state, {}, export, rank=rank, sharded=True)
    reference = _state(weights, opt, sched)
    dist.barrier()  # every worker's files written
    if rank == 0:
        save_file(reference, os.path.join(folder, "..", "reference.safetensors"))
        shutil.copytree(folder, f"{folder}-intact")
    dist.barrier()
    _load_into(rank, world, folder, weights, opt, sched, step)


def _load(rank: int, world: int, folder: str, port: int) -> None:
    """``_load_into`` a model, optimizer and schedule built afresh on ``world`` workers."""
    os.environ["RANK"] = str(rank)
    _load_into(rank, world, folder, *_setup(world, port))


def _load_into(rank: int, world: int, folder: str, weights, opt, sched, step) -> None:
    """Load the checkpoint (counting the bytes read), keep what it restored, take a step; at 2
    workers, then damage a shard and load again."""
    import pyarrow.fs as pafs
    import torch.distributed as dist
    from test_export_final import Recording  # the local filesystem, noting every read

    from raytuner.checkpoint import files

    reads = Recording()
    loaded = files.load_checkpoint(
        folder, weights, opt, sched, pafs.PyFileSystem(reads), sharded=True
    )
    result = {"step": loaded.step, "read": {p: sum(n) for p, n in reads.opened.items()}}
    got = _state(weights, opt, sched)
    if rank == 0:
        save_file(got, os.path.join(folder, "..", f"loaded-{world}.safetensors"))
    step(_slice(STEPS, rank, world))  # the restored optimizer steps its sharded state
    if world > 1:
        shard = sorted(Path(folder, layout.WEIGHTS_DIR).glob("*.safetensors"))[1]
        result["shard"], result["errors"] = str(shard), []
        for damage in (_flip_rows, _truncate):  # rank 1's rows; then the file cut short
            if rank == 0:
                damage(shard)
            dist.barrier()
            try:
                files.load_checkpoint(folder, weights, opt, sched, sharded=True)
            except files.CheckpointError as e:
                result["errors"].append(str(e))
            dist.barrier()
    Path(folder, "..", f"result-{world}-{rank}.json").write_text(json.dumps(result))


def _flip_rows(shard: Path) -> None:
    """8 bytes flipped in the middle of the file's tensor data (its header and size intact)."""
    data = bytearray(shard.read_bytes())
    start = 8 + int.from_bytes(data[:8], "little")
    middle = (start + len(data)) // 2
    data[middle : middle + 8] = bytes(b ^ 0xFF for b in data[middle : middle + 8])
    shard.write_bytes(bytes(data))


def _truncate(shard: Path) -> None:
    shard.write_bytes(shard.read_bytes()[:100])


@pytest.mark.slow
def test_a_sharded_checkpoint_restores_every_piece_on_another_number_of_workers(tmp_path):
    folder = tmp_path / "checkpoint"
    folder.mkdir()
    (folder / layout.EXPORT).mkdir()  # what _trained_files_complete looks for (a LoRA's export)
    (folder / layout.EXPORT / "lora.safetensors").write_bytes(b"x")
    # trained, saved, then (the intact copy kept) loaded back on 2 workers and damaged
    mp.spawn(_train_save_and_load, args=(2, str(folder), free_ports(1)[0]), nprocs=2)
    folder = tmp_path / "checkpoint-intact"
    names = sorted(p.name for p in folder.iterdir())
    assert {layout.WEIGHTS_DIR, layout.EMA_DIR, layout.OPTIMIZER_DIR, layout.OPTIMIZER_JSON} <= set(
        names
    )
    assert len(list((folder / layout.OPTIMIZER_DIR).glob("*.safetensors"))) == 2

    mp.spawn(_load, args=(1, str(folder), free_ports(1)[0]), nprocs=1)
    assert json.loads((tmp_path / "result-1-0.json").read_text())["step"] == STEPS
    expected = load_file(tmp_path / "reference.safetensors")
    loaded = load_file(tmp_path / "loaded-1.safetensors")
    assert expected.keys() == loaded.keys()
    assert any(k.startswith("optimizer/") and k.endswith("/exp_avg_sq") for k in expected)
    for key in expected:
        assert torch.equal(expected[key], loaded[key]), key

    # each of 2 workers reads its own rows: about half the data, never every byte; then 8
    # flipped bytes in the rows one worker reads, and a truncated shard, give every worker a
    # CheckpointError naming the file (before checksums the flipped bytes loaded silently)
    sizes = {}  # folder -> (bytes of the headers every worker reads, bytes of data)
    for sub in (layout.WEIGHTS_DIR, layout.EMA_DIR, layout.OPTIMIZER_DIR):
        files = list((folder / sub).glob("*.safetensors"))
        headers = sum(8 + int.from_bytes(f.read_bytes()[:8], "little") for f in files)
        sizes[sub] = headers, sum(f.stat().st_size for f in files) - headers
    results = [json.loads((tmp_path / f"result-2-{r}.json").read_text()) for r in (0, 1)]
    for result in results:
        assert len(result["errors"]) == 2, result["errors"]
        flipped, truncated = result["errors"]
        assert flipped.startswith(f"{result['shard']}: the bytes of ") and "damaged" in flipped
        assert truncated.startswith(f"{result['shard']}: 100 bytes"), truncated
    for rank, result in enumerate(results):
        read = result["read"]
        for sub, (headers, data) in sizes.items():
            got = sum(n for path, n in read.items() if Path(path).parent.name == sub) - headers
            print(f"rank {rank} read {got} of the {data} bytes of data in {sub}/")
            assert got <= 0.6 * data, (rank, sub, got, data)
