"""``lora.kind = "lokr" | "loha"`` and ``lora.dora``: each kind trains a few steps on a UNet
(SDXL) and a transformer (Flux) family in-process, and its export gives the trained model's
output wherever it is applied: through diffusers' loader where it loads (DoRA everywhere, LoKr
for Z-Image), through ``raytuner sample``'s own path (LoKr, LoHa), and through ComfyUI's rules
(``comfy_rules.py``: every key maps to a weight, and the weight ComfyUI makes of it is the
trained model's). A run resumes exactly from a checkpoint's state of each kind, starts from
raytuner's own file of each kind, and ``plan`` counts each kind's parameters.
"""

from __future__ import annotations

import copy
import dataclasses

import comfy_rules
import pytest
import torch
from peft.tuners.tuners_utils import BaseTunerLayer
from safetensors import safe_open
from safetensors.torch import load_file
from test_training_modes import _batch

from raytuner.checkpoint import layout
from raytuner.config import ConfigError, LoraConfig, ModelConfig, ObjectiveConfig
from raytuner.families import FAMILIES
from raytuner.families.parts import Source
from raytuner.lora import apply as lora_apply
from raytuner.lora import export
from raytuner.train.model import adapt

TINY = Source("tiny")
# alpha unlike the rank, so that a scale a loader gets wrong shows; LoKr at rank 2 keeps w2
# low-rank on the tiny widths (LyCORIS' alpha applies), LoKr at rank 8 stores both whole
KINDS = {
    "lokr": LoraConfig(kind="lokr", rank=2, alpha=3.0, save_dtype="float32"),
    "lokr-whole": LoraConfig(kind="lokr", rank=8, alpha=3.0, factor=4, save_dtype="float32"),
    "loha": LoraConfig(kind="loha", rank=4, alpha=3.0, save_dtype="float32"),
    "dora": LoraConfig(dora=True, rank=4, alpha=3.0, save_dtype="float32"),
}


def _loss(family, denoiser, batch) -> torch.Tensor:
    generators = [torch.Generator().manual_seed(i) for i in range(2)]
    with torch.no_grad():
        return family.loss(TINY, ObjectiveConfig().for_family(family))(denoiser, batch, generators)


def trained(name: str, lora: LoraConfig, steps: int = 3, weights=None, opt_state=None, ema=0.0):
    """The family's tiny denoiser with ``lora``'s adapter after ``steps`` AdamW steps (from
    ``weights`` / ``opt_state`` when given: a resume), and its batch."""
    family = FAMILIES[name]
    batch = _batch(family)
    w = adapt(
        family.denoiser(TINY), mode="lora", lora=lora, targets=family.adapters.targets,
        ema_decay=ema, family=family,
    )  # fmt: skip
    opt = torch.optim.AdamW(w.param_groups(), lr=3e-2)
    if weights is not None:
        w.load(weights)
        opt.load_state_dict(opt_state)
    loss_fn = family.loss(TINY, ObjectiveConfig().for_family(family))
    w.denoiser.train()
    for step in range(steps):
        generators = [torch.Generator().manual_seed(100 + step + i) for i in range(2)]
        loss_fn(w.denoiser, batch, generators).sum().backward()
        opt.step()
        opt.zero_grad()
        w.step()
    w.denoiser.eval()
    return w, opt, batch


def exported(name: str, kind: str, tmp_path):
    lora = KINDS[kind]
    w, _, batch = trained(name, lora)
    model = ModelConfig(family=name)
    meta = export.metadata(family=name, model=model, lora=lora, step=3, run="r", fingerprint="f")
    w.export_lora(str(tmp_path), FAMILIES[name], meta)
    return w, batch, tmp_path / layout.LORA_DIR


def merged_weights(denoiser) -> dict[str, torch.Tensor]:
    """Each adapted module's weight with its adapter merged by peft (the trained weight)."""
    model = copy.deepcopy(denoiser)
    out = {}
    for module_name, m in model.named_modules():
        if isinstance(m, BaseTunerLayer):
            m.merge()
            out[module_name] = m.get_base_layer().weight.detach().clone()
    return out


def comfy_keys(name: str, base) -> dict[str, str]:
    """ComfyUI's keys of the family's tiny denoiser ``base`` (``comfy_rules.accepted``)."""
    wan_layers = base.config.num_layers if name == "wan" else 0
    kohya = export.kohya_names(FAMILIES[name], base)
    return comfy_rules.accepted(name, dict(base.named_modules()), kohya, wan_layers)


