"""The family Protocol and the helpers families share.

A family knows how to load its parts (VAE, text encoders, denoiser, pipeline), how to encode
images and captions for the cache, and its training objective. Generic code calls these members
and never asks which family it holds.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import nn

from raytuner import placement
from raytuner.config.objective import KINDS, DdpmObjective, FlowObjective
from raytuner.families.parts import Source
from raytuner.families.text import TextEncoder, TextEncoderLora

# A batch of cached rows as tensors: "latent" [B,C,H,W], the family's text tensors, and the
# per-image conditioning "original_size", "crop_top_left", "target_size" ([B,2] int64, (h, w)
# order: the image before its crop, the crop's corner, the bucket), as the training feed reads it;
# with masks in the cache (data.mask) also "mask" [B,1,H,W], each latent pixel's loss weight.
Batch = dict[str, torch.Tensor]
# pixels [B,3,H,W] in [-1,1] -> (latent mean, latent std), both in the denoiser's latent scale
ImageEncoder = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
# (denoiser, batch, one generator per sample) -> per-sample loss [B]: an ``Objective``
Loss = Callable[[nn.Module, Batch, Sequence[torch.Generator]], torch.Tensor]
# the latent batch's shape, one generator per sample -> the step's random inputs (CPU tensors)
Draw = Callable[[tuple[int, ...], Sequence[torch.Generator]], dict[str, torch.Tensor]]
DRAWN = ("noise", "timestep", "sigma")  # the batch keys an Objective's draw may fill


class Objective:
    """A family's training loss, split in two: ``draw`` makes a step's random inputs (each
    sample's noise and timestep or noise level) on the CPU from each sample's own generator, and
    the loss reads them from the batch. The training feed calls ``draw`` in its thread and hands
    the draws over pinned, so the step never waits on a host-to-device copy; called with
    generators and a batch without them, the loss draws them itself, the same way."""

    def __init__(self, draw: Draw, loss: Callable[[nn.Module, Batch], torch.Tensor]) -> None:
        self.draw, self._loss = draw, loss

    def __call__(self, denoiser: nn.Module, batch: Batch, generators=None) -> torch.Tensor:
        if not any(k in batch for k in DRAWN):
            latent = batch["latent"]
            drawn = self.draw(tuple(latent.shape), generators)
            batch = batch | {k: v.to(latent.device) for k, v in drawn.items()}
        return self._loss(denoiser, batch)


@dataclass(frozen=True)
class LoraFiles:
    """What a family's LoRA export holds besides the diffusers file, and how its files describe
    themselves to the UIs: the values kohya's sd-scripts writes for the same base model."""

    kohya: str = ""  # the layout of lora_kohya.safetensors (``Family.kohya_names``); "": none
    base_model_version: str = ""  # ss_base_model_version: A1111 / Forge classify a LoRA by it
    network_module: str = "networks.lora"  # ss_network_module: sd-scripts' LoRA module
    architecture: str = ""  # modelspec.architecture of the base model; "": no modelspec keys
    implementation: str = ""  # modelspec.implementation


class Family(Protocol):
    name: str
    default_resolution: int  # side of the square bucket, in pixels
    pixel_multiple: int  # bucket sides are multiples of this (VAE factor x denoiser factor)
    lora_targets: tuple[str, ...]  # default peft target_modules on the denoiser
    denoiser_part: str  # "unet" / "transformer": its pipeline attribute, its name in LoRA keys
    lora_files: LoraFiles  # which LoRA layouts it exports, and how they describe themselves
    # the denoiser's block lists in the order they run (``memory.blocks_to_swap`` streams the
    # last of them); empty: the family does not stream blocks
    swap_blocks: tuple[str, ...]
    # the denoiser's repeated blocks, each a unit that ``scaling.strategy = "fsdp"`` shards and
    # gathers on its own (a block list: each block; a single block: itself), in the order they run
    shard_blocks: tuple[str, ...]
    # class names of the layers inside those blocks that are units of their own, nested in their
    # block (which then keeps only what they do not hold): the UNets' resnets and transformer
    # blocks, so that no unit is a whole down or up block; empty: the blocks are the units
    shard_inner: tuple[str, ...]
    # class names of the repeated blocks ``train.compile`` compiles, each on its own (regional
    # compilation: diffusers' ``_repeated_blocks`` where the model has them)
    compile_blocks: tuple[str, ...]
    # what compiling those blocks did on a GPU (``raytuner bench gpu``): samples/s compiled over
    # eager, or the error the compiled step failed with there; ``train.compile = "auto"``
    # compiles on GPUs where this is a speed-up of more than 5 %
    compiled_on_gpu: float | str
    # its blocks' frozen base linears may multiply in float8 (train.float8_matmul): the
    # transformer families
    float8_matmul: bool
    # its denoiser's convolutions run in channels-last memory format on GPUs (the UNets)
    channels_last: bool
    objective_kind: str  # "ddpm" or "flow": the [objective.<kind>] settings its loss takes
    guidance_embedding: bool  # its denoiser can take objective.flow.guidance (guidance-distilled)
    # the pipeline's guidance_scale when the job and the prompt line set none: the classifier-free
    # guidance scale, or the guidance embedding's value for guidance-distilled families
    default_guidance_scale: float
    # its pipeline takes a negative prompt (classifier-free guidance: kohya's --n and --l)
    negative_prompt: bool
    # the text encoders ``lora.text_encoder`` trains a LoRA on (all of them, as kohya does), in
    # the order ``text_encoder`` returns them; empty: the family trains none (the cache's text)
    text_encoder_loras: tuple[TextEncoderLora, ...]
    # default peft target_modules on those text encoders (``lora.text_encoder_target_modules``)
    text_encoder_lora_targets: tuple[str, ...]
    # image sides must be multiples of this for its parts to run (pixel_multiple is one)
    pixel_grid: int
    # the parts a single-file checkpoint (model.pretrained = "….safetensors") holds, each with
    # the key prefix of its tensors there ("" = every key); its other parts, tokenizers and
    # scheduler come from model.single_file_config. Empty: single files are refused
    single_file_parts: tuple[tuple[str, str], ...]

    # its parts: name (also the subfolder in a diffusers folder) -> "module.Class"
    def part_classes(self) -> dict[str, str]: ...
    # parts from a preset or a folder/hub repo, frozen weights in ``source.dtype`` on ``device``;
    # weights=False: the architecture alone, random weights (``raytuner plan``: on "meta")
    def image_encoder(self, source: Source, device: str, weights: bool = True) -> ImageEncoder: ...
    def text_encoder(self, source: Source, device: str, weights: bool = True) -> TextEncoder: ...
    def denoiser(self, source: Source, device: str = "cpu", weights: bool = True) -> nn.Module: ...
    # objective: its kind's settings, DdpmObjective or FlowObjective (ObjectiveConfig.for_family)
    def loss(self, source: Source, objective) -> Loss: ...
    # how sd-scripts names the LoRA of each module of a denoiser of this config (``Names`` of
    # raytuner.lora.kohya); None: the family writes no kohya file (``lora_files.kohya`` is "")
    def kohya_names(self, config): ...
    # the diffusers layout; adapter_config: the peft LoraConfig as a dict (rank, alpha, targets);
    # text_encoders: a text encoder's part -> (its LoRA's state, its adapter config), if trained
    def save_lora(
        self, directory: str, lora_state: dict, adapter_config: dict, text_encoders=None
    ) -> None: ...
    def pipeline(self, source: Source): ...  # a diffusers DiffusionPipeline, on the CPU
    # pipeline-call arguments that match how the cache was encoded (caption token count)
    def pipeline_options(self, pipe) -> dict: ...
    # shapes of the tensors the cache stores per image of a bucket, for the released full-size
    # model ("latent" and each text tensor): what `raytuner bench feed` writes
    def cache_shapes(self, width: int, height: int) -> dict[str, tuple[int, ...]]: ...
    # a single file's tensors of ``part`` (the keys under its prefix) in the layout diffusers'
    # ``from_single_file`` converts (most families: as they are)
    def single_file_state(self, part: str, state: dict[str, torch.Tensor]) -> dict: ...
    # ``n`` samples of the cached tensors of ``shapes`` (``cache_shapes``, or what its encoders
    # make) at the bucket ``size`` (width, height), as the training feed hands them to ``loss``:
    # random latent and text tensors in ``dtype``, the per-image conditioning, and what else its
    # loss needs (``raytuner plan`` traces one on "meta", ``bench step`` trains on one)
    def example_batch(
        self, shapes: dict, n: int, size: tuple[int, int], device, dtype: torch.dtype
    ) -> Batch: ...


def example_batch(shapes: dict, n: int, size: tuple[int, int], device, dtype: torch.dtype) -> Batch:
    """What every family's example batch holds (``Family.example_batch``): random tensors of
    ``shapes`` in ``dtype`` (the feed reads the cache in float32), and the conditioning the
    feed adds to every row, here an uncropped image of the bucket's size."""
    batch = {k: torch.randn(n, *s, device=device, dtype=dtype) for k, s in shapes.items()}
    width, height = size

    def rows(pair: tuple[int, int]) -> torch.Tensor:
        return torch.tensor([pair] * n, dtype=torch.int64).to(device)

    return batch | {
        "original_size": rows((height, width)),
        "crop_top_left": rows((0, 0)),
        "target_size": rows((height, width)),
    }


def preset_pipeline(pipe):
    """A pipeline built from a preset's parts, every model in eval mode as ``from_pretrained``
    leaves them."""
    for part in pipe.components.values():
        if isinstance(part, nn.Module):
            part.eval()
    return pipe


def file_parts(load_part, source: Source, parts: tuple[tuple[str, str], ...]) -> dict:
    """The pipeline components a single-file checkpoint holds, loaded from it (``{}`` for a
    folder or hub repo): passed to ``from_pretrained`` of the config repo, which then loads
    only the rest (tokenizers, scheduler, the parts the file lacks)."""
    return {name: load_part(source, name) for name, _ in parts} if source.single_file else {}


def save_lora(
    pipeline_cls, part: str, directory: str, lora_state: dict, adapter_config: dict,
    text_encoders=None,
):  # fmt: skip
    """The diffusers layout of a LoRA on the pipeline's ``part`` (``unet`` / ``transformer``)
    and on its ``text_encoders`` (a text encoder's part -> (state, adapter config):
    ``text_encoder``, ``text_encoder_2``), through the pipeline class's own
    ``save_lora_weights``, each with its peft adapter config so a loader applies its alpha."""
    layers = {part: (lora_state, adapter_config)} | (text_encoders or {})
    kwargs = {}
    for name, (state, config) in layers.items():
        kwargs |= {f"{name}_lora_layers": state, f"{name}_lora_adapter_metadata": config}
    pipeline_cls.save_lora_weights(directory, **kwargs)


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
    nothing (nor any gradient), and a half-masked image weighs half."""
    err = (prediction.float() - target.float()) ** 2
    if mask is not None:
        err = err * mask.float()
    return err.reshape(err.shape[0], -1).mean(dim=1)


# --- the Stable Diffusion (UNet + KL VAE + DDPM) families -------------------------------------


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


def kl_image_encoder(vae, device: str) -> ImageEncoder:
    """Latent mean and std of an AutoencoderKL, in the denoiser's scale (scaling_factor)."""
    vae = placement.move(vae, device).eval().requires_grad_(False)
    scale = vae.config.scaling_factor
    dtype = vae.dtype  # diffusers walks every module to answer: once, not each batch

    @torch.no_grad()
    def encode(pixels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        dist = vae.encode(placement.inputs(pixels, device, dtype)).latent_dist
        return dist.mean * scale, dist.std * scale

    return encode


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


def hub_kwargs(source: Source) -> dict:
    """``from_pretrained`` keyword arguments for a whole pipeline folder or hub repo
    (``source.repo``)."""
    return source.hub() | {"torch_dtype": source.dtype}


# --- flow-matching families (Flux, Sana) ------------------------------------------------------


def flow_draw(objective: FlowObjective, image_tokens: Callable[[tuple[int, ...]], int]) -> Draw:
    """A flow-matching step's random inputs: each sample's noise, then its noise level in
    (0, 1) from the objective's density (``diffusers.training_utils``), shifted towards noise
    by the image's token count (``image_tokens(latent shape)``: Flux's resolution-dependent
    shift) or by the fixed ``objective.shift``."""
    from diffusers.training_utils import compute_density_for_timestep_sampling

    def draw(shape: tuple[int, ...], generators) -> dict[str, torch.Tensor]:
        noise = per_sample_noise(shape, generators)
        u = torch.cat(
            [
                compute_density_for_timestep_sampling(
                    objective.timestep_sampling,
                    1,
                    logit_mean=objective.logit_mean,
                    logit_std=objective.logit_std,
                    mode_scale=objective.mode_scale,
                    generator=g,
                )
                for g in generators
            ]
        ).clamp(1e-3, 1 - 1e-3)
        if objective.resolution_shift:
            # the line through (256 tokens, 0.5) and (4096 tokens, 1.15), as Flux's sampler uses
            tokens = image_tokens(shape)
            shift = math.exp(0.5 + (tokens - 256) * (1.15 - 0.5) / (4096 - 256))
        else:
            shift = objective.shift
        return {"noise": noise, "sigma": shift * u / (1 + (shift - 1) * u)}

    return draw


def flow_loss(objective: FlowObjective, batch: Batch, predict, mask=None):
    """Rectified-flow loss per sample: x_t = (1 - s) x_0 + s noise, target noise - x_0, with
    the batch's drawn noise and levels (``flow_draw``), each latent pixel weighted by ``mask``
    (the batch's "mask" if it has one), the sample by the objective's scheme;
    ``predict(noisy, sigmas)``."""
    from diffusers.training_utils import compute_loss_weighting_for_sd3

    latents, sigmas = batch["latent"], batch["sigma"]
    noise = batch["noise"].to(latents.dtype)
    s = sigmas.to(latents.dtype)[:, None, None, None]
    noisy = (1 - s) * latents + s * noise
    err = mse_per_sample(predict(noisy, sigmas), noise - latents, mask)
    return err * compute_loss_weighting_for_sd3(objective.weighting, sigmas).float()
