"""The training-side sections of a job: one frozen keyword-only dataclass per component, each
checking its own values (the input sections, [model] [data] [preprocess], are in
``config/inputs.py``; the objective's in ``config/objective.py``)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from raytuner.config.loader import ConfigError, one_of, positive

OPTIMIZERS = ("adamw", "adamw8bit", "adafactor", "prodigy")
ATTENTION = ("auto", "flash", "efficient", "cudnn", "math")  # train.attention
STRATEGIES = ("ddp", "fsdp")
LR_SCHEDULERS = ("constant", "linear", "cosine", "cosine_with_restarts", "polynomial")
SAVE_DTYPES = ("float16", "bfloat16", "float32")  # lora.save_dtype
# the [lora] keys of the text encoders' LoRA, read only with lora.text_encoder = true
TEXT_ENCODER_KEYS = (
    "text_encoder_rank",
    "text_encoder_alpha",
    "text_encoder_lr",
    "text_encoder_target_modules",
)
DEFAULT_STEPS = 100  # train.max_steps when neither it nor train.epochs is set


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    """The optimisation run."""

    output: str
    name: str = ""  # run name; "" means the job file's stem
    max_steps: int = 0  # optimizer steps; 0: DEFAULT_STEPS, unless epochs is set
    epochs: int = 0  # instead of max_steps: epochs of the global schedule (steps set at train)
    global_batch_size: int = 4
    learning_rate: float = 1e-4
    weight_decay: float = 1e-2
    warmup_steps: int = 0
    max_grad_norm: float = 1.0
    seed: int = 0
    remainder: str = "drop"
    micro_batch_size: int = 0  # 0: a rank's whole slice in one pass; else gradient accumulation
    prefetch: int = 2  # batches a worker assembles ahead of the step
    log_every: int = 10
    sample_log: bool = False  # write the cache rows of every step under <run>/samples/
    mode: str = "lora"  # lora: a peft adapter on the denoiser; full: the whole denoiser
    caption_dropout: float = 0.0  # share of samples trained with the empty caption
    prior_loss_weight: float = 1.0  # the loss weight of regularization images (kohya's)
    ema_decay: float = 0.0  # > 0: keep an EMA of the trained weights; exports use it
    gradient_checkpointing: bool = False
    # torch.compile each of the denoiser's repeated blocks (the family's compile_blocks) once;
    # "auto": on GPU workers, for the families whose compiled blocks were measured faster
    compile: bool | str = "auto"
    # the UNets' convolutions in channels-last memory format on GPUs (false: as stored, NCHW)
    channels_last: bool = True
    # the scaled-dot-product attention kernel on GPUs: auto (torch's choice, cuDNN's left out)
    # | flash | efficient (memory-efficient) | cudnn | math
    attention: str = "auto"
    # the frozen base linears of a transformer family's blocks multiply in float8 (torchao) on
    # GPUs with FP8 tensor cores; the LoRA stays in the compute dtype
    float8_matmul: bool = False
    mixed_precision: str = "bf16"  # bf16 autocast on GPU workers; "no": float32
    tensorboard: bool = True  # event files under <run>/tensorboard (local outputs)
    optimizer: str = "adamw"  # adamw | adamw8bit (bitsandbytes) | adafactor | prodigy
    lr_scheduler: str = "constant"  # after train.warmup_steps: constant | linear | cosine | ...
    lr_cycles: int = 1  # cosine_with_restarts: how many restarts
    lr_power: float = 1.0  # polynomial: the decay's power

    def __post_init__(self) -> None:
        positive("train.max_steps", self.max_steps, zero_ok=True)
        positive("train.epochs", self.epochs, zero_ok=True)
        if self.max_steps and self.epochs:
            raise ConfigError(
                f"train.max_steps = {self.max_steps} and train.epochs = {self.epochs}: set one of "
                "them (train.epochs trains that many epochs of the global schedule)"
            )
        if not self.epochs and not self.max_steps:  # neither set: the default length
            object.__setattr__(self, "max_steps", DEFAULT_STEPS)
        one_of("train.optimizer", self.optimizer, OPTIMIZERS)
        one_of("train.lr_scheduler", self.lr_scheduler, LR_SCHEDULERS)
        positive("train.lr_cycles", self.lr_cycles)
        positive("train.lr_power", self.lr_power)
        positive("train.micro_batch_size", self.micro_batch_size, zero_ok=True)
        positive("train.prefetch", self.prefetch)
        positive("train.global_batch_size", self.global_batch_size)
        positive("train.learning_rate", self.learning_rate)
        positive("train.warmup_steps", self.warmup_steps, zero_ok=True)
        positive("train.log_every", self.log_every)
        positive("train.prior_loss_weight", self.prior_loss_weight, zero_ok=True)
        one_of("train.remainder", self.remainder, ("drop", "pad"))
        one_of("train.mode", self.mode, ("lora", "full"))
        one_of("train.mixed_precision", self.mixed_precision, ("bf16", "no"))
        one_of("train.attention", self.attention, ATTENTION)
        if isinstance(self.compile, str) and self.compile != "auto":
            raise ConfigError(f"train.compile = {self.compile!r}: must be true, false or \"auto\"")
        for key in ("ema_decay", "caption_dropout"):
            if not 0 <= getattr(self, key) < 1:
                raise ConfigError(f"train.{key} = {getattr(self, key)}: must be in [0, 1)")

    def for_epochs(self, steps_per_epoch: int) -> TrainConfig:
        """With ``train.epochs`` set: the same section with ``max_steps`` = epochs x
        ``steps_per_epoch`` (the global batches of an epoch, known once the cache is read)."""
        return dataclasses.replace(self, max_steps=self.epochs * steps_per_epoch, epochs=0)


@dataclass(frozen=True, kw_only=True)
class LoraConfig:
    """LoRA adapter on the denoiser (and with ``text_encoder``, on the text encoders)."""

    rank: int = 16
    alpha: float = 16.0
    dropout: float = 0.0
    target_modules: list[str] = field(default_factory=list)  # empty: the family's default
    init_from: str = ""  # a LoRA file (diffusers or kohya keys) training starts from
    # the dtype of the exported LoRA files (training keeps model.trainable_dtype); float16: what
    # sd-scripts' users save (--save_precision fp16) and every UI loads, Apple's MPS included
    save_dtype: str = "float16"
    # a LoRA on every text encoder of the family too (kohya's default for SD1.5 and SDXL): the
    # captions are then encoded in the worker at every step, not read from the cache
    text_encoder: bool = False
    text_encoder_rank: int = 0  # 0: rank
    text_encoder_alpha: float = 0.0  # 0: alpha
    text_encoder_lr: float = 0.0  # 0: train.learning_rate (kohya's --text_encoder_lr)
    # peft target modules on the text encoders; empty: the family's (CLIP's q/k/v/out_proj)
    text_encoder_target_modules: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        positive("lora.rank", self.rank)
        one_of("lora.save_dtype", self.save_dtype, SAVE_DTYPES)
        positive("lora.alpha", self.alpha)
        if not 0 <= self.dropout < 1:
            raise ConfigError(f"lora.dropout = {self.dropout}: must be in [0, 1)")
        for key in TEXT_ENCODER_KEYS:
            value = getattr(self, key)
            if key != "text_encoder_target_modules":
                positive(f"lora.{key}", value, zero_ok=True)
            if value and not self.text_encoder:
                raise ConfigError(
                    f"lora.{key} = {value!r} is read only when the text encoders are trained, "
                    "and lora.text_encoder = false: set lora.text_encoder = true, or remove "
                    f"lora.{key}"
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


@dataclass(frozen=True, kw_only=True)
class MemoryConfig:
    """Where a training worker keeps what does not fit its GPU (``raytuner plan`` sizes it)."""

    # the denoiser's last N blocks keep their frozen weights in pinned CPU memory and stream to
    # the GPU just before they run (LoRA, transformer families, gradient checkpointing)
    blocks_to_swap: int = 0
    swap_ring: int = 2  # streamed blocks resident at once (the one running + the next)
    activation_offload: bool = False  # the checkpointed blocks' inputs wait in pinned CPU memory

    def __post_init__(self) -> None:
        positive("memory.blocks_to_swap", self.blocks_to_swap, zero_ok=True)
        positive("memory.swap_ring", self.swap_ring)


@dataclass(frozen=True, kw_only=True)
class ScalingConfig:
    """Training world: an int, or [min, max] for elastic training."""

    workers: int | list[int] = 1
    # ddp: every worker holds the whole denoiser (replicated); fsdp: its weights, gradients,
    # optimizer state and EMA are sharded over the workers (FSDP2), a block gathered as it runs
    strategy: str = "ddp"
    use_gpu: bool = False
    cpus_per_worker: float = 1.0
    gpus_per_worker: float = 0.0
    elastic_resize_interval_s: float = 60.0  # how often a running elastic group may resize
    # the GPU's dense bfloat16 peak in TFLOP/s for MFU; 0: from the device's name (a table),
    # unknown where it is not listed
    peak_tflops: float = 0.0
    resource_wait_s: float = 600.0  # how long training waits for its workers' resources

    def __post_init__(self) -> None:
        bounds = self.workers if isinstance(self.workers, list) else [self.workers]
        if len(bounds) not in (1, 2) or min(bounds) < 1 or bounds != sorted(bounds):
            raise ConfigError(
                f"scaling.workers = {self.workers}: use an int >= 1 or [min, max] with min <= max"
            )
        one_of("scaling.strategy", self.strategy, STRATEGIES)
        positive("scaling.elastic_resize_interval_s", self.elastic_resize_interval_s, zero_ok=True)
        positive("scaling.resource_wait_s", self.resource_wait_s, zero_ok=True)
        positive("scaling.peak_tflops", self.peak_tflops, zero_ok=True)
        if self.gpus_per_worker > 0 and not self.use_gpu:
            raise ConfigError(
                f"scaling.gpus_per_worker = {self.gpus_per_worker} with scaling.use_gpu = false: "
                "CPU workers reserve no GPU; set use_gpu = true to train on GPUs, or "
                "gpus_per_worker = 0"
            )

    @property
    def max_workers(self) -> int:
        return self.workers[-1] if isinstance(self.workers, list) else self.workers

    @property
    def min_workers(self) -> int:
        return self.workers[0] if isinstance(self.workers, list) else self.workers


@dataclass(frozen=True, kw_only=True)
class ValidationConfig:
    """Images rendered from checkpoints while training runs, by a Ray actor beside the workers."""

    every_steps: int = 0  # 0: no validation; else a checkpoint and a render every N steps
    prompts: list[str] = field(default_factory=list)
    seeds: list[int] = field(default_factory=lambda: [0])
    steps: int = 20  # denoising steps per image
    width: int = 0  # 0: the job's resolution
    height: int = 0
    prompts_file: str = ""  # one prompt per line, kohya style: "a cat --w 512 --s 20 --n ugly"
    negative_prompt: str = ""
    guidance_scale: float = 0.0  # classifier-free guidance; 0: the family's default
    cpus: float = 0.0  # resources the validation actor reserves (0: none, it shares)
    gpus: float = 0.0

    def __post_init__(self) -> None:
        positive("validation.every_steps", self.every_steps, zero_ok=True)
        positive("validation.steps", self.steps)
        positive("validation.cpus", self.cpus, zero_ok=True)
        positive("validation.gpus", self.gpus, zero_ok=True)
        positive("validation.guidance_scale", self.guidance_scale, zero_ok=True)
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

    every_steps: int = 50
    keep: int = 2
    max_failures: int = 0
    resume: bool = True
    preemption_check_every: int = 10  # steps between checks for an announced preemption; 0: never
    max_preemption_failures: int = 20  # node preemptions a run recovers from (Ray: no limit)
    controller_failure_limit: int = 3  # Ray Train controller failures tolerated (Ray: no limit)

    def __post_init__(self) -> None:
        positive("checkpoint.every_steps", self.every_steps)
        positive("checkpoint.max_preemption_failures", self.max_preemption_failures, zero_ok=True)
        positive("checkpoint.controller_failure_limit", self.controller_failure_limit, zero_ok=True)
        positive("checkpoint.keep", self.keep)
        positive("checkpoint.max_failures", self.max_failures, zero_ok=True)
        positive("checkpoint.preemption_check_every", self.preemption_check_every, zero_ok=True)