# every kind on the transformer; on the UNet the decomposed LoKr alone unless slow (8-16 s
# each); a kind on each of Wan (its own names), Qwen-Image and FLUX.2 (q/k/v onto the fused qkv)
CASES = [("flux", kind) for kind in sorted(KINDS)] + [("sdxl", "lokr")]
CASES += [("wan", "lokr"), ("qwen-image", "loha"), ("flux2-klein", "dora")]
SLOW = pytest.mark.slow
CASES += [pytest.param("sdxl", k, marks=SLOW) for k in ("lokr-whole", "loha", "dora")]
CASES += [pytest.param("flux2-klein", k, marks=SLOW) for k in ("lokr", "loha")]
CASES += [pytest.param("wan", k, marks=SLOW) for k in ("loha", "dora")]
CASES += [pytest.param("qwen-image", k, marks=SLOW) for k in ("lokr-whole", "dora")]


@pytest.mark.parametrize(("name", "kind"), CASES)
def test_each_kind_exports_what_comfyui_and_raytuner_sample_apply_as_trained(name, kind, tmp_path):
    family = FAMILIES[name]
    w, batch, lora_dir = exported(name, kind, tmp_path)
    expected = _loss(family, w.denoiser, batch)
    assert not torch.equal(expected, _loss(family, family.denoiser(TINY).eval(), batch))
    with safe_open(str(lora_dir / layout.DIFFUSERS_FILE), "pt") as f:
        meta = f.metadata()
    assert meta[export.KIND] == KINDS[kind].kind
    assert meta["raytuner.dora"] == str(KINDS[kind].dora).lower()
    # ComfyUI: every key maps to a weight, and the weight it makes is the trained one
    base = family.denoiser(TINY).eval()
    modules = dict(base.named_modules())
    per_module = comfy_rules.loaded(load_file(lora_dir / layout.KOHYA_FILE), comfy_keys(name, base))
    trained_weights = merged_weights(w.denoiser)
    assert per_module.keys() == trained_weights.keys()
    with torch.no_grad():
        for module, tensors in per_module.items():
            weight = modules[module].weight
            comfy = comfy_rules.comfy_weight(weight, tensors)
            torch.testing.assert_close(comfy, trained_weights[module], atol=1e-5, rtol=1e-4)
            weight.copy_(comfy)
    torch.testing.assert_close(_loss(family, base, batch), expected, atol=1e-5, rtol=1e-4)
    # the diffusers file, as raytuner sample applies it (diffusers' loader for DoRA)
    pipe = family.pipeline(TINY)
    if KINDS[kind].kind == "lora":
        pipe.load_lora_weights(str(lora_dir))
    else:
        assert lora_apply.kind_of(str(lora_dir / layout.DIFFUSERS_FILE)) in lora_apply.PEFT_KINDS
        part = family.parts.denoiser
        lora_apply.apply_file(getattr(pipe, part), str(lora_dir / layout.DIFFUSERS_FILE), part)
    denoiser = getattr(pipe, family.parts.denoiser).eval()
    torch.testing.assert_close(_loss(family, denoiser, batch), expected, atol=1e-5, rtol=1e-4)
    pipe.unload_lora_weights()  # what raytuner sample does before the next weights
    assert not any(isinstance(m, BaseTunerLayer) for m in denoiser.modules())


def test_diffusers_loads_a_z_image_lokr_as_trained(tmp_path):
    family = FAMILIES["z-image"]
    w, batch, lora_dir = exported("z-image", "lokr", tmp_path)
    pipe = family.pipeline(TINY)
    pipe.load_lora_weights(str(lora_dir))
    torch.testing.assert_close(
        _loss(family, pipe.transformer.eval(), batch), _loss(family, w.denoiser, batch),
        atol=1e-5, rtol=1e-4,
    )  # fmt: skip
    keys = set(load_file(lora_dir / layout.KOHYA_FILE))
    assert all(k.startswith("diffusion_model.") for k in keys)


@pytest.mark.parametrize("kind", ["lokr", "lokr-whole"])
def test_diffusers_loads_a_flux2_lokr_comfyui_file_as_trained(kind, tmp_path):
    """The LyCORIS file of a FLUX.2 LoKr (SimpleTuner's ``lycoris_`` names) is one diffusers'
    FLUX.2 loader reads too (``_convert_lycoris_flux2_lokr_to_diffusers``, LyCORIS' alpha
    rule), to the trained model's loss."""
    family = FAMILIES["flux2-klein"]
    w, batch, lora_dir = exported("flux2-klein", kind, tmp_path)
    assert all(k.startswith("lycoris_") for k in load_file(lora_dir / layout.KOHYA_FILE))
    pipe = family.pipeline(TINY)
    pipe.load_lora_weights(str(lora_dir), weight_name=layout.KOHYA_FILE)
    torch.testing.assert_close(
        _loss(family, pipe.transformer.eval(), batch), _loss(family, w.denoiser, batch),
        atol=1e-5, rtol=1e-4,
    )  # fmt: skip


