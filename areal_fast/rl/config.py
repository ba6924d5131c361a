"""Configuration of the GRPO-family policy loss."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

AGGREGATIONS = ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "token_sum")
KL_ESTIMATORS = ("k1", "k2", "k3")
RATIO_LEVELS = ("token", "sequence")
BEHAV_WEIGHT_MODES = ("mask", "clamp")
SURROGATES = ("clip", "cispo", "sapo", "m2po")
SEQ_REJECTION_MEASURES = ("ratio", "k1", "k2", "k3")
SEQ_REJECTION_MODES = ("mask", "clamp")


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
    surrogate : str
        The per-token policy-gradient term (:mod:`areal_fast.rl.surrogates`): "clip" (PPO
        above); "cispo" (MiniMax 2025, MiniMax-M1, arXiv:2506.13585, CISPO objective: −sg(clip(r))·A·logp, the clip
        range [1 − eps_clip, 1 + eps_clip_high], eps_clip = 1 leaves no lower bound); "sapo"
        (Gao et al. 2025, SAPO, arXiv:2511.20347: a sigmoid gate −A·σ(τ(r − 1))·4/τ instead of the clip);
        "m2po" (Zheng et al. 2025, M2PO, arXiv:2510.01161: −M·r·A, no clip, M masking the tokens of largest
        (log π/π_behav)² until their second moment is below m2po_threshold).
    sapo_tau_pos : float
        SAPO's gate temperature where A > 0 (1.0, as in the paper).
    sapo_tau_neg : float
        SAPO's gate temperature where A ≤ 0 (1.05, as in the paper).
    m2po_threshold : float
        M2PO's bound τ on the mean of (log π/π_behav)² over the kept tokens of one call
        (the paper's 0.04).
    icepop : bool
        IcePop (Ling Team 2025, "Every Step Evolves", Ring-1T, arXiv:2510.18855): the sampler→trainer
        weight k (exp(old − engine) with engine log-probs, else the decoupled
        exp(prox − old)) is kept where icepop_low ≤ k ≤ icepop_high and set to 0 outside
        (double-sided masking); replaces behav_weight_cap and tis_cap.
    icepop_low : float
        Lower end of IcePop's band (0.5, as in the paper).
    icepop_high : float
        Upper end of IcePop's band (5, as in the paper).
    seq_rejection : str or None
        Sequence-level rejection on the sampler→trainer log-ratio δ (as for icepop), per
        sequence over its trained tokens: "ratio" (geometric mean exp(mean δ); Geo-RS / MIS,
        Liu et al. 2025, "When Speed Kills Stability"), "k1" (mean −δ), "k2" (mean δ²/2) or
        "k3" (mean e^δ − 1 − δ) (KL estimators, Schulman 2020). None: off.
    seq_rejection_mode : str
        "mask": sequences whose measure is outside [seq_rejection_low, seq_rejection_high]
        get weight 0; "clamp" ("ratio" only): the token-level sampler→trainer weight is
        replaced by the sequence's geometric mean clamped to the bounds.
    seq_rejection_low : float or None
        Lower bound of the seq_rejection measure; None: none.
    seq_rejection_high : float or None
        Upper bound of the seq_rejection measure; required when seq_rejection is set.
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
    surrogate: str = "clip"
    sapo_tau_pos: float = 1.0
    sapo_tau_neg: float = 1.05
    m2po_threshold: float = 0.04
    icepop: bool = False
    icepop_low: float = 0.5
    icepop_high: float = 5.0
    seq_rejection: Optional[str] = None
    seq_rejection_mode: str = "mask"
    seq_rejection_low: Optional[float] = None
    seq_rejection_high: Optional[float] = None

    def __post_init__(self):
        _choice("ratio_level", self.ratio_level, RATIO_LEVELS)
        _choice("aggregation", self.aggregation, AGGREGATIONS)
        _choice("kl_estimator", self.kl_estimator, KL_ESTIMATORS)
        _choice("behav_weight_mode", self.behav_weight_mode, BEHAV_WEIGHT_MODES)
        _choice("surrogate", self.surrogate, SURROGATES)
        _choice("seq_rejection_mode", self.seq_rejection_mode, SEQ_REJECTION_MODES)
        if self.seq_rejection is not None:
            _choice("seq_rejection", self.seq_rejection, SEQ_REJECTION_MEASURES)
        if not 0 < self.eps_clip < 1 and not (self.surrogate == "cispo" and self.eps_clip == 1):
            raise ValueError(
                f"eps_clip = {self.eps_clip} must be in (0, 1) (or 1 with surrogate = 'cispo')"
            )
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
        self._check_surrogate()
        self._check_corrections()

    def _check_surrogate(self) -> None:
        """What each surrogate composes with (ValueError naming the keys)."""
        for name in ("sapo_tau_pos", "sapo_tau_neg", "m2po_threshold"):
            if not _positive_finite(getattr(self, name)):
                raise ValueError(f"{name} = {getattr(self, name)} must be a finite number > 0")
        if self.surrogate == "clip":
            return
        if self.dual_clip_c is not None:
            raise ValueError(
                f"dual_clip_c = {self.dual_clip_c} applies to the PPO clip only; set it to "
                f"null with surrogate = {self.surrogate!r}"
            )
        if self.ratio_level != "token":
            raise ValueError(
                f"surrogate = {self.surrogate!r} is defined on token-level ratios; "
                f"ratio_level = {self.ratio_level!r} needs surrogate = 'clip' (GSPO)"
            )

    def _check_corrections(self) -> None:
        """IcePop and sequence-level rejection: bounds and what they replace."""
        if self.icepop:
            if not 0 <= self.icepop_low < self.icepop_high:
                raise ValueError(
                    f"icepop_low = {self.icepop_low}, icepop_high = {self.icepop_high}: "
                    f"need 0 <= icepop_low < icepop_high"
                )
            _replaces("icepop", self, ("behav_weight_cap", "tis_cap"))
        if self.seq_rejection is None:
            return
        low, high = self.seq_rejection_low, self.seq_rejection_high
        if high is None or math.isnan(high):
            raise ValueError(f"seq_rejection = {self.seq_rejection!r} needs seq_rejection_high")
        if low is not None and not low <= high:
            raise ValueError(f"seq_rejection_low = {low} must be <= seq_rejection_high = {high}")
        if self.seq_rejection_mode == "clamp":
            if self.seq_rejection != "ratio":
                raise ValueError(
                    f"seq_rejection_mode = 'clamp' needs seq_rejection = 'ratio' (a KL "
                    f"estimate is no weight), got {self.seq_rejection!r}"
                )
            _replaces("seq_rejection_mode = 'clamp'", self, ("behav_weight_cap", "tis_cap"))
            if self.icepop:
                raise ValueError(
                    "seq_rejection_mode = 'clamp' and icepop both replace the "
                    "sampler→trainer weight; pick one"
                )

    @property
    def corrects_sampler(self) -> bool:
        """Whether an option needs the sampler→trainer log-ratio (icepop, seq_rejection)."""
        return self.icepop or self.seq_rejection is not None

    @property
    def couples_tokens(self) -> bool:
        """Whether a token's loss depends on other tokens (GSPO, M2PO, seq_rejection)."""
        return (
            self.ratio_level == "sequence"
            or self.surrogate == "m2po"
            or self.seq_rejection is not None
        )

    @property
    def clip_high(self) -> float:
        """Upper clip range actually used (eps_clip_high, or eps_clip when None)."""
        return self.eps_clip if self.eps_clip_high is None else self.eps_clip_high


def _replaces(option: str, config: LossConfig, keys: tuple[str, ...]) -> None:
    for key in keys:
        if getattr(config, key) is not None:
            raise ValueError(
                f"{option} replaces {key} (both treat the sampler→trainer weight); "
                f"set {key} to null"
            )


def _positive_finite(value) -> bool:
    return value > 0 and math.isfinite(value)


def _choice(name: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ValueError(f"{name} = {value!r} is not one of {allowed}")
