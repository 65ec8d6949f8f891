"""The LoRA files a run exports load in the ecosystem's tools, and a run can start from one.

The kohya file is sd-scripts' layout (SDXL's sgm block names, Flux's fused ``double_blocks`` /
``single_blocks`` linears) with the ``ss_*`` and ``modelspec.*`` keys A1111 / Forge read;
diffusers' own kohya converters load it to the same images as the diffusers file. Sana gets
the diffusers file only. ``lora.init_from`` reads either layout into the fresh adapter.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from raytuner.checkpoint import layout
from raytuner.cli import main
from raytuner.config import ConfigError, LoraConfig, ModelConfig, TrainConfig
from raytuner.families import FAMILIES
from raytuner.families.flux import kohya_names as flux_kohya_names
from raytuner.families.parts import Source
from raytuner.lora import export, kohya
from raytuner.train.model import adapt, trainable_model
from raytuner.train.weights import Weights

TINY = Source("tiny")
# every Flux module sd-scripts' layout and diffusers' converter share at any width: the double
# blocks' fused q/k/v (image and text), projections, MLPs and modulations, the single blocks'
# output and modulation (their fused linear1 diffusers splits only at Flux.1's own widths)
FLUX_TARGETS = [
    f"transformer_blocks.{i}.attn.{m}" for i in (0, 1) for m in ("to_q", "to_k", "to_v")
]
FLUX_TARGETS += ["to_out.0", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out"]
FLUX_TARGETS += ["ff.net.0.proj", "ff.net.2", "ff_context.net.0.proj", "ff_context.net.2"]
FLUX_TARGETS += ["norm1.linear", "norm1_context.linear", "norm.linear"]
FLUX_TARGETS += [f"single_transformer_blocks.{i}.proj_out" for i in (0, 1)]


def exported(name: str, out: Path, lora: LoraConfig, seed: int = 0) -> Weights:
    """A known LoRA (random A and B) on the family's tiny denoiser, exported to ``out``."""
    family = FAMILIES[name]
    weights = adapt(
        family.denoiser(TINY),
        mode="lora",
        lora=lora,
        targets=family.adapters.targets,
        ema_decay=0,
        family=family,
    )
    g = torch.Generator().manual_seed(seed)
    weights.load({k: torch.randn(v.shape, generator=g) / 3 for k, v in weights.state().items()})
    model, run = ModelConfig(family=name), f"known-{name}"
    meta = export.metadata(family=name, model=model, lora=lora, step=5, run=run, fingerprint="f")
    weights.export_lora(str(out), family, meta)
    return weights


def image(name: str, lora_dir: Path | None = None, weight_name: str | None = None) -> np.ndarray:
    """One seeded denoising step at 32x32 through the family's tiny diffusers pipeline."""
    pipe = FAMILIES[name].pipeline(TINY)
    if lora_dir is not None:
        pipe.load_lora_weights(str(lora_dir), weight_name=weight_name)
    extra = {"max_sequence_length": 32} if name == "flux" else {}
    return pipe(
        "a red circle",
        num_inference_steps=1,
        height=32,
        width=32,
        output_type="np",
        generator=torch.Generator().manual_seed(0),
        **extra,
    ).images


def meta(path: Path) -> dict[str, str]:
    with safe_open(str(path), framework="pt") as f:
        return f.metadata()


@pytest.mark.parametrize("name", ["sdxl", "flux"])
def test_kohya_file_is_sd_scripts_layout_and_renders_like_the_diffusers_file(name, tmp_path):
    targets = FLUX_TARGETS if name == "flux" else []
    exported(name, tmp_path, LoraConfig(rank=2, alpha=4.0, target_modules=targets))
    lora = tmp_path / "lora"
    keys = load_file(str(lora / layout.KOHYA_FILE)).keys()
    if name == "flux":  # sd-scripts' names, q/k/v as one fused LoRA of rank 3 x 2
        assert "lora_unet_double_blocks_0_img_attn_qkv.lora_down.weight" in keys
        assert "lora_unet_double_blocks_1_txt_attn_qkv.lora_up.weight" in keys
        assert "lora_unet_single_blocks_0_linear2.alpha" in keys
        qkv = load_file(str(lora / layout.KOHYA_FILE))[
            "lora_unet_double_blocks_0_img_attn_qkv.lora_down.weight"
        ]
        assert qkv.shape[0] == 6
    else:  # the tiny SDXL's cross-attention down block 1 is sgm's input block 3
        assert "lora_unet_input_blocks_3_1_transformer_blocks_0_attn1_to_q.lora_down.weight" in keys
    assert not any("transformer_blocks_0_attn_to_q" in k for k in keys)

    with_diffusers = image(name, lora, layout.DIFFUSERS_FILE)
    with_kohya = image(name, lora, layout.KOHYA_FILE)
    assert not np.allclose(with_diffusers, image(name), atol=1e-3)  # the LoRA shows
    np.testing.assert_allclose(with_kohya, with_diffusers, atol=1e-5)