@pytest.mark.parametrize("kind", ["dora", *(pytest.param(k, marks=SLOW) for k in ("lokr", "loha"))])
def test_a_resumed_run_of_each_kind_trains_what_an_uninterrupted_one_does(kind):
    """The checkpoint's state (``Weights.state``: every kind's peft names, DoRA's magnitude
    included) and the optimizer's restore a run exactly; the EMA too."""
    lora = KINDS[kind]
    straight, _, _ = trained("flux", lora, steps=4, ema=0.9)
    first, opt, _ = trained("flux", lora, steps=2, ema=0.9)
    state, opt_state, ema = first.state(), opt.state_dict(), first.ema_state()
    assert set(state) == set(first.tensors())
    resumed, _, _ = trained("flux", lora, steps=0, weights=state, opt_state=opt_state, ema=0.9)
    resumed.load_ema(ema, 2)
    opt2 = torch.optim.AdamW(resumed.param_groups(), lr=3e-2)
    opt2.load_state_dict(opt_state)
    family, batch = FAMILIES["flux"], _batch(FAMILIES["flux"])
    loss_fn = family.loss(TINY, ObjectiveConfig().for_family(family))
    resumed.denoiser.train()
    for step in (2, 3):
        generators = [torch.Generator().manual_seed(100 + step + i) for i in range(2)]
        loss_fn(resumed.denoiser, batch, generators).sum().backward()
        opt2.step()
        opt2.zero_grad()
        resumed.step()
    for key, value in straight.state().items():
        torch.testing.assert_close(resumed.state()[key], value, rtol=0, atol=0, msg=key)
    for key, value in straight.ema_state().items():
        torch.testing.assert_close(resumed.ema_state()[key], value, rtol=0, atol=0, msg=key)


@pytest.mark.parametrize("kind", ["lokr", "loha", "dora"])
def test_init_from_raytuners_file_of_each_kind_starts_from_its_weights(kind, tmp_path):
    w, _, lora_dir = exported("flux", kind, tmp_path)
    path = str(lora_dir / layout.DIFFUSERS_FILE)
    family = FAMILIES["flux"]
    started = adapt(
        family.denoiser(TINY), mode="lora", lora=dataclasses.replace(KINDS[kind], init_from=path),
        targets=family.adapters.targets, ema_decay=0, family=family,
    )  # fmt: skip
    for key, value in w.state().items():
        torch.testing.assert_close(started.state()[key], value, msg=key)
    other = "loha" if kind == "lokr" else "lokr"
    with pytest.raises(ConfigError, match="lora.init_from.*lora.kind"):
        adapt(
            family.denoiser(TINY), mode="lora",
            lora=LoraConfig(kind=other, rank=4, alpha=3.0, init_from=path),
            targets=family.adapters.targets, ema_decay=0, family=family,
        )  # fmt: skip


SHARDED_LORA = LoraConfig(kind="lokr", rank=2, alpha=3.0, factor=4, save_dtype="float32")


def _two_steps(strategy, rank: int, world: int, out: str) -> dict:
    """The tiny Flux's LoKr after 2 of the worker's own train steps on global batches 0 and 1
    (this worker's slice of each; world 1: both workers' samples), gathered, and its export."""
    from test_sharded_checkpoints import _slice

    from raytuner.config import MemoryConfig, TrainConfig
    from raytuner.train import optim
    from raytuner.train.feed import RankSlice
    from raytuner.train.model import trainable_model
    from raytuner.train.step import train_step

    flux, cpu = FAMILIES["flux"], torch.device("cpu")
    model, train = ModelConfig(family="flux", pretrained="tiny"), TrainConfig(output="unused")
    trained_model = trainable_model(model, train, SHARDED_LORA, flux, cpu, strategy=strategy)
    weights = trained_model.weights
    opt, sched = optim.for_run(train, weights.params)
    loss_fn = flux.loss(trained_model.source, ObjectiveConfig().for_family(flux))
    step = train_step(
        trained_model, trained_model.denoiser, loss_fn, opt, sched, train, MemoryConfig(), cpu,
        world,
    )  # fmt: skip
    for i in range(2):
        parts = [_slice(i, r, 2) for r in ((rank,) if world == 2 else (0, 1))]
        tensors = {k: torch.cat([p.tensors[k] for p in parts]) for k in parts[0].tensors}
        seeds = [s for p in parts for s in p.seeds]
        step(RankSlice(0, i, parts[0].count, tensors, seeds, []))
    meta = export.metadata(
        family="flux", model=model, lora=SHARDED_LORA, step=2, run="r", fingerprint="f"
    )
    weights.export_lora(out if rank == 0 else None, flux, meta)
    return weights.gathered()


