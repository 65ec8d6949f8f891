"""Where an encoder actor's text encoder lives: whole on its GPU, its repeated layers split over
the actor's GPUs (``preprocess.gpus_per_actor`` > 1), or its layers in host memory streamed to
the GPU as they run (``preprocess.text_encoder_offload``). A 24 B text encoder (47 GB in
bfloat16) fits no 24 GB card whole.

``layout`` decides from sizes alone (the check and `raytuner plan` on the meta device, the actor
from its GPUs); ``place`` carries a decision out on a built encoder: forward hooks move a split
layer's inputs to its GPU and its outputs back to the first (so that every hidden state a family
stacks lies on one device), and an offloaded encoder's layers stream through the denoiser's own
``BlockStreamer``.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
from torch import nn

from raytuner.placement.stream import BlockStreamer

WHOLE, SPLIT, OFFLOAD = "whole", "split", "offload"
RING = 2  # offloaded layers resident or uploading at once


@dataclass(frozen=True)
class EncoderLayout:
    """A text encoder's placement: ``how`` (whole, split or offload), over ``gpus`` GPUs, each
    holding at most ``per_gpu_bytes``; ``assign``: the GPU of every repeated layer (split)."""

    how: str
    gpus: int
    per_gpu_bytes: int
    fits: bool
    assign: tuple[int, ...] = ()

    def describe(self) -> str:
        if self.how == SPLIT:
            return f"its layers split over {self.gpus} GPUs"
        if self.how == OFFLOAD:
            return "its layers in host memory, streamed to the GPU as they run"
        return "whole on one GPU"


def split_blocks(blocks: list[int], gpus: int, first: int = 0) -> list[int]:
    """The GPU of each of ``blocks`` (their bytes, in the order they run), contiguous and
    balanced over ``gpus`` GPUs; the first GPU also holds ``first`` bytes (the embeddings and
    whatever is not a repeated layer)."""
    target = (first + sum(blocks)) / gpus
    out, done = [], first
    for size in blocks:  # each layer on the GPU its middle byte falls in
        out.append(min(gpus - 1, int((done + size / 2) // target)))
        done += size
    return out


def layout(
    weights: int,
    blocks: list[int],
    activations: int,
    gpu_bytes: int,
    gpus: int = 1,
    offload: bool = False,
) -> EncoderLayout:
    """Where a text encoder of ``weights`` bytes, ``blocks`` of them its repeated layers,
    running a batch of ``activations`` bytes, goes on ``gpus`` GPUs of ``gpu_bytes`` each:
    offloaded when asked (its other weights, ``RING`` layers and the activations on the GPU);
    else whole when it fits one GPU; else split over the GPUs (each GPU its layers and the
    activations, the first also the rest)."""
    rest = weights - sum(blocks)
    if offload:
        need = rest + RING * max(blocks, default=0) + activations
        return EncoderLayout(OFFLOAD, 1, need, need <= gpu_bytes)
    whole = weights + activations
    if gpus <= 1 or whole <= gpu_bytes or not blocks:
        return EncoderLayout(WHOLE, 1, whole, whole <= gpu_bytes)
    assign = split_blocks(blocks, gpus, rest)
    loads = [rest if g == 0 else 0 for g in range(gpus)]
    for g, size in zip(assign, blocks, strict=True):
        loads[g] += size
    need = max(loads) + activations
    return EncoderLayout(SPLIT, len(set(assign) | {0}), need, need <= gpu_bytes, tuple(assign))


def repeated_blocks(module: nn.Module) -> list[nn.Module]:
    """A text encoder's repeated layers: its ``nn.ModuleList`` holding the most parameters
    (CLIP's and T5's encoder layers, a decoder-only LM's ``layers``)."""
    lists = [m for m in module.modules() if isinstance(m, nn.ModuleList) and len(m)]
    if not lists:
        return []
    best = max(lists, key=lambda m: sum(p.numel() for p in m.parameters()))
    return list(best)


def block_bytes(module: nn.Module) -> tuple[int, list[int]]:
    """A module's weight bytes, and those of each of its repeated layers."""
    def size(m: nn.Module) -> int:
        return sum(p.numel() * p.element_size() for p in m.parameters())

    return size(module), [size(b) for b in repeated_blocks(module)]


def _moved(value, device):
    """Every tensor in ``value`` (nested tuples, lists, dicts, model outputs) on ``device``."""
    if torch.is_tensor(value):
        return value.to(device)
    if isinstance(value, tuple) and hasattr(value, "_fields"):  # a named tuple
        return type(value)(*(_moved(v, device) for v in value))
    if isinstance(value, list | tuple):
        return type(value)(_moved(v, device) for v in value)
    if isinstance(value, dict):  # transformers' ModelOutput is an OrderedDict
        for k in list(value):
            value[k] = _moved(value[k], device)
        return value
    return value


def _inputs_to(device, module, args, kwargs):
    return _moved(args, device), _moved(kwargs, device)


def _outputs_to(device, module, args, output):
    return _moved(output, device)


def place(module: nn.Module, how: EncoderLayout, devices: list) -> list:
    """``module`` placed as ``how`` says on ``devices`` (the actor's GPUs, the first where its
    inputs go); returns what keeps it so (hooks, a streamer)."""
    first = torch.device(devices[0])
    blocks = repeated_blocks(module)
    if how.how == WHOLE or not blocks:
        module.to(first)
        return []
    inside = {id(p) for b in blocks for p in b.parameters()}
    for p in module.parameters():
        if id(p) not in inside:
            p.data = p.data.to(first)
    for m in module.modules():  # buffers (rotary frequencies, position ids) beside their use
        for name, b in m.named_buffers(recurse=False):
            m._buffers[name] = b.to(first)
    if how.how == OFFLOAD:
        for p in (p for b in blocks for p in b.parameters()):
            p.data = p.data.to("cpu")
        return [BlockStreamer(blocks, list(range(len(blocks))), first, RING)]
    kept = []
    for block, g in zip(blocks, how.assign, strict=True):
        device = torch.device(devices[g])
        block.to(device)
        if g:  # not on the first GPU: inputs over, outputs back
            pre = functools.partial(_inputs_to, device)
            kept.append(block.register_forward_pre_hook(pre, with_kwargs=True))
            kept.append(block.register_forward_hook(functools.partial(_outputs_to, first)))
    return kept
