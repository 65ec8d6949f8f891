"""The ``[objective]`` section: one sub-table per kind of training objective.

``[objective.ddpm]`` holds what the DDPM families (SD1.5, SDXL) read, ``[objective.flow]`` what
the flow-matching families (Flux, Sana) read. A family's loss receives only its kind's settings
(``ObjectiveConfig.for_family``); ``raytuner check`` refuses the other kind's table set away from
its defaults. The flat keys of older job files are refused with where each one moved.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from raytuner.config.loader import ConfigError, one_of
from raytuner.config.ranges import ranged

DENSITIES = ("uniform", "logit_normal", "mode", "ltx2")


@dataclass(frozen=True, kw_only=True)
class DdpmObjective:
    """DDPM families: timesteps drawn uniformly, the target from the scheduler's config."""

    weighting: str = "none"  # none | min_snr
    min_snr_gamma: float = ranged(5.0, 0, low_open=True)
    noise_offset: float = ranged(0.0, 0, 1)  # per-channel offset added to the noise

    def __post_init__(self) -> None:
        one_of("objective.ddpm.weighting", self.weighting, ("none", "min_snr"))


@dataclass(frozen=True, kw_only=True)
class FlowObjective:
    """Flow-matching families: a noise-level density, a shift and a loss weighting."""

    timestep_sampling: str = "logit_normal"  # uniform | logit_normal | mode | ltx2
    logit_mean: float = ranged(0.0, -10, 10)
    logit_std: float = ranged(1.0, 0, 10, low_open=True)
    # the mode density maps [0, 1] onto itself, monotonically, for these scales only
    mode_scale: float = ranged(1.29, -1, 1.75)
    resolution_shift: bool = True  # shift noise levels up for larger images
    # a fixed shift (used when resolution_shift is off)
    shift: float = ranged(1.0, 0, 100, low_open=True)
    weighting: str = "none"  # none | sigma_sqrt | cosmap
    # guidance embedding for guidance-distilled checkpoints (Flux dev)
    guidance: float = ranged(1.0, 0, 100)
    # the share of clip samples whose first latent frame is kept clean (noise level 0) and out
    # of the loss, so a LoRA trained on text to video keeps image to video (LTX-2's trainer:
    # 0.1); families whose denoiser takes a level per token (geometry.first_frame_clean)
    first_frame_p: float = ranged(0.0, 0, 1)

    def __post_init__(self) -> None:
        one_of("objective.flow.timestep_sampling", self.timestep_sampling, DENSITIES)
        one_of("objective.flow.weighting", self.weighting, ("none", "sigma_sqrt", "cosmap"))


@dataclass(frozen=True, kw_only=True)
class ObjectiveConfig:
    """Noise levels and loss weights, one sub-table per objective kind (``Family.objective_kind``
    names the attribute its loss reads)."""

    ddpm: DdpmObjective = field(default_factory=DdpmObjective)
    flow: FlowObjective = field(default_factory=FlowObjective)

    # the flat [objective] keys of older job files -> where they live now (the loader refuses
    # them with this, so an old job file never silently trains something else)
    MOVED: ClassVar[dict[str, str]] = {
        "weighting": "objective.ddpm.weighting (DDPM families) or objective.flow.weighting "
        "(flow-matching families)",
        "min_snr_gamma": "objective.ddpm.min_snr_gamma",
        "noise_offset": "objective.ddpm.noise_offset",
    } | {
        key: f"objective.flow.{key}"
        for key in (
            "timestep_sampling",
            "logit_mean",
            "logit_std",
            "mode_scale",
            "resolution_shift",
            "shift",
            "guidance",
        )
    }

    def for_family(self, family) -> DdpmObjective | FlowObjective:
        """The settings of ``family.objective_kind``: what its ``loss`` takes."""
        kind = family.objective_kind
        if kind not in KINDS:
            raise ConfigError(
                f"{family.name}: objective_kind {kind!r} has no [objective.{kind}] settings; "
                f"kinds: {', '.join(KINDS)}"
            )
        return getattr(self, kind)


# objective kind -> its settings class and how messages describe it
KINDS: dict[str, tuple[type, str]] = {
    "ddpm": (DdpmObjective, "DDPM"),
    "flow": (FlowObjective, "flow-matching"),
}
