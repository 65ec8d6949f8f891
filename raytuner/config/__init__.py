"""Job configuration: one frozen keyword-only dataclass per component (``sections.py``, the input
sections in ``inputs.py``, the objective's in ``objective.py``), loaded from a job TOML
(``job.py``, through ``loader.py``) with the rules between sections (``rules.py``) checked at
load. What a job asks of its model family and this installation is refused by
the job check (``raytuner.jobcheck``), once, from the API.
"""

from raytuner.config.inputs import (
    DataConfig,
    MergeAdapterConfig,
    ModelConfig,
    PreprocessConfig,
    SourceConfig,
)
from raytuner.config.job import SECTIONS, JobConfig, build_job, load_job
from raytuner.config.loader import ConfigError, parse_override
from raytuner.config.objective import DdpmObjective, FlowObjective, ObjectiveConfig
from raytuner.config.sections import (
    LR_SCHEDULERS,
    OPTIMIZERS,
    CheckpointConfig,
    LoraConfig,
    MemoryConfig,
    ScalingConfig,
    TrackingConfig,
    TrainConfig,
    ValidationConfig,
)

__all__ = [
    "LR_SCHEDULERS",
    "OPTIMIZERS",
    "SECTIONS",
    "CheckpointConfig",
    "ConfigError",
    "DataConfig",
    "DdpmObjective",
    "FlowObjective",
    "JobConfig",
    "LoraConfig",
    "MemoryConfig",
    "MergeAdapterConfig",
    "ModelConfig",
    "ObjectiveConfig",
    "PreprocessConfig",
    "ScalingConfig",
    "SourceConfig",
    "TrackingConfig",
    "TrainConfig",
    "ValidationConfig",
    "build_job",
    "load_job",
    "parse_override",
]
