"""``lora.text_encoder``: a LoRA on each of the family's text encoders (SD1.5's CLIP-L, SDXL's
CLIP-L and OpenCLIP bigG: the family's ``adapters.text_encoders``), trained with the denoiser's.

The cache's text tensors cannot train an encoder: the worker encodes every caption again at
every step. The feed hands the step each row's token ids (``tokens``, in its background thread;
a dropped caption is the empty one, encoded by the trained encoders like any other), and the
step turns them into the text tensors the family's loss reads (``encode``, under autocast and
with gradients), in place of the cached ones. The encoders' frozen weights are in
``model.dtype`` on the worker's device, their LoRA in ``model.trainable_dtype``.

The denoiser is DDP-wrapped; the text encoders are not: once a step, after the last
micro-batch, ``average_gradients`` averages their LoRA's gradients over the workers (one
all-reduce, DDP's mean), so any number of workers trains the same update. The parameters join
the denoiser's in ``train.weights.Weights`` (under their part's name: ``text_encoder.…``,
``text_encoder_2.…``), so clipping, the optimizer (a param group of their own learning rate),
the LR schedule, the EMA, checkpoints and the export take them with the rest.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from raytuner.families.text import TOKENS


def _checkpointing(encoder: nn.Module) -> None:
    """Gradient checkpointing of a transformers text encoder, non-reentrant (its input, token
    ids, needs no gradient: the reentrant kind would give the LoRA none)."""
    kwargs = {"use_reentrant": False}
    if hasattr(encoder, "activation_checkpointing_enable"):  # transformers 5
        encoder.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        encoder.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


def draw(names: list[str], params: list[torch.Tensor], seed: int, rank: int) -> dict:
    """peft's "gaussian" start (down ~ N(0, 1/rank), up 0), drawn on the CPU from ``seed`` in
    the adapter's order: the same values on any device and any rank."""
    generator = torch.Generator().manual_seed(seed)
    return {
        n: torch.randn(p.shape, generator=generator) / rank
        if ".lora_A." in n
        else torch.zeros(p.shape)
        for n, p in zip(names, params, strict=True)
    }


