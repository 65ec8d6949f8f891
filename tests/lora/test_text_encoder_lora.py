"""``lora.text_encoder``: a LoRA on SD1.5's and SDXL's text encoders, trained with the denoiser's
(issue 31, item 4). The tiny models train in this process with the worker's own setup and step
(``trainable_model``, ``train_step``, ``checkpoints``) and export both layouts: diffusers'
``load_lora_weights`` applies the text encoders' keys (the image changes against the
denoiser's keys alone), the kohya file names them as sd-scripts does and renders the same
image, a checkpoint resumes exactly, and two gloo workers train the one worker's update. The
feed hands token ids (never the cached text tensors), ``plan`` counts the encoders, ``check``
refuses what cannot train them, and a 2-worker Ray run's LoRA is what ``raytuner sample``
renders with (slow)."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import socket
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
from PIL import Image
from run_checks import pipeline_image
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from test_jobcheck import accepted, check, refused

from raytuner.checkpoint import files
from raytuner.checkpoint.layout import DIFFUSERS_FILE, KOHYA_FILE
from raytuner.cli import main
from raytuner.config import (
    ConfigError,
    LoraConfig,
    MemoryConfig,
    ModelConfig,
    ObjectiveConfig,
    TrainConfig,
    load_job,
)
from raytuner.data import cache
from raytuner.data.reader import open_dataset
from raytuner.families import FAMILIES
from raytuner.families.parts import Source
from raytuner.lora import export
from raytuner.train import optim
from raytuner.train.feed import Feed, RankSlice
from raytuner.train.model import trainable_model
from raytuner.train.step import forward_backward, train_step

TINY, CPU = Source("tiny"), torch.device("cpu")
CAPTIONS = ["a red circle", "a blue square", "", "a green triangle on white"]
REPO = Path(__file__).resolve().parents[2]
# sd-scripts' names of a CLIP's attention LoRA (networks/lora.py: lora_te{1,2}_ + the module path)
KOHYA_TE = re.compile(
    r"lora_te[12]?_text_model_encoder_layers_\d+_self_attn_(q|k|v|out)_proj"
    r"\.(lora_down\.weight|lora_up\.weight|alpha)"
)
PREFIXES = {"sd15": {"lora_te": "text_encoder"}}
PREFIXES["sdxl"] = {"lora_te1": "text_encoder", "lora_te2": "text_encoder_2"}


def _lora(**keys) -> LoraConfig:
    """Rank 4 on the UNet; rank 2, alpha 8 on the text encoders."""
    text = {"text_encoder": True, "text_encoder_rank": 2, "text_encoder_alpha": 8.0}
    return LoraConfig(**({"rank": 4, "alpha": 4.0} | text | keys))


def _train(**keys) -> TrainConfig:
    plain = {"output": "unused", "learning_rate": 1e-2, "global_batch_size": 4, "max_steps": 8}
    return TrainConfig(**(plain | keys))


class Run:
    """The worker's setup and step of a tiny model with its text encoders trained, in this
    process; ``world``: the step's scale (a gloo group of that many ranks when above 1)."""

    def __init__(self, name: str, train: TrainConfig, lora: LoraConfig, world: int = 1):
        from torch.nn.parallel import DistributedDataParallel

        self.family, self.train, self.lora = FAMILIES[name], train, lora
        self.model = model = ModelConfig(family=name, pretrained="tiny")
        torch.manual_seed(train.seed)
        self.trained = trainable_model(model, train, lora, self.family, CPU)
        self.weights, self.text = self.trained.weights, self.trained.weights.text
        self.opt, self.sched = optim.for_run(train, self.weights.param_groups())
        model = self.trained.denoiser
        if world > 1:  # as Ray Train's prepare_model wraps it
            model = self.trained.placement.distributed(lambda m, **_: DistributedDataParallel(m))
        loss_fn = self.family.loss(self.trained.source, ObjectiveConfig().for_family(self.family))
        args = (loss_fn, self.opt, self.sched, train, MemoryConfig(), CPU, world)
        self.step = train_step(self.trained, model, *args)
        self.encode_image = self.family.image_encoder(TINY, "cpu")

    def batch(self, i: int, rows: slice = slice(None)) -> RankSlice:
        """Global batch ``i``: four seeded images' latents, the captions' token ids (one of
        them the empty caption), the conditioning; ``rows``: a rank's slice of it."""
        pixels = torch.rand(4, 3, 64, 64, generator=torch.Generator().manual_seed(i)) * 2 - 1
        latent = self.encode_image(pixels)[0]
        shapes = {"latent": tuple(latent.shape[1:])}
        tensors = self.family.example_batch(shapes, 4, (64, 64), "cpu", torch.float32)
        tensors = tensors | {"latent": latent} | self.text.tokens(CAPTIONS)
        seeds = [4 * i + j for j in range(4)]
        return RankSlice(0, i, 8, {k: v[rows] for k, v in tensors.items()}, seeds[rows], [])

    def steps(self, batches, rows: slice = slice(None)) -> list[float]:
        return [self.step(self.batch(i, rows)).item() for i in batches]

    def gradients(self, i: int, rows: slice = slice(None)) -> dict[str, torch.Tensor]:
        """What the step computes of batch ``i`` before clipping: forward and backward in
        micro-batches, the text encoders' gradients averaged over the workers."""
        s = self.step
        args = (s.model, s.loss_fn, self.batch(i, rows), CPU, s.micro_batch_size, s.scale)
        forward_backward(*args, encode=self.text.encode)
        self.text.average_gradients()
        grads = {
            n: p.grad.clone()
            for n, p in zip(self.weights.names, self.weights.params, strict=True)
            if p.grad is not None
        }
        self.opt.zero_grad(set_to_none=True)
        return grads


