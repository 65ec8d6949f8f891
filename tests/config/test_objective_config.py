"""``[objective]`` holds one sub-table per objective kind: ``[objective.ddpm]`` for the DDPM
families, ``[objective.flow]`` for the flow-matching ones. The loader reads the sub-tables and
``--set objective.flow.shift=3``, refuses a misspelt nested key and the flat keys of older job
files (saying where each moved), ``raytuner check`` refuses the other kind's settings, and a
family's loss receives only its own kind's settings."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from raytuner.cli import main
from raytuner.config import (
    ConfigError,
    DdpmObjective,
    FlowObjective,
    ObjectiveConfig,
    load_job,
)
from raytuner.families import FAMILIES
from raytuner.families.parts import Source

JOB = """
[model]
family = "{family}"
[data]
images = "{root}/images"
cache = "{root}/cache"
[train]
output = "{root}/runs"
"""


def write(tmp_path: Path, extra: str = "", family: str = "sdxl") -> Path:
    path = tmp_path / "job.toml"
    path.write_text(JOB.format(family=family, root=tmp_path.as_posix()) + extra)
    return path


def test_sub_tables_load_each_kind_with_defaults_for_the_rest(tmp_path):
    extra = "[objective.flow]\nresolution_shift = false\nshift = 3\n"
    extra += "[objective.ddpm]\nnoise_offset = 0.05\n"
    job = load_job(write(tmp_path, extra, family="sana"))
    assert job.objective.flow == FlowObjective(resolution_shift=False, shift=3.0)
    assert isinstance(job.objective.flow.shift, float)  # an integer in TOML, typed like a float
    assert job.objective.ddpm == DdpmObjective(noise_offset=0.05)
    assert load_job(write(tmp_path)).objective == ObjectiveConfig()  # no [objective]: defaults


def test_misspelt_nested_key_is_refused_with_its_dotted_name(tmp_path):
    with pytest.raises(ConfigError) as e:
        load_job(write(tmp_path, "[objective.flow]\nshif = 3.0\n"))
    assert "unknown key objective.flow.shif" in str(e.value)
    assert "allowed keys in [objective.flow]" in str(e.value) and "shift" in str(e.value)
    with pytest.raises(ConfigError, match="objective.ddpm = 3 has type int; expected table"):
        load_job(write(tmp_path, "[objective]\nddpm = 3\n"))
    with pytest.raises(ConfigError, match="objective.flow.weighting = 'min_snr': must be one of"):
        load_job(write(tmp_path, '[objective.flow]\nweighting = "min_snr"\n'))


@pytest.mark.parametrize(
    "line, moved",
    [
        ("shift = 3.0", "objective.shift moved to objective.flow.shift"),
        ("guidance = 3.5", "objective.guidance moved to objective.flow.guidance"),
        ("noise_offset = 0.1", "objective.noise_offset moved to objective.ddpm.noise_offset"),
        ('weighting = "min_snr"', "objective.weighting moved to objective.ddpm.weighting"),
    ],
)
def test_old_flat_keys_are_refused_saying_where_they_moved(tmp_path, line, moved):
    with pytest.raises(ConfigError, match=moved):
        load_job(write(tmp_path, f"[objective]\n{line}\n"))


def test_set_overrides_a_key_of_a_sub_table(tmp_path):
    path = write(tmp_path, "[objective.flow]\nshift = 2.0\nlogit_std = 0.5\n", family="sana")
    job = load_job(path, ["objective.flow.shift=3", "objective.ddpm.min_snr_gamma=4"])
    assert job.objective.flow == FlowObjective(shift=3.0, logit_std=0.5)  # the rest kept
    assert job.objective.ddpm.min_snr_gamma == 4.0
    with pytest.raises(ConfigError, match="objective.shift moved to objective.flow.shift"):
        load_job(path, ["objective.shift=3"])
    with pytest.raises(ConfigError, match="unknown key objective.flow.shif"):
        load_job(path, ["objective.flow.shif=3"])
    with pytest.raises(ConfigError, match="objective.flow.shift is a value in the job file"):
        load_job(path, ["objective.flow.shift.x=3"])


def _check(tmp_path, capsys, family, *overrides, extra=""):
    args = ["check", str(write(tmp_path, extra, family=family))]
    for text in overrides:
        args += ["--set", text]
    return main(args), capsys.readouterr().err


def test_check_refuses_the_other_kinds_settings_naming_the_key_and_what_to_use(tmp_path, capsys):
    code, err = _check(tmp_path, capsys, "sdxl", extra="[objective.flow]\nshift = 3.0\n")
    assert code == 2
    assert (
        "objective.flow.shift = 3.0 is read only by flow-matching families "
        f"({', '.join(n for n, f in FAMILIES.items() if f.objective_kind == 'flow')}); "
        "sdxl trains with DDPM: use [objective.ddpm]"
    ) in err
    code, err = _check(tmp_path, capsys, "flux", 'objective.ddpm.weighting="min_snr"')
    assert code == 2
    assert "objective.ddpm.weighting = 'min_snr' is read only by DDPM families (sd15, sdxl)" in err
    assert "use [objective.flow]" in err
    code, err = _check(tmp_path, capsys, "sana", "objective.flow.guidance=3.5")
    assert code == 2 and "objective.flow.guidance = 3.5: sana's denoiser has no guidance" in err
    code, err = _check(tmp_path, capsys, "sdxl", extra="[objective]\nshift = 3.0\n")
    assert code == 2 and "objective.shift moved to objective.flow.shift" in err


def test_a_ddpm_familys_loss_gets_only_the_ddpm_settings():
    sd15, source = FAMILIES["sd15"], Source("tiny")
    denoiser = sd15.denoiser(source)
    gen = torch.Generator().manual_seed(0)
    batch = {
        "latent": torch.randn(2, 4, 8, 8, generator=gen),
        "prompt_embeds": torch.randn(2, 77, 32, generator=gen),
    }

    def loss(objective: ObjectiveConfig) -> torch.Tensor:
        settings = objective.for_family(sd15)
        assert isinstance(settings, DdpmObjective)
        generators = [torch.Generator().manual_seed(i) for i in range(2)]
        with torch.no_grad():
            return sd15.loss(source, settings)(denoiser, batch, generators)

    plain = loss(ObjectiveConfig())
    flow_changed = ObjectiveConfig(flow=FlowObjective(shift=3.0, weighting="cosmap"))
    assert torch.equal(loss(flow_changed), plain)  # the flow settings never reach it
    offset = ObjectiveConfig(ddpm=DdpmObjective(noise_offset=0.5))
    assert not torch.allclose(loss(offset), plain)
    with pytest.raises(TypeError, match=r"\[objective.ddpm\] settings \(DdpmObjective\)"):
        sd15.loss(source, ObjectiveConfig())
    with pytest.raises(TypeError, match="not FlowObjective"):
        sd15.loss(source, FlowObjective())
    assert isinstance(ObjectiveConfig().for_family(FAMILIES["flux"]), FlowObjective)
