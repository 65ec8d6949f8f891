"""``scaling.strategy = "fsdp"``: the denoiser sharded over the training workers with FSDP2
(``torch.distributed.fsdp.fully_shard``). Each of the family's repeated blocks
(``blocks.shard``: transformer blocks, the UNets' down/mid/up blocks, and inside the UNets' each
resnet and transformer block: ``blocks.shard_inner``) is a unit of its own, the root holds the rest
(embeddings, final layers); every parameter of a unit, frozen or trained, is
split by rows over the workers (``Shard(0)``), and a unit's whole parameters exist only while it
runs (all-gathered before its forward and again for its backward, freed after).

Mixed precision: a unit gathers and computes in the compute dtype (``model.dtype``: bfloat16 on
GPUs), trained parameters keep their float32 master rows and their gradients are reduced
(reduce-scattered, averaged over the workers) in float32. A unit's inputs are not cast: it
sees what a replicated worker's block sees, and autocast casts at each matmul. A LoRA adapter
is sharded with its block like the frozen base weights it sits on: its few rows cost nothing to
gather, and it needs no collective of its own.

The model is built on the meta device, sharded, and only then given memory: each worker
allocates its rows alone and fills them one full tensor at a time (``materialize``), so no worker
ever holds the whole model, on the GPU or on the host.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

__all__ = [
    "fill",
    "gather",
    "is_sharded",
    "local",
    "materialize",
    "of_classes",
    "owned",
    "shard",
    "single_process_group",
    "units",
    "world",
]


def world() -> int:
    """The number of training workers (1 without a process group)."""
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def single_process_group(device: torch.device) -> None:
    """A process group of one, for sharding outside Ray Train (``raytuner bench step``)."""
    if not dist.is_initialized():
        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)


def of_classes(root: nn.Module, names: Iterable[str]) -> list[nn.Module]:
    """The modules under ``root`` (itself included) of any of the classes ``names`` (or of a
    subclass: a sharded block's class is FSDP's subclass of it), in ``root.modules()`` order."""
    names = set(names)
    return [m for m in root.modules() if names & {c.__name__ for c in type(m).__mro__}]


def units(denoiser: nn.Module, family) -> list[nn.Module]:
    """The denoiser's sharding units besides its root: every block of each of the family's
    ``blocks.shard`` lists (a single block counts as one), each preceded by the layers inside it
    that are units of their own (``blocks.shard_inner``; a unit is sharded after those nested
    in it). A mixture of experts trained in turn (``expert_modules``): each expert's blocks, in
    turn; the root holds every expert's other layers."""
    experts = getattr(denoiser, "expert_modules", None)
    out: list[nn.Module] = []
    for model in experts() if experts is not None else [denoiser]:
        for name in family.blocks.shard:
            part = getattr(model, name)
            for block in part if isinstance(part, nn.ModuleList) else [part]:
                out += [m for m in of_classes(block, family.blocks.shard_inner) if m is not block]
                out.append(block)
    return out


def owned(units: list[nn.Module]) -> list[list[nn.Parameter]]:
    """Each of ``units``' own parameters, those no unit nested in it holds: what it gathers
    (``units``' order: nested units come first)."""
    seen: set[int] = set()
    out = []
    for unit in units:
        own = [p for p in unit.parameters() if id(p) not in seen]
        seen |= {id(p) for p in own}
        out.append(own)
    return out


def is_sharded(tensor: torch.Tensor) -> bool:
    return isinstance(tensor, DTensor)


def shard(denoiser: nn.Module, family, device: torch.device, compute: torch.dtype) -> None:
    """Shard ``denoiser`` (on the meta device, or real) over every worker of the process group
    on ``device``: a unit per block and one at the root, gathered in ``compute`` (float32: no
    cast), gradients reduced in float32."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mesh = init_device_mesh(device.type, (world(),))
    # Inputs are not cast (cast_forward_inputs=False): a unit sees what a replicated worker's
    # block sees (float32 timesteps and rotary tables; autocast casts at each matmul). FSDP's cast
    # quantised the timestep to bfloat16 at the root, and torch < 2.12 skipped it when a
    # checkpointed block was recomputed: FLUX.2 [dev] failed its first backward on an H200
    # (torch 2.11, "Recomputed values ... have different metadata", pytorch#159359).
    policy = MixedPrecisionPolicy(
        param_dtype=None if compute == torch.float32 else compute,
        reduce_dtype=torch.float32,
        cast_forward_inputs=False,
    )
    for unit in units(denoiser, family):
        fully_shard(unit, mesh=mesh, mp_policy=policy)
    fully_shard(denoiser, mesh=mesh, mp_policy=policy)


def materialize(
    module: nn.Module,
    device: torch.device,
    tensors: Iterable[tuple[str, torch.Tensor]],
    computed: dict[str, torch.Tensor] | None = None,
) -> None:
    """Give a sharded module built on the meta device its memory on ``device``: each worker
    allocates its own rows, then ``tensors`` (parameter name, full tensor), one at a time, fill
    them (``fill``). Buffers keep the values they were built with; one built on meta (no
    values: Wan's rotary tables) takes its value from ``computed`` (by name)."""
    computed = computed or {}
    buffers = {
        name: computed[name] if b.is_meta and name in computed else b.detach().clone()
        for name, b in module.named_buffers()
    }
    if missing := [name for name, b in buffers.items() if b.is_meta]:
        raise ValueError(f"buffers built on the meta device with no value to take: {missing}")
    module.to_empty(device=device)
    with torch.no_grad():
        for name, b in module.named_buffers():
            b.copy_(buffers[name])
    for name, full in tensors:
        fill(module, {name: full})


@torch.no_grad()
def fill(module: nn.Module, tensors: dict[str, torch.Tensor]) -> None:
    """Set parameters of ``module`` from full tensors (any device, any dtype): a sharded one
    keeps its own rows of the tensor, a whole one takes all of it. Meta parameters stay meta
    (``raytuner plan``)."""
    for name, full in tensors.items():
        param = module.get_parameter(name)
        if param.is_meta:
            continue
        if tuple(full.shape) != tuple(param.shape):
            raise ValueError(f"{name}: a tensor of shape {tuple(full.shape)} for {param.shape}")
        if is_sharded(param):
            local = full.to(param.device, param.dtype)
            param.copy_(
                distribute_tensor(local, param.device_mesh, param.placements, src_data_rank=None)
            )
        else:
            param.copy_(full)


def local(tensor: torch.Tensor) -> torch.Tensor:
    """This worker's rows of a sharded tensor; an unsharded tensor as it is."""
    return tensor.to_local() if is_sharded(tensor) else tensor


def gather(tensor: torch.Tensor) -> torch.Tensor:
    """The whole tensor on every worker (a collective: every worker calls it, in the same order);
    an unsharded tensor as it is."""
    return tensor.full_tensor() if is_sharded(tensor) else tensor