def _export(run: Run, folder: Path) -> Path:
    """The run's LoRA export (as a checkpoint's), with the metadata the worker writes."""
    meta = export.metadata(
        family=run.family.name, model=run.model, lora=run.lora, step=3, run="te", fingerprint=""
    )
    run.weights.export_lora(str(folder), run.family, meta)
    return folder / "lora"


def _images(name: str, weights) -> np.ndarray:
    """The tiny pipeline's image with ``weights`` (a LoRA folder or a dict) loaded."""
    pipe = FAMILIES[name].pipeline(TINY)
    if isinstance(weights, tuple):
        pipe.load_lora_weights(str(weights[0]), weight_name=weights[1])
    else:
        pipe.load_lora_weights(weights if isinstance(weights, dict) else str(weights))
    return pipeline_image(pipe)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["sd15", "sdxl"])
def test_trained_text_encoders_export_keys_diffusers_applies_and_sd_scripts_names(name, tmp_path):
    run = Run(name, _train(), _lora())  # lora.save_dtype: float16, as every export's
    run.steps(range(3))
    lora = _export(run, tmp_path)
    diffusers, kohya = load_file(lora / DIFFUSERS_FILE), load_file(lora / KOHYA_FILE)
    assert {t.dtype for t in [*diffusers.values(), *kohya.values()]} == {torch.float16}

    # diffusers' layout: each encoder's keys from CLIP's text_model, the trained values
    trained = run.text.state()
    parts = sorted(PREFIXES[name].values())
    assert sorted({k.split(".")[0] for k in diffusers} - {"unet"}) == parts
    for key, value in trained.items():
        part, module = key.split(".", 1)
        path = module if module.startswith("text_model.") else f"text_model.{module}"
        assert torch.equal(diffusers[f"{part}.{path}"], value.half()), key
    moved = [k for k, v in trained.items() if "lora_B" in k and v.abs().sum() > 0]
    assert {k.split(".")[0] for k in moved} == set(parts)  # every encoder learned

    # sd-scripts' layout: lora_te_* (SD1.5), lora_te1_* / lora_te2_* (SDXL), alpha 8
    te = {k: v for k, v in kohya.items() if k.startswith("lora_te")}
    assert all(KOHYA_TE.fullmatch(k) for k in te), sorted(te)[:3]
    assert {k.split("_text_model")[0] for k in te} == set(PREFIXES[name])
    assert len(te) == 3 * len(trained) // 2  # down, up and alpha of every adapted module
    assert {float(v) for k, v in te.items() if k.endswith(".alpha")} == {8.0}
    first = f"{next(iter(PREFIXES[name]))}_text_model_encoder_layers_0_self_attn_q_proj"
    assert te[f"{first}.lora_down.weight"].shape == (2, 32)  # text_encoder_rank = 2
    with safe_open(str(lora / KOHYA_FILE), "pt") as f:
        meta = f.metadata()
    assert meta["ss_network_train_unet_only"] == "False"
    assert (
        meta["raytuner.text_encoder_rank"] == "2" and meta["raytuner.text_encoder_alpha"] == "8.0"
    )

    # load_lora_weights applies the text encoders' keys: another image than the UNet's alone;
    # sd-scripts' file, through diffusers' converter, renders the diffusers file's image
    full = _images(name, lora)
    unet_only = _images(name, {k: v for k, v in diffusers.items() if k.startswith("unet.")})
    assert np.abs(full - unet_only).max() > 0.05
    np.testing.assert_allclose(_images(name, (lora, KOHYA_FILE)), full, atol=1e-5)


