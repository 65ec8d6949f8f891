"""Block swap: the frozen weights of some of the denoiser's blocks live in (pinned) CPU memory
and are uploaded to the compute device just before the block runs, in forward, in the
gradient-checkpointing recompute and so in backward, overlapped with compute on a side stream.

Upload only: a swapped block's frozen weights have one permanent host copy, packed into one
flat buffer so a block is one host-to-device copy; on the device it gets a fresh flat buffer
that its parameters are rebound to (``param.data``: the Parameter objects stay, so peft, the
optimizer and DDP's ignore list keep referring to them). Evicting a block rebinds its
parameters to an empty placeholder and frees the device buffer's storage, so anything that
touches a block that is not in place fails loudly (on the CPU as on a GPU) instead of reading
stale weights. At most ``ring`` swapped blocks are resident or in flight at once.

Nothing but :class:`Copier` touches streams or events; nothing but ``raytuner.placement`` builds
a :class:`BlockStreamer`.
"""

from __future__ import annotations

import collections
import functools

import torch
from torch import nn

ALIGN = 64  # byte alignment of each tensor inside a block's flat buffer


class Copier:
    """Host-to-device copies on a side stream (CUDA), or plain copies (CPU: the same steps)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.cuda = device.type == "cuda"
        self.stream = torch.cuda.Stream(device) if self.cuda else None

    def host(self, nbytes: int) -> torch.Tensor:
        """A host buffer the device copies from without staging (page-locked on CUDA)."""
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=self.cuda)

    def upload(self, host: torch.Tensor):
        """Start copying ``host`` to a new device buffer; returns (buffer, event)."""
        if not self.cuda:
            return host.clone(), None
        with torch.cuda.stream(self.stream):
            flat = torch.empty(host.numel(), dtype=torch.uint8, device=self.device)
            flat.copy_(host, non_blocking=True)
            event = torch.cuda.Event()
            event.record(self.stream)
        return flat, event

    def ready(self, flat: torch.Tensor, event) -> None:
        """Make the compute stream wait for an upload, and keep the buffer's memory from being
        reused before the compute stream is done with it."""
        if event is not None:
            current = torch.cuda.current_stream(self.device)
            current.wait_event(event)
            flat.record_stream(current)


class _Unit:
    """One swapped block: its frozen parameters, their host copy and their device placeholder."""

    def __init__(self, block: nn.Module, copier: Copier):
        self.params = [p for p in block.parameters() if not p.requires_grad]
        self.shapes = [(p.shape, p.dtype, p.numel() * p.element_size()) for p in self.params]
        self.offsets, total = [], 0
        for _, _, nbytes in self.shapes:
            self.offsets.append(total)
            total += -(-nbytes // ALIGN) * ALIGN
        self.nbytes = total
        self.host = copier.host(total)
        for p, view in zip(self.params, self._views(self.host), strict=True):
            view.copy_(p.data)
        empty = {p.dtype: torch.empty(0, dtype=p.dtype, device=copier.device) for p in self.params}
        self.placeholders = [empty[p.dtype] for p in self.params]
        self.flat = self.event = None

    def _views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        return [
            flat[o : o + nbytes].view(dtype).view(shape)
            for (shape, dtype, nbytes), o in zip(self.shapes, self.offsets, strict=True)
        ]

    def evict(self) -> None:
        for p, empty in zip(self.params, self.placeholders, strict=True):
            p.data = empty
        if self.flat is not None:
            self.flat.untyped_storage().resize_(0)  # any view still held now fails on use
        self.flat = self.event = None


class BlockStreamer:
    """Streams the frozen weights of ``blocks[i]`` for every i in ``swapped``; the other blocks
    are left where they are. Forward pre-hooks on every block keep the running block in place
    and the next swapped one (in the direction the pass travels: backward recomputes in
    reverse) uploading; the least recently used resident block makes room. ``group_of``: each
    block's model (an expert of a mixture: a pass runs one of them), looked ahead in alone;
    None: one model."""

    def __init__(
        self, blocks: list[nn.Module], swapped: list[int], device, ring: int = 2, group_of=None
    ):
        if not swapped:
            raise ValueError("no block to swap")
        self.blocks, self.ring = blocks, max(ring, 1)
        self.group_of = list(group_of) if group_of is not None else [0] * len(blocks)
        self.copier = Copier(torch.device(device))
        self.units = {i: _Unit(blocks[i], self.copier) for i in swapped}
        self.order = sorted(swapped)
        self.resident: collections.OrderedDict[int, None] = collections.OrderedDict()
        self.peak_resident = 0
        self.uploads = 0
        for unit in self.units.values():
            unit.evict()
        self.hooks = [
            block.register_forward_pre_hook(functools.partial(self._before, i))
            for i, block in enumerate(blocks)
        ]

    def _before(self, i: int, module, args) -> None:
        backward = torch._C._current_graph_task_id() != -1
        if i in self.units:
            self._bring(i)
        group = self.group_of[i]
        ahead = [
            j for j in self.order if self.group_of[j] == group and (j < i if backward else j > i)
        ]
        if ahead:
            self._prefetch(ahead[-1] if backward else ahead[0], keep=i)

    def _bring(self, i: int) -> None:
        """Block i in place for the compute stream (uploaded now if it was not on its way)."""
        self._prefetch(i, keep=i)
        unit = self.units[i]
        self.copier.ready(unit.flat, unit.event)
        unit.event = None
        for p, view in zip(unit.params, unit._views(unit.flat), strict=True):
            p.data = view
        self.resident.move_to_end(i)

    def _prefetch(self, j: int, keep: int) -> None:
        if j in self.resident:
            return
        while len(self.resident) >= self.ring:
            victim = next((k for k in self.resident if k != keep), None)
            if victim is None:
                return  # the ring holds only the running block: no room to look ahead
            self.units[victim].evict()
            del self.resident[victim]
        unit = self.units[j]
        unit.flat, unit.event = self.copier.upload(unit.host)
        self.uploads += 1
        self.resident[j] = None
        self.peak_resident = max(self.peak_resident, len(self.resident))

    def evict_all(self) -> None:
        """Every swapped block back to its host copy only (between passes that may not use it)."""
        for i in list(self.resident):
            self.units[i].evict()
            del self.resident[i]

    def remove(self) -> None:
        """Stop streaming: hooks off, every swapped block's weights bound to its host copy."""
        for hook in self.hooks:
            hook.remove()
        self.evict_all()
        for unit in self.units.values():
            for p, view in zip(unit.params, unit._views(unit.host), strict=True):
                p.data = view
