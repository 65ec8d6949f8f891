"""Rules between a job's sections, checked when the job is loaded (``JobConfig``): what block
swap, activation offload and float8 need of training; what a text-encoder LoRA needs of
training; a prior-loss weight only beside regularization images; a run name that is one folder
name; the folders raytuner writes never nested with the image folders it reads."""

from __future__ import annotations

import os
import posixpath
from urllib.parse import urlsplit

from raytuner.config.loader import ConfigError


def _sharded(strategy: str) -> bool:
    """Whether the job names the sharded strategy (``"auto"`` shards only what can be)."""
    from raytuner.placement.strategy import Strategy  # here: the package imports torch

    return bool((pinned := Strategy.pinned(strategy)) and pinned.sharded)


def memory_needs(memory, train, model) -> None:
    """What block swap, activation offload and float8 weights require of the other sections
    (the family's side is checked where the family is known: ``jobcheck.model.blocks_to_swap``)."""
    if memory.blocks_to_swap and train.mode != "lora":
        raise ConfigError(
            f"memory.blocks_to_swap = {memory.blocks_to_swap} streams frozen weights: it needs "
            'train.mode = "lora" (a full fine-tune trains every block; use blocks_to_swap = 0)'
        )
    for key, on in (
        ("blocks_to_swap", memory.blocks_to_swap),
        ("activation_offload", memory.activation_offload),
    ):
        if on and not train.gradient_checkpointing:
            raise ConfigError(
                f"memory.{key} = {getattr(memory, key)} needs train.gradient_checkpointing = "
                "true (a block's weights and inputs are needed again only when it is recomputed)"
            )
    if model.dtype == "float8" and train.mode != "lora":
        raise ConfigError(
            'model.dtype = "float8" stores frozen weights: it needs train.mode = "lora" '
            '(a full fine-tune trains in model.trainable_dtype; use "bfloat16" or "auto")'
        )


def gpu_needs(train, scaling, model=None, memory=None) -> None:
    """Settings that choose a GPU kernel: refused for CPU workers, which have none of them;
    float8 matrix products refused beside what they were not made for."""
    if train.attention != "auto" and not scaling.use_gpu:
        raise ConfigError(
            f'train.attention = "{train.attention}" picks a GPU attention kernel, but '
            'scaling.use_gpu = false: CPU workers run torch\'s own; set train.attention = '
            '"auto" or scaling.use_gpu = true'
        )
    if not train.float8_matmul:
        return
    fix = "set train.float8_matmul = false"
    clashes = [
        (not scaling.use_gpu, "scaling.use_gpu = false: CPU workers have no FP8 tensor cores"),
        (model is not None and model.dtype == "float8",
         'model.dtype = "float8": the weights are stored in float8 already'),
        (memory is not None and memory.blocks_to_swap > 0,
         "memory.blocks_to_swap: streamed blocks' weights are untried with the float8 casts"),
        (_sharded(scaling.strategy),
         'scaling.strategy = "fsdp": sharded weights are untried with the float8 casts'),
        (train.mode != "lora", 'train.mode = "full": only frozen base weights multiply in float8'),
    ]  # fmt: skip
    for clash, why in clashes:
        if clash:
            raise ConfigError(f"train.float8_matmul = true with {why}; {fix}")


def text_encoder_needs(lora, train, scaling, memory) -> None:
    """What ``lora.text_encoder`` (a LoRA on the text encoders, trained beside the denoiser's)
    cannot be combined with; the family's side is checked where the family is known
    (``jobcheck.lora.text_encoder``)."""
    if not lora.text_encoder:
        return
    fix = "set lora.text_encoder = false"
    if train.mode != "lora":
        raise ConfigError(
            f'lora.text_encoder = true with train.mode = "{train.mode}": the text encoders\' '
            'LoRA trains beside a denoiser LoRA; use train.mode = "lora" or ' + fix
        )
    if _sharded(scaling.strategy):
        raise ConfigError(
            f'lora.text_encoder = true with scaling.strategy = "{scaling.strategy}": the text '
            "encoders are replicated on every worker (their gradients averaged once a step), "
            'not sharded; use scaling.strategy = "ddp" (allowed with it) or ' + fix
        )
    if memory.blocks_to_swap:
        raise ConfigError(
            f"lora.text_encoder = true with memory.blocks_to_swap = {memory.blocks_to_swap}: "
            "block swap is for the transformer families, whose text encoders raytuner does not "
            f"train; set memory.blocks_to_swap = 0 or {fix}"
        )


