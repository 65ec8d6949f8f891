"""What a run trains, kept: the trained tensors of the denoiser (a peft LoRA adapter,
``train.mode = "lora"``, with ``lora.text_encoder`` one on the text encoders too:
``train/text_lora.py``; or the whole denoiser, ``"full"``) for checkpoints, their exponential
moving average (``diffusers.training_utils.EMAModel``) and a LoRA's export (a full fine-tune's
is written from its checkpoint: ``checkpoint/full_model.py``). ``model.py`` builds them."""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator

import torch
from peft.utils import get_peft_model_state_dict, set_peft_model_state_dict
from torch import nn

from raytuner.checkpoint.layout import LORA_DIR
from raytuner.families import mixture
from raytuner.lora import export, kinds, lycoris
from raytuner.placement import sharding


def _cpu(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.detach().cpu().contiguous() for k, v in state.items()}


class Weights:
    """The denoiser's trained weights (made by ``model.adapt``): their tensors for a checkpoint,
    their EMA, their export.

    Sharded (``scaling.strategy = "fsdp"``), every tensor here is a worker's rows of it (a
    DTensor): ``tensors``/``ema_tensors`` give them to a sharded checkpoint as they are, and
    ``gathered`` assembles them whole, a tensor at a time, on every worker (the LoRA export)."""

    def __init__(
        self,
        denoiser: nn.Module,
        *,
        mode: str,
        names: list[str],
        params: list[torch.Tensor],
        text=None,
        ema=None,
        sharded: bool = False,
        provenance: dict | None = None,
    ):
        """``names``/``params``: the trained parameters (the denoiser's, then the text
        encoders' LoRA's: ``text``, a ``text_lora.TextLora``); ``ema``: their EMA (diffusers'
        EMAModel) or None; ``sharded``: each tensor is this worker's rows; ``provenance``: what
        the LoRA files say of where training started (``lora.init_from``)."""
        self.denoiser, self.mode, self.text = denoiser, mode, text
        self.names, self.params, self.ema = names, params, ema
        self.sharded = sharded  # every tensor here is this worker's rows (``strategy.SHARDED``)
        self.provenance = {"ss_training_started_at": str(time.time())} | (provenance or {})

    def local_bytes(self) -> int:
        """Bytes of the trained tensors this worker holds (a sharded run: its rows)."""
        return sum(sharding.local(p).nbytes for p in self.params)

    def _peft_names(self) -> dict[str, str]:
        """The adapter's peft state names (``get_peft_model_state_dict``'s) -> parameter names."""
        return {kinds.peft_name(n): n for n in self.names}

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
        dora = self.dora_scales(state)
        if directory is None:
            return
        root, config = os.path.join(directory, LORA_DIR), self.denoiser.peft_config["default"]
        if family.turns:  # every expert of a mixture: each its own LoRA in lora/<expert>/
            self._export_experts(root, state, family, meta | self.provenance, dora)
            return
        export.write_lora(
            root,
            state,
            family=family,
            adapter_config=config.to_dict(),
            meta=meta | self.provenance,
            denoiser=self.denoiser,
            text_encoders=self.text.split(state) if self.text is not None else (),
            dora_scale=dora,
        )

    def _export_experts(self, root: str, state: dict, family, meta: dict, dora: dict) -> None:
        """Each expert's LoRA (its tensors of ``state`` and DoRA scales of ``dora``, without
        its part's prefix) into ``<root>/<expert>/``, the files a run of that expert alone
        writes into ``<root>/``, their ``raytuner.expert`` its name."""
        config = self.denoiser.peft_config["default"].to_dict()
        experts = mixture.experts_of(self.denoiser)
        for expert, (part, module) in zip(family.turns, experts, strict=True):
            export.write_lora(
                os.path.join(root, expert.name),
                mixture.split_state(state, part),
                family=family.with_expert(expert.name),
                adapter_config=config,
                meta=meta | {"raytuner.expert": expert.name},
                denoiser=module,
                dora_scale=mixture.split_state(dora, part),
            )

    def dora_scales(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The DoRA modules' ComfyUI scales (``lycoris.dora_scales``) of the exported ``state``,
        each base weight gathered whole in turn (a collective when sharded: every worker)."""
        layers = kinds.dora_layers(self.denoiser)
        if not layers:
            return {}
        config = self.denoiser.peft_config["default"]

        def weight_of(module: str) -> torch.Tensor:
            return sharding.gather(layers[module].get_base_layer().weight).detach().cpu()

        return lycoris.dora_scales(state, weight_of, config.lora_alpha / config.r)
