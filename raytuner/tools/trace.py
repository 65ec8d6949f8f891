"""Counting the memory of code run on the meta device (``raytuner plan``): the peak of the bytes
its tensors hold, with attention traced as the fused kernel a GPU runs, and activation offload
as a trace sees it."""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


class LiveBytes(TorchDispatchMode):
    """The peak of the bytes held by tensors created while active (each storage counted once,
    until it is freed)."""

    def __init__(self) -> None:
        super().__init__()
        self.now = self.peak = 0
        self._sizes: dict[int, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        # a view of an input (a weight's transpose, a reshape) holds no new memory
        inputs = {
            t.untyped_storage()._cdata
            for t in tree_leaves((args, kwargs))
            if isinstance(t, torch.Tensor)
        }
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.untyped_storage()._cdata not in inputs:
                self._track(t.untyped_storage())
        return out

    def _track(self, storage) -> None:
        key = storage._cdata
        if key in self._sizes:
            return
        self._sizes[key] = storage.nbytes()
        self.now += self._sizes[key]
        self.peak = max(self.peak, self.now)
        weakref.finalize(storage, self._free, key)

    def _free(self, key: int) -> None:
        self.now -= self._sizes.pop(key, 0)


def _fused_attention(*args, **kwargs):
    names = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale")
    given = dict(zip(names, args, strict=False)) | kwargs
    q, k, v = given.pop("query"), given.pop("key"), given.pop("value")
    return _fused(q, k, v, **given)


def _fused(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, **kw):
    if kw.get("enable_gqa") and k.shape[-3] != q.shape[-3]:
        k = k.repeat_interleave(q.shape[-3] // k.shape[-3], -3)
        v = v.repeat_interleave(q.shape[-3] // v.shape[-3], -3)
    if attn_mask is not None and attn_mask.dtype != torch.bool:
        attn_mask = attn_mask.to(q.dtype)
    op = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    return op(q, k, v, dropout_p, is_causal, attn_mask=attn_mask, scale=scale)[0]


@contextlib.contextmanager
def traced() -> Iterator[LiveBytes]:
    """Count the bytes of what runs inside, with ``scaled_dot_product_attention`` traced as a
    fused kernel: on meta tensors torch would otherwise trace the math fallback, which keeps the
    whole score matrix for backward. (Patched on the module, not through a torch-function mode:
    gradient checkpointing recomputes the forward in backward, outside any such mode.)"""
    live, original = LiveBytes(), F.scaled_dot_product_attention
    F.scaled_dot_product_attention = _fused_attention
    try:
        with live:
            yield live
    finally:
        F.scaled_dot_product_attention = original


@contextlib.contextmanager
def offloaded(on: bool) -> Iterator[None]:
    """``memory.activation_offload`` in a trace: a tensor saved outside the checkpointed blocks
    leaves the device until backward unpacks it (a new device tensor, counted from then)."""
    if not on:
        yield
        return

    def pack(t):
        return (t.shape, t.dtype, t.device)

    def unpack(saved):
        return torch.empty(saved[0], dtype=saved[1], device=saved[2])

    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        yield