def test_flux_default_targets_at_flux1_width_convert_exactly_through_diffusers():
    """The family's default targets put q/k/v of every block in a fused kohya linear (the
    single blocks' linear1 beside the MLP's input, trained by no one here: zeros). diffusers'
    kohya-Flux converter (Flux.1's own widths: 3072, MLP 12288) gives back each module's
    delta, alpha / rank x B @ A, exactly; so does the plain kohya formula every UI applies."""
    from diffusers import FluxPipeline

    width, mlp, r, alpha = 3072, 12288, 4, 8.0
    modules = [f"transformer_blocks.0.attn.{m}" for m in ("to_q", "to_k", "to_v", "to_out.0")]
    modules += [f"single_transformer_blocks.0.attn.{m}" for m in ("to_q", "to_k", "to_v")]
    g = torch.Generator().manual_seed(0)
    state = {}
    for m in modules:
        state[f"{m}.lora_A.weight"] = torch.randn(r, width, generator=g) / 50
        state[f"{m}.lora_B.weight"] = torch.randn(width, r, generator=g) / 50
    dims = dict.fromkeys(modules, width) | {"single_transformer_blocks.0.proj_mlp": mlp}
    tensors = kohya.to_kohya(state, flux_kohya_names, alpha, dims)
    assert tensors["lora_unet_single_blocks_0_linear1.lora_up.weight"].shape == (
        3 * width + mlp,
        4 * r,
    )

    converted = FluxPipeline.lora_state_dict(dict(tensors))
    probe = torch.randn(width, 8, generator=g)  # deltas compared on random inputs: B @ (A @ x)

    def trained(m: str) -> torch.Tensor:
        return alpha / r * state[f"{m}.lora_B.weight"] @ (state[f"{m}.lora_A.weight"] @ probe)

    for m in modules:
        a, b = (converted[f"transformer.{m}.lora_{x}.weight"] for x in "AB")
        torch.testing.assert_close(b @ (a @ probe), trained(m), rtol=1e-4, atol=1e-6, msg=m)
    assert not converted["transformer.single_transformer_blocks.0.proj_mlp.lora_B.weight"].any()

    name = "lora_unet_double_blocks_0_img_attn_qkv"
    down, up = tensors[f"{name}.lora_down.weight"], tensors[f"{name}.lora_up.weight"]
    fused = float(tensors[f"{name}.alpha"]) / down.shape[0] * up @ (down @ probe)  # what a UI adds
    for j, m in enumerate(modules[:3]):
        torch.testing.assert_close(
            fused[j * width : (j + 1) * width], trained(m), rtol=1e-4, atol=1e-6
        )


def _tensor_bytes(path: Path) -> int:
    """A safetensors file's size without its 8-byte header length and JSON header."""
    header = int.from_bytes(path.read_bytes()[:8], "little")
    return path.stat().st_size - 8 - header


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_save_dtype_writes_half_the_bytes_and_diffusers_loads_the_files(dtype, tmp_path):
    """``lora.save_dtype``: both files' tensors in that dtype, half the float32 export's bytes,
    named in the metadata; the pipeline loads each and renders the float32 export's image
    (to the dtype's rounding)."""
    lora = {"rank": 4, "alpha": 4.0}
    exported("sdxl", tmp_path / "full", LoraConfig(**lora, save_dtype="float32"))
    exported("sdxl", tmp_path / "half", LoraConfig(**lora, save_dtype=dtype))
    for file in (layout.DIFFUSERS_FILE, layout.KOHYA_FILE):
        full, half = tmp_path / "full" / "lora" / file, tmp_path / "half" / "lora" / file
        assert {t.dtype for t in load_file(str(half)).values()} == {getattr(torch, dtype)}
        assert {t.dtype for t in load_file(str(full)).values()} == {torch.float32}
        assert _tensor_bytes(half) * 2 == _tensor_bytes(full)
        assert meta(half)["raytuner.save_dtype"] == dtype
        reference = image("sdxl", full.parent, file)
        assert not np.allclose(reference, image("sdxl"), atol=1e-3)  # the LoRA shows
        np.testing.assert_allclose(image("sdxl", half.parent, file), reference, atol=2e-2)


