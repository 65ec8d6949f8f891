"""A sharded block computes on what a replicated one computes on. With bfloat16 frozen weights
(every GPU run) FSDP's mixed precision cast each unit's floating inputs to bfloat16: the
timestep reached the denoiser quantised (0.737 became 0.7383), and on torch 2.11 (an H200,
2026-11-27) FLUX.2 [dev] failed its first backward with gradient checkpointing, since that
torch skipped the cast when a checkpointed block was recomputed ("Recomputed values for the
following tensors have different metadata", pytorch#159359). Here one gloo worker runs the tiny
Flux LoRA step, checkpointed, replicated and then sharded, recording every block's inputs in
its forward and in its recompute."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from raytuner.families import FAMILIES


def _inputs(value) -> list:
    if isinstance(value, torch.Tensor):
        return [str(value.dtype)]
    if isinstance(value, (tuple, list)):
        return [d for v in value for d in _inputs(v)]
    return []


def _record(denoiser, family, seen: list) -> None:
    """Every sharding unit's inputs as its own forward gets them (after FSDP's hooks): the
    dtypes of its tensors, and whether autograd's backward (a recompute) called it."""
    from raytuner.placement import sharding

    for index, unit in enumerate(sharding.units(denoiser, family)):
        real = unit.forward

        def forward(*args, _real=real, _index=index, **kwargs):
            phase = "recompute" if torch._C._current_graph_task_id() != -1 else "forward"
            seen.append([phase, _index, _inputs(list(args) + list(kwargs.values()))])
            return _real(*args, **kwargs)

        unit.forward = forward


def _steps(rank: int, port: int, out: str) -> None:
    import torch.distributed as dist
    from test_sharded_checkpoints import _slice

    from raytuner.config import LoraConfig, MemoryConfig, ModelConfig, ObjectiveConfig, TrainConfig
    from raytuner.placement.strategy import REPLICATED, SHARDED
    from raytuner.train import optim
    from raytuner.train.model import trainable_model
    from raytuner.train.step import train_step

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=0, world_size=1)
    flux, cpu = FAMILIES["flux"], torch.device("cpu")
    model = ModelConfig(family="flux", pretrained="tiny", dtype="bfloat16")
    train = TrainConfig(
        output="unused", global_batch_size=2, max_steps=10, gradient_checkpointing=True
    )
    result = {}
    for name, strategy in (("replicated", REPLICATED), ("sharded", SHARDED)):
        trained = trainable_model(model, train, LoraConfig(rank=4, alpha=4.0), flux, cpu,
                                  strategy=strategy)  # fmt: skip
        seen: list = []
        _record(trained.denoiser, flux, seen)
        opt, sched = optim.for_run(train, trained.weights.params)
        loss_fn = flux.loss(trained.source, ObjectiveConfig().for_family(flux))
        step = train_step(trained, trained.denoiser, loss_fn, opt, sched, train, MemoryConfig(),
                          cpu, 1)  # fmt: skip
        loss = step(_slice(0, 0, 1)).item()
        result[name] = {"loss": loss, "seen": seen}
    Path(out, "result.json").write_text(json.dumps(result))
    dist.destroy_process_group()


def test_a_sharded_block_gets_the_inputs_a_replicated_one_gets(tmp_path):
    """In the forward and when recomputed, each sharded block gets the dtypes the replicated
    block gets (float32 timestep embedding and rotary tables, autocast casting at the matmuls),
    and the first step's loss is the replicated one's."""
    from ray_head import free_ports

    mp.spawn(_steps, args=(free_ports(1)[0], str(tmp_path)), nprocs=1)
    result = json.loads((tmp_path / "result.json").read_text())
    replicated, sharded = result["replicated"], result["sharded"]
    assert {p for p, _, _ in sharded["seen"]} == {"forward", "recompute"}, sharded["seen"]

    def by_phase(seen, phase):
        return sorted((i, d) for p, i, d in seen if p == phase)

    forward = by_phase(sharded["seen"], "forward")
    assert by_phase(sharded["seen"], "recompute") == forward
    assert forward == by_phase(replicated["seen"], "forward")
    assert any("torch.float32" in d for _, d in forward), forward  # not all cast to bfloat16
    assert sharded["loss"] == pytest.approx(replicated["loss"], rel=1e-6, abs=0)
