"""The model families raytuner can fine-tune. Adding one (docs/architecture.md, "Adding a family"):
its file, its two presets, its job TOML, one entry here."""

from raytuner.config import ConfigError
from raytuner.families.base import Family
from raytuner.families.flux import Flux
from raytuner.families.flux2 import Flux2Dev, Flux2Klein
from raytuner.families.flux_kontext import FluxKontext
from raytuner.families.ltx2 import LTX2
from raytuner.families.qwen_image import QwenImage
from raytuner.families.qwen_image_edit import QwenImageEdit
from raytuner.families.sana import Sana
from raytuner.families.sd15 import SD15
from raytuner.families.sdxl import SDXL
from raytuner.families.wan import Wan
from raytuner.families.wan22 import Wan22, Wan22TI2V
from raytuner.families.z_image import ZImage

FAMILIES: dict[str, Family] = {
    "sd15": SD15(),
    "sdxl": SDXL(),
    "flux": Flux(),
    "sana": Sana(),
    "z-image": ZImage(),
    "wan": Wan(),
    "wan22": Wan22(),
    "wan22-5b": Wan22TI2V(),
    "qwen-image": QwenImage(),
    "flux2-klein": Flux2Klein(),
    "flux2-dev": Flux2Dev(),
    "flux-kontext": FluxKontext(),
    "qwen-image-edit": QwenImageEdit(),
    "ltx2": LTX2(),
}


def get_family(name: str, expert: str = "") -> Family:
    """The family ``model.family`` names, training its ``model.expert`` (a mixture of experts
    by noise level: ``Family.with_expert``); the one lookup is ``api.check``'s (every other
    place is handed the family object, or the validation actor its job's names)."""
    try:
        family = FAMILIES[name]
    except KeyError:
        raise ConfigError(
            f"model.family = {name!r} is unknown; available: {', '.join(FAMILIES)}"
        ) from None
    try:
        return family.with_expert(expert)
    except ValueError as e:
        raise ConfigError(str(e)) from None
