"""A family's training objective: the DDPM and flow-matching math its ``loss`` is made of.

An ``Objective`` is a loss split in two: ``draw`` makes a step's random inputs on the CPU from
each sample's own generator, the loss reads them from the batch. The UNet families train with the
DDPM helpers (``ddpm_*``), the transformer families with the flow-matching ones (``flow_*``);
``objective_of_kind`` checks that a family's loss is handed its own kind's settings.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from raytuner.config.objective import KINDS, DdpmObjective, FlowObjective
from raytuner.families.parts import Source

# A batch of cached rows as tensors: "latent" [B,C,H,W], the family's text tensors, and the
# per-image conditioning "original_size", "crop_top_left", "target_size" ([B,2] int64, (h, w)
# order: the image before its crop, the crop's corner, the bucket) and "fps" ([B] float32: the
# rate its source samples clips at, 0.0 where each clip's own: unknown), as the training feed
# reads it; with masks in the cache (data.mask) also "mask" [B,1,H,W], each latent pixel's loss
# weight.
Batch = dict[str, torch.Tensor]
# (denoiser, batch, one generator per sample) -> per-sample loss [B]: an ``Objective``
Loss = Callable[[nn.Module, Batch, Sequence[torch.Generator]], torch.Tensor]
# the latent batch's shape, one generator per sample -> the step's random inputs (CPU tensors)
Draw = Callable[[tuple[int, ...], Sequence[torch.Generator]], dict[str, torch.Tensor]]
# the batch keys an Objective's draw may fill ("first_frame": objective.flow.first_frame_p)
DRAWN = ("noise", "timestep", "sigma", "first_frame")


class Objective:
    """A family's training loss, split in two: ``draw`` makes a step's random inputs (each
    sample's noise and timestep or noise level) on the CPU from each sample's own generator, and
    the loss reads them from the batch. The training feed calls ``draw`` in its thread and hands
    the draws over pinned, so the step never waits on a host-to-device copy; called with
    generators and a batch without them, the loss draws them itself, the same way."""

    def __init__(
        self, draw: Draw, loss: Callable[[nn.Module, Batch], torch.Tensor], turns=()
    ) -> None:
        """``turns``: a draw for each expert of a mixture trained in turn (``model.expert =
        "both"``: each its expert's noise levels), ``draw`` the first's; empty: ``draw``."""
        self.draw, self._loss, self.turns = draw, loss, tuple(turns)

    def draw_of(self, turn: int) -> Draw:
        """The draw of a step that trains expert ``turn`` (``mixture.phase``): its own noise
        levels; ``draw`` where the objective has no turns."""
        return self.turns[turn] if self.turns else self.draw

    def __call__(self, denoiser: nn.Module, batch: Batch, generators=None) -> torch.Tensor:
        if not any(k in batch for k in DRAWN):
            latent = batch["latent"]
            drawn = self.draw(tuple(latent.shape), generators)
            batch = batch | {k: v.to(latent.device) for k, v in drawn.items()}
        return self._loss(denoiser, batch)


def per_sample_noise(shape: tuple[int, ...], generators: Sequence[torch.Generator]):
    """Noise drawn per sample from its own generator (float32, on the CPU): independent of how
    the batch is split."""
    noise = [torch.randn(shape[1:], generator=g, dtype=torch.float32) for g in generators]
    return torch.stack(noise)


def ddpm_target(scheduler, latents, noise, timesteps) -> torch.Tensor:
    """What a DDPM-family denoiser is trained to predict, from the scheduler's config."""
    kind = scheduler.config.prediction_type
    if kind == "epsilon":
        return noise
    if kind == "v_prediction":
        return scheduler.get_velocity(latents, noise, timesteps)
    raise ValueError(f"prediction_type {kind!r} in the scheduler config is not supported")


def mse_per_sample(prediction: torch.Tensor, target: torch.Tensor, mask=None) -> torch.Tensor:
    """The squared error's mean over each sample's latent pixels, each weighted by ``mask``
    ([B, 1, H, W] in [0, 1], or None: all 1), as kohya's masked loss: a pixel of weight 0 adds
    nothing (nor any gradient), and a half-masked image weighs half. A video family's latents
    [B, C, T, H, W] take the mask on every latent frame."""
    err = (prediction.float() - target.float()) ** 2
    if mask is not None:
        mask = mask.float()
        err = err * (mask.unsqueeze(2) if err.ndim == mask.ndim + 1 else mask)
    return err.reshape(err.shape[0], -1).mean(dim=1)


# --- the DDPM families (Stable Diffusion's UNets) --------------------------------------------


def sd_scheduler_config(prediction_type: str = "epsilon") -> dict:
    """The DDPM schedule Stable Diffusion 1.5 and SDXL were trained with (tiny presets)."""
    return dict(
        beta_start=0.00085,
        beta_end=0.012,
        beta_schedule="scaled_linear",
        num_train_timesteps=1000,
        prediction_type=prediction_type,
        steps_offset=1,
        timestep_spacing="leading",
    )


def objective_of_kind(family, objective):
    """``objective`` when it is the settings of ``family.objective_kind`` (what ``loss`` takes);
    a TypeError naming the right ones otherwise (the whole ObjectiveConfig, or the other kind)."""
    cls = KINDS[family.objective_kind][0]
    if not isinstance(objective, cls):
        raise TypeError(
            f"{family.name}'s loss takes its [objective.{family.objective_kind}] settings "
            f"({cls.__name__}), not {type(objective).__name__}: pass "
            "ObjectiveConfig.for_family(family)"
        )
    return objective


def ddpm_draw(num_train_timesteps: int, objective: DdpmObjective) -> Draw:
    """A DDPM step's random inputs: each sample's noise (plus ``objective.noise_offset`` times a
    per-channel draw) and timestep, in that order from the sample's generator."""

    def draw(shape: tuple[int, ...], generators) -> dict[str, torch.Tensor]:
        noise = per_sample_noise(shape, generators)
        if objective.noise_offset:
            offsets = torch.stack([torch.randn(shape[1], generator=g) for g in generators])
            noise = noise + objective.noise_offset * offsets[:, :, None, None]
        steps = [torch.randint(0, num_train_timesteps, (1,), generator=g) for g in generators]
        return {"noise": noise, "timestep": torch.cat(steps)}

    return draw


def ddpm_loss(
    scheduler, objective: DdpmObjective, batch: Batch, predict, mask=None
) -> torch.Tensor:
    """Per-sample MSE of ``predict(noisy latents, timesteps)`` against the scheduler's target
    (each latent pixel weighted by ``mask``, the batch's "mask" if it has one), with the batch's
    drawn noise and timesteps (``ddpm_draw``), min-SNR weighted when ``objective.weighting =
    "min_snr"``."""
    latents, steps = batch["latent"], batch["timestep"]
    noise = batch["noise"].to(latents.dtype)
    noisy = scheduler.add_noise(latents, noise, steps)
    target = ddpm_target(scheduler, latents, noise, steps)
    loss = mse_per_sample(predict(noisy, steps), target, mask)
    if objective.weighting == "min_snr":
        from diffusers.training_utils import compute_snr

        snr = compute_snr(scheduler, steps)
        clipped = snr.clamp(max=objective.min_snr_gamma)
        v = scheduler.config.prediction_type == "v_prediction"
        loss = loss * clipped / (snr + 1 if v else snr)
    return loss


def ddpm_objective(scheduler, objective: DdpmObjective, loss) -> Objective:
    """A UNet family's Objective: ``loss(denoiser, batch)`` with the DDPM draws."""
    return Objective(ddpm_draw(scheduler.config.num_train_timesteps, objective), loss)


def ddpm_scheduler(source: Source):
    """The training scheduler of a diffusers folder / hub repo; a preset's is Stable
    Diffusion's own (``sd_scheduler_config``)."""
    from diffusers import DDPMScheduler

    if source.preset:
        return DDPMScheduler(**sd_scheduler_config())
    return DDPMScheduler.from_pretrained(source.repo, **source.hub("scheduler"))


# --- flow-matching families (Flux, Sana) ------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class ShiftLine:
    """The resolution shift a family's scheduler makes (``use_dynamic_shifting``): log(shift)
    on the line through (``base_tokens``, ``base_shift``) and (``max_tokens``, ``max_shift``)
    of the image's token count (its scheduler config's ``base_image_seq_len``, ``base_shift``,
    ``max_image_seq_len``, ``max_shift``). The default is Flux.1's."""

    base_tokens: int = 256
    base_shift: float = 0.5
    max_tokens: int = 4096
    max_shift: float = 1.15

    def shift(self, tokens: int) -> float:
        slope = (self.max_shift - self.base_shift) / (self.max_tokens - self.base_tokens)
        return math.exp(self.base_shift + (tokens - self.base_tokens) * slope)


FLUX_SHIFT = ShiftLine()  # Flux.1's sampler: 0.5 at 256 tokens, 1.15 at 4096


def flow_draw(
    objective: FlowObjective,
    image_tokens: Callable[[tuple[int, ...]], int],
    line: ShiftLine = FLUX_SHIFT,
    levels: tuple[float, float] = (0.0, 1.0),
) -> Draw:
    """A flow-matching step's random inputs: each sample's noise, then its noise level in
    (0, 1) from the objective's density (``diffusers.training_utils``), shifted towards noise
    by the image's token count (``image_tokens(latent shape)``) on the family's ``line`` (its
    scheduler's resolution-dependent shift; Flux.1's by default) or by the fixed
    ``objective.shift`` (``ltx2`` takes the shift into its own formula instead, as LTX-2's
    trainer does: ``_ltx2_level``); a level outside ``levels`` (``[low, high)``: the noise
    levels an expert of a mixture denoises) is drawn again from the same generator, so the
    levels are the density cut to that range."""

    def draw(shape: tuple[int, ...], generators) -> dict[str, torch.Tensor]:
        noise = per_sample_noise(shape, generators)
        shift = line.shift(image_tokens(shape)) if objective.resolution_shift else objective.shift
        sigmas = [_level_within(objective, shift, levels, g) for g in generators]
        drawn = {"noise": noise, "sigma": torch.cat(sigmas)}
        if objective.first_frame_p:
            drawn["first_frame"] = first_frames(objective.first_frame_p, shape, generators)
        return drawn

    return draw


def first_frames(p: float, shape: tuple[int, ...], generators) -> torch.Tensor:
    """Whether each sample's first latent frame is kept clean (1.0) or noised (0.0): a draw of
    probability ``p`` from the sample's generator after its level; an image's (one latent
    frame, or no frame axis) is never kept clean (it would leave nothing to learn), though it
    draws too, so a batch's split never shifts a generator."""
    clip = len(shape) == 5 and shape[2] > 1
    kept = [float(torch.rand(1, generator=g).item() < p and clip) for g in generators]
    return torch.tensor(kept, dtype=torch.float32)


MAX_REDRAWS = 10_000  # draws of a level in an expert's range before the range is refused


def _level_within(objective: FlowObjective, shift: float, levels, generator) -> torch.Tensor:
    """One sample's shifted noise level [1] in ``levels`` (``flow_draw``)."""
    low, high = levels
    density = _ltx2_level if objective.timestep_sampling == "ltx2" else _shifted_level
    for _ in range(MAX_REDRAWS):
        sigma = density(objective, shift, generator)
        if (low, high) == (0.0, 1.0) or low <= float(sigma) < high:
            return sigma
    raise ValueError(
        f"noise levels [{low}, {high}): {MAX_REDRAWS} draws of [objective.flow]'s density "
        f"(timestep_sampling {objective.timestep_sampling!r}, shift {shift:.3g}) fell outside "
        "them; widen the density (logit_std, uniform sampling) or change the shift"
    )


def _shifted_level(objective: FlowObjective, shift: float, generator) -> torch.Tensor:
    """A level [1] of diffusers' density (uniform, logit_normal, mode), kept off 0 and 1, then
    shifted by multiplying its odds by ``shift``."""
    from diffusers.training_utils import compute_density_for_timestep_sampling

    u = compute_density_for_timestep_sampling(
        objective.timestep_sampling,
        1,
        logit_mean=objective.logit_mean,
        logit_std=objective.logit_std,
        mode_scale=objective.mode_scale,
        generator=generator,
    ).clamp(1e-3, 1 - 1e-3)
    return shift * u / (1 + (shift - 1) * u)


# LTX-2's sampler (``ltx2``): the standard normal's 0.5th and 99.9th percentiles, which the
# stretch maps onto 0 and 1; the level under which a stretched draw is reflected; how often a
# draw is uniform instead
LTX2_PERCENTILES = (-2.5758, 3.0902)
LTX2_EPS = 1e-3
LTX2_UNIFORM = 0.1


def _ltx2_level(objective: FlowObjective, shift: float, generator) -> torch.Tensor:
    """A level [1] of LTX-2's "stretched shifted logit-normal" density, as the official trainer
    draws its sigmas (Lightricks/LTX-2, ``packages/ltx-trainer/src/ltx_trainer/
    timestep_samplers.py``, ``ShiftedLogitNormalTimestepSampler``), the shift included:
    sigmoid(N(mu, std)) with mu = log(shift) + logit_mean (``shift`` on the family's token line
    is LTX-2's mu there; std = logit_std, officially 1), stretched linearly so that the
    density's 0.5th and 99.9th percentiles land on 0 and 1; a stretched level under eps = 1e-3
    is reflected to 2 eps - level, then cut to [0, 1]; one draw in ten is uniform on [eps, 1)
    instead. Why the stretch: at 6,144 tokens the shift is about 16 and the plain shifted
    logit-normal puts 99.5 % of its levels above 0.55, so the low noise levels that make the
    detail are almost never trained. The levels are finally kept in [1e-3, 1 - 1e-3] as the
    other densities are. Three draws from ``generator`` per level (two uniform, one normal),
    whichever is kept."""
    mu, std = math.log(shift) + objective.logit_mean, objective.logit_std
    pick, uniform = torch.rand(2, generator=generator).tolist()
    normal = float(torch.randn(1, generator=generator))
    if pick < LTX2_UNIFORM:
        level = LTX2_EPS + (1 - LTX2_EPS) * uniform
    else:
        # on the side of 1/2 where the sigmoids don't round to 1: for mu > 0 the stretch of
        # 1 - sigmoid(z) = sigmoid(-z) between its own percentiles, the same level
        side = 1.0 if mu <= 0 else -1.0
        low, high = (_sigmoid(side * (mu + p * std)) for p in LTX2_PERCENTILES)
        level = (_sigmoid(side * (mu + std * normal)) - low) / (high - low)
        level = min(max(level if level >= LTX2_EPS else 2 * LTX2_EPS - level, 0.0), 1.0)
    return torch.tensor([min(max(level, 1e-3), 1 - 1e-3)], dtype=torch.float32)


def _sigmoid(z: float) -> float:
    """1 / (1 + e^-z), without overflow for any z."""
    if z >= 0:
        return 1 / (1 + math.exp(-z))
    return math.exp(z) / (1 + math.exp(z))


def flow_loss(objective: FlowObjective, batch: Batch, predict, mask=None, levels=None):
    """Rectified-flow loss per sample: x_t = (1 - s) x_0 + s noise, target noise - x_0, with
    the batch's drawn noise and levels (``flow_draw``), each latent pixel weighted by ``mask``
    (the batch's "mask" if it has one), the sample by the objective's scheme;
    ``predict(noisy, sigmas)``. ``levels``: each latent element's own s (broadcast to the
    latents: a clip whose first frame is kept clean), else its sample's."""
    from diffusers.training_utils import compute_loss_weighting_for_sd3

    latents, sigmas = batch["latent"], batch["sigma"]
    noise = batch["noise"].to(latents.dtype)
    s = sigmas.to(latents.dtype).view(-1, *[1] * (latents.ndim - 1))  # images and clips
    s = s if levels is None else levels.to(latents.dtype)
    noisy = (1 - s) * latents + s * noise
    err = mse_per_sample(predict(noisy, sigmas), noise - latents, mask)
    return err * compute_loss_weighting_for_sd3(objective.weighting, sigmas).float()


def noised_frames(first: torch.Tensor | None, shape: torch.Size) -> torch.Tensor | None:
    """[B, 1, T, 1, 1]: 0 on the first latent frame of each sample whose ``first`` ([B], the
    draw's "first_frame") is 1, kept clean as an image-to-video pipeline's conditioning frame,
    1 elsewhere; None where the batch has no such draw (every frame noised)."""
    if first is None:
        return None
    b, t = shape[0], shape[2]
    frame = torch.arange(t, device=first.device).view(1, t) == 0
    keep = 1 - first.view(b, 1).float() * frame.float()
    return keep.view(b, 1, t, 1, 1)


def token_levels(level: torch.Tensor, noised: torch.Tensor, per_frame: int) -> torch.Tensor:
    """Each token's level [B, T x per_frame] (its sample's ``level`` [B], 0 on a clean first
    frame: ``noised_frames``) for a denoiser that takes one a token, frame by frame,
    ``per_frame`` tokens each."""
    b, t = noised.shape[0], noised.shape[2]
    frames = level.view(b, 1, 1) * noised.view(b, t, 1).to(level.dtype)
    return frames.expand(b, t, per_frame).reshape(b, t * per_frame)


def first_frame_loss(objective: FlowObjective, batch: Batch, predict, noised: torch.Tensor):
    """``flow_loss`` of clips some of whose first frames are kept clean (``noised``: 0 there):
    such a frame at level 0 and out of the loss, the loss the mean over the frames left (the
    masked mean of Lightricks' LTX-2 trainer), the batch's "mask" on every frame."""
    b, t = noised.shape[0], noised.shape[2]
    mask = noised if "mask" not in batch else batch["mask"].unsqueeze(2) * noised
    levels = batch["sigma"].view(b, 1, 1, 1, 1) * noised
    return flow_loss(objective, batch, predict, mask, levels) / noised.view(b, t).mean(dim=1)
