"""The rollout config sections (areal_fast/rollout/config.py): what the vLLM engines take."""

from __future__ import annotations

import pytest

from areal_fast.rollout.config import VLLMConfig


def test_for_model_resolves_auto_to_the_model_dtype_and_keeps_the_rest():
    config = VLLMConfig(max_model_len=512, seed=3)
    resolved = config.for_model("bfloat16")
    assert resolved.dtype == "bfloat16" and config.dtype == "auto"  # a copy
    assert (resolved.max_model_len, resolved.seed) == (512, 3)
    explicit = VLLMConfig(dtype="float16")
    assert explicit.for_model("float32") is explicit


def test_engine_settings_are_checked_where_they_are_made():
    with pytest.raises(ValueError, match="startup_timeout"):
        VLLMConfig(startup_timeout=0)
    with pytest.raises(ValueError, match="dtype = 'int8'"):
        VLLMConfig(dtype="int8")
