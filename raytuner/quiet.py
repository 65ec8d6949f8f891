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
import os
import re
import subprocess
import sys
import warnings
from contextlib import contextmanager, suppress

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
    # torchao, which raytuner does not use, imported by diffusers' quantizer module whenever it
    # is installed (by another tool in the same environment): its own CUDA kernel libraries,
    # which a CPU torch or another torch build cannot load (train.float8_matmul runs torch's
    # own _scaled_mm); its Enum registrations torch now calls deprecated; and diffusers' loader
    # of torchao-quantized checkpoints, which raytuner never loads
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
    # the end of each Ray Data stream that succeeded (a failed one says so, and stays), and of
    # the preprocess's write: raytuner's own line says what the stream did, in its words
    # (its start, "Starting execution" and "Execution plan", is off: ``runtime.connect``)
    (
        "ray.data._internal.execution.streaming_executor",
        "\u2714\ufe0f +Dataset \\S+ execution finished in ",
    ),
    ("ray.data.dataset", r"Data sink \w+ finished\. \d+ rows and \S+ data written\."),
)


# (category, what the message starts with) of Python warnings (``warnings.warn``, not logging):
# why each says nothing to a raytuner user
WARNINGS: tuple[tuple[type[Warning], str], ...] = (
    # scaling.strategy = "fsdp": diffusers' Flux blocks return views of their concatenated
    # output, which FSDP2 flags in case an in-place op follows; none does, in diffusers' forward
    # or in raytuner's losses (tests/train/test_fsdp.py: sharded training equals unsharded)
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


# where Ray has no state API (a local Ray started without its dashboard, ``runtime.connect``),
# and state tracking was turned on all the same (RAY_TRAIN_ENABLE_STATE_TRACKING=1 in the
# environment; raytuner leaves it off there, ``runtime.has_state_api``): Ray Train's state
# actor every 30 s, with a 60-line traceback. (Ray Train's PlacementGroupCleaner, which asked
# that API every second, is not started there: ``trainer._create_default_callbacks``.)
WITHOUT_STATE_API: tuple[tuple[str, str], ...] = (
    (
        "ray.train.v2._internal.state.state_actor",
        r"State API unavailable when checking if actor is alive\.",
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
def no_loading_bars():
    """Around diffusers' ``load_lora_weights`` of a LoRA with text-encoder keys: transformers
    draws a "Loading weights" progress bar for each text encoder it puts the LoRA into (one
    per render and text encoder, each done in milliseconds). Only transformers' bars, and only
    inside the block."""
    from transformers.utils import logging as transformers_logging

    was = transformers_logging.is_progress_bar_enabled()
    transformers_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was:
            transformers_logging.enable_progress_bar()


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


# Lines that Ray's C++ code writes straight to a process's stderr, where no logging filter
# reaches them (the driver's own, and its actors' as the driver prints them), matched anywhere
# in the line: why each says nothing to a raytuner user
STDERR_LINES: tuple[str, ...] = (
    # Ray's core worker, creating an actor that may restart and whose constructor arguments
    # lie in the object store: Ray Data's encoder pool (the map function is passed by
    # reference) and Ray Train's PreemptionWatcher. Ray Data and Ray Train hold those
    # references as long as the actors live, so the restart it warns of cannot fail so
    r" E \d+ \d+\] core_worker\.cc:\d+: Actor with class name: "
    r"'(MapWorker\(MapBatches\(Encoder\)\)|PreemptionWatcher)' and ID: '[0-9a-f]+' has "
    r"constructor arguments in the object store and max_restarts > 0\.",
)

FILTERS: set[int] = set()  # the filter processes running (``runtime.kill_started_processes``)

# the filter process: stdin's lines to stdout, but those matching a pattern (argv); a partial
# line waits 0.1 s for its end; signals are left to the process it filters for (Ctrl-C and
# `ray job stop` reach both), it ends when that process's stderr closes
_FILTER = r"""
import os, re, select, signal, sys
signal.signal(signal.SIGINT, signal.SIG_IGN)
signal.signal(signal.SIGTERM, signal.SIG_IGN)
drop = re.compile(b"|".join(a.encode() for a in sys.argv[1:]))
pending = b""
while True:
    if pending and not select.select([0], [], [], 0.1)[0]:
        os.write(1, pending)
        pending = b""
    chunk = os.read(0, 65536)
    lines = (pending + chunk).split(b"\n")
    pending = lines.pop()
    out = b"".join(line + b"\n" for line in lines if not drop.search(line))
    if out:
        os.write(1, out)
    if not chunk:
        os.write(1, pending)
        break
"""


@contextmanager
def stderr_filtered(patterns: tuple[str, ...] = STDERR_LINES):
    """Within the block, this process's stderr (file descriptor 2, what it writes and what its
    child processes inherit) passes through a small filter process that drops the lines
    matching ``patterns`` (``STDERR_LINES``) and writes every other line on, at once and in
    order, to the stderr the process had; after the block stderr is that again, every line
    written in it passed on. Where no filter process can start, stderr stays as it is."""
    try:
        sys.stderr.flush()
        saved = os.dup(2)
        process = subprocess.Popen(
            [sys.executable, "-I", "-S", "-c", _FILTER, *patterns],
            stdin=subprocess.PIPE,
            stdout=saved,
        )
    except OSError as e:
        logging.getLogger("raytuner").debug("stderr not filtered: %s", e)
        yield
        return
    os.dup2(process.stdin.fileno(), 2)
    process.stdin.close()
    FILTERS.add(process.pid)
    try:
        yield
    finally:
        sys.stderr.flush()
        os.dup2(saved, 2)  # the filter's input closes: it writes what is left and ends
        os.close(saved)
        with suppress(subprocess.TimeoutExpired):  # a child process holds the old stderr yet
            process.wait(timeout=10)
