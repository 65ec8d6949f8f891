"""`raytuner check` refuses every number a run could not mean: each numeric key of the job TOML
has an allowed range (``config/ranges.py``, written in docs/job-toml.md), and a value outside it,
or a float that is not finite, is exit 2 with one line naming the key, the value and what is
allowed. Before, `check` took many of them and the run went wrong later: silently
(``train.max_grad_norm = 0`` zeroed every gradient, ``learning_rate = inf`` trained to NaN,
``max_steps = 0`` with ``epochs = 0`` trained 100 steps) or inside a worker
(``weight_decay = -1``, ``cpus_per_worker = -1`` 87 s later).

``BAD`` is the specification: values each key refuses (floats also nan, inf and -inf). A test
fails for a numeric key without a declared range, or one missing from ``BAD``."""

from __future__ import annotations

import dataclasses
import re
import typing

import pytest
import torch
from test_jobcheck import REPO, accepted, check

from raytuner.config import SECTIONS, LoraConfig, MemoryConfig, ModelConfig, ObjectiveConfig

# key -> values (TOML text) outside its range; a list key's bad element is its last
BAD: dict[str, list[str]] = {
    "data.sources.repeats": ["0", "-1", "10001"],
    "data.frames": ["[0]", "[81, 2000]"],
    "data.fps": ["-1", "241"],
    "data.sources.frames": ["[0]"],
    "data.sources.fps": ["-2", "241"],
    "preprocess.resolution": ["-64", "32", "8256"],
    "preprocess.bucket_step": ["-8", "4", "2048"],
    "preprocess.min_aspect": ["0", "-0.5", "1.5"],
    "preprocess.max_aspect": ["0.5", "-2"],
    "preprocess.batch_size": ["0", "1025"],
    "preprocess.min_actors": ["0", "-1"],
    "preprocess.max_actors": ["0"],
    "preprocess.gpus_per_actor": ["-1", "0.00001", "17"],
    "preprocess.gpu_memory_gib": ["-1"],
    "preprocess.cpus_per_actor": ["0", "-1"],
    "preprocess.seed": ["-1", str(2**63)],
    "preprocess.min_size": ["-1"],
    "preprocess.max_pixels": ["0", "-1"],
    "preprocess.background": ["[0, 0, 256]", "[-1]"],
    "preprocess.max_restarts": ["-1"],
    "preprocess.resource_wait_s": ["-1"],
    "train.max_steps": ["-1", "0"],
    "train.epochs": ["-1", "0"],
    "train.global_batch_size": ["0", "-4"],
    "train.learning_rate": ["0", "-1e-4", "11"],
    "train.weight_decay": ["-1", "2"],
    "train.warmup_steps": ["-1"],
    "train.max_grad_norm": ["-1"],
    "train.seed": ["-1", str(2**63)],
    "train.micro_batch_size": ["-1"],
    "train.prefetch": ["0", "65"],
    "train.log_every": ["0"],
    "train.caption_dropout": ["-0.1", "1"],
    "train.prior_loss_weight": ["0", "-1"],
    "train.ema_decay": ["-0.1", "1"],
    "train.lr_cycles": ["0"],
    "train.lr_power": ["0", "-1"],
    "lora.rank": ["0", "4097", "1000000"],
    "lora.alpha": ["0", "-1", "1e6"],
    "lora.dropout": ["-0.1", "1"],
    "lora.factor": ["-1", "4097"],  # LyCORIS' -1 is 0 here
    "lora.rank_dropout": ["-0.1", "1"],
    "lora.module_dropout": ["-0.1", "1"],
    "lora.text_encoder_rank": ["-1", "4097"],
    "lora.text_encoder_alpha": ["-1", "1e6"],
    "lora.text_encoder_lr": ["-1", "11"],
    "objective.ddpm.min_snr_gamma": ["0", "-1"],
    "objective.ddpm.noise_offset": ["-0.1", "2"],
    "objective.flow.logit_mean": ["-11", "11"],
    "objective.flow.logit_std": ["0", "11"],
    "objective.flow.mode_scale": ["-2", "2"],
    "objective.flow.shift": ["0", "-1", "101"],
    "objective.flow.guidance": ["-1", "101"],
    "objective.flow.first_frame_p": ["-0.1", "1.5"],
    "scaling.workers": ["0", "[0, 2]"],
    "scaling.cpus_per_worker": ["0", "-1"],
    "scaling.gpus_per_worker": ["-1", "2"],
    "scaling.elastic_resize_interval_s": ["-1"],
    "scaling.peak_tflops": ["-1"],
    "scaling.resource_wait_s": ["-1"],
    "checkpoint.every_steps": ["0", "-1"],
    "checkpoint.keep": ["0"],
    "checkpoint.max_failures": ["-1"],
    "checkpoint.preemption_check_every": ["-1"],
    "checkpoint.max_preemption_failures": ["-1"],
    "checkpoint.controller_failure_limit": ["-1"],
    "validation.every_steps": ["-1"],
    "validation.seeds": ["[0, -1]", f"[{2**63}]"],
    "validation.steps": ["-1", "1001"],
    "validation.width": ["-64", "4", "8200"],
    "validation.height": ["-64", "4", "8200"],
    "validation.guidance_scale": ["-1", "101"],
    "validation.frames": ["-1", "1026"],
    "validation.fps": ["0", "241"],
    "validation.cpus": ["-1"],
    "validation.gpus": ["-1", "2"],
    "memory.blocks_to_swap": ["-1"],
    "memory.swap_ring": ["0"],
    "model.merge_adapters.weight": ["-17", "17"],
    "model.expert_switch_every": ["0", "1000001"],
}


