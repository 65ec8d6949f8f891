"""What a run trains: a peft LoRA adapter on the denoiser (``train.mode = "lora"``, with
``lora.text_encoder`` one on the text encoders too: ``train/text_lora.py``) or the whole
denoiser (``"full"``), optionally with an exponential moving average of the trained weights
(``diffusers.training_utils.EMAModel``), and a LoRA's export (a full fine-tune's is written from
its checkpoint: ``lora/full_model.py``)."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import os
import time
from collections.abc import Iterator
from typing import NamedTuple

import torch
from peft import LoraConfig as PeftLoraConfig
from peft.utils import get_peft_model_state_dict, set_peft_model_state_dict
from torch import nn

from raytuner.config import ConfigError
from raytuner.lora import export, kohya
from raytuner.lora import init_from as lora_init
from raytuner.placement import sharding
from raytuner.runs import KOHYA_FILE, LORA_DIR
from raytuner.train import float8_matmul, text_lora

log = logging.getLogger("raytuner.train")


def _cpu(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.detach().cpu().contiguous() for k, v in state.items()}


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


class Weights:
    """The denoiser's trainable weights: their tensors for a checkpoint, their EMA, their export.

    Sharded (``scaling.strategy = "fsdp"``), every tensor here is a worker's rows of it (a
    DTensor): ``tensors``/``ema_tensors`` give them to a sharded checkpoint as they are, and
    ``gathered`` assembles them whole, a tensor at a time, on every worker (the LoRA export)."""

    def __init__(
        self,
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
    ):
        """``dtype``: the trained weights' (``model.trainable_dtype``), whatever the frozen
        ones are in; ``family``: given, a LoRA starts from ``lora.init_from`` (a resumed run
        then loads its checkpoint over it) and must fit the family's kohya layout; ``seed``: the
        LoRA's initial draw (``train.seed``); ``place``: called with the denoiser once its
        trained weights exist and before they get values (``trainable_model``'s sharding);
        ``text``: the text encoders' LoRA (``text_lora.TextLora``), trained with the rest: its
        parameters follow the denoiser's in ``names`` and ``params``."""
        self.denoiser, self.mode, self.text = denoiser, mode, text
        self.provenance = {"ss_training_started_at": str(time.time())}
        denoiser.requires_grad_(mode == "full")
        if mode == "lora":
            denoiser.add_adapter(
                PeftLoraConfig(
                    r=lora.rank,
                    lora_alpha=lora.alpha,
                    lora_dropout=lora.dropout,
                    init_lora_weights="gaussian",
                    target_modules=list(lora.target_modules or targets),
                )
            )
        for p in denoiser.parameters():
            if p.requires_grad:
                p.data = p.data.to(dtype)
        if place is not None:
            place(denoiser)
        named = [(n, p) for n, p in denoiser.named_parameters() if p.requires_grad]
        self.names, self.params = [n for n, _ in named], [p for _, p in named]
        if mode == "lora":
            self._draw_lora(seed, lora.rank)
            if family is not None:
                self._lora_files(family, lora)
        if text is not None:
            self.names, self.params = self.names + text.names, self.params + text.params
        self.ema = None
        if ema_decay:
            from diffusers.training_utils import EMAModel

            # one update for every tensor (foreach); a sharded run's rows one by one
            self.ema = EMAModel(self.params, decay=ema_decay, foreach=not self.sharded)

    @property
    def sharded(self) -> bool:
        """Whether the trained weights are sharded over the workers (``scaling.strategy``)."""
        return any(sharding.is_sharded(p) for p in self.params)

    def _draw_lora(self, seed: int, rank: int) -> None:
        """peft's "gaussian" start (``text_lora.draw``) from ``seed`` in the adapter's order:
        the same values on any device, sharded or not."""
        sharding.fill(self.denoiser, text_lora.draw(self.names, self.params, seed, rank))

    def _lora_files(self, family, lora) -> None:
        """Refuse targets the family's kohya layout has no name for (before training, not at
        the first checkpoint); read ``lora.init_from`` into the fresh adapter."""
        names = export.kohya_names(family, self.denoiser)
        if names is not None:
            modules = kohya.modules_of(get_peft_model_state_dict(self.denoiser))
            if missing := [m for m in modules if not names(m)]:
                raise ConfigError(
                    f"lora.target_modules reaches {', '.join(missing[:3])}, which "
                    f"{family.name}'s kohya layout ({KOHYA_FILE}) has no name for: "
                    "leave it out of lora.target_modules"
                )
        if lora.init_from:
            text = self.text.start() if self.text is not None else []
            state, texts, provenance = lora_init.start_from(
                self.denoiser, lora.init_from, lora, family, text
            )
            names = self._peft_names()
            sharding.fill(self.denoiser, {names[k]: v for k, v in state.items()})
            if self.text is not None:
                self.text.load(texts)
            self.provenance |= provenance

    def _peft_names(self) -> dict[str, str]:
        """The adapter's peft state names (``get_peft_model_state_dict``'s) -> parameter names."""
        return {n.replace(".default", ""): n for n in self.names}

    def tensors(self) -> dict[str, torch.Tensor]:
        """The tensors a checkpoint keeps, live (a sharded worker's rows): the adapter under
        its peft names, or the whole denoiser's state."""
        if self.mode == "lora":
            return dict(zip(self._peft_names(), self.params, strict=True))
        return dict(self.denoiser.state_dict())

    def ema_tensors(self) -> dict[str, torch.Tensor] | None:
        """The EMA of the trained weights, live, by parameter name."""
        if self.ema is None:
            return None
        return dict(zip(self.names, self.ema.shadow_params, strict=True))

    def state(self) -> dict[str, torch.Tensor]:
        """``tensors`` whole on the CPU (an unsharded run's checkpoint)."""
        if self.mode == "lora":
            text = self.text.state() if self.text is not None else {}
            return _cpu(get_peft_model_state_dict(self.denoiser)) | text
        return _cpu(self.denoiser.state_dict())

    def gathered(self) -> dict[str, torch.Tensor]:
        """``tensors`` whole on the CPU, gathered one at a time (a collective when sharded):
        copies, also of tensors on the CPU (the EMA's values stay the export's after
        ``averaged`` puts the trained ones back in place)."""
        return {
            k: sharding.gather(v).detach().to("cpu", copy=True) for k, v in self.tensors().items()
        }

    def keys(self) -> set[str]:
        return set(self.tensors())

    def load(self, state: dict[str, torch.Tensor]) -> None:
        if self.mode == "lora" and self.text is not None:
            text = {k: v for k, v in state.items() if k.startswith(self.text.parts())}
            self.text.load(text)
            state = {k: v for k, v in state.items() if k not in text}
        if self.mode == "lora":
            set_peft_model_state_dict(self.denoiser, state)
        else:
            self.denoiser.load_state_dict(state)

    def param_groups(self) -> list:
        """What the optimizer steps: the trained parameters, the text encoders' LoRA in a param
        group of its own (its ``lora.text_encoder_lr`` when set; the LR schedule scales both)."""
        if self.text is None:
            return self.params
        n = len(self.params) - len(self.text.params)
        text = {"params": self.params[n:]} | ({"lr": self.text.lr} if self.text.lr else {})
        return [{"params": self.params[:n]}, text]

    def ema_state(self) -> dict[str, torch.Tensor] | None:
        if self.ema is None:
            return None
        return _cpu(self.ema_tensors())

    def load_ema(self, shadow: dict[str, torch.Tensor], step: int) -> None:
        device = self.params[0].device
        self.ema.shadow_params = [shadow[n].to(device) for n in self.names]  # beside its weight
        self.ema.optimization_step = step

    def step(self) -> None:
        """After each optimizer step: move the average."""
        if self.ema is not None:
            self.ema.step(self.params)

    @contextlib.contextmanager
    def averaged(self) -> Iterator[None]:
        """The EMA weights in place of the trained ones (a no-op without EMA)."""
        if self.ema is None:
            yield
            return
        self.ema.store(self.params)
        self.ema.copy_to(self.params)
        try:
            yield
        finally:
            self.ema.restore(self.params)

    def export_lora(self, directory: str | None, family, meta: dict[str, str]) -> None:
        """The LoRA the user takes away (the EMA weights when enabled), both layouts, into
        ``<directory>/lora/``. Sharded, every worker gathers and only the one given a
        ``directory`` writes."""
        with self.averaged():
            state = self.gathered()
        if directory is None:
            return
        export.write_lora(
            os.path.join(directory, LORA_DIR),
            state,
            family=family,
            adapter_config=self.denoiser.peft_config["default"].to_dict(),
            meta=meta | self.provenance,
            denoiser=self.denoiser,
            text_encoders=self.text.split(state) if self.text is not None else (),
        )


class Trainable(NamedTuple):
    """What a worker trains, placed: the denoiser, its trained Weights, the Source it came from,
    the step's autocast dtype and the placement that keeps every tensor where it belongs."""

    denoiser: nn.Module
    weights: Weights
    source: object  # parts.Source
    amp: torch.dtype | None
    placement: object  # raytuner.placement.DenoiserPlacement
    compiled: bool = False  # its repeated blocks compiled (train.compile)


def trainable_model(
    model, train, lora, family, device: torch.device, memory=None, source=None, strategy="ddp"
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
    if device.type == "meta":
        denoiser = family.denoiser(source, "meta", weights=False)
        lora, swapped = dataclasses.replace(lora, init_from=""), 0
    elif strategy == "fsdp":
        denoiser, swapped = family.denoiser(source, "meta", weights=False), 0
        place = functools.partial(_sharded, family=family, source=source, device=device, amp=amp)
    else:
        denoiser = family.denoiser(source, str(placement.load_device(device, memory, float8)))
        swapped = memory.blocks_to_swap
    denoiser.train()
    if float8:
        parts.float8_storage(denoiser.requires_grad_(False))
    if train.gradient_checkpointing:
        denoiser.enable_gradient_checkpointing()
    text = None
    if lora.text_encoder and train.mode == "lora":
        text = text_lora.build(family, source, device, lora, train, trainable)
    weights = Weights(
        denoiser,
        mode=train.mode,
        lora=lora,
        targets=family.lora_targets,
        ema_decay=train.ema_decay,
        dtype=trainable,
        family=family,
        seed=train.seed,
        place=place,
        text=text,
    )
    if amp is not None:  # the LoRA layers' inputs left in the compute dtype (see _no_casts)
        _no_casts(denoiser)
        for encoder in text.encoder.encoders if text is not None else []:
            _no_casts(encoder)
    placed = placement.DenoiserPlacement(denoiser, family, device, swapped, memory.swap_ring)
    placed.average(weights.ema)
    placement.memory_format(denoiser, family, device, train.channels_last)
    if train.float8_matmul and device.type != "meta":  # frozen base linears in float8
        float8_matmul.refuse_device(device)
        float8_matmul.convert(denoiser, family)
    compiled = compiles(train.compile, family, device, swapped)
    if compiled:
        compile_blocks(denoiser, family)
    return Trainable(denoiser, weights, source, amp, placed, compiled)


def compiles(setting: bool | str, family, device: torch.device, swapped: int = 0) -> bool:
    """Whether ``train.compile`` compiles the blocks here: true or false as set; ``"auto"`` on
    a GPU for a family whose compiled blocks were measured more than 5 % faster there
    (``compiled_on_gpu``), never with blocks streamed (block swap) nor on the meta device."""
    if device.type == "meta":
        return False
    if setting != "auto":
        return bool(setting)
    gain = family.compiled_on_gpu
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
    ``compile_blocks``) compiled on its own, in place (its parameters keep their names), with
    what it holds (a LoRA) and what wraps it (gradient checkpointing, sharding) as they are.
    Regional compilation: a graph per block type, not per model. Shapes: a block type compiles
    at the first bucket (and for the first block, whose input needs no gradient, once more) and
    at the second bucket, where dynamo makes the sizes it took as constants dynamic; no bucket
    after that compiles again. Returns how many blocks."""
    blocks = sharding.of_classes(denoiser, family.compile_blocks)
    if not blocks:
        raise ValueError(
            f"train.compile: the {family.name} denoiser has none of its repeated blocks "
            f"({', '.join(family.compile_blocks)})"
        )
    log.info("train.compile: compiling %d %s blocks at their first steps", len(blocks), family.name)
    for block in blocks:
        block.compile()
    return len(blocks)


def _sharded(denoiser: nn.Module, *, family, source, device: torch.device, amp) -> None:
    """Shard a meta-device denoiser (its adapter in place) over the workers, computing in
    ``amp`` (None: float32), then give each worker its rows of the frozen and base weights,
    read one tensor at a time from the model's files (``part_tensors.tensors``); the adapter's get
    their values from ``Weights``."""
    from raytuner.families import part_tensors

    part = family.denoiser_part
    files = part_tensors.tensors(family, source, part, family.part_classes()[part])

    def base():
        for name, _ in denoiser.named_parameters():
            if ".lora_" in name:
                continue
            key = name.replace(".base_layer", "")
            if key not in files:
                raise ValueError(f"{source.pretrained}: its {part} has no tensor {key}")
            yield name, files[key]

    sharding.shard(denoiser, family, device, amp or torch.float32)
    sharding.materialize(denoiser, device, base())