def test_save_dtype_refuses_a_weight_beyond_float16(tmp_path):
    weights = exported("sd15", tmp_path / "ok", LoraConfig(rank=2, alpha=2.0))
    weights.load({k: torch.full_like(v, 7e4) for k, v in weights.state().items()})
    meta = {"raytuner.save_dtype": "float16", "raytuner.run": "big"}
    with pytest.raises(ValueError, match=r"lora.save_dtype = 'float16'.*7e\+04.*bfloat16"):
        weights.export_lora(str(tmp_path / "big"), FAMILIES["sd15"], meta)


def test_files_carry_the_metadata_the_uis_classify_by(tmp_path):
    expected = {
        "sd15": ("sd_v1", "stable-diffusion-v1/lora", "diffusers"),
        "sdxl": (
            "sdxl_base_v1-0",
            "stable-diffusion-xl-v1-base/lora",
            "https://github.com/Stability-AI/generative-models",
        ),
        "flux": ("flux1", "flux-1-dev/lora", "https://github.com/black-forest-labs/flux"),
    }
    for name, (version, architecture, implementation) in expected.items():
        exported(name, tmp_path / name, LoraConfig(rank=2, alpha=2.0))
        for file in (layout.KOHYA_FILE, layout.DIFFUSERS_FILE):
            m = meta(tmp_path / name / "lora" / file)
            assert m["ss_base_model_version"] == version, (name, file)
            assert m["modelspec.architecture"] == architecture
            assert m["modelspec.implementation"] == implementation
            assert m["modelspec.sai_model_spec"] == "1.0.1"
            assert m["modelspec.title"] == f"known-{name}"
            assert m["ss_network_dim"] == "2" and m["ss_network_alpha"] == "2.0"
            assert float(m["ss_training_started_at"]) <= float(m["ss_training_finished_at"])
    assert meta(tmp_path / "flux" / "lora" / layout.KOHYA_FILE)["ss_network_module"] == (
        "networks.lora_flux"
    )
    # Sana: no tool reads a kohya Sana LoRA, so only the diffusers file, without modelspec
    exported("sana", tmp_path / "sana", LoraConfig(rank=2, alpha=2.0))
    assert sorted(p.name for p in (tmp_path / "sana" / "lora").iterdir()) == [layout.DIFFUSERS_FILE]
    assert not any(
        k.startswith("modelspec.") for k in meta(tmp_path / "sana" / "lora" / layout.DIFFUSERS_FILE)
    )


def trained_from(name: str, path: Path, lora: LoraConfig):
    model = ModelConfig(family=name)
    train = TrainConfig(output="unused")
    return trainable_model(model, train, lora, FAMILIES[name], torch.device("cpu")).weights


@pytest.mark.parametrize("name", ["sdxl", "flux"])
def test_init_from_either_export_starts_from_its_weights(name, tmp_path):
    lora = LoraConfig(rank=2, alpha=4.0)
    known = exported(name, tmp_path / "known", lora).state()
    for file in (layout.DIFFUSERS_FILE, layout.KOHYA_FILE):
        path = tmp_path / "known" / "lora" / file
        weights = trained_from(name, path, LoraConfig(rank=2, alpha=4.0, init_from=str(path)))
        start = weights.state()
        assert start.keys() == known.keys()
        for key in known:  # the files hold lora.save_dtype's float16
            expected = known[key].to(torch.float16).float()
            torch.testing.assert_close(start[key], expected, msg=f"{file}: {key}")

        weights.export_lora(str(tmp_path / "next"), FAMILIES[name], {"raytuner.run": "next"})
        m = meta(tmp_path / "next" / "lora" / layout.DIFFUSERS_FILE)
        assert m["raytuner.init_from"] == str(path)
        assert (
            m["raytuner.init_from_sha256"]
            == __import__("hashlib").sha256(path.read_bytes()).hexdigest()
        )
        assert json.loads(m["raytuner.init_from_metadata"])["raytuner.run"] == f"known-{name}"
        assert m["modelspec.title"] == "next"


def test_init_from_reads_the_diffusers_module_names_in_kohya_keys(tmp_path):
    """The kohya keys diffusers' ``convert_state_dict_to_kohya`` writes (raytuner's earlier
    exports), on SDXL whose own kohya file uses the sgm names."""
    from diffusers.utils import convert_state_dict_to_kohya

    lora = LoraConfig(rank=2, alpha=4.0)
    known = exported("sdxl", tmp_path / "known", lora).state()
    tensors = convert_state_dict_to_kohya({f"unet.{k}": v for k, v in known.items()})
    tensors = {k: torch.tensor(4.0) if k.endswith(".alpha") else v for k, v in tensors.items()}
    assert any(k.startswith("lora_unet_down_blocks_1_attentions_0_") for k in tensors)
    path = tmp_path / "flat.safetensors"
    save_file(tensors, str(path))
    start = trained_from("sdxl", path, LoraConfig(rank=2, alpha=4.0, init_from=str(path)))
    for key, value in start.state().items():
        torch.testing.assert_close(value, known[key], msg=key)


