"""ComfyUI's keys of each family's LyCORIS file (``lora_kohya.safetensors`` of a LoKr, LoHa or
DoRA): every module the family trains by default gets a key ComfyUI's rules for that model
accept (``comfy_rules.accepted``: its model branch of ``model_lora_keys_unet``), and every
tensor of the file is one ComfyUI reads there; Sana, which ComfyUI has no model of, gets none.
The weight ComfyUI makes of each key is checked per kind in ``test_adapter_kinds.py``."""

from __future__ import annotations

import comfy_rules
import pytest
from peft.tuners.tuners_utils import BaseTunerLayer
from safetensors.torch import load_file
from test_adapter_kinds import TINY, comfy_keys

from raytuner.checkpoint import layout
from raytuner.config import LoraConfig, ModelConfig
from raytuner.families import FAMILIES
from raytuner.lora import export
from raytuner.train.model import adapt

LOKR = LoraConfig(kind="lokr", rank=2, alpha=3.0, save_dtype="float32")


def _exported(name: str, tmp_path):
    """The family's tiny denoiser with a fresh LoKr on its default targets, exported."""
    family = FAMILIES[name]
    w = adapt(
        family.denoiser(TINY), mode="lora", lora=LOKR, targets=family.adapters.targets,
        ema_decay=0, family=family,
    )  # fmt: skip
    meta = export.metadata(
        family=name, model=ModelConfig(family=name), lora=LOKR, step=0, run="r", fingerprint="f"
    )
    w.export_lora(str(tmp_path), family, meta)
    adapted = {n for n, m in w.denoiser.named_modules() if isinstance(m, BaseTunerLayer)}
    return adapted, tmp_path / layout.LORA_DIR


@pytest.mark.parametrize("name", sorted(comfy_rules.BRANCH))
def test_every_trained_module_has_a_key_comfyui_maps_for_the_family(name, tmp_path):
    adapted, lora_dir = _exported(name, tmp_path)
    assert adapted
    keys = comfy_keys(name, FAMILIES[name].denoiser(TINY))
    per_module = comfy_rules.loaded(load_file(lora_dir / layout.KOHYA_FILE), keys)
    assert set(per_module) == adapted
    for t in per_module.values():  # both Kronecker factors, whole or low-rank
        assert {n[:7] for n in t if n.startswith("lokr_")} == {"lokr_w1", "lokr_w2"}


def test_sana_has_no_comfyui_file(tmp_path):
    """ComfyUI has no Sana model (custom nodes load it through diffusers), so no key of a
    LyCORIS file would load there: raytuner writes the diffusers file alone."""
    assert "sana" not in comfy_rules.BRANCH
    _, lora_dir = _exported("sana", tmp_path)
    assert sorted(p.name for p in lora_dir.iterdir()) == [layout.DIFFUSERS_FILE]
