"""Counting the memory of code run on the meta device (``raytuner plan``): the peak of the bytes
its tensors hold, with attention traced as the fused kernel a GPU runs, and activation offload
as a trace sees it; repeated ops answered from memory (``MetaMemo``: a trace twice as fast)."""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from raytuner.train import float8_matmul


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
        inputs = {t.untyped_storage()._cdata for t in _tensors((args, kwargs))}
        for t in _tensors(out):
            if t.untyped_storage()._cdata not in inputs:
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


class MetaMemo(TorchDispatchMode):
    """Repeated meta ops answered from memory. On the meta device an op's outputs depend only
    on its inputs' shapes, strides and dtypes and its other arguments, and most of torch's meta
    kernels are Python: the bulk of a trace's time, spent again in each of a model's repeated
    blocks (Flux: 57) on the same shapes. A functional op (no argument or output aliased or
    written) of meta tensors and plain arguments, seen before with the same ones, gets new
    tensors of the outputs' shapes, strides and dtypes (``empty_strided``, as its kernel makes
    them) instead of its kernel. An output that is not a plain new tensor (an offset, a storage
    larger than the tensor, a storage shared or an input's) is never memorized."""

    def __init__(self, seen: dict) -> None:
        super().__init__()
        self.seen = seen  # key -> the outputs' shapes, strides and dtypes, or None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        key = _op_key(func, args, kwargs)
        if key is not None and (made := self.seen.get(key)) is not None:
            return _made(made)
        out = func(*args, **kwargs)
        if key is not None and key not in self.seen:
            if len(self.seen) >= MEMO_SIZE:
                self.seen.clear()
            self.seen[key] = _outputs(out, args, kwargs)
        return out


MEMO_SIZE = 50_000  # op signatures remembered (an SDXL step has about 3 500)
_SEEN: dict = {}  # shared by every trace of the process: a signature's outputs never change
_FUNCTIONAL: dict = {}  # op -> whether no argument or output is aliased or written
_PLAIN = (bool, int, float, str, torch.dtype, torch.device, torch.memory_format, torch.layout)


def _op_key(func, args, kwargs):
    """``func`` and its arguments as a key, or None when not memorizable."""
    functional = _FUNCTIONAL.get(func)
    if functional is None:
        schema = func._schema
        aliased = [a.alias_info for a in (*schema.arguments, *schema.returns)]
        functional = _FUNCTIONAL[func] = not any(aliased) and not schema.is_mutable
    if not functional:
        return None
    key = _arg_key((args, tuple(sorted(kwargs.items()))))
    return None if key is None else (func, key)


def _tensors(tree) -> list[torch.Tensor]:
    """The tensors in an op's arguments or outputs (tuples, lists and dicts of them, as torch's
    pytree finds them there) without pytree's generic node lookups: a trace's hottest loop
    (Wan's VAE: ~1 million calls, a quarter of its plan's time with pytree)."""
    found, stack = [], [tree]
    while stack:
        x = stack.pop()
        if isinstance(x, torch.Tensor):
            found.append(x)
        elif isinstance(x, tuple | list):
            stack.extend(x)
        elif isinstance(x, dict):
            stack.extend(x.values())
    return found


def _arg_key(a):
    if isinstance(a, torch.Tensor):
        if a.device.type != "meta":
            return None
        return (tuple(a.shape), a.stride(), a.dtype, a.storage_offset())
    if isinstance(a, list | tuple):
        keys = []
        for x in a:
            if (key := _arg_key(x)) is None:
                return None
            keys.append(key)
        return (type(a), tuple(keys))
    if a is None or isinstance(a, _PLAIN):
        return (type(a), a)
    return None  # a generator, a symbolic size, anything else: run the kernel


def _outputs(out, args, kwargs):
    """The outputs' shapes, strides and dtypes, or None when they are not plain new tensors."""
    inputs = {t.untyped_storage()._cdata for t in _tensors((args, kwargs))}
    outs, specs = (out if isinstance(out, tuple | list) else (out,)), []
    for t in outs:
        if t is None:
            specs.append(None)
            continue
        if not isinstance(t, torch.Tensor) or t.device.type != "meta" or t.storage_offset():
            return None
        storage = t.untyped_storage()
        if storage._cdata in inputs or storage.nbytes() != _plain_bytes(t):
            return None
        inputs.add(storage._cdata)
        specs.append((tuple(t.shape), t.stride(), t.dtype))
    return (type(out) if isinstance(out, tuple | list) else None, specs)


def _plain_bytes(t: torch.Tensor) -> int:
    """The bytes ``empty_strided`` gives a tensor of ``t``'s shape and strides."""
    if t.numel() == 0:
        return 0
    return (1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride(), strict=True))) * t.itemsize


def _made(made):
    kind, specs = made
    outs = [
        None if s is None else torch.empty_strided(s[0], s[1], dtype=s[2], device="meta")
        for s in specs
    ]
    return outs[0] if kind is None else kind(outs)


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
        with MetaMemo(_SEEN), live:  # the memo below the counter: it sees every output
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


def bytes_by_dtype(*modules) -> dict[str, int]:
    """What the modules hold, by dtype: parameters, buffers and the float8 copies of
    ``train.float8_matmul``'s linears."""
    out: dict[str, int] = {}
    for module in modules:
        for t in [*module.parameters(), *module.buffers(), *float8_matmul.copies(module)]:
            name = str(t.dtype).removeprefix("torch.")
            out[name] = out.get(name, 0) + t.numel() * t.element_size()
    return out
