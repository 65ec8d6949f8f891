"""A whole job: one section per component, loaded from a job TOML.

Every component receives only its own section. Unknown sections and keys and wrong types are
rejected with where they came from (the file, or the ``--set`` override that named them), the
dotted key, the nearest known name (``did you mean …?``) and what is allowed.
``--set section.key=value`` overrides (``section.sub.key=value`` for a sub-table such as
``[objective.flow]``) are parsed as TOML values, so they are typed exactly like the file.
"""

from __future__ import annotations

import dataclasses
import tomllib
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from raytuner.config import rules
from raytuner.config.inputs import BOTH_EXPERTS, DataConfig, ModelConfig, PreprocessConfig
from raytuner.config.loader import (
    ConfigError,
    build_section,
    check_key,
    did_you_mean,
    parse_override,
    set_dotted,
)
from raytuner.config.objective import ObjectiveConfig
from raytuner.config.sections import (
    CheckpointConfig,
    LoraConfig,
    MemoryConfig,
    ScalingConfig,
    TrackingConfig,
    TrainConfig,
    ValidationConfig,
)


@dataclass(frozen=True, kw_only=True)
class JobConfig:
    """A whole job: one section per component."""

    model: ModelConfig
    data: DataConfig
    preprocess: PreprocessConfig = field(default_factory=PreprocessConfig)
    train: TrainConfig
    lora: LoraConfig = field(default_factory=LoraConfig)
    objective: ObjectiveConfig = field(default_factory=ObjectiveConfig)
    scaling: ScalingConfig = field(default_factory=ScalingConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    validation: ValidationConfig = field(default_factory=ValidationConfig)
    memory: MemoryConfig = field(default_factory=MemoryConfig)
    tracking: TrackingConfig = field(default_factory=TrackingConfig)
    # the dotted keys the job file and its --set overrides name (``train.micro_batch_size`` …):
    # what the job pins, as against what it leaves to its defaults (``tools/plan/adopt.py``)
    given: frozenset[str] = field(default=frozenset(), repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.train.global_batch_size < self.scaling.max_workers:
            raise ConfigError(
                f"train.global_batch_size = {self.train.global_batch_size} is smaller than "
                f"the {self.scaling.max_workers} workers: every worker needs a sample per step"
            )
        rules.memory_needs(self.memory, self.train, self.model)
        rules.text_encoder_needs(self.lora, self.train, self.scaling, self.memory)
        rules.module_dropout_needs(self.lora, self.scaling)
        rules.gpu_needs(self.train, self.scaling, self.model, self.memory)
        rules.regularization(self.data, self.train)
        rules.run_name(self.train.name)
        rules.paths_apart(self.data, self.train)

    def to_dict(self) -> dict[str, Any]:
        """The sections as plain values (``job.json``, ``raytuner check --print``)."""
        return {name: dataclasses.asdict(getattr(self, name)) for name in SECTIONS}


# section name -> its dataclass
SECTIONS: dict[str, type] = {
    name: hint
    for name, hint in typing.get_type_hints(JobConfig).items()
    if dataclasses.is_dataclass(hint)
}


def unknown_section(where: str, name: str) -> ConfigError:
    """The error for a table ``[name]`` that is no section, with the nearest section's name."""
    hint = did_you_mean(name, list(SECTIONS)).replace("mean ", "mean [").replace("?)", "]?)")
    return ConfigError(
        f"{where}: unknown section [{name}]{hint}; allowed sections: " + ", ".join(SECTIONS)
    )


def build_job(raw: dict[str, Any], where: str) -> JobConfig:
    unknown = sorted(set(raw) - set(SECTIONS))
    if unknown:
        raise unknown_section(where, unknown[0])
    for required in ("model", "data", "train"):
        if required not in raw:
            raise ConfigError(f"{where}: missing section [{required}]")
    sections = {name: build_section(SECTIONS[name], raw[name], where, name) for name in raw}
    tables = [(name, table) for name, table in raw.items() if isinstance(table, dict)]
    given = {f"{name}.{key}" for name, table in tables for key in table}
    try:
        return JobConfig(**sections, given=frozenset(given))
    except ConfigError as e:
        raise ConfigError(f"{where}: {e}") from None


def load_job(path: str | Path, overrides: list[str] = ()) -> JobConfig:
    """Read a job TOML, apply ``section.key=value`` (``section.sub.key=value``) overrides,
    validate."""
    path = Path(path)
    try:
        raw = tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"{path}: no such job file") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{path}: not valid TOML: {e}") from None
    raw.setdefault("train", {})
    for text in overrides:
        section, key, value = parse_override(text)
        if section not in SECTIONS:
            raise unknown_section(f"--set {text}", section)
        check_key(SECTIONS[section], section, key, f"--set {text}")
        set_dotted(raw, section, key, value, text)
    if isinstance(raw["train"], dict) and not raw["train"].get("name"):
        raw["train"]["name"] = path.stem + _expert_suffix(raw.get("model"))
    return build_job(raw, str(path))


def _expert_suffix(model) -> str:
    """A run of one expert of a mixture (``model.expert``) is named after it by default: the
    job's two runs (``<job>-high``, ``<job>-low``) and their LoRA files apart; a run of every
    expert (``"both"``) is the job's (its files are named after their experts inside it)."""
    expert = model.get("expert", "") if isinstance(model, dict) else ""
    named = isinstance(expert, str) and expert and expert != BOTH_EXPERTS
    return f"-{expert}" if named else ""
