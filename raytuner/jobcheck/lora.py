"""The job check's rules about the LoRA a job trains (``raytuner.jobcheck``): adapter-kind keys
for a run that trains no adapter; ``model.merge_adapters`` files that are missing, of a full
fine-tune, of an unknown layout or of another model; a ``lora.init_from`` file (a folder of
a file per expert for a run of every expert) that is missing, set for a run that trains no
LoRA, or whose LoRA does not fit the job's adapter;
target modules peft or the family's kohya layout cannot take; a text encoders' LoRA for a
family whose text encoders raytuner does not train."""

from __future__ import annotations

import contextlib
import dataclasses
import os

from raytuner.config import ConfigError, JobConfig
from raytuner.config.inputs import BOTH_EXPERTS
from raytuner.families import parts
from raytuner.train import text_lora


def init_from(job: JobConfig) -> None:
    """A LoRA to start from: for a LoRA run, and (a local path) there; what it holds is checked
    by ``adapter``."""
    path = job.lora.init_from
    if not path:
        return
    if job.train.mode != "lora":
        raise ConfigError(
            f"lora.init_from = {path!r}: train.mode = {job.train.mode!r} trains no LoRA; "
            'remove the key or set train.mode = "lora"'
        )
    both = job.model.expert == BOTH_EXPERTS  # a folder of a file per expert
    exists = os.path.isdir if both else os.path.isfile
    if "://" not in path and not exists(os.path.expanduser(path)):
        raise ConfigError(
            f"lora.init_from = {path!r}: no such {'folder' if both else 'file'} (a relative "
            f"path is from the working directory, {os.getcwd()})"
        )


def merge_adapters(job: JobConfig, family) -> None:
    """``[[model.merge_adapters]]``: for a LoRA run (a full fine-tune's export would hold
    them: refused rather than subtracted, which a DoRA's merge cannot be), each file there (a
    local path) and, from its header (the denoiser built on the meta device, no weight read),
    of a layout ``lora/merge.py`` reads, on modules of the denoiser, of their shapes."""
    adapters = job.model.merge_adapters
    if not adapters:
        return
    if job.train.mode != "lora":
        raise ConfigError(
            f"model.merge_adapters: train.mode = {job.train.mode!r} exports the whole "
            "denoiser, which would hold the merged adapters; merge them into the model "
            'yourself and set model.pretrained to it, or set train.mode = "lora"'
        )
    for i, adapter in enumerate(adapters):
        path = adapter.path
        if "://" not in path and not os.path.isfile(os.path.expanduser(path)):
            raise ConfigError(
                f"model.merge_adapters[{i}].path = {path!r}: no such file (a relative path is "
                f"from the working directory, {os.getcwd()})"
            )
        _merged_expert(i, adapter.expert, family)
    from raytuner.lora import merge

    denoiser = family.denoiser(parts.model_source(job.model, "cpu"), "meta", weights=False)
    merge.check(adapters, family, denoiser)


def _merged_expert(i: int, expert: str, family) -> None:
    """``model.merge_adapters[i].expert``: one of the experts in a run of them all (each file
    is one expert's), the run's own or none in a run of one expert, none for one denoiser."""
    key = f"model.merge_adapters[{i}].expert = {expert!r}"
    names = [e.name for e in family.turns or family.experts]
    if family.turns and expert not in names:
        raise ConfigError(
            f'{key}: a run of every expert merges each file into one of them; set it to '
            f"{' or '.join(repr(n) for n in names)}"
        )
    if family.expert and expert not in ("", family.expert.name):
        raise ConfigError(
            f"{key}: this run trains the {family.expert.name!r} expert alone; remove the entry "
            f"or set it to {family.expert.name!r}"
        )
    if not family.experts and expert:
        raise ConfigError(f"{key}: {family.name} has one denoiser; remove the key")


def kind(job: JobConfig) -> None:
    """``lora.kind`` and its options, or ``lora.dora``, for a run that trains no adapter
    (``train.mode = "full"``): set, they would be ignored."""
    lora, default = job.lora, type(job.lora)()
    if job.train.mode == "lora":
        return
    keys = ("kind", "dora", "factor", "decompose_both", "rank_dropout", "module_dropout")
    for key in keys:
        value = getattr(lora, key)
        if value != getattr(default, key):
            raise ConfigError(
                f"lora.{key} = {value!r}: train.mode = {job.train.mode!r} trains no adapter; "
                f'remove lora.{key} or set train.mode = "lora"'
            )


def adapter(job: JobConfig, family) -> None:
    """What a worker refuses as it builds its LoRA, refused from the architecture alone (built
    on the meta device: nothing allocated, no weight read): target modules that reach no
    module of the denoiser or of the text encoders (peft), that the family's kohya layout has
    no name for, and a ``lora.init_from`` file whose LoRA does not fit the adapter (its rank,
    alpha, modules or shapes, read from the file's header: ``init_from.check_file``). Only for a
    job that sets one of those keys (the family's own targets fit)."""
    lora = job.lora
    own_targets = lora.target_modules or (lora.text_encoder and lora.text_encoder_target_modules)
    if job.train.mode != "lora" or not (lora.init_from or own_targets):
        return
    import torch

    from raytuner.families.mixture import experts_of
    from raytuner.lora.init_from import check_file, expert_files
    from raytuner.train.model import adapt

    meta, source = torch.device("meta"), parts.model_source(job.model, "cpu")
    dtype = parts.DTYPES[job.model.trainable_dtype]
    text = None
    if lora.text_encoder:
        with _refusing("lora.text_encoder_target_modules", lora.text_encoder_target_modules):
            text = text_lora.build(family, source, meta, lora, job.train, dtype)
    with _refusing("lora.target_modules", lora.target_modules):
        weights = adapt(
            family.denoiser(source, "meta", weights=False),
            mode="lora",
            lora=dataclasses.replace(lora, init_from=""),  # its values are read below
            targets=family.adapters.targets,
            ema_decay=0.0,
            dtype=dtype,
            family=family,
        )
    if lora.init_from and family.turns:  # every expert: each from its own file
        files = expert_files(lora.init_from, family)
        for (_, expert), (of_expert, path) in zip(experts_of(weights.denoiser), files,
                                                   strict=True):  # fmt: skip
            check_file(expert, path, lora, of_expert)
    elif lora.init_from:
        starts = text.start() if text is not None else []
        check_file(weights.denoiser, lora.init_from, lora, family, starts)


def text_encoder(lora, family) -> None:
    """Refuse ``lora.text_encoder`` for a family whose text encoders raytuner does not train
    (``raytuner check``, exit 2); what it needs of the other sections is refused when the job
    is loaded (``config.rules.text_encoder_needs``)."""
    if not lora.text_encoder or family.adapters.text_encoders:
        return
    from raytuner.families import FAMILIES

    able = ", ".join(n for n, f in FAMILIES.items() if f.adapters.text_encoders)
    raise ConfigError(
        f"lora.text_encoder = true: raytuner trains no {family.name} text encoder (its LoRA "
        f"files and loaders take the denoiser's; the cache's text embeddings are used); "
        f"allowed for {able}; set lora.text_encoder = false"
    )


@contextlib.contextmanager
def _refusing(key: str, value: list[str]):
    """peft's refusal of target modules (none of the model's, or of a kind it cannot adapt)
    as a ConfigError naming ``key``."""
    try:
        yield
    except ConfigError:
        raise
    except (ValueError, TypeError) as e:  # TypeError: a layer LoKr / LoHa cannot adapt
        shown = value or "(the family's)"
        raise ConfigError(f"{key} = {shown}: {str(e).splitlines()[0]}") from None
