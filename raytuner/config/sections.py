"""The training-side sections of a job: one frozen keyword-only dataclass per component, each
checking its own values (the input sections, [model] [data] [preprocess], are in
``config/inputs.py``; the objective's in ``config/objective.py``)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from raytuner.config.loader import ConfigError, one_of
from raytuner.config.ranges import RESOURCE_STEP, SEED_MAX, ranged
from raytuner.config.sizes import parse_size

OPTIMIZERS = ("adamw", "adamw8bit", "adafactor", "prodigy")
ATTENTION = ("auto", "flash", "efficient", "cudnn", "math")  # train.attention
STRATEGIES = ("auto", "ddp", "fsdp")
LR_SCHEDULERS = ("constant", "linear", "cosine", "cosine_with_restarts", "polynomial")
SAVE_DTYPES = ("float16", "bfloat16", "float32")  # lora.save_dtype
# lora.kind: a LoRA (peft's LoraConfig), LyCORIS' Kronecker (LoKr) or Hadamard (LoHa) adapter
ADAPTER_KINDS = ("lora", "lokr", "loha")
# the [lora] keys of one adapter kind, refused for the others (kind -> keys)
KIND_KEYS = {
    "lora": ("dora", "dropout"),
    "lokr": ("factor", "decompose_both", "rank_dropout", "module_dropout"),
    "loha": ("rank_dropout", "module_dropout"),
}
# the [lora] keys of the text encoders' LoRA, read only with lora.text_encoder = true
TEXT_ENCODER_KEYS = (
    "text_encoder_rank",
    "text_encoder_alpha",
    "text_encoder_lr",
    "text_encoder_target_modules",
)
DEFAULT_STEPS = 100  # train.max_steps when neither it nor train.epochs is set
# lora.rank: above the width of every family's attention layers (Flux, Sana: 3072; a LoRA's
# rank beyond its layer's width adds nothing)
MAX_RANK = 4096
MAX_LR = 10.0  # train.learning_rate: Prodigy's multiplier is about 1, AdamW's rates far below
MAX_RENDER_STEPS = 1000  # validation.steps, a prompt line's --s: sd-scripts clamps to 1..1000
MAX_SIDE = 8192  # validation.width/height, preprocess.resolution: pixels
MAX_GUIDANCE = 100.0  # validation.guidance_scale
MAX_FRAMES = 1025  # validation.frames, a prompt line's --f: data.frames' bound
MAX_FPS = 240.0  # validation.fps: data.fps' bound
RESOURCE_HINT = f"Ray counts resources in steps of {RESOURCE_STEP}"
GPU_HINT = "a worker or actor computes on one GPU; a fraction shares it"


def steps_hint(other: str) -> str:
    """train.max_steps' and train.epochs': 0 leaves the run's length to the other."""
    return f"0 unsets it for train.{other}; leave both out for {DEFAULT_STEPS} steps"


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    """The optimisation run."""

    output: str
    name: str = ""  # run name; "" means the job file's stem
    # optimizer steps; 0: DEFAULT_STEPS, unless epochs is set
    max_steps: int = ranged(0, 1, zero="unset", zero_needs="epochs", hint=steps_hint("epochs"))
    # instead of max_steps: epochs of the global schedule (steps set at train)
    epochs: int = ranged(0, 1, zero="unset", zero_needs="max_steps", hint=steps_hint("max_steps"))
    global_batch_size: int = ranged(4, 1)
    learning_rate: float = ranged(1e-4, 0, MAX_LR, low_open=True)
    weight_decay: float = ranged(1e-2, 0, 1)
    warmup_steps: int = ranged(0, 0)
    # 0: no clipping (sd-scripts' and SimpleTuner's meaning)
    max_grad_norm: float = ranged(1.0, 0, low_open=True, zero="no clipping")
    seed: int = ranged(0, 0, SEED_MAX)
    remainder: str = "drop"
    # 0: a rank's whole slice in one pass; else gradient accumulation
    micro_batch_size: int = ranged(0, 1, zero="a rank's whole slice at once")
    prefetch: int = ranged(2, 1, 64)  # batches a worker assembles ahead of the step
    log_every: int = ranged(10, 1)
    sample_log: bool = False  # write the cache rows of every step under <run>/samples/
    mode: str = "lora"  # lora: a peft adapter on the denoiser; full: the whole denoiser
    # share of samples trained with the empty caption
    caption_dropout: float = ranged(0.0, 0, 1, high_open=True)
    # the loss weight of regularization images (kohya's)
    prior_loss_weight: float = ranged(
        1.0, 0, low_open=True, hint="0 would train them for nothing: leave their source out"
    )
    # > 0: keep an EMA of the trained weights; exports use it
    ema_decay: float = ranged(0.0, 0, 1, high_open=True)
    gradient_checkpointing: bool = False
    # torch.compile each of the denoiser's repeated blocks (the family's blocks.compile) once;
    # "auto": on GPU workers, for the families whose compiled blocks were measured faster
    compile: bool | str = "auto"
    # the UNets' convolutions in channels-last memory format on GPUs (false: as stored, NCHW)
    channels_last: bool = True
    # the scaled-dot-product attention kernel on GPUs: auto (torch's choice, cuDNN's left out)
    # | flash | efficient (memory-efficient) | cudnn | math
    attention: str = "auto"
    # the frozen base linears of a transformer family's blocks multiply in float8 (torch's
    # _scaled_mm) on GPUs with FP8 tensor cores; the LoRA stays in the compute dtype
    float8_matmul: bool = False
    mixed_precision: str = "bf16"  # bf16 autocast on GPU workers; "no": float32
    tensorboard: bool = True  # event files under <run>/tensorboard (local outputs)
    optimizer: str = "adamw"  # adamw | adamw8bit (bitsandbytes) | adafactor | prodigy
    lr_scheduler: str = "constant"  # after train.warmup_steps: constant | linear | cosine | ...
    lr_cycles: int = ranged(1, 1)  # cosine_with_restarts: how many restarts
    lr_power: float = ranged(1.0, 0, low_open=True)  # polynomial: the decay's power

    def __post_init__(self) -> None:
        if self.max_steps and self.epochs:
            raise ConfigError(
                f"train.max_steps = {self.max_steps} and train.epochs = {self.epochs}: set one of "
                "them (train.epochs trains that many epochs of the global schedule)"
            )
        if not self.epochs and not self.max_steps:  # neither set: the default length
            object.__setattr__(self, "max_steps", DEFAULT_STEPS)
        one_of("train.optimizer", self.optimizer, OPTIMIZERS)
        one_of("train.lr_scheduler", self.lr_scheduler, LR_SCHEDULERS)
        one_of("train.remainder", self.remainder, ("drop", "pad"))
        one_of("train.mode", self.mode, ("lora", "full"))
        one_of("train.mixed_precision", self.mixed_precision, ("bf16", "no"))
        one_of("train.attention", self.attention, ATTENTION)
        if isinstance(self.compile, str) and self.compile != "auto":
            raise ConfigError(f"train.compile = {self.compile!r}: must be true, false or \"auto\"")

    def for_epochs(self, steps_per_epoch: int) -> TrainConfig:
        """With ``train.epochs`` set: the same section with ``max_steps`` = epochs x
        ``steps_per_epoch`` (the global batches of an epoch, known once the cache is read)."""
        return dataclasses.replace(self, max_steps=self.epochs * steps_per_epoch, epochs=0)

    def warmup_warning(self) -> str:
        """A warning when the warm-up does not end before the run does (``train.warmup_steps``
        >= ``train.max_steps``): the learning rate never reaches ``train.learning_rate``. ""
        when it does, or while the steps are not known yet (``train.epochs``: ``for_epochs``).
        Not refused: a short test run may mean it."""
        if not self.max_steps or self.warmup_steps < self.max_steps:
            return ""
        return (
            f"train.warmup_steps = {self.warmup_steps} is not below train.max_steps = "
            f"{self.max_steps}: the learning rate is still warming up when the run ends and "
            "never reaches train.learning_rate. Set train.warmup_steps below train.max_steps "
            f"(e.g. {self.max_steps // 10}, a tenth of them) or raise train.max_steps"
        )


