"""The one model builder of a run: what a worker trains, built and placed in order: the
denoiser (from its files, a preset, or on the meta device for ``raytuner plan``) in the frozen
weights' dtype, ``model.merge_adapters`` merged into its weights in float32 before they are
stored in float8 or sharded (``lora/merge.py``), sharded over the workers (``scaling.strategy
= "fsdp"``) or built where it will stream from (block swap, float8 storage), gradient
checkpointing, the adapter and its
initial values (``adapt``: the LoRA's draw, ``lora.init_from``, the text encoders' LoRA) and the
EMA, then its placement, the compute kernels (attention, channels-last, float8 matrix
products) and ``train.compile``. The loop, both benches and ``plan`` build through
``trainable_model``; the trained tensors are kept by ``weights.Weights``."""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
from typing import NamedTuple

import torch
from peft.utils import get_peft_model_state_dict
from torch import nn

from raytuner.checkpoint.layout import KOHYA_FILE
from raytuner.config import ConfigError
from raytuner.families import mixture
from raytuner.lora import export, init_from, kinds, kohya, merge
from raytuner.placement import sharding
from raytuner.placement.strategy import REPLICATED, Strategy
from raytuner.train import float8_matmul, recompute, text_lora
from raytuner.train.weights import Weights

log = logging.getLogger("raytuner.train")


def autocast_dtype(precision: str, device: torch.device, frozen: torch.dtype):
    """The step's autocast dtype: the frozen weights' when they are half precision (the inputs
    and float32 LoRA layers meet them there), bf16 on a GPU when ``train.mixed_precision =
    "bf16"``, else None (float32 throughout)."""
    if frozen != torch.float32:
        return frozen
    return torch.bfloat16 if precision == "bf16" and device.type == "cuda" else None


def attention_backends(device: torch.device, choice: str = "auto") -> None:
    """The attention kernels training may use on a GPU (``train.attention``): ``auto`` keeps
    cuDNN's fused attention out (its backward failed on an H100, torch 2.11, Flux at 1024 px:
    "mha_graph.execute ... is_good()", where flash attention runs) and lets torch choose among
    the rest; any other choice is that kernel alone, so a shape it cannot run fails loudly
    rather than falling back to another (a bench compares the kernel it names)."""
    if device.type != "cuda":
        return
    b = torch.backends.cuda
    if choice == "auto":
        b.enable_cudnn_sdp(False)
        return
    b.enable_flash_sdp(choice == "flash")
    b.enable_mem_efficient_sdp(choice == "efficient")
    b.enable_cudnn_sdp(choice == "cudnn")
    b.enable_math_sdp(choice == "math")


class Trainable(NamedTuple):
    """What a worker trains, placed: the denoiser, its trained Weights, the Source it came from,
    the step's autocast dtype and the placement that keeps every tensor where it belongs."""

    denoiser: nn.Module
    weights: Weights
    source: object  # parts.Source
    amp: torch.dtype | None
    placement: object  # raytuner.placement.DenoiserPlacement
    compiled: bool = False  # its repeated blocks compiled (train.compile)


