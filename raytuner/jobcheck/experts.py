"""The job check's rule about a run of every expert of a mixture in one run (``model.expert =
"both"``, ``raytuner.jobcheck``): the settings such a run does not take. Its experts are built
side by side in one worker, replicated (ddp; ``memory.blocks_to_swap`` streams the last blocks
of each) or sharded (fsdp: each expert's blocks units of their own), each with its own adapter
(``families/mixture.py``); what would hold or load them otherwise is refused, naming the key,
its value and what to set (one expert a run takes each of these settings)."""

from __future__ import annotations

from raytuner.config import ConfigError, JobConfig
from raytuner.config.inputs import BOTH_EXPERTS

ONE_A_RUN = 'or train one expert a run (model.expert = "high", then "low")'


def _refused(job: JobConfig) -> tuple[str, str] | None:
    """(the key and its value, what to set instead) of the first setting a run of every
    expert does not take, or None."""
    t = job.train
    rules = [
        (t.mode != "lora", f"train.mode = {t.mode!r}", 'set train.mode = "lora"'),
    ]  # fmt: skip
    return next(((key, fix) for refused, key, fix in rules if refused), None)


def turns(job: JobConfig, family) -> None:
    """Refuse what a run of every expert in turn does not take (its experts side by side in
    each worker, an adapter of its own on each); nothing for another run."""
    if job.model.expert != BOTH_EXPERTS or not family.turns:
        return
    if (found := _refused(job)) is not None:
        key, fix = found
        raise ConfigError(
            f'{key} with model.expert = "{BOTH_EXPERTS}": a run of every expert holds them '
            f"side by side in each worker with an adapter of its own on each, and is built "
            f"only so; {fix}, {ONE_A_RUN}"
        )