def module_dropout_needs(lora, scaling) -> None:
    """``lora.module_dropout`` skips modules at random on each worker, so a step's gradients
    reach other parameters on each: DDP finds them (``find_unused_parameters``), a sharded
    reduce-scatter cannot take gradients that differ in kind between the workers."""
    # "auto" never shards it (tools/plan/auto.py)
    if lora.module_dropout and _sharded(scaling.strategy):
        raise ConfigError(
            f'lora.module_dropout = {lora.module_dropout} with scaling.strategy = '
            f'"{scaling.strategy}": each worker skips other modules, whose rows then get a '
            'gradient on some workers only; use scaling.strategy = "ddp" or lora.rank_dropout'
        )


def regularization(data, train) -> None:
    """``train.prior_loss_weight`` weights the regularization images' loss: set away from 1
    without a regularization source, it would change nothing."""
    if train.prior_loss_weight != 1.0 and not any(s.regularization for s in data.sources):
        raise ConfigError(
            f"train.prior_loss_weight = {train.prior_loss_weight} weights the loss of "
            "regularization images, and no [[data.sources]] has regularization = true: add "
            "one (kohya's reg folders: repeats_from_folder = true) or remove the key"
        )


def run_name(name: str) -> None:
    """``train.name`` names the run's folder under ``train.output``: one plain folder name."""
    problem = ""
    if not name.strip():
        problem = "is empty"
    elif any(bad in name for bad in ("/", "\\", "..")):
        problem = "contains '/', '\\' or '..' (it would leave the run's folder)"
    elif name.startswith("."):
        problem = "starts with '.' (a hidden folder)"
    if problem:
        raise ConfigError(
            f"train.name = {name!r} {problem}: it names the run's folder under train.output; "
            "use one plain folder name such as 'my-lora' (the job file's name when unset)"
        )


def _location(path: str) -> tuple[str, str, tuple[str, ...]]:
    """Where a path or URI points, comparable by path components: (scheme, bucket or host,
    components). Local paths and ``file://`` URIs become absolute normalised local paths."""
    if "://" in path:
        parts = urlsplit(path)
        if parts.scheme.lower() != "file":
            names = posixpath.normpath("/" + parts.path).split("/")
            return parts.scheme.lower(), parts.netloc, tuple(n for n in names if n)
        path = parts.path
    names = os.path.abspath(os.path.expanduser(path)).split(os.sep)
    return "file", "", tuple(n for n in names if n)


def _inside(inner: str, outer: str) -> bool:
    """Whether ``inner`` is ``outer`` or below it (whole path components: /data/images is not
    inside /data/img)."""
    (scheme, host, names), (o_scheme, o_host, o_names) = _location(inner), _location(outer)
    return (scheme, host) == (o_scheme, o_host) and names[: len(o_names)] == o_names


def paths_apart(data, train) -> None:
    """The folders raytuner writes (cache, runs) and the image folders it reads never nest:
    preprocess would list what raytuner wrote there (validation PNGs, exports) as images, and
    ``cache gc`` or a new run could delete or overwrite images."""
    written = {"data.cache": data.cache, "train.output": train.output}
    for key, value in written.items():
        if not value.strip():
            raise ConfigError(f'{key} is empty: set a folder or URI (e.g. {key} = "runs")')
    sources = [("data.images", data.images)] if data.images else []
    sources += [(f"data.sources[{i}].path", s.path) for i, s in enumerate(data.sources)]
    for key, value in sources:
        if not value.strip():
            raise ConfigError(f"{key} is empty: set the image folder (a local path or a URI)")
        for w_key, w_value in written.items():
            if _inside(w_value, value):
                nesting = f"{w_key} = {w_value!r} is inside the image folder {key} = {value!r}"
            elif _inside(value, w_value):
                nesting = f"the image folder {key} = {value!r} is inside {w_key} = {w_value!r}"
            else:
                continue
            raise ConfigError(
                f"{nesting}: preprocess would read what raytuner writes as training images; "
                f"move {w_key} outside every image folder (e.g. to a sibling folder)"
            )
