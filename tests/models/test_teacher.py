"""The distillation teacher's checks: a full model reading the student's token ids."""

import pytest
import transformers
from conftest import swapped_vocab_copy

from areal_fast.models.teacher import check_teacher


def test_a_teacher_with_the_same_tokenizer_and_a_wider_head_passes(tiny_model_dir, tmp_path):
    config = transformers.AutoConfig.from_pretrained(str(tiny_model_dir))
    config.vocab_size += 28  # a padded LM head, as larger models of one family have
    config.hidden_size = 64  # and another size
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "t")
    transformers.AutoTokenizer.from_pretrained(str(tiny_model_dir)).save_pretrained(tmp_path / "t")
    check_teacher(str(tmp_path / "t"), str(tiny_model_dir))
    check_teacher(str(tiny_model_dir), str(tiny_model_dir))


def test_another_vocabulary_names_both_paths_and_a_token(tiny_model_dir, tmp_path):
    teacher = tmp_path / "t"
    vocab = swapped_vocab_copy(tiny_model_dir, teacher, "x", "y")
    with pytest.raises(ValueError) as info:
        check_teacher(str(teacher), str(tiny_model_dir))
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith(f"actor.distill.teacher_path = {str(teacher)!r} has another")
    assert f"model.path = {str(tiny_model_dir)!r}" in message
    assert f"e.g. 'x' is {vocab['x']} in the teacher, {vocab['y']} in the student" in message


def test_a_lora_adapter_or_nothing_is_refused(tmp_path, tiny_model_dir):
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text("{}")
    with pytest.raises(ValueError, match="is a LoRA adapter, not a model"):
        check_teacher(str(adapter), str(tiny_model_dir))
    with pytest.raises(ValueError) as info:
        check_teacher(str(tmp_path / "empty/x"), str(tiny_model_dir))
    assert str(info.value).startswith("actor.distill.teacher_path = ")
    assert "does not exist" in str(info.value)