def test_init_from_sd_scripts_fused_lora_of_rank_r(tmp_path):
    """sd-scripts' default Flux LoRA: one rank-r LoRA on each fused linear (a shared down):
    each of q, k, v starts from its slice of the fused delta."""
    family, r = FAMILIES["flux"], 2
    start = trained_from("flux", tmp_path, LoraConfig(rank=r, alpha=2.0))  # the module sizes
    dims = export.out_dims(start.denoiser)
    q, k, v = (f"transformer_blocks.0.attn.to_{x}" for x in "qkv")
    g = torch.Generator().manual_seed(3)
    name = "lora_unet_double_blocks_0_img_attn_qkv"
    down = torch.randn(r, 16, generator=g)
    up = torch.randn(dims[q] + dims[k] + dims[v], r, generator=g)
    path = tmp_path / "sd-scripts.safetensors"
    save_file(
        {
            f"{name}.lora_down.weight": down,
            f"{name}.lora_up.weight": up,
            f"{name}.alpha": torch.tensor(2.0),
        },
        str(path),
        metadata={"ss_output_name": "x"},
    )
    lora = LoraConfig(rank=r, alpha=2.0, target_modules=[q, k, v], init_from=str(path))
    weights = trained_from("flux", path, lora)
    state = weights.state()
    for j, module in enumerate((q, k, v)):
        torch.testing.assert_close(state[f"{module}.lora_A.weight"], down)
        torch.testing.assert_close(state[f"{module}.lora_B.weight"], up[16 * j : 16 * (j + 1)])
    assert family.adapters.files.kohya == "flux"


def test_init_from_refuses_what_it_cannot_start_from(tmp_path):
    exported("sdxl", tmp_path / "known", LoraConfig(rank=2, alpha=4.0))
    path = tmp_path / "known" / "lora" / layout.KOHYA_FILE
    with pytest.raises(ConfigError, match=r"rank 2 and alpha 4.*lora.rank = 4.*lora.rank = 2"):
        trained_from("sdxl", path, LoraConfig(rank=4, alpha=4.0, init_from=str(path)))
    with pytest.raises(ConfigError, match="alpha 4.*lora.alpha = 8"):
        trained_from("sdxl", path, LoraConfig(rank=2, alpha=8.0, init_from=str(path)))

    tensors = load_file(str(path))
    tensors["lora_unet_not_a_block.lora_down.weight"] = torch.zeros(2, 4)
    tensors["lora_te1_text_model_encoder_layers_0_mlp_fc1.lora_up.weight"] = torch.zeros(4, 2)
    odd = tmp_path / "odd.safetensors"
    save_file(tensors, str(odd))
    with pytest.raises(ConfigError, match="name no module.*lora_unet_not_a_block"):
        trained_from("sdxl", odd, LoraConfig(rank=2, alpha=4.0, init_from=str(odd)))
    # a text encoder's LoRA in a job that trains none (tests/lora/test_text_encoder_lora.py
    # starts it)
    del tensors["lora_unet_not_a_block.lora_down.weight"]
    save_file(tensors, str(odd))
    with pytest.raises(ConfigError, match="lora_te1_text_model.*set lora.text_encoder = true"):
        trained_from("sdxl", odd, LoraConfig(rank=2, alpha=4.0, init_from=str(odd)))

    # a LoRA on modules the job's targets do not reach
    with pytest.raises(ConfigError, match="lora.target_modules does not reach"):
        narrow = LoraConfig(rank=2, alpha=4.0, target_modules=["to_q"], init_from=str(path))
        trained_from("sdxl", path, narrow)


def test_check_refuses_a_missing_init_from(tmp_path, capsys):
    job = tmp_path / "job.toml"
    job.write_text(
        f'[model]\nfamily = "sdxl"\n[data]\nimages = "{tmp_path}/images"\n'
        f'cache = "{tmp_path}/cache"\n[train]\noutput = "{tmp_path}/runs"\n'
        f'[lora]\ninit_from = "{tmp_path}/gone.safetensors"\n'
    )
    assert main(["check", str(job)]) == 2
    err = capsys.readouterr().err
    assert "lora.init_from" in err and "gone.safetensors" in err and "no such file" in err
