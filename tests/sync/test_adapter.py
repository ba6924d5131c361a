"""Adapter tensor names and their grouping per module (areal_fast/sync/adapter.py), which the
trainer's ``adapter_weights`` and both engines' checks share."""

from __future__ import annotations

import pytest

from areal_fast.sync.adapter import (
    LORA_A,
    LORA_B,
    AdapterShapes,
    group_adapter,
    is_adapter_update,
    split_adapter_name,
)

Q = "model.layers.0.self_attn.q_proj"
V = "model.layers.1.self_attn.v_proj"


def test_update_of_adapter_tensors_only():
    assert is_adapter_update([Q + LORA_A, Q + LORA_B])
    assert is_adapter_update(iter([V + LORA_B]))  # a generator is read once
    assert not is_adapter_update([])
    assert not is_adapter_update([Q + LORA_A, "model.norm.weight"])
    assert not is_adapter_update([Q + ".lora_A.default.weight"])  # peft's names are not ours


def test_split_names_the_module_and_the_tensor():
    assert split_adapter_name(Q + LORA_A) == (Q, ".lora_A")
    assert split_adapter_name("x.lora_B") == ("x", ".lora_B")
    with pytest.raises(ValueError, match=r"'model.norm.weight' is not an adapter tensor"):
        split_adapter_name("model.norm.weight")


def test_group_pairs_each_module_in_first_seen_order():
    shapes = {V + LORA_B: [32, 4], Q + LORA_A: (4, 16), V + LORA_A: (4, 16), Q + LORA_B: (16, 4)}
    groups = group_adapter(shapes)
    assert list(groups) == [V, Q]
    assert groups[V] == AdapterShapes((4, 16), (32, 4))  # lists become tuples
    assert groups[Q].a == (4, 16) and groups[Q].b == (16, 4)
    assert groups[Q].missing(Q) == "" and group_adapter({}) == {}


def test_group_keeps_a_lone_tensor_and_says_which_is_missing():
    groups = group_adapter({Q + LORA_A: (4, 16), V + LORA_B: (32, 4)})
    assert groups[Q] == AdapterShapes((4, 16), None)
    assert groups[Q].missing(Q) == f"adapter for {Q!r}: {Q}.lora_B is missing"
    assert groups[V].missing(V) == f"adapter for {V!r}: {V}.lora_A is missing"


def test_group_refuses_a_name_that_is_not_an_adapter_tensor():
    with pytest.raises(ValueError, match=r"^tensor 'model.norm.weight' is not an adapter tensor"):
        group_adapter({Q + LORA_A: (4, 16), "model.norm.weight": (16,)})
