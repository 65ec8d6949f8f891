"""Where every tensor of a run lives: the one module that moves models, optimizer state and input
batches between devices. Training, checkpoint restore, ``raytuner sample``, the validation actor
and DDP all place through it; no other code calls ``.to(device)`` on a model.

A denoiser's plan (``memory`` section): its trainable weights, buffers and the frozen weights of
the blocks that stay are on the compute device; the frozen weights of the last
``memory.blocks_to_swap`` blocks (the family's ``blocks.swap`` lists, in the order they run)
live in pinned host memory and stream in (:mod:`raytuner.placement.stream`). Optimizer state
sits next to its parameter. DDP never sees a frozen parameter.
"""

from __future__ import annotations

import contextlib
import weakref

import torch
from torch import nn

from raytuner.placement.stream import BlockStreamer

__all__ = [
    "DenoiserPlacement",
    "PlacementError",
    "activations",
    "batch",
    "block_groups",
    "blocks",
    "check",
    "inputs",
    "last_of_each",
    "load_device",
    "memory_format",
    "move",
    "place_pipeline",
    "unplace_pipeline",
]


class PlacementError(RuntimeError):
    """A tensor found somewhere other than its planned device."""


def move(module: nn.Module, device) -> nn.Module:
    """A whole part (encoder, VAE, pipeline component) onto ``device``."""
    return module.to(device)


def inputs(tensor: torch.Tensor, device, dtype=None) -> torch.Tensor:
    """An encoder's input batch on its device, in its weights' dtype."""
    return tensor.to(device, dtype)


def batch(tensors: dict[str, torch.Tensor], device) -> dict[str, torch.Tensor]:
    """A training batch on the compute device (asynchronously from pinned host memory), its
    floating-point tensors made float32 there (the feed reads them in the cache's dtype)."""
    moved = {k: v.to(device, non_blocking=True) for k, v in tensors.items()}
    return {k: v.float() if v.is_floating_point() else v for k, v in moved.items()}


def load_device(device: torch.device, memory, float8: bool = False) -> torch.device:
    """Where the denoiser is built before it is placed: the host when some of it will stream
    or be stored in float8 (a 24 GB bfloat16 transformer never has to fit the GPU whole), else
    the compute device."""
    return torch.device("cpu") if memory.blocks_to_swap or float8 else device


def memory_format(
    denoiser: nn.Module, family, device, wanted: bool = True, sharded: bool = False
) -> None:
    """The UNets' convolutions in channels-last format on GPUs (the family's
    ``channels_last``, unless ``train.channels_last = false``): cuDNN's NHWC kernels under
    bfloat16, no layout change around each convolution. An unsharded model only (a sharded one
    keeps its rows as they are)."""
    cuda = torch.device(device).type == "cuda"
    if wanted and family.blocks.channels_last and cuda and not sharded:
        denoiser.to(memory_format=torch.channels_last)


def block_groups(denoiser: nn.Module, family) -> list[list[nn.Module]]:
    """The swappable blocks of each model the denoiser runs, each in the order they run (the
    family's ``blocks.swap``): one list, or one an expert of a mixture trained in turn
    (``expert_modules``), in turn."""
    experts = getattr(denoiser, "expert_modules", None)
    models = experts() if experts is not None else [denoiser]
    return [[block for name in family.blocks.swap for block in getattr(m, name)] for m in models]


def blocks(denoiser: nn.Module, family) -> list[nn.Module]:
    """The denoiser's swappable blocks in the order they run (``block_groups``, one after the
    other)."""
    return [block for group in block_groups(denoiser, family) for block in group]


def last_of_each(sizes: list[int], n: int) -> list[int]:
    """The indices, in the groups of ``sizes`` laid one after the other, of each group's last
    ``n`` blocks: what ``memory.blocks_to_swap = n`` streams (of every expert of a mixture)."""
    out, start = [], 0
    for size in sizes:
        out += list(range(start + size - n, start + size)) if n else []
        start += size
    return out