@pytest.mark.slow
def test_a_checkpoint_with_text_encoders_resumes_exactly(tmp_path):
    """SDXL, both encoders trained at their own learning rate under a cosine schedule, with an
    EMA, two micro-batches a step: a checkpoint of step 2 continues to the uninterrupted run's
    weights, EMA and optimizer state, bit for bit."""
    train = _train(
        ema_decay=0.5,
        micro_batch_size=2,
        lr_scheduler="cosine",
        warmup_steps=1,
        max_steps=6,
    )
    lora = _lora(text_encoder_lr=2.5e-3, save_dtype="float32")
    whole = Run("sdxl", train, lora)
    whole.steps(range(4))
    lrs = [g["lr"] for g in whole.opt.param_groups]
    assert lrs[1] == pytest.approx(lrs[0] * 0.25) and 0 < lrs[0] < 1e-2  # one schedule, scaled

    first = Run("sdxl", train, lora)
    first.steps(range(2))
    folder = tmp_path / "checkpoint"
    folder.mkdir()
    export = lambda d: first.weights.export_lora(d, first.family, {})  # noqa: E731
    state = files.TrainState(step=2)
    save = (first.weights, first.opt, first.sched, state, {}, export)
    files.save_checkpoint(str(folder), *save)
    saved = load_file(folder / "weights.safetensors")
    assert {k.split(".")[0] for k in saved} >= {"text_encoder", "text_encoder_2"}
    assert any(k.startswith("text_encoder_2.") for k in load_file(folder / "ema.safetensors"))

    resumed = Run("sdxl", train, lora)
    files.load_checkpoint(str(folder), resumed.weights, resumed.opt, resumed.sched)
    resumed.steps(range(2, 4))
    for key, value in whole.weights.state().items():
        assert torch.equal(value, resumed.weights.state()[key]), key
    for key, value in whole.weights.ema_state().items():
        assert torch.equal(value, resumed.weights.ema_state()[key]), key
    for a, b in zip(whole.opt.state.values(), resumed.opt.state.values(), strict=True):
        assert all(torch.equal(a[k], b[k]) for k in a)
    # the export holds the EMA of the text encoders' LoRA too
    exported = load_file(_export(whole, tmp_path / "whole") / DIFFUSERS_FILE)
    ema = whole.weights.ema_state()
    key = next(k for k in ema if k.startswith("text_encoder_2.") and "lora_B" in k)
    file_key = key.replace(".default", "")
    assert torch.equal(exported[file_key], ema[key]) and not torch.equal(
        ema[key], whole.weights.state()[file_key]
    )


