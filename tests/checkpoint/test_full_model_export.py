"""The export of a sharded full fine-tune reads the checkpoint a block at a time
(``lora/full_model.py``): its peak memory stays near the largest block, not the model.

Two gloo processes shard a Flux transformer of 25 blocks (~380 MB in float32, each single block
~16 MB) and write their rows as a sharded checkpoint does; a separate process exports it to a
diffusers folder and reports its peak RSS. The bound, from what one block costs at once: its
tensors read (1x), the bytes of its safetensors file (1x) and DCP's read of a worker's rows
before they are copied in (1x): 3x the largest block, plus 48 MiB of allocator slack. Holding
the whole model would exceed it by hundreds of MB. The folder then loads with
``from_pretrained`` and equals the workers' weights. No Ray needed."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from ray_head import free_ports

from raytuner.checkpoint import layout

CONFIG = dict(
    patch_size=1,
    in_channels=64,
    num_layers=1,
    num_single_layers=24,
    attention_head_dim=64,
    num_attention_heads=8,
    joint_attention_dim=128,
    pooled_projection_dim=128,
    guidance_embeds=False,
    axes_dims_rope=[8, 28, 28],
)
SLACK = 48 * 2**20


def _write_shards(rank: int, world: int, folder: str, port: int) -> None:
    """One worker: the model built on meta, sharded, its rows drawn, then saved as a sharded
    checkpoint's ``weights/`` (and rank 0 the denoiser's config)."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from diffusers import FluxTransformer2DModel
    from torch.distributed.checkpoint import HuggingFaceStorageWriter

    from raytuner.families import FAMILIES
    from raytuner.placement import sharding

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    with torch.device("meta"):
        model = FluxTransformer2DModel.from_config(CONFIG)
    sharding.shard(model, FAMILIES["flux"], torch.device("cpu"), torch.float32)
    model.to_empty(device="cpu")
    torch.manual_seed(rank)
    with torch.no_grad():
        for p in model.parameters():
            p.to_local().normal_(std=0.02)
    writer = HuggingFaceStorageWriter(
        os.path.join(folder, layout.WEIGHTS_DIR), save_distributed=True
    )
    dcp.save(dict(model.state_dict()), storage_writer=writer)
    if rank == 0:
        Path(folder, layout.DENOISER).write_text(model.to_json_string())
    dist.destroy_process_group()


EXPORT = """
import json, sys, threading, psutil
from raytuner.checkpoint import full_model
trained = full_model.Trained(sys.argv[1])
me, peak, done = psutil.Process(), [0], threading.Event()
def sample():
    while not done.is_set():
        peak[0] = max(peak[0], me.memory_info().rss)
        done.wait(0.001)
before = me.memory_info().rss
sampler = threading.Thread(target=sample)
sampler.start()
if sys.argv[3] == "whole":  # what the test would see of an export that reads everything
    everything = trained.read(list(trained.shapes))
else:
    full_model.write_folder(trained, sys.argv[2], {})
done.set()
sampler.join()
blocks = {}
for name, (shape, dtype) in trained.shapes.items():
    n = 1
    for s in shape:
        n *= s
    block = full_model.block_of(name)
    blocks[block] = blocks.get(block, 0) + n * dtype.itemsize
print(json.dumps({"grew": peak[0] - before, "blocks": blocks}))
"""


def _export(checkpoint: Path, out: Path, how: str) -> dict:
    """The export in a process of its own: how much its RSS grew, and each block's bytes."""
    done = subprocess.run(
        [sys.executable, "-c", EXPORT, str(checkpoint), str(out), how],
        capture_output=True,
        text=True,
        check=True,
        timeout=300,
    )
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_the_export_of_a_sharded_checkpoint_holds_a_block_not_the_model(tmp_path):
    checkpoint, out = tmp_path / "checkpoint", tmp_path / "model" / "transformer"
    checkpoint.mkdir()
    mp.spawn(_write_shards, args=(2, str(checkpoint), free_ports(1)[0]), nprocs=2)
    assert len(list((checkpoint / layout.WEIGHTS_DIR).glob("*.safetensors"))) == 2

    report = _export(checkpoint, out, "blocks")
    largest, whole = max(report["blocks"].values()), sum(report["blocks"].values())
    bound = 3 * largest + SLACK
    print(f"export grew by {report['grew'] / 2**20:.0f} MiB; bound {bound / 2**20:.0f} MiB; "
          f"model {whole / 2**20:.0f} MiB, largest block {largest / 2**20:.0f} MiB")  # fmt: skip
    assert report["grew"] <= bound
    # the bound means something: reading the whole model at once breaks it
    assert _export(checkpoint, out, "whole")["grew"] > bound + 128 * 2**20

    from diffusers import FluxTransformer2DModel

    from raytuner.checkpoint import full_model

    exported = FluxTransformer2DModel.from_pretrained(out).state_dict()
    trained = full_model.Trained(str(checkpoint))
    saved = trained.read(list(trained.shapes))
    assert exported.keys() == saved.keys()
    assert all(torch.equal(exported[k], saved[k]) for k in saved)