class DenoiserPlacement:
    """Places a (peft-wrapped) denoiser for training or sampling on ``device`` and keeps it so:
    ``swapped`` block indices stream, everything else is resident."""

    def __init__(self, denoiser: nn.Module, family, device, blocks_to_swap: int = 0, ring=2):
        self.denoiser, self.device = denoiser, torch.device(device)
        groups = block_groups(denoiser, family) if blocks_to_swap else []
        self.blocks = [block for group in groups for block in group]
        sizes = [len(group) for group in groups]
        if blocks_to_swap >= max(min(sizes, default=0), 1):
            raise PlacementError(
                f"memory.blocks_to_swap = {blocks_to_swap}: the denoiser has "
                f"{min(sizes, default=0)} swappable blocks; swap at most "
                f"{min(sizes, default=0) - 1}"
            )
        # the last blocks_to_swap of each (of every expert of a mixture)
        self.swapped = last_of_each(sizes, blocks_to_swap)
        streamed = self._streamed_ids()
        for p in denoiser.parameters():
            if id(p) not in streamed and p.device != self.device:
                p.data = p.data.to(self.device)
        for module in denoiser.modules():
            for name, b in module.named_buffers(recurse=False):
                if b.device != self.device:
                    module._buffers[name] = b.to(self.device)
        self.streamer = None
        if self.swapped:
            group_of = [g for g, size in enumerate(sizes) for _ in range(size)]
            self.streamer = BlockStreamer(self.blocks, self.swapped, self.device, ring, group_of)

    def average(self, ema) -> None:
        """An EMA of the trained weights (``diffusers``' EMAModel) beside them."""
        if ema is not None:
            ema.to(device=self.device)

    def _streamed_ids(self) -> set[int]:
        return {
            id(p) for i in self.swapped for p in self.blocks[i].parameters() if not p.requires_grad
        }

    def frozen_names(self) -> list[str]:
        return [n for n, p in self.denoiser.named_parameters() if not p.requires_grad]

    def check(self, optimizer: torch.optim.Optimizer | None = None) -> None:
        """Every parameter and buffer on its planned device (a streamed block: its empty
        placeholder or its uploaded weights, both on the device; its host copy in host memory),
        and every optimizer state tensor beside its parameter; else PlacementError naming them."""
        wrong = [
            f"{name} on {t.device}"
            for name, t in [*self.denoiser.named_parameters(), *self.denoiser.named_buffers()]
            if t.device != self.device
        ]
        if self.streamer is not None:
            wrong += [
                f"host copy of block {i} on {unit.host.device}"
                for i, unit in self.streamer.units.items()
                if unit.host.device.type != "cpu"
            ]
        for group in optimizer.param_groups if optimizer else []:
            for p in group["params"]:
                for key, v in optimizer.state.get(p, {}).items():
                    if torch.is_tensor(v) and v.numel() > 1 and v.device != p.device:
                        wrong.append(f"optimizer state {key!r} on {v.device}, not {p.device}")
        if wrong:
            raise PlacementError(f"{len(wrong)} tensors off their planned device: {wrong[:5]}")

    def resident_frozen_bytes(self) -> int:
        """Bytes of frozen weights on the device now (streamed placeholders hold none)."""
        return sum(
            p.numel() * p.element_size()
            for p in self.denoiser.parameters()
            if not p.requires_grad and p.device == self.device
        )

    def distributed(self, prepare):
        """The denoiser wrapped for data parallel training by ``prepare`` (Ray Train's
        ``prepare_model``): frozen parameters are on DDP's ignore list (no broadcast of frozen
        weights at start, no bucket for them, streamed ones may be on either side), gradients
        are views of DDP's buckets, and the model is not moved again. A
        sharded denoiser is distributed already (``strategy.Strategy.wrap``)."""
        from torch.nn.parallel import DistributedDataParallel

        DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(
            self.denoiser, self.frozen_names()
        )
        # gradients written into DDP's buckets (no second copy of them). Not static_graph: a
        # rank accumulates as many micro-batches as its slice holds (an uneven last batch, a
        # padded bucket), and a static graph's reducer fails on a rank whose count differs
        # (tests/train/test_train_exact.py, test_fsdp.py's skewed job)
        options = {"gradient_as_bucket_view": True}
        # lora.module_dropout: unused adapters in a step; experts trained in turn
        # (model.expert = "both"): the idle expert's adapter. A parameter no rank used keeps
        # no gradient (DDP leaves it as it is), so the optimizer skips it
        idle = getattr(self.denoiser, "leaves_parameters_unused", False)
        if idle or _skips_modules(self.denoiser):
            options["find_unused_parameters"] = True
        return prepare(self.denoiser, move_to_device=False, parallel_strategy_kwargs=options)

    def release(self) -> None:
        """Stop streaming: every swapped block's frozen weights bound to their host copy (to
        load other weights into the model; place it again afterwards)."""
        if self.streamer is not None:
            self.streamer.remove()
            self.streamer = None


def _skips_modules(module) -> bool:
    """Whether an adapter layer of ``module`` skips its update at random in training (peft's
    LoKr / LoHa ``module_dropout``): those steps leave its parameters without a gradient."""
    return any(
        any(p > 0 for p in getattr(m, "module_dropout", {}).values())
        for m in module.modules()
        if isinstance(getattr(m, "module_dropout", None), dict)
    )


@contextlib.contextmanager
def activations(offload: bool, device: torch.device):
    """``memory.activation_offload``: tensors saved for backward outside the checkpointed blocks'
    recompute (each block's inputs, which gradient checkpointing keeps) wait in pinned host
    memory until backward needs them."""
    if not offload:
        yield
        return
    with torch.autograd.graph.save_on_cpu(pin_memory=device.type == "cuda"):
        yield


_PIPELINES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def place_pipeline(pipe, family, device, blocks_to_swap: int = 0) -> None:
    """A sampling pipeline on ``device``; with ``blocks_to_swap``, its denoiser streams the same
    blocks as training does (the other components are placed whole)."""
    unplace_pipeline(pipe)
    denoiser = getattr(pipe, family.parts.denoiser)
    if not (blocks_to_swap and family.blocks.swap):
        pipe.to(device)
        return
    for part in pipe.components.values():
        if isinstance(part, nn.Module) and part is not denoiser:
            move(part, device)
    _PIPELINES[pipe] = DenoiserPlacement(denoiser, family, device, blocks_to_swap)


def unplace_pipeline(pipe) -> None:
    """Undo ``place_pipeline``'s streaming before other weights are loaded into ``pipe``."""
    placement = _PIPELINES.pop(pipe, None)
    if placement is not None:
        placement.release()