def _numeric(cls: type, prefix: str) -> dict[str, tuple[dataclasses.Field, typing.Any]]:
    """Every numeric key below ``cls`` (dotted, sub-tables and arrays of tables included):
    (its field, its type)."""
    out = {}
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        tp, key = hints[f.name], f"{prefix}.{f.name}"
        args = typing.get_args(tp)
        if dataclasses.is_dataclass(tp):
            out |= _numeric(tp, key)
        elif typing.get_origin(tp) is list and args and dataclasses.is_dataclass(args[0]):
            out |= _numeric(args[0], key)
        elif {int, float} & {tp, *args, *(a for t in args for a in typing.get_args(t))}:
            out[key] = (f, tp)
    return out


NUMERIC = {k: v for name, cls in SECTIONS.items() for k, v in _numeric(cls, name).items()}
FLOATS = [k for k, (_, tp) in NUMERIC.items() if tp is float]
CASES = [(k, v) for k, values in BAD.items() for v in values]
CASES += [(k, v) for k in FLOATS for v in ("nan", "inf", "-inf")]


def _override(key: str, value: str) -> str:
    """``--set`` text putting ``value`` at ``key`` (a source's key: a second source)."""
    for table in ("data.sources", "model.merge_adapters"):
        if key.startswith(f"{table}."):
            return f"{table}=[{{path = 'more', {key.rsplit('.', 1)[1]} = {value}}}]"
    return f"{key}={value}"


@pytest.mark.parametrize("key, value", CASES, ids=[f"{k}={v}" for k, v in CASES])
def test_a_number_outside_its_keys_range_is_refused_naming_key_value_and_range(
    tmp_path, capsys, key, value
):
    code, err = check(tmp_path, capsys, _override(key, value))
    assert code == 2, f"accepted: {key} = {value}"
    assert len(err.strip().splitlines()) == 1, err
    # the key (a list's element, a source's key: with its index), the value, what is allowed
    shown = re.escape(key).replace(r"data\.sources\.", r"data\.sources\[0\]\.")
    shown = shown.replace(r"merge_adapters\.", r"merge_adapters\[0\]\.")
    assert re.search(rf"{shown}(\[\d+\])? = [^:]+: must be ", err), err
    if not value.startswith("["):
        number = float(value)
        assert re.search(rf" = {re.escape(value)}|= {number!r}", err), err


def test_every_numeric_key_declares_its_range_and_is_tried():
    from raytuner.config.ranges import RANGE

    undeclared = [k for k, (f, _) in NUMERIC.items() if RANGE not in f.metadata]
    assert not undeclared, f"numeric keys without a range (ranged(...)): {undeclared}"
    assert set(BAD) == set(NUMERIC), "BAD must try every numeric key, and only those"
    for key, (f, _) in NUMERIC.items():  # the defaults lie in their range
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        for value in default if isinstance(default, list) else [default]:
            assert f.metadata[RANGE].allows(value), (key, value)


