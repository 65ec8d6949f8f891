"""``lora.init_from`` of other tools' LyCORIS files (``raytuner.lora.lycoris_from``): a LoKr or
LoHa in LyCORIS' tensor names under the keys sd-scripts / musubi-tuner (``lora_unet_`` and the
model's own names), SimpleTuner (``lycoris_``), ai-toolkit / ComfyUI (``diffusion_model.``) and
diffusers (``transformer.``) write starts the run from the weight the file makes under LyCORIS'
scale rule (``alpha / rank`` where a factor is low-rank, 1 where both are whole), whatever
alpha it stores; a key of a fused linear, of another kind, factorization or rank is refused
naming it, by the worker and by `raytuner check` from the file's header.

The files are raytuner's ComfyUI exports (SimpleTuner's, sd-scripts' and Wan's names, checked
against ComfyUI's rules in test_comfy_keys.py) without raytuner's metadata, renamed and
rescaled as the other tools write them."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from safetensors.torch import load_file, save_file
from test_adapter_kinds import KINDS, exported, merged_weights
from test_jobcheck import accepted, refused

from raytuner.checkpoint import layout
from raytuner.config import ConfigError, LoraConfig
from raytuner.families import FAMILIES
from raytuner.families.parts import Source
from raytuner.train.model import adapt

TINY = Source("tiny")


def _comfy_file(name: str, kind: str, tmp_path):
    """A trained adapter of ``kind`` on the family's tiny denoiser, its merged weights, and its
    LyCORIS tensors (the ComfyUI file's, without raytuner's metadata)."""
    w, _, lora_dir = exported(name, kind, tmp_path)
    return merged_weights(w.denoiser), load_file(lora_dir / layout.KOHYA_FILE)


def _started(name: str, tensors: dict, lora: LoraConfig, tmp_path) -> dict:
    """Each adapted module's merged weight of a run started from ``tensors``' file."""
    path = tmp_path / "other.safetensors"
    save_file(tensors, str(path))  # no metadata: another tool's file
    family = FAMILIES[name]
    w = adapt(
        family.denoiser(TINY), mode="lora", lora=dataclasses.replace(lora, init_from=str(path)),
        targets=family.adapters.targets, ema_decay=0, family=family,
    )  # fmt: skip
    assert w.provenance["raytuner.init_from_modules"] == str(len({
        k.rsplit(".", 1)[0] for k in tensors
    }))  # fmt: skip
    return merged_weights(w.denoiser)


def _same(started: dict, trained: dict) -> None:
    assert started.keys() == trained.keys()
    for module, weight in trained.items():
        torch.testing.assert_close(started[module], weight, atol=1e-5, rtol=1e-4, msg=module)


def _renamed(tensors: dict, old: str, new: str, flat: bool = False) -> dict:
    """Keys ``old<module>`` as ``new<module>`` (``flat``: the module's dots as underscores)."""
    out = {}
    for key, value in tensors.items():
        module, _, tensor = key.removeprefix(old).rpartition(".")
        out[f"{new}{module.replace('.', '_') if flat else module}.{tensor}"] = value
    return out


@pytest.mark.parametrize("kind", ["lokr-whole", "loha"])
def test_simpletuner_ai_toolkit_and_diffusers_names_start_from_the_files_weights(kind, tmp_path):
    trained, tensors = _comfy_file("flux", kind, tmp_path)
    assert all(k.startswith("lycoris_") for k in tensors)  # SimpleTuner's
    _same(_started("flux", tensors, KINDS[kind], tmp_path), trained)
    # ai-toolkit's / ComfyUI's diffusion_model.<module>, diffusers' transformer.<module>:
    # the module names from the model's own (dots), the tensors as they are
    modules = {m.replace(".", "_"): m for m in trained}
    dotted = {}
    for key, value in tensors.items():
        base, _, tensor = key.removeprefix("lycoris_").rpartition(".")
        dotted[f"{modules[base]}.{tensor}"] = value
    for prefix in ("diffusion_model.", "transformer."):
        ai = {prefix + k: v for k, v in dotted.items()}
        _same(_started("flux", ai, KINDS[kind], tmp_path), trained)


def test_lycoris_scale_rule_whatever_alpha_the_file_stores(tmp_path):
    """A LoKr of another alpha (LyCORIS scales by alpha / rank) and a LoKr of two whole
    factors (no scale, its alpha ignored as LyCORIS and ComfyUI ignore it) start from the
    weight they make, under the job's lora.alpha."""
    trained, tensors = _comfy_file("sdxl", "lokr", tmp_path / "low")  # w2 low-rank
    scaled = {k.rsplit(".", 1)[0] for k in tensors if k.endswith(".alpha")}
    assert scaled
    doubled = {k: v * 2 if k.endswith(".alpha") else v for k, v in tensors.items()}
    doubled |= {f"{m}.lokr_w1": tensors[f"{m}.lokr_w1"] / 2 for m in scaled}
    _same(_started("sdxl", doubled, KINDS["lokr"], tmp_path), trained)
    other_alpha = dataclasses.replace(KINDS["lokr"], alpha=7.0)
    _same(_started("sdxl", tensors, other_alpha, tmp_path), trained)

    trained, tensors = _comfy_file("flux", "lokr-whole", tmp_path / "whole")
    assert not any(k.endswith(".alpha") for k in tensors)
    with_alpha = tensors | {k.rsplit(".", 1)[0] + ".alpha": torch.tensor(99.0) for k in tensors}
    _same(_started("flux", with_alpha, KINDS["lokr-whole"], tmp_path), trained)


def test_sd_scripts_and_musubi_names_start_from_the_files_weights(tmp_path):
    """sd-scripts' LyCORIS names of SDXL (``lora_unet_input_blocks_…``), and Wan's own module
    names under ``diffusion_model.`` and musubi-tuner's (``lora_unet_blocks_0_self_attn_q``)."""
    trained, tensors = _comfy_file("sdxl", "lokr", tmp_path)
    assert all(k.startswith("lora_unet_") for k in tensors)
    _same(_started("sdxl", tensors, KINDS["lokr"], tmp_path), trained)
    trained, tensors = _comfy_file("wan", "loha", tmp_path)
    assert "diffusion_model.blocks.0.self_attn.q.hada_w1_a" in tensors  # ComfyUI's, ai-toolkit's
    _same(_started("wan", tensors, KINDS["loha"], tmp_path), trained)
    musubi = _renamed(tensors, "diffusion_model.", "lora_unet_", flat=True)
    assert "lora_unet_blocks_0_self_attn_q.hada_w1_a" in musubi
    _same(_started("wan", musubi, KINDS["loha"], tmp_path), trained)


def test_init_from_refuses_a_lycoris_file_it_cannot_start_from(tmp_path):
    _, tensors = _comfy_file("flux", "lokr", tmp_path)
    key = next(k for k in tensors if k.endswith(".lokr_w1"))
    lokr = KINDS["lokr"]
    cases = [
        (LoraConfig(kind="loha", rank=2, alpha=3.0), r"lora.kind = 'loha': set lora.kind = 'lokr'"),
        (LoraConfig(kind="lora", rank=2, alpha=3.0), r"is a lokr .*lora.kind = 'lora'"),
        (dataclasses.replace(lokr, rank=1), r"set lora.kind, lora.rank, lora.factor"),
        (dataclasses.replace(lokr, target_modules=["to_q"]), "lora.target_modules does not"),
    ]
    for lora, match in cases:
        with pytest.raises(ConfigError, match=f"lora.init_from = .*{match}"):
            _started("flux", tensors, lora, tmp_path)
    fused = {"lora_unet_double_blocks_0_img_attn_qkv.lokr_w1": tensors[key]}
    with pytest.raises(ConfigError, match=r"img_attn_qkv.lokr_w1: an adapter on the fused"):
        _started("flux", fused, lokr, tmp_path)
    other = {"lycoris_not_a_block.lokr_w1": tensors[key]}
    with pytest.raises(ConfigError, match=r"lycoris_not_a_block.lokr_w1: names no module"):
        _started("flux", other, lokr, tmp_path)
    text = tensors | {"lora_te1_text_model_encoder_layers_0_mlp_fc1.lokr_w1": tensors[key] + 0}
    with pytest.raises(ConfigError, match=r"mlp_fc1.lokr_w1: a text encoder's LoKr / LoHa"):
        _started("flux", text, lokr, tmp_path)


def test_check_refuses_a_lycoris_file_of_another_kind_or_rank_from_its_header(tmp_path, capsys):
    _, tensors = _comfy_file("flux", "loha", tmp_path / "trained")
    path = tmp_path / "loha.safetensors"
    save_file(tensors, str(path))
    init = f"lora.init_from={path}"
    accepted(tmp_path, capsys, init, 'lora.kind="loha"', "lora.rank=4", family="flux")
    err = refused(tmp_path, capsys, init, 'lora.kind="lokr"', "lora.rank=4", family="flux")
    assert "lora.init_from = " in err and ".hada_w1_a is a loha" in err
    assert "is a loha (a LyCORIS file), the job's lora.kind = 'lokr'" in err
    err = refused(tmp_path, capsys, init, 'lora.kind="loha"', "lora.rank=2", family="flux")
    assert "lycoris_" in err and "is a loha of" in err and "set lora.kind, lora.rank" in err
