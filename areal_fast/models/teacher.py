"""The distillation teacher's checks: a full model that reads the student's token ids."""

from __future__ import annotations

from pathlib import Path

from areal_fast.models.loading import load_model_config, load_tokenizer, resolve_model_path

TEACHER_KEY = "actor.distill.teacher_path"


def check_teacher(teacher_path: str, student_path: str) -> None:
    """Refuse, in one line, a teacher that cannot score the student's tokens.

    The teacher of on-policy distillation reads the student's sampled token ids, so it must
    be a full causal LM (a LoRA adapter folder is not one: the teacher is always the whole
    frozen model) whose tokenizer has exactly the student's vocabulary (same token → id
    map). The LM heads may have different padded sizes.

    Parameters
    ----------
    teacher_path : str
        ``actor.distill.teacher_path``: Hugging Face id or local model folder.
    student_path : str
        ``model.path``.

    Raises
    ------
    ValueError
        One line naming ``actor.distill.teacher_path`` (and ``model.path`` for a vocabulary
        mismatch): a LoRA adapter folder, a missing or unloadable model, another vocabulary.
    """
    folder = Path(teacher_path).expanduser()
    if (folder / "adapter_config.json").is_file() and not (folder / "config.json").is_file():
        raise ValueError(
            f"{TEACHER_KEY} = {teacher_path!r} is a LoRA adapter, not a model: the teacher "
            f"is always a full frozen model (merge the adapter into its base first)"
        )
    try:
        resolve_model_path(teacher_path)
        load_model_config(teacher_path)
        teacher_vocab = load_tokenizer(teacher_path).get_vocab()
    except ValueError as exc:
        raise ValueError(str(exc).replace("model.path", TEACHER_KEY, 1)) from exc
    student_vocab = load_tokenizer(student_path).get_vocab()
    if teacher_vocab != student_vocab:
        raise ValueError(
            f"{TEACHER_KEY} = {teacher_path!r} has another vocabulary than model.path = "
            f"{student_path!r} ({len(teacher_vocab)} vs {len(student_vocab)} tokens"
            f"{_first_difference(teacher_vocab, student_vocab)}): the teacher must read the "
            f"student's token ids"
        )


def _first_difference(teacher: dict, student: dict) -> str:
    """``, e.g. 'x' is 5 in the teacher, 7 in the student`` for the first token whose id
    differs (None: missing), in the student's id order."""
    for token in sorted(set(teacher) | set(student), key=lambda t: (student.get(t, -1), t)):
        if teacher.get(token) != student.get(token):
            ids = f"{teacher.get(token)} in the teacher, {student.get(token)} in the student"
            return f", e.g. {token!r} is {ids}"
    return ""
