"""``model.merge_adapters``: a LoRA / LoKr / LoHa / DoRA file merged into the frozen denoiser
before training gives the model the adapter gives (every kind, raytuner's diffusers file and its
kohya / LyCORIS file, a UNet and a transformer family, its weight applied); ``check`` refuses a
file it cannot merge; one end-to-end run with a merged adapter trains otherwise than one
without, exports the trained adapter alone with the merged files in its metadata, refuses a
resume with other merged adapters, and ``sample`` renders with them and, ``--no-merge``,
without."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from test_adapter_kinds import KINDS, _loss, trained
from test_jobcheck import accepted, refused
from test_training_modes import _batch

from raytuner.checkpoint.layout import DIFFUSERS_FILE, KOHYA_FILE, WEIGHTS
from raytuner.cli import main
from raytuner.config import (
    ConfigError,
    LoraConfig,
    MergeAdapterConfig,
    ModelConfig,
    TrainConfig,
    load_job,
)
from raytuner.families import FAMILIES
from raytuner.families.parts import Source
from raytuner.lora import export
from raytuner.placement.strategy import REPLICATED, SHARDED
from raytuner.train.model import adapt, trainable_model

TINY = Source("tiny")
REPO = Path(__file__).resolve().parents[2]
ALL_KINDS = {"lora": LoraConfig(rank=4, alpha=3.0, save_dtype="float32")} | KINDS


def _exported(name: str, lora: LoraConfig, folder: Path):
    """The tiny ``name`` family's adapter of ``lora`` after 3 steps, exported into ``folder``."""
    weights, _, batch = trained(name, lora, steps=2)
    model = ModelConfig(family=name)
    meta = export.metadata(family=name, model=model, lora=lora, step=3, run="r", fingerprint="f")
    weights.export_lora(str(folder), FAMILIES[name], meta)
    return weights, batch, folder / "lora"


def merged_model(name: str, *adapters: tuple[Path, float], strategy=REPLICATED):
    """The tiny denoiser a worker trains with ``adapters`` merged (a fresh LoRA: no change)."""
    merge = [MergeAdapterConfig(path=str(p), weight=w) for p, w in adapters]
    model, cpu = ModelConfig(family=name, merge_adapters=merge), torch.device("cpu")
    train, lora = TrainConfig(output="unused"), LoraConfig(rank=2)
    trainable = trainable_model(model, train, lora, FAMILIES[name], cpu, strategy=strategy)
    return trainable.denoiser.eval()


@pytest.mark.parametrize("name", ["sdxl", pytest.param("flux", marks=pytest.mark.slow)])
def test_each_kind_merged_from_either_file_is_the_model_the_adapter_gives(name, tmp_path):
    """For each kind, both exported files (diffusers/peft; kohya or LyCORIS) merged at weight 1
    give the loss of the model with the trained adapter applied; the base's differs."""
    family = FAMILIES[name]
    base = None
    for kind, lora in ALL_KINDS.items():
        weights, batch, folder = _exported(name, lora, tmp_path / kind)
        want = _loss(family, weights.denoiser, batch)
        base = _loss(family, merged_model(name), batch) if base is None else base
        assert (base - want).abs().max() > 1e-4, kind  # the adapter changes the loss
        for file in (DIFFUSERS_FILE, KOHYA_FILE):
            got = _loss(family, merged_model(name, (folder / file, 1.0)), batch)
            torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4, msg=f"{kind} {file}")


def _lora_file(folder: Path, name: str = "sdxl", targets=("ff.net.2", "proj_out")) -> Path:
    """A random rank-2 LoRA of the tiny ``name`` family on ``targets`` (none of the modules its
    trained LoRA adapts), raytuner's diffusers file."""
    family = FAMILIES[name]
    lora = LoraConfig(rank=2, alpha=2.0, target_modules=list(targets), save_dtype="float32")
    w = adapt(family.denoiser(TINY), mode="lora", lora=lora, targets=(), ema_decay=0)
    for p in w.params:
        p.data = torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())) * 0.3
    w.export_lora(str(folder), family, {})
    return folder / "lora" / DIFFUSERS_FILE


def test_the_weight_scales_a_linear_update(tmp_path):
    """A LoRA merged twice at weight 0.5 is the model it gives merged once at 1; at 0 the base."""
    path = _lora_file(tmp_path)
    family = FAMILIES["sdxl"]
    batch = _batch(family)
    once = _loss(family, merged_model("sdxl", (path, 1.0)), batch)
    halves = _loss(family, merged_model("sdxl", (path, 0.5), (path, 0.5)), batch)
    torch.testing.assert_close(halves, once, atol=1e-5, rtol=1e-5)
    zero = _loss(family, merged_model("sdxl", (path, 0.0)), batch)
    torch.testing.assert_close(zero, _loss(family, merged_model("sdxl"), batch))
    assert (once - zero).abs().max() > 1e-3