def adapt(
    denoiser: nn.Module,
    *,
    mode: str,
    lora,
    targets,
    ema_decay: float,
    dtype: torch.dtype = torch.float32,
    family=None,
    seed: int = 0,
    place=None,
    text=None,
    sharded: bool = False,
) -> Weights:
    """The denoiser's trained weights made: the adapter added (``mode = "lora"``: peft's adapter
    of ``lora``'s kind and shape, ``kinds.peft_config``, on ``targets`` unless
    ``lora.target_modules`` says otherwise) or every
    weight trained (``"full"``), the trained ones in ``dtype`` (``model.trainable_dtype``),
    ``place(denoiser)`` (``trainable_model``'s sharding) before they get values, the LoRA drawn
    from ``seed`` (``train.seed``) the same way on any device, sharded or not, and with
    ``family`` given checked against its kohya layout and started from ``lora.init_from`` (a
    resumed run then loads its checkpoint over it), the text encoders' LoRA (``text``) after
    the denoiser's, and the EMA when ``ema_decay``. DoRA's magnitudes start at the placed base
    weights' row norms."""
    denoiser.requires_grad_(mode == "full")
    if mode == "lora":
        denoiser.add_adapter(kinds.peft_config(lora, targets))
    for p in denoiser.parameters():
        if p.requires_grad:
            p.data = p.data.to(dtype)
    if place is not None:
        place(denoiser)
    named = [(n, p) for n, p in denoiser.named_parameters() if p.requires_grad]
    names, params = [n for n, _ in named], [p for _, p in named]
    provenance = {}
    if mode == "lora":  # peft's start (kinds.draw), in the adapter's order
        sharding.fill(denoiser, kinds.draw(names, params, seed, lora.rank))
        sharding.fill(denoiser, kinds.dora_magnitudes(denoiser, sharding.gather))
        if family is not None:
            provenance = _lora_files(denoiser, names, family, lora, text)
    if text is not None:
        names, params = names + text.names, params + text.params
    ema = None
    if ema_decay:
        from diffusers.training_utils import EMAModel

        # one update for every tensor (foreach); a sharded run's rows one by one
        ema = EMAModel(params, decay=ema_decay, foreach=not sharded)
    return Weights(
        denoiser, mode=mode, names=names, params=params, text=text, ema=ema, sharded=sharded,
        provenance=provenance,
    )  # fmt: skip


def _lora_files(denoiser: nn.Module, names: list[str], family, lora, text) -> dict:
    """Refuse targets the family's kohya layout has no name for (before training, not at the
    first checkpoint); read ``lora.init_from`` into the fresh adapter; return its provenance."""
    for _, expert in mixture.experts_of(denoiser):  # each expert of a mixture: its own file
        _kohya_named(expert, family)
    if not lora.init_from:
        return {}
    peft_names = {kinds.peft_name(n): n for n in names}
    if family.turns:  # every expert of a mixture: each from its own file
        return _experts_from(denoiser, lora, family, peft_names)
    texts = text.start() if text is not None else []
    state, text_state, provenance = init_from.start_from(
        denoiser, lora.init_from, lora, family, texts
    )
    sharding.fill(denoiser, {peft_names[k]: v for k, v in state.items()})
    if text is not None:
        text.load(text_state)
    return provenance


def _experts_from(mixture_model: nn.Module, lora, family, peft_names: dict) -> dict:
    """``lora.init_from`` of a run of every expert (``init_from.expert_files``): each expert's
    adapter read from its own file; the provenance names the folder, and each file's sha256,
    modules and metadata by expert."""
    files = init_from.expert_files(lora.init_from, family)
    by_expert = {}
    for (part, expert), (of_expert, path) in zip(mixture.experts_of(mixture_model), files,
                                                  strict=True):  # fmt: skip
        state, _, provenance = init_from.start_from(expert, path, lora, of_expert)
        sharding.fill(mixture_model, {peft_names[f"{part}.{k}"]: v for k, v in state.items()})
        by_expert[of_expert.expert.name] = provenance
    return {"raytuner.init_from": lora.init_from} | {
        key: json.dumps({e: p[key] for e, p in by_expert.items()}, sort_keys=True)
        for key in ("raytuner.init_from_sha256", "raytuner.init_from_modules",
                    "raytuner.init_from_metadata")
    }  # fmt: skip


def _kohya_named(denoiser: nn.Module, family) -> None:
    """Refuse LoRA targets of ``denoiser`` the family's kohya layout has no name for."""
    kohya_names = export.kohya_names(family, denoiser)
    if kohya_names is not None:
        modules = kohya.modules_of(get_peft_model_state_dict(denoiser))
        if missing := [m for m in modules if not kohya_names(m)]:
            raise ConfigError(
                f"lora.target_modules reaches {', '.join(missing[:3])}, which "
                f"{family.name}'s kohya layout ({KOHYA_FILE}) has no name for: "
                "leave it out of lora.target_modules"
            )


