"""The ``ltx2`` noise-level density: LTX-2's official "stretched shifted logit-normal" sampler
(Lightricks/LTX-2, ``packages/ltx-trainer/src/ltx_trainer/timestep_samplers.py``,
``ShiftedLogitNormalTimestepSampler``), drawn by ``flow_draw`` from each sample's generator.

The draws are checked against the sampler's closed-form distribution function, written here
from the official code's description: sigmoid(N(mu, std)), stretched linearly so the 0.5th and
99.9th percentiles land on 0 and 1, reflected under eps = 1e-3, cut to [0, 1], one draw in ten
uniform on [eps, 1).
"""

from __future__ import annotations

import math
from functools import cache
from statistics import NormalDist

import pytest
import torch

from raytuner.config import FlowObjective
from raytuner.config.loader import ConfigError
from raytuner.config.objective import DENSITIES
from raytuner.families.objectives import ShiftLine, flow_draw

LTX2_LINE = ShiftLine(base_tokens=1024, base_shift=0.95, max_tokens=4096, max_shift=2.05)
N = 20_000
EPS, UNIFORM = 1e-3, 0.1
GRID = [0.02, 0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 0.98]


def _sigmas(objective, tokens, seed=0, levels=(0.0, 1.0), n=N):
    generators = [torch.Generator().manual_seed(seed)] * n  # one stream, drawn in turn
    draw = flow_draw(objective, lambda shape: tokens, LTX2_LINE, levels)
    return draw((n, 1, 1, 1), generators)["sigma"]


@cache
def _ltx2_sigmas(tokens: int) -> torch.Tensor:
    """20,000 ``ltx2`` levels at ``tokens`` on LTX-2's line (shared by the tests)."""
    return _sigmas(FlowObjective(timestep_sampling="ltx2"), tokens)


def _mu(tokens: int) -> float:
    """LTX-2's ``_get_shift_for_sequence_length``: mu on the line 0.95 at 1024, 2.05 at 4096."""
    return 0.95 + (tokens - 1024) * (2.05 - 0.95) / (4096 - 1024)


def _cdf(s: float, mu: float, std=1.0, stretch=True, mix=True) -> float:
    """P(sigma <= s) of the official sampler (``stretch``/``mix`` off: without that part)."""
    normal = NormalDist(mu, std)

    def logit_normal_cdf(v: float) -> float:  # P(sigmoid(N(mu, std)) <= v)
        return 0.0 if v <= 0 else 1.0 if v >= 1 else normal.cdf(math.log(v / (1 - v)))

    if stretch:
        low, high = (1 / (1 + math.exp(-(mu + p * std))) for p in (-2.5758, 3.0902))

        def below(t: float) -> float:  # P(stretched level before the reflection <= t)
            return logit_normal_cdf(low + t * (high - low))

        # a level under eps is reflected to 2 eps - level: kept <= s unless it was < 2 eps - s
        core = below(s) - below(2 * EPS - s)
    else:
        core = logit_normal_cdf(s)
    if not mix:
        return core
    return (1 - UNIFORM) * core + UNIFORM * max(0.0, (s - EPS) / (1 - EPS))


@pytest.mark.parametrize("tokens", [1024, 6144])
def test_draws_follow_the_official_stretched_mixed_density(tokens):
    sigmas = _ltx2_sigmas(tokens)
    assert ((sigmas > 0) & (sigmas < 1)).all()
    mu = _mu(tokens)
    assert math.isclose(math.log(LTX2_LINE.shift(tokens)), mu)
    empirical = [(sigmas <= s).float().mean().item() for s in GRID]
    pairs = list(zip(GRID, empirical, strict=True))
    tolerance = 0.012  # > 3 standard errors of an empirical CDF of 20,000 draws
    for s, p in pairs:
        assert abs(p - _cdf(s, mu)) < tolerance, (s, p, _cdf(s, mu))
    if tokens == 6144:  # the check tells the sampler apart from one without its stretch or mix
        for partial in (dict(stretch=False), dict(mix=False)):  # off by 0.277, 0.053
            worst = max(abs(p - _cdf(s, mu, **partial)) for s, p in pairs)
            assert worst > 3 * tolerance, partial


def test_the_stretch_trains_low_noise_levels_at_many_tokens():
    # 6,144 tokens on LTX-2's line: shift ~16 (mu ~2.78)
    assert LTX2_LINE.shift(6144) == pytest.approx(16.17, abs=0.01)
    low_ltx2 = (_ltx2_sigmas(6144) < 0.5).float().mean().item()
    # the plain shifted logit_normal is sigmoid(N(mu, 1)) (multiplying the odds by e^mu adds
    # mu to the logit), drawn here directly: diffusers' import alone would take seconds
    generator = torch.Generator().manual_seed(0)
    plain = torch.sigmoid(_mu(6144) + torch.randn(N, generator=generator))
    low_plain = (plain < 0.5).float().mean().item()
    # measured: 0.103 (closed form 0.104) vs 0.0025 (closed form 0.0027)
    assert 0.09 < low_ltx2 < 0.12
    assert low_plain < 0.006
    assert (plain > 0.55).float().mean().item() > 0.99  # 99.5 % above 0.55 without the stretch


def test_same_generators_give_the_same_levels_and_ranges_are_honoured():
    objective = FlowObjective(timestep_sampling="ltx2")
    first, again = _sigmas(objective, 6144, seed=3, n=64), _sigmas(objective, 6144, seed=3, n=64)
    torch.testing.assert_close(first, again, rtol=0, atol=0)
    assert not torch.equal(first, _sigmas(objective, 6144, seed=4, n=64))
    per_sample = [torch.Generator().manual_seed(i) for i in range(8)]
    draw = flow_draw(objective, lambda shape: 6144, LTX2_LINE)
    both = draw((8, 1, 1, 1), per_sample)["sigma"]
    alone = draw((1, 1, 1, 1), [torch.Generator().manual_seed(5)])["sigma"]
    assert both[5] == alone[0]  # a sample's level depends on its generator only
    expert = _sigmas(objective, 6144, levels=(0.0, 0.3), n=256)
    assert ((expert >= 1e-3) & (expert < 0.3)).all()


@pytest.mark.parametrize("shift", [math.e, 1 / math.e])
def test_the_fixed_shift_is_the_densitys_mu(shift):
    # mu = +1 and -1: the two sides the sampler computes its stretch on
    fixed = FlowObjective(timestep_sampling="ltx2", resolution_shift=False, shift=shift)
    sigmas = _sigmas(fixed, 123_456, n=5000)  # the token count is not read
    for s in (0.1, 0.2, 0.5, 0.8, 0.9):
        assert abs((sigmas <= s).float().mean().item() - _cdf(s, math.log(shift))) < 0.025


def test_the_config_takes_ltx2_and_refuses_an_unknown_density():
    assert "ltx2" in DENSITIES
    assert FlowObjective(timestep_sampling="ltx2").timestep_sampling == "ltx2"
    allowed = "must be one of uniform, logit_normal, mode, ltx2"
    with pytest.raises(ConfigError, match=f"objective.flow.timestep_sampling = 'ltx3': {allowed}"):
        FlowObjective(timestep_sampling="ltx3")
