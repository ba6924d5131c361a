"""Drop-in adapters that let other RL libraries train with areal_fast's losses.

- :mod:`areal_fast.integrations.trl` — :class:`AFGRPOTrainer`, a subclass of TRL's
  ``GRPOTrainer`` whose log-probs come from :func:`areal_fast.linear_logprobs` and whose loss is
  :func:`areal_fast.grpo_loss`; :func:`trl_loss_config` maps a ``GRPOConfig`` to a
  :class:`areal_fast.LossConfig`.
- :mod:`areal_fast.integrations.verl` — :func:`register_verl_policy_loss` registers
  :func:`areal_fast.grpo_loss` as a verl policy loss (``actor.policy_loss.loss_mode``);
  :func:`verl_policy_loss` is that loss as a plain function.

Neither TRL nor verl is a dependency of areal_fast: each submodule imports its library when it
is imported (TRL) or when a function that needs it is called (verl). The names above can be
imported from this package directly; that imports the submodule on first access.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "AFGRPOTrainer": "trl",
    "trl_loss_config": "trl",
    "register_verl_policy_loss": "verl",
    "verl_loss_config": "verl",
    "verl_policy_loss": "verl",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        module = importlib.import_module(f"{__name__}.{_EXPORTS[name]}")
        return getattr(module, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
