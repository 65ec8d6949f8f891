"""`raytuner plan` for sharded workers (``scaling.strategy = "fsdp"``) and what `raytuner check`
refuses with them.

The sharded bytes are the job's own parameters divided as FSDP2 divides them: checked to the
byte against a real 2-worker sharded model after an AdamW step. The Flux.1-dev full fine-tune,
which no replicated worker can hold, fits an 80 GiB card at 8 sharded workers, and plan's
suggestion for the replicated job names fsdp with the fewest workers that fit."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from ray_head import free_ports
from test_jobcheck import accepted, refused

from raytuner.config import load_job
from raytuner.families import FAMILIES
from raytuner.tools.plan import fsdp
from raytuner.tools.plan import trace as planner
from raytuner.tools.plan.measure import GiB, measure
from raytuner.tools.plan.report import parse_size

REPO = Path(__file__).resolve().parents[2]
FULL = ['train.mode="full"']


def test_the_shipped_sharded_flux_job_fits_the_l40s_its_comment_names():
    text = (REPO / "jobs" / "flux-full.toml").read_text()
    assert "L40S (48 GB)" in text and "42.2 GiB at 5" in text
    job = load_job(REPO / "jobs" / "flux-full.toml")
    result = measure(job, FAMILIES["flux"], parse_size("48GiB"), compare=False)
    # the job leaves the strategy to raytuner: auto shards it, and says why
    assert "scaling.strategy" not in job.given
    assert result["strategy"] == "fsdp" and result["workers"] == [5, 8]
    assert result["strategy_choice"].startswith("strategy auto → fsdp: a replica needs 2")
    fewest, most = result["sharded"]["by_workers"]
    assert (fewest["workers"], most["workers"]) == (5, 8)
    assert result["peak_bytes"] == fewest["peak_bytes"] > most["peak_bytes"]
    assert result["fits"], f"{result['peak_bytes'] / GiB:.1f} GiB"
    # 16 bytes a parameter (float32 weights, gradients, AdamW's two moments), split 8 ways
    state = sum(most[k] for k in ("weights_bytes", "gradients_bytes", "optimizer_bytes"))
    assert state == pytest.approx(16 * result["denoiser_params"] / 8, rel=0.01)


@pytest.mark.slow
def test_the_shipped_qwen_image_full_finetune_fits_the_l40s_its_comment_names():
    """20.43 B parameters at 16 bytes each (304 GiB), no card holds a replica: sharded over the
    8 workers the elastic group shrinks to at least, 44.7 GiB a worker."""
    text = (REPO / "jobs" / "qwen-image-full.toml").read_text()
    assert "L40S (48 GB)" in text and "44.7 GiB with 8" in text
    job = load_job(REPO / "jobs" / "qwen-image-full.toml")
    result = measure(job, FAMILIES["qwen-image"], parse_size("48GiB"), compare=False)
    fewest, most = result["sharded"]["by_workers"]
    assert (fewest["workers"], most["workers"]) == (8, 16)
    assert result["fits"] and result["peak_bytes"] == fewest["peak_bytes"] < 45.6 * GiB
    state = sum(fewest[k] for k in ("weights_bytes", "gradients_bytes", "optimizer_bytes"))
    assert state == pytest.approx(16 * 20_430_401_088 / 8, rel=0.01)


def test_a_flux_full_finetune_fits_80gib_sharded_over_8_and_plan_says_so():
    flux = REPO / "jobs" / "flux.toml"
    replicated = load_job(flux, [*FULL, "scaling.workers=8", 'scaling.strategy="ddp"'])
    result = measure(replicated, FAMILIES["flux"], parse_size("80GiB"), compare=False)
    assert not result["fits"] and result["peak_bytes"] > 200 * GiB
    (fsdp,) = [s for s in result["suggestions"] if "fsdp" in s["set"]]
    assert fsdp["fits"] and fsdp["set"].startswith('scaling.strategy = "fsdp", scaling.workers =')
    sharded = load_job(flux, [*FULL, "scaling.workers=8", 'scaling.strategy="fsdp"'])
    result = measure(sharded, FAMILIES["flux"], parse_size("80GiB"), compare=False)
    assert result["fits"] and result["peak_bytes"] < 40 * GiB


def _autograd_nodes(root) -> list:
    """Every node of the autograd graph behind ``root`` (a loss's ``grad_fn``)."""
    found, stack, seen = [], [root], set()
    while stack:
        node = stack.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        found.append(node)
        stack += [child for child, _ in node.next_functions]
    return found


def _gathered_in_a_step(job, family, trained) -> tuple[int, int]:
    """The most parameter elements a sharded worker holds whole at once (gathered from the
    other worker, or the root's) in the forward and in the backward of the job's loss: looked
    at as every module starts its forward, and as every node of the backward starts."""
    from torch.distributed.tensor import DTensor

    denoiser, most = trained.denoiser, {"forward": 0, "backward": 0}

    def look(phase: str) -> None:
        whole = sum(p.numel() for p in denoiser.parameters() if not isinstance(p, DTensor))
        most[phase] = max(most[phase], whole)

    for module in denoiser.modules():
        module.register_forward_pre_hook(lambda *_: look("forward"))
    size = planner.largest_bucket(job, family)
    _, shapes = planner.trace_encoders(job, family, size)
    batch = family.example_batch(shapes, 1, size, torch.device("cpu"), torch.float32)
    loss_fn = family.loss(trained.source, job.objective.for_family(family))
    loss = loss_fn(denoiser, batch, [torch.Generator().manual_seed(0)]).sum()
    for node in _autograd_nodes(loss.grad_fn):
        node.register_prehook(lambda *_: look("backward"))
    loss.backward()
    return most["forward"], most["backward"]


def _sharded_bytes(rank: int, world: int, out: str, port: int) -> None:
    """A real sharded worker of the tiny SDXL full fine-tune after an AdamW step: the bytes of
    its rows of the weights, the gradients and AdamW's moments (each storage once)."""
    import torch.distributed as dist

    from raytuner.placement.strategy import SHARDED
    from raytuner.train.model import trainable_model

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    job = load_job(REPO / "jobs" / "tiny.toml", FULL)
    family = FAMILIES["sdxl"]
    cpu = torch.device("cpu")
    trained = trainable_model(job.model, job.train, job.lora, family, cpu, strategy=SHARDED)
    params = trained.weights.params
    opt = torch.optim.AdamW(params)
    for p in params:
        p.grad = torch.ones_like(p)
    opt.step()

    def stored(tensors) -> int:
        storages = {t.to_local().untyped_storage().data_ptr(): t for t in tensors}
        return sum(t.to_local().untyped_storage().nbytes() for t in storages.values())

    moments = [s[k] for s in opt.state.values() for k in ("exp_avg", "exp_avg_sq")]
    figures = {
        "weights_bytes": stored(trained.denoiser.parameters()),
        "gradients_bytes": stored([p.grad for p in params]),
        "optimizer_bytes": stored(moments),
        "up_block_elements": sum(p.numel() for p in trained.denoiser.up_blocks[0].parameters()),
    }
    # last: what is whole during a forward and backward (forward, backward)
    figures["gathered_elements"] = _gathered_in_a_step(job, family, trained)
    Path(out, f"{rank}.json").write_text(json.dumps(figures))
    dist.destroy_process_group()


@pytest.mark.slow
def test_plan_divides_the_state_as_fsdp_does(tmp_path):
    mp.spawn(_sharded_bytes, args=(2, str(tmp_path), free_ports(1)[0]), nprocs=2)
    measured = [json.loads((tmp_path / f"{r}.json").read_text()) for r in (0, 1)]
    job = load_job(REPO / "jobs" / "tiny.toml", FULL)
    family = FAMILIES["sdxl"]
    size = planner.largest_bucket(job, family)
    _, shapes = planner.trace_encoders(job, family, size)
    parts = planner.sharded_parts(job, family, shapes, size, 1, False)
    planned = fsdp.worker_bytes(job, parts, 2, 0)
    for key in ("weights_bytes", "gradients_bytes", "optimizer_bytes"):
        assert [m[key] for m in measured] == [planned[key]] * 2, key
    # what a worker holds whole at once: at most plan's root and two units in flight, and two
    # units together are less than one of the UNet's up blocks (its resnets and transformer
    # blocks are units, not its down and up blocks)
    itemsize = getattr(torch, parts["compute_dtype"]).itemsize
    in_flight = (planned["root_bytes"] + planned["gathered_bytes"]) // itemsize
    for i, phase in enumerate(("forward", "backward")):
        most = max(m["gathered_elements"][i] for m in measured)
        print(f"{phase}: at most {most} elements whole; plan's root and two units {in_flight}")
        assert 0 < most <= in_flight, (phase, most, in_flight)
    assert planned["gathered_bytes"] // itemsize < measured[0]["up_block_elements"]


@pytest.mark.parametrize(
    "override, key",
    [
        ("memory.blocks_to_swap=4", "memory.blocks_to_swap = 4"),
        ('model.dtype="float8"', 'model.dtype = "float8"'),
        ('train.optimizer="adamw8bit"', 'train.optimizer = "adamw8bit"'),
        ('train.optimizer="adafactor"', 'train.optimizer = "adafactor"'),
        ('train.optimizer="prodigy"', 'train.optimizer = "prodigy"'),
    ],
)
def test_what_cannot_take_sharded_weights_is_refused(tmp_path, capsys, override, key):
    fsdp = ('scaling.strategy="fsdp"', "train.gradient_checkpointing=true")
    err = refused(tmp_path, capsys, *fsdp, override, family="flux")
    assert key in err and 'scaling.strategy = "ddp"' in err


def test_sharded_jobs_with_what_composes_pass(tmp_path, capsys):
    settings = ['scaling.strategy="fsdp"', 'train.optimizer="adamw"', "train.ema_decay=0.9"]
    settings += ["train.gradient_checkpointing=true", "memory.activation_offload=true"]
    accepted(tmp_path, capsys, *settings, family="flux")