def trainable_model(
    model, train, lora, family, device: torch.device, memory=None, source=None,
    strategy: Strategy = REPLICATED,
) -> Trainable:
    """The denoiser a worker trains, placed for ``device`` in train mode (frozen weights in
    ``model.dtype``, trained ones in ``model.trainable_dtype``, ``memory.blocks_to_swap`` of
    its blocks streamed): one setup for the loop, both benches and ``raytuner plan``.

    ``strategy`` (``scaling.strategy``) ``"fsdp"``: built on the meta device, sharded over the
    process group's workers, each worker's rows then allocated and read (``_sharded``).
    ``source``: the parts' Source when not the job's own on ``device`` (plan: the GPU's
    dtypes, a released repo's shipped architecture). On the meta device (plan) nothing is
    loaded, read, streamed or sharded: the architecture alone, every weight resident, no
    ``lora.init_from`` (its values change no size); plan counts streamed and sharded bytes
    itself. With ``lora.text_encoder`` the family's text encoders are built beside it, on the
    same device, with their LoRA (``Weights.text``)."""
    from raytuner import placement
    from raytuner.config import MemoryConfig
    from raytuner.families import parts

    memory = memory or MemoryConfig()
    trainable = parts.DTYPES[model.trainable_dtype]
    source = source or parts.model_source(model, device)
    if train.mode == "full":
        source = dataclasses.replace(source, dtype=trainable)
    attention_backends(device, train.attention)
    amp = autocast_dtype(train.mixed_precision, device, source.dtype)
    float8, place = model.dtype == parts.FLOAT8, None
    if device.type == "meta":  # merged adapters change values, no size: not read
        denoiser = family.denoiser(source, "meta", weights=False)
        lora, swapped = dataclasses.replace(lora, init_from=""), 0
    elif strategy.sharded:
        denoiser, swapped = family.denoiser(source, "meta", weights=False), 0
        merged = merge.read(model.merge_adapters, family, denoiser)
        place = functools.partial(
            _sharded, family=family, source=source, device=device, amp=amp, merged=merged
        )
    else:
        denoiser = family.denoiser(source, str(placement.load_device(device, memory, float8)))
        merge.into(denoiser, merge.read(model.merge_adapters, family, denoiser))
        swapped = memory.blocks_to_swap
    denoiser.train()
    if float8:
        parts.float8_storage(denoiser.requires_grad_(False))
    if train.gradient_checkpointing:
        denoiser.enable_gradient_checkpointing(recompute.checkpointed)
    text = None
    if lora.text_encoder and train.mode == "lora":
        text = text_lora.build(family, source, device, lora, train, trainable)
    weights = adapt(
        denoiser,
        mode=train.mode,
        lora=lora,
        targets=family.adapters.targets,
        ema_decay=train.ema_decay,
        dtype=trainable,
        family=family,
        seed=train.seed,
        place=place,
        text=text,
        sharded=strategy.sharded and device.type != "meta",
    )
    if amp is not None:  # the LoRA layers' inputs left in the compute dtype (see _no_casts)
        _no_casts(denoiser)
        for encoder in text.encoder.encoders if text is not None else []:
            _no_casts(encoder)
    placed = placement.DenoiserPlacement(denoiser, family, device, swapped, memory.swap_ring)
    placed.average(weights.ema)
    placement.memory_format(denoiser, family, device, train.channels_last, strategy.sharded)
    if train.float8_matmul:  # frozen base linears in float8, their copies made (meta: plan's)
        float8_matmul.refuse_device(device)
        float8_matmul.convert(denoiser, family, amp or source.dtype)
    compiled = compiles(train.compile, family, device, swapped)
    if compiled:
        compile_blocks(denoiser, family)
    return Trainable(denoiser, weights, source, amp, placed, compiled)


