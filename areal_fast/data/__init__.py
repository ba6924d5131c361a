"""Problem sets (generated tasks, GSM8K, your own rows), prompts and rewards."""

from areal_fast.data.gsm8k import load_gsm8k, parse_gsm8k_answer
from areal_fast.data.problems import MathProblem
from areal_fast.data.rewards import (
    DEFAULT_INSTRUCTION,
    apply_chat_template,
    build_prompt_messages,
    extract_answer,
    math_reward,
    normalize_number,
)
from areal_fast.data.tasks import drop_eval_overlap, known_tasks, load_problems
from areal_fast.data.user_data import load_user_data

__all__ = [
    "DEFAULT_INSTRUCTION",
    "MathProblem",
    "apply_chat_template",
    "build_prompt_messages",
    "drop_eval_overlap",
    "extract_answer",
    "known_tasks",
    "load_gsm8k",
    "load_problems",
    "load_user_data",
    "math_reward",
    "normalize_number",
    "parse_gsm8k_answer",
]
