"""The few warnings raytuner's libraries print that tell a raytuner user nothing, dropped by the
name of the logger that prints them and the start of their message: never a whole library, never
by level, so every other warning and error of Ray, diffusers, transformers and raytuner shows.

``install()`` runs when anything imports ``raytuner`` (``raytuner/__init__.py``): in the driver,
and in every Ray worker and actor, which import raytuner to run its code before they load a
model (and in every worker of the job, through Ray's ``worker_process_setup_hook``,
``runtime.setup_worker``). A logger's filters see the records made by that logger; these loggers
are made here if the library has not been imported yet, and the library takes the same object.

What could be fixed where it came from was: Ray Train's PlacementGroupCleaner found several Ray
instances on the machine because none of the job's workers knew its own cluster
(``runtime.setup_worker`` tells them). The rest cannot be avoided by raytuner: peft imports
bitsandbytes whenever it is installed (it is, for ``train.optimizer = "adamw8bit"``), diffusers
imports peft and its pipeline modules the image processors, and Ray 2.60 has no
non-deprecated way to bound an actor pool's restarts (``ray_remote_args_accepted``)."""

from __future__ import annotations

import logging
import re
import warnings
from contextlib import contextmanager

# (logger, what its message starts with): why each says nothing to a raytuner user
DROPPED: tuple[tuple[str, str], ...] = (
    # printed when bitsandbytes is imported (peft imports it, diffusers imports peft) on a CPU
    # with AVX512-BF16: its optional 4-bit CPU kernel comes from the `kernels` package and the
    # Hub; raytuner uses no 4-bit layer (adamw8bit's optimizer does not need the kernel)
    (
        "bitsandbytes.backends.cpu.ops",
        r"Failed to load CPU gemm_4bit_forward from kernels-community",
    ),
    # diffusers' pipeline modules import CLIPImageProcessor / SiglipImageProcessor (for safety
    # checkers and IP adapters raytuner never runs); transformers 5 then falls back to the PIL
    # class, which is the class they were before 5. torchvision cannot be installed beside a
    # CPU torch (docs: the CUDA build breaks `import diffusers`)
    (
        "transformers.utils.import_utils",
        r"`\w+ImageProcessor` requires torchvision \(not installed\); falling back to `\w+Pil`",
    ),
    # `load_lora_weights` of a LoRA on the denoiser alone (every LoRA raytuner trains) looks
    # for text-encoder keys too, and says, once per text encoder and load, that there are none.
    # A LoRA with no key for the denoiser is still reported (diffusers.loaders.peft).
    (
        "diffusers.loaders.lora_base",
        r"No LoRA keys associated to \w+ found with the prefix='text_encoder(_\d+)?'",
    ),
    # torchao (the fp8 extra: train.float8_matmul), imported by diffusers' quantizer module
    # whenever it is installed: its own CUDA kernel libraries, which a CPU torch or another
    # torch build cannot load (the float8 matrix products raytuner runs are torch's own
    # _scaled_mm, not these); its Enum registrations torch now calls deprecated; and diffusers'
    # loader of torchao-quantized checkpoints, which raytuner never loads
    ("torchao", r"Failed to load \S+\.so: Could not load this library"),
    ("torchao.kernel.intmm", r"Warning: Detected no triton"),  # its int8 kernels: unused
    ("torch.utils._pytree", r"<enum '\w+'> is an Enum subclass and is now natively supported"),
    (
        "diffusers.quantizers.torchao.torchao_quantizer",
        r"Unable to import `torchao` Tensor objects",
    ),
    # Ray Data's answer to raytuner's own setting (``runtime.connect``): its per-operator bars
    # flood a job's log, raytuner prints one progress line instead (preprocess/progress.py)
    ("ray.data._internal.progress", r"Progress bars disabled\. To enable, set"),
)


# (category, what the message starts with) of Python warnings (``warnings.warn``, not logging):
# why each says nothing to a raytuner user
WARNINGS: tuple[tuple[type[Warning], str], ...] = (
    # scaling.strategy = "fsdp": diffusers' Flux blocks return views of their concatenated
    # output, which FSDP2 flags in case an in-place op follows; none does, in diffusers' forward
    # or in raytuner's losses (tests/test_fsdp.py: sharded training equals unsharded)
    (UserWarning, r"FSDP2-wrapped module \(\w+\) returned a view tensor"),
    # train.compile: diffusers' gradient checkpointing asks is_torch_version (an lru_cache'd
    # pure function of the installed version) inside the compiled blocks
    (UserWarning, r"Dynamo detected a call to a `functools\.lru_cache`-wrapped function"),
    # exports and renders read a sharded checkpoint in one process on purpose (no_dist=True)
    (UserWarning, r"torch\.distributed is disabled, unavailable or uninitialized, assuming"),
)


class Drop(logging.Filter):
    """Drops the records of its logger whose message starts with ``pattern`` (a regex)."""

    def __init__(self, pattern: str) -> None:
        super().__init__()
        self.pattern = re.compile(pattern)

    def filter(self, record: logging.LogRecord) -> bool:
        return self.pattern.match(record.getMessage()) is None


# where Ray has no state API (a local Ray started without its dashboard, ``runtime.connect``):
# Ray Train's PlacementGroupCleaner asks it every second whether the run's controller lives,
# cannot know, keeps the run's placement group and says so each time
WITHOUT_STATE_API: tuple[tuple[str, str], ...] = (
    (
        "ray.train.v2._internal.execution.controller.placement_group_cleaner",
        r"Failed to query Ray Train Controller actor state\. State API may be temporarily",
    ),
)


def install(no_state_api: bool = False) -> None:
    """Add the filters of ``DROPPED`` (and of ``WITHOUT_STATE_API`` in the workers of a Ray
    that has no state API), once per logger and pattern, and ignore ``WARNINGS``."""
    for name, pattern in DROPPED + (WITHOUT_STATE_API if no_state_api else ()):
        logger = logging.getLogger(name)
        if not any(getattr(f, "pattern", None) == re.compile(pattern) for f in logger.filters):
            logger.addFilter(Drop(pattern))
    for category, message in WARNINGS:
        warnings.filterwarnings("ignore", message=message, category=category)


@contextmanager
def ray_remote_args_accepted():
    """Around a Ray Data ``map_batches`` that passes ``max_restarts`` / ``max_task_retries``:
    Ray 2.60 deprecated every option passed as ``**ray_remote_args`` (removal: Ray 2.64) but
    gave these two no named parameter, and without them an actor pool restarts a dying actor
    without end. Only that deprecation, and only inside the block."""
    from ray.util.annotations import RayDeprecationWarning

    with warnings.catch_warnings():
        warnings.filterwarnings(
            "ignore", message=r"`ray_remote_args` is deprecated", category=RayDeprecationWarning
        )
        yield