def test_a_sharded_worker_merges_each_tensor_as_it_reads_it(tmp_path):
    """``scaling.strategy = "fsdp"`` (a process group of one): the frozen weights, merged as
    each is read from the model's tensors, give the replicated merged model's loss."""
    from raytuner.placement import sharding

    sharding.single_process_group(torch.device("cpu"))
    path, family = _lora_file(tmp_path), FAMILIES["sdxl"]
    batch = _batch(family)
    want = _loss(family, merged_model("sdxl", (path, 0.8)), batch)
    got = _loss(family, merged_model("sdxl", (path, 0.8), strategy=SHARDED), batch)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert (want - _loss(family, merged_model("sdxl"), batch)).abs().max() > 1e-3


def test_float8_storage_holds_the_merged_weights(tmp_path):
    """``model.dtype = "float8"``: each merged linear is stored in float8 from the merged
    weight (merged before the weights are quantized), not from the base's."""
    from raytuner.families import parts
    from raytuner.lora import merge

    path, family = _lora_file(tmp_path), FAMILIES["sdxl"]
    adapters = [MergeAdapterConfig(path=str(path), weight=1.0)]
    model = ModelConfig(family="sdxl", dtype="float8", merge_adapters=adapters)
    train, cpu = TrainConfig(output="unused"), torch.device("cpu")
    trained = trainable_model(model, train, LoraConfig(rank=2), family, cpu).denoiser
    base = family.denoiser(parts.model_source(model, "cpu"), "cpu")  # bfloat16
    updates = merge.read(adapters, family, base)
    store = parts._ScaledFloat8(torch.bfloat16)
    for module, changes in updates.items():
        weight = base.get_submodule(module).weight
        want = store(*store.right_inverse(merge.merged(weight, changes)))
        assert torch.equal(trained.get_submodule(module).weight, want), module
        assert not torch.equal(want, store(*store.right_inverse(weight))), module


def test_check_refuses_a_file_it_cannot_merge_naming_the_key(tmp_path, capsys):
    good = _lora_file(tmp_path / "good")
    key = "model.merge_adapters[0].path"

    def entry(path) -> str:
        return f'model.merge_adapters=[{{path="{path}", weight=0.8}}]'

    accepted(tmp_path, capsys, entry(good))
    err = refused(tmp_path, capsys, entry(tmp_path / "missing.safetensors"))
    assert key in err and "no such file" in err, err
    err = refused(tmp_path, capsys, entry(good), 'train.mode="full"')
    assert "model.merge_adapters" in err and 'train.mode = "lora"' in err, err
    odd = tmp_path / "odd.safetensors"
    save_file({"something.else.weight": torch.zeros(2, 2)}, str(odd))
    err = refused(tmp_path, capsys, entry(odd))
    assert key in err and "something.else" in err, err
    err = refused(tmp_path, capsys, entry(good), family="flux")  # an SDXL LoRA on Flux
    assert key in err and "no module of this model" in err, err
    lokr = tmp_path / "lokr.safetensors"  # a LoKr whose factors fit no weight of the module
    module = "lycoris_down_blocks_1_attentions_0_proj_out"
    save_file({f"{module}.lokr_w1": torch.zeros(3, 3), f"{module}.lokr_w2": torch.zeros(5, 5)},
              str(lokr))  # fmt: skip
    err = refused(tmp_path, capsys, entry(lokr))
    assert key in err and "another model" in err, err
    text = tmp_path / "text.safetensors"
    tensors = load_file(str(good)) | {"lora_te1_x.lora_down.weight": torch.zeros(2, 2)}
    save_file(tensors, str(text))
    err = refused(tmp_path, capsys, entry(text))
    assert key in err and "text encoder" in err, err


def test_a_worker_refuses_a_file_that_changed_after_check(tmp_path):
    """The worker reads the whole file: one that no longer fits fails it naming the key."""
    odd = tmp_path / "odd.safetensors"
    save_file({"lora_unet_nothing.lora_down.weight": torch.zeros(2, 4)}, str(odd))
    with pytest.raises(ConfigError, match=r"model\.merge_adapters\[0\]\.path"):
        merged_model("sdxl", (odd, 1.0))