def _table(text: str, key: str) -> list[str]:
    """The rows of ``key``'s table in docs/job-toml.md (``### `[train]```, ``[[data.sources]]``)."""
    section = key.rsplit(".", 1)[0]
    arrays = ("data.sources", "model.merge_adapters")  # arrays of tables
    title = f"### `[[{section}]]`" if section in arrays else f"### `[{section}]`"
    lines = text.split(title + "\n", 1)[1].split("\n### ", 1)[0].splitlines()
    return [line for line in lines if line.startswith("| `")]


def test_each_keys_range_is_in_the_job_toml_reference():
    from raytuner.config.ranges import RANGE, integer

    text = (REPO / "docs" / "job-toml.md").read_text()
    for key, (f, tp) in NUMERIC.items():
        allowed = f.metadata[RANGE].text(integer(tp))
        row = [r for r in _table(text, key) if r.startswith(f"| `{f.name}` |")]
        assert row and allowed in row[0], f"docs/job-toml.md: {key} must say {allowed!r}"


@pytest.mark.parametrize(
    "overrides",
    [
        ["train.max_grad_norm=0"],  # sd-scripts' and SimpleTuner's "no clipping"
        ["train.max_steps=0", "train.epochs=3"],  # 0 unsets a key the file set
        ["scaling.workers=[1, 2]", "validation.seeds=[0, 9223372036854775807]"],
        ["train.learning_rate=1", "lora.alpha=1", "lora.rank=4096", "preprocess.min_size=0"],
    ],
)
def test_the_edges_of_the_ranges_are_accepted(tmp_path, capsys, overrides):
    accepted(tmp_path, capsys, *overrides)


def test_max_grad_norm_0_trains_unclipped_not_zero(tmp_path):
    """``train.max_grad_norm = 0`` trains without clipping (sd-scripts' and SimpleTuner's
    meaning): one step on the tiny SD1.5 LoRA equals an unclipped one (a bound no gradient
    reaches). Before, clipping to norm 0 zeroed every gradient and the LoRA learnt nothing."""
    from raytuner.config import TrainConfig
    from raytuner.families import FAMILIES
    from raytuner.families.parts import Source
    from raytuner.train import optim
    from raytuner.train.feed import RankSlice
    from raytuner.train.model import trainable_model
    from raytuner.train.step import train_step

    family, cpu = FAMILIES["sd15"], torch.device("cpu")
    tiny = Source("tiny")
    latent = family.image_encoder(tiny, "cpu")(torch.zeros(1, 3, 64, 64))[0]
    text = family.text_encoder(tiny, "cpu")(["a caption"])
    shapes = {"latent": tuple(latent.shape[1:])} | {k: v.shape[1:] for k, v in text.items()}
    torch.manual_seed(0)
    batch = RankSlice(
        0, 0, 1, family.example_batch(shapes, 2, (64, 64), cpu, torch.float32), [0, 1], []
    )

    def one_step(max_grad_norm: float) -> dict[str, torch.Tensor]:
        train = TrainConfig(
            output=str(tmp_path), learning_rate=1e-2, weight_decay=0.0,
            max_grad_norm=max_grad_norm, global_batch_size=2,
        )  # fmt: skip
        model = ModelConfig(family="sd15", pretrained="tiny")
        trained = trainable_model(model, train, LoraConfig(rank=2, alpha=2.0), family, cpu)
        opt, sched = optim.for_run(train, trained.weights.params)
        loss_fn = family.loss(trained.source, ObjectiveConfig().for_family(family))
        step = train_step(
            trained, trained.denoiser, loss_fn, opt, sched, train, MemoryConfig(), cpu
        )
        step(batch)
        return trained.weights.state()

    unclipped, zero = one_step(1e30), one_step(0.0)
    ups = [k for k in zero if "lora_B" in k]
    assert ups and any(zero[k].abs().max() > 0 for k in ups), "the LoRA learnt nothing"
    for key, value in unclipped.items():
        assert torch.equal(zero[key], value), key