def _sharded_worker(rank: int, port: int, out: str) -> None:
    import os

    import torch.distributed as dist

    from raytuner.placement.strategy import SHARDED

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    state = _two_steps(SHARDED, rank, 2, out)
    torch.save(state, f"{out}/state-{rank}.pt")
    dist.destroy_process_group()


@pytest.mark.slow
def test_a_sharded_lokr_trains_as_a_replicated_one_and_exports_its_file(tmp_path):
    """``scaling.strategy = "fsdp"`` with ``lora.kind = "lokr"``: two gloo workers, each its
    rows of the frozen base and the adapter, train what one replicated worker trains on both
    workers' samples, and the gathered export holds it in both layouts."""
    import torch.multiprocessing as mp
    from ray_head import free_ports

    from raytuner.placement.strategy import REPLICATED

    (tmp_path / "sharded").mkdir()
    mp.spawn(_sharded_worker, args=(free_ports(1)[0], str(tmp_path / "sharded")), nprocs=2)
    replicated = _two_steps(REPLICATED, 0, 1, str(tmp_path / "replicated"))
    for rank in (0, 1):
        sharded = torch.load(tmp_path / "sharded" / f"state-{rank}.pt")
        assert sharded.keys() == replicated.keys()
        for key, value in replicated.items():
            torch.testing.assert_close(sharded[key], value, atol=1e-5, rtol=1e-4, msg=key)
    for name in (layout.DIFFUSERS_FILE, layout.KOHYA_FILE):
        a = load_file(tmp_path / "sharded" / layout.LORA_DIR / name)
        b = load_file(tmp_path / "replicated" / layout.LORA_DIR / name)
        assert a.keys() == b.keys()
        for key in a:
            torch.testing.assert_close(a[key], b[key], atol=1e-5, rtol=1e-4, msg=key)


def _ddp_worker(rank: int, port: int, out: str) -> None:
    """One of two gloo workers: the tiny Flux's LoHa with ``module_dropout`` in DDP, wrapped
    as the run wraps it (``placement.distributed``; Ray Train's ``prepare_model`` builds the
    same ``DistributedDataParallel`` of the options it is given), 4 train steps."""
    import os

    import torch.distributed as dist
    from test_sharded_checkpoints import _slice
    from torch.nn.parallel import DistributedDataParallel

    from raytuner.config import MemoryConfig, TrainConfig
    from raytuner.train import optim
    from raytuner.train.model import trainable_model
    from raytuner.train.step import train_step

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    flux, cpu = FAMILIES["flux"], torch.device("cpu")
    model, train = ModelConfig(family="flux", pretrained="tiny"), TrainConfig(output="unused")
    lora = LoraConfig(kind="loha", rank=2, module_dropout=0.5)
    trained_model = trainable_model(model, train, lora, flux, cpu)

    def prepare(module, move_to_device, parallel_strategy_kwargs):
        return DistributedDataParallel(module, **parallel_strategy_kwargs)

    ddp = trained_model.placement.distributed(prepare)
    opt, sched = optim.for_run(train, trained_model.weights.params)
    loss_fn = flux.loss(trained_model.source, ObjectiveConfig().for_family(flux))
    step = train_step(trained_model, ddp, loss_fn, opt, sched, train, MemoryConfig(), cpu, 2)
    for i in range(4):
        step(_slice(i, rank, 2))
    torch.save(trained_model.weights.state(), f"{out}/state-{rank}.pt")
    dist.destroy_process_group()


@pytest.mark.slow
def test_module_dropout_trains_in_ddp_with_modules_skipped_on_some_workers(tmp_path):
    """``lora.module_dropout``: a module one worker skips has no gradient there; DDP is told
    to look for such parameters, so the step goes on and both workers keep the same weights
    (without it DDP stops the second step: "Expected to have finished reduction")."""
    import torch.multiprocessing as mp
    from ray_head import free_ports

    mp.spawn(_ddp_worker, args=(free_ports(1)[0], str(tmp_path)), nprocs=2)
    a, b = (torch.load(tmp_path / f"state-{r}.pt") for r in (0, 1))
    assert a.keys() == b.keys()
    for key in a:
        torch.testing.assert_close(a[key], b[key], rtol=0, atol=0, msg=key)
    assert any(k.endswith("hada_w2_b") and v.abs().sum() > 0 for k, v in a.items())


def test_module_dropout_with_sharded_training_is_refused(tmp_path):
    with pytest.raises(
        ConfigError, match='lora.module_dropout = 0.1 with scaling.strategy = "fsdp"'
    ):
        from raytuner.config import load_job

        job = tmp_path / "job.toml"
        job.write_text(
            '[model]\nfamily = "flux"\n[data]\nimages = "i"\ncache = "c"\n[train]\noutput = "o"\n'
        )
        load_job(job, ['lora.kind="loha"', "lora.module_dropout=0.1", 'scaling.strategy="fsdp"'])