@dataclass(frozen=True, kw_only=True)
class LoraConfig:
    """LoRA adapter on the denoiser (and with ``text_encoder``, on the text encoders)."""

    # the adapter: "lora" (B @ A), "lokr" (LyCORIS' Kronecker product w1 (x) w2), "loha"
    # (LyCORIS' Hadamard product of two low-rank products), each through peft
    kind: str = "lora"
    # DoRA (kind "lora"): each output row's magnitude trained apart from its direction
    dora: bool = False
    rank: int = ranged(16, 1, MAX_RANK)
    alpha: float = ranged(
        16.0, 0, 4 * MAX_RANK, low_open=True,
        hint="sd-scripts reads alpha 0 as alpha = rank: write that value",
    )  # fmt: skip
    dropout: float = ranged(0.0, 0, 1, high_open=True)
    # LoKr: the Kronecker factorization's factor (LyCORIS' --network_args factor): each side of a
    # layer split as factor x side / factor where factor divides it; 0: near-square (LyCORIS' -1)
    factor: int = ranged(0, 1, MAX_RANK, zero="near-square factors (LyCORIS' factor = -1)")
    decompose_both: bool = False  # LoKr: w1 (the small factor) low-rank too, as w2 may be
    # LoKr/LoHa: each step drops this share of the adapter's output rows (LyCORIS' rank_dropout)
    rank_dropout: float = ranged(0.0, 0, 1, high_open=True)
    # LoKr/LoHa: each step skips each adapted module with this probability (module_dropout)
    module_dropout: float = ranged(0.0, 0, 1, high_open=True)
    target_modules: list[str] = field(default_factory=list)  # empty: the family's default
    init_from: str = ""  # a LoRA file (diffusers or kohya keys) training starts from
    # the dtype of the exported LoRA files (training keeps model.trainable_dtype); float16: what
    # sd-scripts' users save (--save_precision fp16) and every UI loads, Apple's MPS included
    save_dtype: str = "float16"
    # a LoRA on every text encoder of the family too (kohya's default for SD1.5 and SDXL): the
    # captions are then encoded in the worker at every step, not read from the cache
    text_encoder: bool = False
    text_encoder_rank: int = ranged(0, 1, MAX_RANK, zero="lora.rank")
    text_encoder_alpha: float = ranged(0.0, 0, 4 * MAX_RANK, low_open=True, zero="lora.alpha")
    # kohya's --text_encoder_lr
    text_encoder_lr: float = ranged(0.0, 0, MAX_LR, low_open=True, zero="train.learning_rate")
    # peft target modules on the text encoders; empty: the family's (CLIP's q/k/v/out_proj)
    text_encoder_target_modules: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        one_of("lora.save_dtype", self.save_dtype, SAVE_DTYPES)
        one_of("lora.kind", self.kind, ADAPTER_KINDS)
        self._kind_keys()
        for key in TEXT_ENCODER_KEYS:
            value = getattr(self, key)
            if value and not self.text_encoder:
                raise ConfigError(
                    f"lora.{key} = {value!r} is read only when the text encoders are trained, "
                    "and lora.text_encoder = false: set lora.text_encoder = true, or remove "
                    f"lora.{key}"
                )

    def _kind_keys(self) -> None:
        """A key of another adapter kind than ``kind`` is refused (peft has no such option
        for it), as is a text encoders' LoRA beside a LyCORIS adapter or DoRA."""
        for kind, keys in KIND_KEYS.items():
            if kind == self.kind:
                continue
            for key in keys:
                value = getattr(self, key)
                if value and key not in KIND_KEYS[self.kind]:
                    able = [k for k, ks in KIND_KEYS.items() if key in ks]
                    raise ConfigError(
                        f"lora.{key} = {value!r} is an option of lora.kind = "
                        f"{' or '.join(map(repr, able))} (peft has none for {self.kind!r}): "
                        f"remove lora.{key}{_kind_hint(key)}"
                    )
        if self.text_encoder and (self.kind != "lora" or self.dora):
            what = "lora.dora = true" if self.dora else f"lora.kind = {self.kind!r}"
            raise ConfigError(
                f"lora.text_encoder = true with {what}: the text encoders' adapter is a plain "
                "LoRA (as sd-scripts trains it) and raytuner trains it only beside one; set "
                f'lora.text_encoder = false, or lora.kind = "lora" and lora.dora = false'
            )

    def without_text_encoder(self) -> LoraConfig:
        """The same adapter on the denoiser alone (every text-encoder key at its default)."""
        return dataclasses.replace(
            self, text_encoder=False, **{k: type(getattr(self, k))() for k in TEXT_ENCODER_KEYS}
        )

    @property
    def text_rank(self) -> int:
        """The text encoders' LoRA rank (``text_encoder_rank``, else ``rank``)."""
        return self.text_encoder_rank or self.rank

    @property
    def text_alpha(self) -> float:
        """The text encoders' LoRA alpha (``text_encoder_alpha``, else ``alpha``)."""
        return self.text_encoder_alpha or self.alpha