def _two_ranks(rank: int, port: int, out: str) -> None:
    """One of two gloo ranks: its half of each global batch, DDP on the UNet, the text
    encoders' gradients averaged by the step; rank 0 saves the first batch's gradients and the
    trained tensors after three steps."""
    os.environ |= {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    run = Run("sdxl", _train(micro_batch_size=1), _lora(), world=2)
    mine = slice(2 * rank, 2 * rank + 2)
    grads = {f"grad.{k}": v for k, v in run.gradients(0, mine).items()}
    run.steps(range(3), mine)
    if rank == 0:
        save_file(run.weights.state() | grads, out)
    dist.barrier()
    # no teardown: freeing DDP's reducer, the last holder of a gloo group, joins the group's
    # thread while holding the GIL, and that thread may be freeing a finished all-reduce's
    # tensors, which needs the GIL (seen hanging here); the rank's results are written
    os._exit(0)


@pytest.mark.slow
def test_two_workers_train_the_text_encoders_as_one(tmp_path):
    """Two gloo ranks of two samples each, in micro-batches of one, against one rank of four:
    the same gradients (the global batch's mean; to float rounding, the reductions add in
    another order) and after three steps the same LoRA on the UNet and on both text encoders
    (AdamW at lr 1e-2 carries the rounding on: 3e-4, as tests/train/test_train_exact.py allows);
    SDXL's unused CLIP-L last layer gets no gradient on either and stays as it started."""
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = str(tmp_path / "two.safetensors")
    mp.spawn(_two_ranks, args=(port, out), nprocs=2)
    one = Run("sdxl", _train(), _lora())
    grads = one.gradients(0)
    one.steps(range(3))
    two, single = load_file(out), one.weights.state()
    two_grads = {k.removeprefix("grad."): v for k, v in two.items() if k.startswith("grad.")}
    assert two_grads.keys() == grads.keys()
    assert any(k.startswith("text_encoder_2.") for k in grads)
    for key, value in grads.items():
        change = (two_grads[key] - value).norm() / value.norm().clamp_min(1e-12)
        assert change <= 1e-5, f"gradient of {key}: relative difference {change:.2e}"
    for key, value in single.items():
        change = (two[key] - value).norm() / value.norm().clamp_min(1e-12)
        assert change <= 3e-4, f"{key}: relative difference {change:.2e}"
    unused = [k for k in single if k.startswith("text_encoder.") and ".layers.1." in k]
    assert unused and not any(k.startswith("text_encoder.") and ".layers.1." in k for k in grads)
    assert all(not single[k].any() for k in unused if "lora_B" in k)


def test_the_feed_hands_token_ids_and_reads_captions_only_for_such_jobs(job_file):
    """The skewed SDXL cache: a job that trains the text encoders reads each caption's text
    and no text tensor; its batches carry both tokenizers' ids, a dropped caption the empty
    caption's; a job that does not reads no caption."""
    job = load_job(job_file)
    fp = cache.fingerprint(job.model, job.preprocess)
    plain = open_dataset(job.data.cache, fp)
    with pytest.raises(ValueError, match="without its captions"):
        plain.captions([0])
    assert sorted(plain.tensors) == ["pooled_prompt_embeds", "prompt_embeds"]
    plain.close()

    text = Run("sdxl", _train(), _lora()).text
    data = open_dataset(job.data.cache, fp, computed=text.outputs)
    assert data.tensors == []
    assert data.captions([0, 1], [False, True])[1] == ""
    for i, path in enumerate(data.paths):
        caption = Path(job.data.images, path).with_suffix(".txt").read_text()
        assert data.captions([i]) == [caption]
    feed = Feed(
        data, seed=0, global_batch_size=4, remainder="pad", rank=0, world=1, prefetch=1,
        pin=False, caption_dropout=0.5, tokenize=text.tokens,
    )  # fmt: skip
    batch = feed.assemble(0, 0, feed.epoch(0))
    assert not set(text.outputs) & set(batch.tensors)
    assert set(batch.tensors) >= {"latent", "input_ids", "input_ids_2"}
    empty = text.tokens([""])
    dropped = [torch.equal(batch.tensors["input_ids"][j], empty["input_ids"][0]) for j in range(4)]
    assert any(dropped) and not all(dropped)  # caption dropout: half of them, from the seeds
    data.close()


def test_plan_counts_the_text_encoders():
    """SD1.5 at 512 px, micro-batch 1: its CLIP-L's weights (123 M parameters in bfloat16),
    its LoRA with gradients and AdamW state, and its work join the worker's figures."""
    from raytuner.tools.plan.measure import measure

    family = FAMILIES["sd15"]
    overrides = ["train.micro_batch_size=1", "train.gradient_checkpointing=true"]
    figures = {}
    for on in (False, True):
        job = load_job(
            REPO / "jobs" / "sd15.toml", [*overrides, f"lora.text_encoder={str(on).lower()}"]
        )
        figures[on] = measure(job, family, 80 * 2**30, compare=False)
    off, on = figures[False]["worker"], figures[True]["worker"]
    assert on["text_encoder_params"] == pytest.approx(123.06e6, rel=0.01)
    lora = 12 * 4 * 16 * (768 + 768)  # 12 layers, q/k/v/out, rank 16
    assert on["text_encoder_trained_params"] == lora
    assert on["trainable_params"] - off["trainable_params"] == lora
    assert on["weights_bytes"] - off["weights_bytes"] == pytest.approx(
        on["text_encoder_params"] * 2 + lora * 4, rel=0.01
    )
    assert on["optimizer_bytes"] - off["optimizer_bytes"] == 2 * 4 * lora
    assert on["tflops_per_sample"] > off["tflops_per_sample"] * 1.01
    # the encoder's weights are held through the step; its activations and gradients are
    # made and freed before the UNet's backward peaks (checkpointed, micro-batch 1)
    grown = figures[True]["peak_bytes"] - figures[False]["peak_bytes"]
    assert grown >= on["weights_bytes"] - off["weights_bytes"]


def test_init_from_starts_the_text_encoders_from_either_layout(tmp_path):
    run = Run("sd15", _train(), _lora(save_dtype="float32"))
    run.steps(range(2))
    lora = _export(run, tmp_path)
    trained = run.text.state()
    for file in (DIFFUSERS_FILE, KOHYA_FILE):
        started = Run("sd15", _train(), _lora(init_from=str(lora / file)))
        state = started.text.state()
        for key, value in trained.items():
            torch.testing.assert_close(state[key], value, msg=f"{file}: {key}")
    with pytest.raises(ConfigError, match="set lora.text_encoder = true"):
        Run("sd15", _train(), LoraConfig(rank=4, alpha=4.0, init_from=str(lora / KOHYA_FILE)))
    with pytest.raises(ConfigError, match="lora.text_encoder_rank = 4"):
        Run("sd15", _train(), _lora(text_encoder_rank=4, init_from=str(lora / DIFFUSERS_FILE)))


def test_a_run_from_before_the_text_encoder_keys_resumes(job_file, tmp_path):
    """A checkpoint's run.json written before ``lora.text_encoder`` lacks its keys: the same
    job resumes it, one that trains the text encoders is refused, naming the key."""
    from raytuner.checkpoint.resume import check_resumable, run_identity
    from raytuner.train.trainer import _dataset_change

    # as train() hands it over: scaling.strategy decided ("auto" -> ddp on CPU workers)
    job = load_job(job_file, [f"train.output={tmp_path}", 'scaling.strategy="ddp"'])
    fp, dataset = "fp", {"id": "d"}
    identity = run_identity(job.model, job.lora, job.train, fp, "d", "ddp")
    for key in ("text_encoder", "text_encoder_rank", "text_encoder_alpha"):
        del identity["lora"][key]
    del identity["lora"]["text_encoder_target_modules"]
    folder = tmp_path / job.train.name / "checkpoint_2026-01-01_00-00-00.000000_step-000004"
    folder.mkdir(parents=True)
    (folder / "run.json").write_text(json.dumps(identity))
    run_dir = str(tmp_path / job.train.name)
    check_resumable(job, run_dir, fp, dataset, _dataset_change)
    trains_them = dataclasses.replace(job, lora=dataclasses.replace(job.lora, text_encoder=True))
    with pytest.raises(ConfigError, match=r"lora\.text_encoder changed"):
        check_resumable(trains_them, run_dir, fp, dataset, _dataset_change)


@pytest.mark.parametrize(
    "family, overrides, says",
    [
        ("flux", [], "raytuner trains no flux text encoder"),
        ("sana", [], "allowed for sd15, sdxl"),
        ("sdxl", ['train.mode="full"'], 'train.mode = "full"'),
        ("sdxl", ['scaling.strategy="fsdp"'], "not sharded"),
        ("flux", ["memory.blocks_to_swap=2", "train.gradient_checkpointing=true"], "block swap"),
    ],
)
def test_check_refuses_text_encoders_it_cannot_train(family, overrides, says, tmp_path, capsys):
    err = refused(tmp_path, capsys, "lora.text_encoder=true", *overrides, family=family)
    assert "lora.text_encoder = true" in err and says in err, err
    code, err = check(tmp_path, capsys, "lora.text_encoder_lr=1e-5", family=family)
    assert code == 2 and "set lora.text_encoder = true, or remove lora.text_encoder_lr" in err


@pytest.mark.parametrize("family", ["sd15", "sdxl"])
def test_check_takes_text_encoders_of_sd15_and_sdxl(family, tmp_path, capsys):
    te = ["lora.text_encoder=true", "lora.text_encoder_rank=8", "lora.text_encoder_lr=5e-5"]
    accepted(tmp_path, capsys, *te, family=family)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_two_ray_workers_train_the_text_encoders_and_sample_renders_with_them(job_file, tmp_path):
    """The skewed SDXL job on 2 Ray Train workers with both text encoders trained and caption
    dropout: its LoRA holds the text encoders' keys in both layouts, and `raytuner sample`
    renders other images with it than with its UNet keys alone."""
    from raytuner.api import train

    overrides = ['train.name="te"', "lora.text_encoder=true", "train.caption_dropout=0.25"]
    overrides += ["train.max_steps=4", "checkpoint.every_steps=2", "train.sample_log=false"]
    summary = train(load_job(job_file, overrides))
    assert summary["step"] == 4 and np.isfinite(summary["loss"])
    diffusers = load_file(summary["lora"])
    assert {k.split(".")[0] for k in diffusers} == {"unet", "text_encoder", "text_encoder_2"}
    te = [k for k in load_file(summary["kohya"]) if k.startswith("lora_te")]
    assert {k[:8] for k in te} == {"lora_te1", "lora_te2"} and all(
        KOHYA_TE.fullmatch(k) for k in te
    )

    unet = tmp_path / "unet-only"
    unet.mkdir()
    save_file({k: v for k, v in diffusers.items() if k.startswith("unet.")}, unet / DIFFUSERS_FILE)
    pixels = {}
    for label, weights in (("trained", str(Path(summary["lora"]).parent)), ("unet", str(unet))):
        out = tmp_path / label
        args = ["sample", str(job_file), "--set", 'train.name="te"', "--checkpoint", weights]
        assert (
            main([*args, "--prompt", "a noisy square picture", "--steps", "2", "--out", str(out)])
            == 0
        )
        record = json.loads((out / "samples.json").read_text())
        pixels[label] = np.asarray(Image.open(out / record["files"][0]))
    assert np.abs(pixels["trained"].astype(int) - pixels["unet"].astype(int)).max() > 2