def compiles(setting: bool | str, family, device: torch.device, swapped: int = 0) -> bool:
    """Whether ``train.compile`` compiles the blocks here: true or false as set; ``"auto"`` on
    a GPU for a family whose compiled blocks were measured more than 5 % faster there
    (``blocks.compiled_on_gpu``), never with blocks streamed (block swap) nor on the meta device."""
    if device.type == "meta":
        return False
    if setting != "auto":
        return bool(setting)
    gain = family.blocks.compiled_on_gpu
    return device.type == "cuda" and not swapped and not isinstance(gain, str) and gain > 1.05


def _no_casts(module: nn.Module) -> None:
    """peft casts each LoRA layer's input to the LoRA's float32 and autocast casts it back to
    the compute dtype for the matmul: under autocast the first cast only copies (the same
    values reach the matmul), so it is turned off."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    for m in module.modules():
        if isinstance(m, BaseTunerLayer):
            m.cast_input_dtype_enabled = False


def compile_blocks(denoiser: nn.Module, family) -> int:
    """``train.compile``: each of the denoiser's repeated blocks (the family's
    ``blocks.compile``) compiled on its own, in place (its parameters keep their names), with
    what it holds (a LoRA) and what wraps it (gradient checkpointing, sharding) as they are.
    Regional compilation: a graph per block type, not per model. Shapes: a block type compiles
    at the first bucket (and for the first block, whose input needs no gradient, once more) and
    at the second bucket, where dynamo makes the sizes it took as constants dynamic; no bucket
    after that compiles again. Returns how many blocks."""
    blocks = sharding.of_classes(denoiser, family.blocks.compile)
    if not blocks:
        raise ValueError(
            f"train.compile: the {family.name} denoiser has none of its repeated blocks "
            f"({', '.join(family.blocks.compile)})"
        )
    log.info("train.compile: compiling %d %s blocks at their first steps", len(blocks), family.name)
    for block in blocks:
        block.compile()
    return len(blocks)


def _sharded(
    denoiser: nn.Module, *, family, source, device: torch.device, amp, merged=None
) -> None:
    """Shard a meta-device denoiser (its adapter in place) over the workers, computing in
    ``amp`` (None: float32), then give each worker its rows of the frozen and base weights,
    read one tensor at a time from the model's files (``part_tensors.tensors``; each expert's
    from its own part's, under its prefix, for a mixture trained in turn), with ``merged``'s
    adapters merged into each in float32 (``model.merge_adapters``); the adapter's get their
    values from ``Weights``."""
    merged = merged or {}
    from raytuner.families import part_tensors

    # (the part whose files hold them, the prefix of their names in the denoiser)
    pieces = [(part or family.parts.denoiser, f"{part}." if part else "")
              for part, _ in mixture.experts_of(denoiser)]  # fmt: skip
    files = {
        prefix: part_tensors.tensors(family, source, part, family.parts.classes[part])
        for part, prefix in pieces
    }

    def base():
        for name, _ in denoiser.named_parameters():
            if kinds.is_adapter(name):
                continue
            prefix = next(p for p in files if name.startswith(p))
            key = name[len(prefix) :].replace(".base_layer", "")
            if key not in files[prefix]:
                part = prefix.rstrip(".") or family.parts.denoiser
                raise ValueError(f"{source.pretrained}: its {part} has no tensor {key}")
            module = prefix + key.removesuffix(".weight")  # merged: by the denoiser's names
            if module in merged and key.endswith(".weight"):
                yield name, merge.merged(files[prefix][key].float(), merged[module])
            else:
                yield name, files[prefix][key]

    sharding.shard(denoiser, family, device, amp or torch.float32)
    computed = {}  # rotary tables: not in the files
    for part, prefix in pieces:
        buffers = part_tensors.computed_buffers(family, source, part)
        computed |= {prefix + name: tensor for name, tensor in buffers.items()}
    sharding.materialize(denoiser, device, base(), computed)