def _kind_hint(key: str) -> str:
    """What a user of another kind's key may mean instead."""
    if key == "dropout":
        return " (LoKr and LoHa drop rows or modules: lora.rank_dropout, lora.module_dropout)"
    if key in ("rank_dropout", "module_dropout"):
        return " (a LoRA drops its input: lora.dropout)"
    return ""


@dataclass(frozen=True, kw_only=True)
class MemoryConfig:
    """Where a training worker keeps what does not fit its GPU (``raytuner plan`` sizes it)."""

    # the denoiser's last N blocks keep their frozen weights in pinned CPU memory and stream to
    # the GPU just before they run (LoRA, transformer families, gradient checkpointing)
    blocks_to_swap: int = ranged(0, 0)  # at most the family's blocks - 1 (jobcheck)
    # streamed blocks resident at once (the one running + the next)
    swap_ring: int = ranged(2, 1)
    activation_offload: bool = False  # the checkpointed blocks' inputs wait in pinned CPU memory


@dataclass(frozen=True, kw_only=True)
class ScalingConfig:
    """Training world: an int, or [min, max] for elastic training."""

    workers: int | list[int] = ranged(1, 1)
    # ddp: every worker holds the whole denoiser (replicated); fsdp: its weights, gradients,
    # optimizer state and EMA are sharded over the workers (FSDP2), a block gathered as it runs;
    # auto: ddp while a replica fits a worker's memory, else fsdp over the fewest workers that
    # fit (tools/plan/auto.py), decided before any worker loads weights
    strategy: str = "auto"
    # the memory a worker has ("80GiB", "24GB"), which auto and `check` size the job on; "": the
    # GPU a worker gets, asked of the cluster as training starts (CPU workers: none, auto -> ddp)
    worker_memory: str = ""
    use_gpu: bool = False
    cpus_per_worker: float = ranged(1.0, RESOURCE_STEP, hint=RESOURCE_HINT)
    # a worker computes on one GPU: a fraction shares one
    gpus_per_worker: float = ranged(0.0, RESOURCE_STEP, 1, zero="one GPU a worker", hint=GPU_HINT)
    # how often a running elastic group may resize
    elastic_resize_interval_s: float = ranged(60.0, 0)
    # the GPU's dense bfloat16 peak in TFLOP/s for MFU; 0: from the device's name (a table),
    # unknown where it is not listed
    peak_tflops: float = ranged(0.0, 0)
    # how long training waits for its workers' resources
    resource_wait_s: float = ranged(600.0, 0)

    def __post_init__(self) -> None:
        bounds = self.workers if isinstance(self.workers, list) else [self.workers]
        if len(bounds) not in (1, 2) or bounds != sorted(bounds):
            raise ConfigError(
                f"scaling.workers = {self.workers}: use an int >= 1 or [min, max] with min <= max"
            )
        one_of("scaling.strategy", self.strategy, STRATEGIES)
        if self.worker_memory:
            parse_size(self.worker_memory, "scaling.worker_memory =")
        if self.gpus_per_worker > 0 and not self.use_gpu:
            raise ConfigError(
                f"scaling.gpus_per_worker = {self.gpus_per_worker} with scaling.use_gpu = false: "
                "CPU workers reserve no GPU; set use_gpu = true to train on GPUs, or "
                "gpus_per_worker = 0"
            )

    @property
    def memory_bytes(self) -> int | None:
        """``worker_memory`` in bytes; None when it is left to the GPU a worker gets."""
        return parse_size(self.worker_memory) if self.worker_memory else None

    @property
    def max_workers(self) -> int:
        return self.workers[-1] if isinstance(self.workers, list) else self.workers

    @property
    def min_workers(self) -> int:
        return self.workers[0] if isinstance(self.workers, list) else self.workers