def _image(out: Path) -> np.ndarray:
    record = json.loads((out / "samples.json").read_text())
    return np.asarray(Image.open(out / record["files"][0])).astype(int)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_merged_adapter_trains_the_model_but_stays_out_of_the_export(job_file, tmp_path):
    """The skewed SDXL job with a LoRA on modules its trained LoRA does not adapt merged, and
    without: other losses and other trained weights, the same export keys (the trained
    adapter's alone, equal to the checkpoint's trained tensors), the merged file named in the
    export's metadata; a resume with another weight refused naming it; `sample` renders with
    the merged adapter by default and without it with --no-merge."""
    from raytuner.api import train

    path = _lora_file(tmp_path / "merge")
    merged_keys = {k.rsplit(".lora_", 1)[0].removeprefix("unet.") for k in load_file(str(path))}
    entry = f'model.merge_adapters=[{{path="{path}", weight=1.0}}]'
    steps = ["train.max_steps=2", "checkpoint.every_steps=2", "train.sample_log=false"]
    runs = {}
    for label, extra in (("merged", [entry]), ("plain", [])):
        job = load_job(job_file, [f'train.name="{label}"', *steps, *extra])
        runs[label] = train(job)
    merged, plain = runs["merged"], runs["plain"]
    assert merged["loss"] != plain["loss"]
    a, b = load_file(merged["lora"]), load_file(plain["lora"])
    assert a.keys() == b.keys()
    assert not {k for k in a if any(m in k for m in merged_keys)}
    assert any(not torch.equal(a[k], b[k]) for k in a)
    run = Path(merged["lora"]).parents[1]
    checkpoint = max(p for p in run.glob("checkpoint_*") if p.is_dir())
    trained = load_file(str(checkpoint / WEIGHTS))
    assert len(trained) == len(a)
    for key, value in trained.items():  # the export holds what training produced, and only it
        exported_key = "unet." + key.replace(".default", "")
        torch.testing.assert_close(a[exported_key], value.float(), msg=key)
    for file in (merged["lora"], merged["kohya"]):
        with safe_open(file, "pt") as f:
            meta = json.loads(f.metadata()[export.MERGED])
        sha = hashlib.sha256(path.read_bytes()).hexdigest()
        assert meta == [{"path": str(path), "weight": 1.0, "sha256": sha}]
    with safe_open(plain["lora"], "pt") as f:
        assert export.MERGED not in f.metadata()

    other = f'model.merge_adapters=[{{path="{path}", weight=0.5}}]'
    job = load_job(job_file, ['train.name="merged"', *steps, other])
    with pytest.raises(ConfigError, match=r"model\.merge_adapters = \[.* x 1 .*\], the job has"):
        train(job)

    pixels = {}
    for label, flags in (("with", []), ("without", ["--no-merge"])):
        out = tmp_path / label
        args = ["sample", str(job_file), "--set", 'train.name="merged"', "--set", entry, *flags]
        assert main([*args, "--prompt", "a noisy square", "--steps", "2", "--out", str(out)]) == 0
        pixels[label] = _image(out)
        record = json.loads((out / "samples.json").read_text())
        assert len(record["merged_adapters"]) == (0 if flags else 1)
    assert np.abs(pixels["with"] - pixels["without"]).max() > 2


def test_plan_counts_nothing_more_for_merged_adapters(tmp_path):
    """The step ``plan`` traces (the worker's own model on the meta device) is the same with
    merged adapters as without, and reads none of their files (one that is not there)."""
    from raytuner.tools.plan import trace as planner

    family, results = FAMILIES["sdxl"], []
    missing = tmp_path / "not-there.safetensors"
    for extra in ([], [f'model.merge_adapters=[{{path="{missing}", weight=0.7}}]']):
        job = load_job(REPO / "jobs" / "tiny.toml", ['model.family="sdxl"', *extra])
        size = planner.largest_bucket(job, family)
        shapes = planner.trace_encoders(job, family, size)[1]
        results.append(planner.trace_step(job, family, shapes, size, 1, False))
    assert results[0] == results[1]


def test_a_resume_needs_the_same_merged_files_and_a_run_from_before_the_key_resumes(tmp_path):
    """A checkpoint's run identity without ``model.merge_adapters`` (written before the key)
    resumes with none merged; merging a file into it, or resuming a merged run with another
    weight or another file's contents, is refused naming both lists."""
    from raytuner.checkpoint.resume import check_resumable, run_identity
    from raytuner.lora import merge

    job = load_job(REPO / "jobs" / "tiny.toml", [f"train.output={tmp_path}"])
    run_dir = tmp_path / job.train.name
    folder = run_dir / "checkpoint_2026-01-01_00-00-00.000000_step-000004"
    folder.mkdir(parents=True)
    identity = run_identity(job.model, job.lora, job.train, "fp", "d", job.scaling.strategy)
    del identity["model"]["merge_adapters"]
    (folder / "run.json").write_text(json.dumps(identity))

    def resume(merged=()):
        check_resumable(job, str(run_dir), "fp", {"id": "d"}, lambda *a: "", merged)

    resume()
    path = _lora_file(tmp_path / "merge")
    merged = merge.identity([MergeAdapterConfig(path=str(path), weight=0.5)])
    with pytest.raises(ConfigError, match=r"model\.merge_adapters = none, the job has \[.*x 0\.5"):
        resume(merged)
    identity["model"]["merge_adapters"] = merged
    (folder / "run.json").write_text(json.dumps(identity))
    resume(merged)
    other = merge.identity([MergeAdapterConfig(path=str(path), weight=0.6)])
    with pytest.raises(ConfigError, match=r"x 0\.5 .*, the job has \[.* x 0\.6 "):
        resume(other)
    save_file({k: v * 2 for k, v in load_file(str(path)).items()}, str(path))  # new contents
    with pytest.raises(ConfigError, match="sha256"):
        resume(merge.identity([MergeAdapterConfig(path=str(path), weight=0.5)]))
