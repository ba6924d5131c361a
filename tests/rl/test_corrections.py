"""IcePop and sequence-level rejection (``rl.corrections``) against references written from
each paper's equation (``loss_reference``, float64, fresh random inputs every run): values and
gradients of ``grpo_loss``, the per-sequence measures, and the one-line refusals."""

from __future__ import annotations

import math

import pytest
from loss_reference import ENGINE_CASES, FAMILY, LENGTHS, check_case, inputs

from areal_fast.rl.config import LossConfig
from areal_fast.rl.corrections import sequence_measure
from areal_fast.rl.objectives import grpo_loss

CORRECTION_CASES = [name for name, cfg in FAMILY.items() if cfg.corrects_sampler]


@pytest.mark.parametrize("name", CORRECTION_CASES)
def test_values_and_gradients_match_the_papers(name, fresh_seed):
    check_case(name, fresh_seed)


def test_every_case_exercises_its_bounds(fresh_seed):
    """The inputs cross the bounds: some tokens clipped, masked, rejected; some not."""
    logp, old, prox, engine, adv, mask, cu = inputs()
    for name in ("geo-mask", "k1-mask", "k2-mask", "k3-mask-cispo", "icepop-engine"):
        cfg = FAMILY[name]
        extra = {"engine_logprobs": engine} if name in ENGINE_CASES else {"prox_logprobs": prox}
        _, stats = grpo_loss(logp, old, adv, mask, cu, cfg, **extra)
        assert 0 < float(stats["rejected_fraction"]) < 1, (name, fresh_seed)


@pytest.mark.parametrize("measure", ["ratio", "k1", "k2", "k3"])
def test_sequence_measures(measure, fresh_seed):
    _, old, _, engine, _, mask, cu = inputs()
    delta = old - engine
    got = sequence_measure(delta, mask, cu, measure)
    estimate = {
        "ratio": lambda d: d,
        "k1": lambda d: -d,
        "k2": lambda d: d * d / 2,
        "k3": lambda d: math.exp(d) - 1 - d,
    }[measure]
    for s in range(len(LENGTHS)):
        values = [estimate(float(delta[t])) for t in range(cu[s], cu[s + 1]) if mask[t]]
        mean = sum(values) / len(values) if values else 0.0
        want = math.exp(mean) if measure == "ratio" else mean
        assert got[s].item() == pytest.approx(want, rel=1e-12, abs=1e-15), (s, fresh_seed)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(icepop=True, behav_weight_cap=5.0), "icepop replaces behav_weight_cap"),
        (dict(icepop=True, tis_cap=2.0), "icepop replaces tis_cap"),
        (dict(icepop=True, icepop_low=2.0, icepop_high=1.0), "need 0 <= icepop_low"),
        (dict(seq_rejection="k4"), "seq_rejection = 'k4' is not one of"),
        (dict(seq_rejection="k3"), "seq_rejection = 'k3' needs seq_rejection_high"),
        (
            dict(seq_rejection="k1", seq_rejection_mode="clamp", seq_rejection_high=1.0),
            "seq_rejection_mode = 'clamp' needs seq_rejection = 'ratio'",
        ),
        (
            dict(seq_rejection="ratio", seq_rejection_low=2.0, seq_rejection_high=1.0),
            "seq_rejection_low = 2.0 must be <= seq_rejection_high = 1.0",
        ),
        (
            dict(
                seq_rejection="ratio",
                seq_rejection_mode="clamp",
                seq_rejection_high=2.0,
                behav_weight_cap=5.0,
            ),
            "seq_rejection_mode = 'clamp' replaces behav_weight_cap",
        ),
    ],
)
def test_refused_combinations_are_one_line(kwargs, message):
    with pytest.raises(ValueError, match=message) as info:
        LossConfig(**kwargs)
    assert "\n" not in str(info.value)


def test_a_sampler_correction_without_sampler_logprobs_is_refused():
    logp, old, _, _, adv, mask, cu = inputs()
    with pytest.raises(ValueError, match="config.icepop needs engine_logprobs or prox_logprobs"):
        grpo_loss(logp, old, adv, mask, cu, LossConfig(icepop=True))