@dataclass(frozen=True, kw_only=True)
class ValidationConfig:
    """Images rendered from checkpoints while training runs, by a Ray actor beside the workers."""

    # 0: no validation; else a checkpoint and a render every N steps
    every_steps: int = ranged(0, 1, zero="no validation")
    prompts: list[str] = field(default_factory=list)
    seeds: list[int] = ranged([0], 0, SEED_MAX)
    # denoising steps per image; 0: the model's default (20; a distilled model's few steps)
    steps: int = ranged(0, 1, MAX_RENDER_STEPS, zero="the model's default")
    # pixels, multiples of the family's pixel grid (jobcheck); 0: the job's resolution
    width: int = ranged(0, 8, MAX_SIDE, zero="the job's resolution")
    height: int = ranged(0, 8, MAX_SIDE, zero="the job's resolution")
    prompts_file: str = ""  # one prompt per line, kohya style: "a cat --w 512 --s 20 --n ugly"
    negative_prompt: str = ""
    # classifier-free guidance; 0: the family's default (a distilled model's: none)
    guidance_scale: float = ranged(0.0, 0, MAX_GUIDANCE, low_open=True, zero="the family's default")
    # video families: the frames of each clip (the family's frame rule, Wan: 4n + 1, is
    # jobcheck's; image families render one); 0: the largest data.frames bucket
    frames: int = ranged(0, 1, MAX_FRAMES, zero="the largest data.frames bucket")
    fps: float = ranged(16.0, 0, MAX_FPS, low_open=True)  # a clip's frame rate (Wan's: 16)
    # render as a step- and guidance-distilled model (Z-Image Turbo, Flux.2 [klein]): its few
    # steps, no classifier-free guidance. auto: when the pipeline's config says is_distilled or
    # model.pretrained is a distilled release the family names; yes / no: as said
    distilled: str = "auto"
    # resources the validation actor reserves (0: none, it shares)
    cpus: float = ranged(0.0, RESOURCE_STEP, zero="none", hint=RESOURCE_HINT)
    gpus: float = ranged(0.0, RESOURCE_STEP, 1, zero="none", hint=GPU_HINT)

    def __post_init__(self) -> None:
        one_of("validation.distilled", self.distilled, ("auto", "yes", "no"))
        if self.every_steps and not ((self.prompts or self.prompts_file) and self.seeds):
            raise ConfigError(
                "validation.every_steps > 0 needs validation.prompts (or prompts_file) and seeds"
            )


@dataclass(frozen=True, kw_only=True)
class TrackingConfig:
    """Experiment trackers rank 0 reports to besides TensorBoard (``train.tensorboard``)."""

    wandb: bool = False  # Weights & Biases: scalars, validation grids, the job as run config
    wandb_project: str = "raytuner"
    wandb_entity: str = ""  # "": the logged-in user's default
    wandb_mode: str = "online"  # online | offline (runs saved locally; `wandb sync` later)

    def __post_init__(self) -> None:
        one_of("tracking.wandb_mode", self.wandb_mode, ("online", "offline"))


@dataclass(frozen=True, kw_only=True)
class CheckpointConfig:
    """Checkpoints through ray.train.report."""

    every_steps: int = ranged(50, 1)
    keep: int = ranged(2, 1)
    max_failures: int = ranged(0, 0)
    resume: bool = True
    # steps between checks for an announced preemption; 0: never
    preemption_check_every: int = ranged(10, 1, zero="never")
    # node preemptions a run recovers from (Ray: no limit)
    max_preemption_failures: int = ranged(20, 0)
    # Ray Train controller failures tolerated (Ray: no limit)
    controller_failure_limit: int = ranged(3, 0)
