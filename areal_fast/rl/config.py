"""Configuration of the GRPO-family policy loss."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

AGGREGATIONS = ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "token_sum")
KL_ESTIMATORS = ("k1", "k2", "k3")
RATIO_LEVELS = ("token", "sequence")
BEHAV_WEIGHT_MODES = ("mask", "clamp")


@dataclass
class LossConfig:
    """Options of :func:`areal_fast.grpo_loss`; every field defaults to plain GRPO/PPO.

    Attributes
    ----------
    eps_clip : float
        Lower clip range: the ratio is clipped to [1 − eps_clip, 1 + eps_clip_high]
        (Schulman et al. 2017, PPO, Eq. 7).
    eps_clip_high : float or None
        Upper clip range; None means eps_clip (DAPO "clip-higher", Yu et al. 2025).
    dual_clip_c : float or None
        Dual clip for negative advantages: per-token loss is capped at −c·A when A < 0
        (Ye et al. 2020, "Mastering Complex Control in MOBA Games", Eq. 5). Must be > 1.
    ratio_level : str
        "token" (PPO/GRPO) or "sequence" (GSPO, Zheng et al. 2025: one ratio per sequence,
        exp of the masked mean log-ratio).
    aggregation : str
        "token_mean" | "seq_mean_token_mean" | "seq_mean_token_sum" | "token_sum".
    seq_len_norm : float or None
        Constant divisor of "seq_mean_token_sum" (Dr.GRPO passes the max generation length).
    kl_coef : float
        Weight of the KL penalty to the reference policy (needs ref_logprobs when > 0).
    kl_estimator : str
        "k1" | "k2" | "k3" (Schulman 2020, "Approximating KL Divergence").
    entropy_coef : float
        The loss subtracts entropy_coef · entropy (needs entropy when > 0).
    behav_weight_cap : float or None
        Decoupled PPO (Fu et al. 2025, AReaL, Eq. 5): cap on w = exp(prox − old).
    behav_weight_mode : str
        "mask" zeroes tokens with w > cap; "clamp" uses min(w, cap).
    tis_cap : float or None
        Truncated importance sampling between trainer and engine log-probs
        (Yao et al. 2025, "Your Efficient RL Framework Secretly Brings You Off-Policy RL").
    """

    eps_clip: float = 0.2
    eps_clip_high: Optional[float] = None
    dual_clip_c: Optional[float] = None
    ratio_level: str = "token"
    aggregation: str = "token_mean"
    seq_len_norm: Optional[float] = None
    kl_coef: float = 0.0
    kl_estimator: str = "k3"
    entropy_coef: float = 0.0
    behav_weight_cap: Optional[float] = None
    behav_weight_mode: str = "mask"
    tis_cap: Optional[float] = None

    def __post_init__(self):
        _choice("ratio_level", self.ratio_level, RATIO_LEVELS)
        _choice("aggregation", self.aggregation, AGGREGATIONS)
        _choice("kl_estimator", self.kl_estimator, KL_ESTIMATORS)
        _choice("behav_weight_mode", self.behav_weight_mode, BEHAV_WEIGHT_MODES)
        if not 0 < self.eps_clip < 1:
            raise ValueError(f"eps_clip = {self.eps_clip} must be in (0, 1)")
        if self.eps_clip_high is not None and not _positive_finite(self.eps_clip_high):
            raise ValueError(f"eps_clip_high = {self.eps_clip_high} must be a finite number > 0")
        if self.dual_clip_c is not None and not (
            _positive_finite(self.dual_clip_c) and self.dual_clip_c > 1
        ):
            raise ValueError(f"dual_clip_c = {self.dual_clip_c} must be a finite number > 1")
        if self.aggregation == "seq_mean_token_sum" and not _positive_finite(
            self.seq_len_norm or 0
        ):
            raise ValueError(
                "seq_len_norm must be a finite number > 0 when aggregation = 'seq_mean_token_sum'"
            )
        for name in ("behav_weight_cap", "tis_cap"):
            value = getattr(self, name)
            if value is not None and not value > 0:  # +inf: no cap
                raise ValueError(f"{name} = {value} must be > 0")
        for name in ("kl_coef", "entropy_coef"):
            value = getattr(self, name)
            if not (value >= 0 and math.isfinite(value)):
                raise ValueError(f"{name} = {value} must be a finite number >= 0")

    @property
    def clip_high(self) -> float:
        """Upper clip range actually used (eps_clip_high, or eps_clip when None)."""
        return self.eps_clip if self.eps_clip_high is None else self.eps_clip_high


def _positive_finite(value) -> bool:
    return value > 0 and math.isfinite(value)


def _choice(name: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ValueError(f"{name} = {value!r} is not one of {allowed}")