class TextLora:
    """The LoRA on a family's text encoders: its parameters (``names``, ``params``), the token
    ids of captions (``tokens``), the text tensors of a batch (``encode``), its state and its
    export."""

    def __init__(self, encoder, family, lora, *, dtype: torch.dtype, seed: int, checkpointing):
        """``encoder``: the family's text encoders (``Family.text_encoder``, a
        ``TrainableTextEncoder``) on the worker's device; ``lora``: the job's [lora] section;
        ``dtype``: the LoRA's (``model.trainable_dtype``); ``seed``: its initial draw."""
        from peft import LoraConfig as PeftLoraConfig
        from peft import inject_adapter_in_model

        self.encoder, self.specs = encoder, family.adapters.text_encoders
        self.lr = lora.text_encoder_lr  # 0: train.learning_rate
        targets = list(lora.text_encoder_target_modules or family.adapters.text_encoder_targets)
        self.names, self.params = [], []
        self._trained: list[bool] | None = None  # which get a gradient (average_gradients)
        for spec, module in zip(self.specs, encoder.encoders, strict=True):
            config = PeftLoraConfig(
                r=lora.text_rank,
                lora_alpha=lora.text_alpha,
                lora_dropout=lora.dropout,
                init_lora_weights="gaussian",
                target_modules=targets,
            )
            inject_adapter_in_model(config, module)
            module.train()  # LoRA dropout (CLIP has none of its own)
            if checkpointing:
                _checkpointing(module)
            for name, p in module.named_parameters():
                if ".lora_" in name:
                    p.data = p.data.to(dtype)
                    self.names.append(f"{spec.part}.{name}")
                    self.params.append(p.requires_grad_(True))
        if self.params and self.params[0].device.type != "meta":
            # a stream of its own: the denoiser's LoRA draws the same values with or without it
            values = draw(self.names, self.params, seed + 1, lora.text_rank)
            with torch.no_grad():
                for name, p in zip(self.names, self.params, strict=True):
                    p.copy_(values[name])

    @property
    def outputs(self) -> tuple[str, ...]:
        """The text tensors the step computes (the cache's are not read for them)."""
        return self.encoder.outputs

    @property
    def modules(self) -> list[nn.Module]:
        return list(self.encoder.encoders)

    def parts(self) -> tuple[str, ...]:
        """The key prefixes of its tensors (``text_encoder.``, ``text_encoder_2.``)."""
        return tuple(f"{spec.part}." for spec in self.specs)

    def start(self) -> list[tuple]:
        """(its ``TextEncoderLora``, the encoder) of each text encoder: what ``lora.init_from``
        reads a file's text-encoder LoRA into."""
        return list(zip(self.specs, self.modules, strict=True))

    def tokens(self, captions: list[str]) -> dict[str, torch.Tensor]:
        """The captions' token ids on the host ([B, length] int64 per tokenizer): what the
        feed adds to a batch instead of the cached text tensors."""
        return self.encoder.tokens(captions, "cpu")

    def encode(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The batch with its token ids replaced by the text tensors the trained encoders make
        of them (with gradients): what the family's loss reads."""
        tokens = {k: v for k, v in batch.items() if k in TOKENS}
        rest = {k: v for k, v in batch.items() if k not in tokens}
        return rest | self.encoder.embed(tokens)

    def example(self, batch: dict[str, torch.Tensor], device) -> dict[str, torch.Tensor]:
        """A family's example batch (``Family.example_batch``) as the feed hands it to a step
        that trains the text encoders: token ids of a caption of average length in place of the
        text tensors (``raytuner plan`` traces it on the meta device, ``bench step`` trains)."""
        n = len(batch["latent"])
        tokens = self.tokens(["a caption of average length for a photograph"] * n)
        rest = {k: v for k, v in batch.items() if k not in self.outputs}
        return rest | {k: v.to(device) for k, v in tokens.items()}

    def state(self) -> dict[str, torch.Tensor]:
        """Its tensors on the CPU under their checkpoint names (``<part>.<peft name>``)."""
        from peft.utils import get_peft_model_state_dict

        out = {}
        for spec, module in zip(self.specs, self.modules, strict=True):
            state = get_peft_model_state_dict(module)
            out |= {f"{spec.part}.{k}": v.detach().cpu().contiguous() for k, v in state.items()}
        return out

    def load(self, state: dict[str, torch.Tensor]) -> None:
        """``state`` (checkpoint names, ``state``'s) into the adapters."""
        from peft.utils import set_peft_model_state_dict

        for spec, module in zip(self.specs, self.modules, strict=True):
            prefix = f"{spec.part}."
            mine = {k[len(prefix) :]: v for k, v in state.items() if k.startswith(prefix)}
            set_peft_model_state_dict(module, mine)

    def split(self, state: dict[str, torch.Tensor]) -> list[tuple]:
        """``state``'s tensors of each text encoder, taken out of it: (its ``TextEncoderLora``,
        its peft state by the model's module names, its adapter config) for the export."""
        out = []
        for spec, module in zip(self.specs, self.modules, strict=True):
            prefix = f"{spec.part}."
            mine = {k[len(prefix) :]: state.pop(k) for k in list(state) if k.startswith(prefix)}
            out.append((spec, mine, module.peft_config["default"].to_dict()))
        return out

    def average_gradients(self) -> None:
        """Average the LoRA's gradients over the workers (sum / world, as DDP does for the
        denoiser's): one all-reduce of every gradient. A parameter no worker has a gradient for
        (SDXL's CLIP-L last layer: its output is not used) keeps none, as on a single worker, so
        the optimizer leaves it alone; which those are is worked out once, on the first step
        (an all-reduce of whether each worker has one, read on the host), not at every step."""
        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
            return
        if self._trained is None:
            flags = torch.tensor([p.grad is not None for p in self.params], dtype=torch.float32)
            flags = flags.to(self.params[0].device)
            dist.all_reduce(flags)
            self._trained = [bool(f) for f in flags.tolist()]
        grads = [
            p.grad.reshape(-1) if p.grad is not None else p.new_zeros(p.numel())
            for p, trained in zip(self.params, self._trained, strict=True)
            if trained
        ]
        if not grads:
            return
        flat = torch.cat(grads)
        dist.all_reduce(flat)
        flat /= dist.get_world_size()
        mine = [p for p, trained in zip(self.params, self._trained, strict=True) if trained]
        for p, grad in zip(mine, flat.split([p.numel() for p in mine]), strict=True):
            p.grad = grad.view_as(p).clone()


def build(family, source, device: torch.device, lora, train, dtype: torch.dtype) -> TextLora:
    """The family's text encoders on ``device`` (frozen weights in ``source.dtype``;
    on the meta device, the architecture alone: ``raytuner plan``) with their LoRA in
    ``dtype``, gradient checkpointing as the denoiser's (``train.gradient_checkpointing``)."""
    weights = device.type != "meta"
    encoder = family.text_encoder(source, str(device), weights=weights)
    return TextLora(
        encoder,
        family,
        lora,
        dtype=dtype,
        seed=train.seed,
        checkpointing=train.gradient_checkpointing,
    )
