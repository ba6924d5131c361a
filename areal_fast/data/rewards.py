"""Prompts, answer extraction and the 0/1 correctness reward for math tasks.

The reward is a plain function of (completion text, gold answer) so it can run in any
thread of the rollout executor. Extraction is rule based and cheap; ``math_verify`` is
only consulted when a numeric comparison is impossible (symbolic gold answers such as
``\\frac{1}{2}``, or a boxed expression instead of a number).
"""

from __future__ import annotations

import logging
import re
import threading
from collections.abc import Mapping, Sequence
from decimal import Decimal, InvalidOperation
from typing import Any

DEFAULT_INSTRUCTION = "Give only the final answer as a number."
"""Answer-format suffix appended to every question unless the caller gives another."""

NUMERIC_TOLERANCE = Decimal("1e-6")
"""Two numeric answers match when they differ by at most this much (absolute)."""

MATH_VERIFY_TIMEOUT_S = 5
"""Timeout for one ``math_verify`` parse/verify call, honoured on the main thread only."""

_MATH_VERIFY_MAX_CHARS = 2000
"""Only this many trailing characters of a completion are handed to ``math_verify``."""

# A number: optional minus (not when it is a binary minus such as ``5-3``), digits with
# optional thousands groups, optional decimal part. The look-behind keeps the ``2`` of
# ``x2`` or the ``1`` of ``step1`` from being read as numbers.
_NUMBER_RE = re.compile(
    r"(?<![0-9A-Za-z_])"
    r"(?:(?<![0-9A-Za-z_)\]])-)?"
    r"(?:\d{1,3}(?:,\d{3})+(?!\d)|\d+)(?:\.\d+)?"
    r"|(?<![0-9A-Za-z_.])-?\.\d+"
)
_PLAIN_NUMBER_RE = re.compile(r"[+-]?(?:\d+(?:\.\d*)?|\.\d+)")
_THOUSANDS_RE = re.compile(r"[+-]?\d{1,3}(?:,\d{3})+(?:\.\d+)?")
_HASH_RE = re.compile(r"####[ \t]*([^\n]*)")
_ANSWER_IS_RE = re.compile(
    r"\banswer\b\s*(?:is|was|would be|will be|should be)?\s*[:=]?\s*([^\n]*)", re.IGNORECASE
)
_TEXT_CMD_RE = re.compile(r"\\(?:text|textbf|mathrm|mbox|textrm)\s*\{([^{}]*)\}")
_NUMBER_WITH_UNIT_RE = re.compile(r"([+-]?[\d.,]+)\s*[A-Za-z][A-Za-z .]*")
_MINUS_SIGNS = str.maketrans({"\u2212": "-", "\u2013": "-", "\u2014": "-"})


# --------------------------------------------------------------------------- numbers


def normalize_number(text: str | None) -> str | None:
    """Canonical string of a number written the way people and models write them.

    Parameters
    ----------
    text : str or None
        Candidate such as ``"1,234"``, ``"$12.50"``, ``"-3."``, ``"+7"``, ``"45%"``.

    Returns
    -------
    str or None
        ``"1234"``, ``"12.5"``, ``"-3"``, ``"7"``, ``"45"``: integers without a decimal
        point, decimals without trailing zeros, never an exponent. ``None`` if ``text``
        is not a single number.
    """
    if not isinstance(text, str):
        return None
    s = text.translate(_MINUS_SIGNS).strip()
    s = s.replace("\\$", "").replace("$", "").replace("\\%", "").replace("%", "").strip()
    s = s.rstrip(".").strip()
    if _THOUSANDS_RE.fullmatch(s):
        s = s.replace(",", "")
    if not _PLAIN_NUMBER_RE.fullmatch(s):
        return None
    try:
        value = Decimal(s)
    except InvalidOperation:
        return None
    if value == value.to_integral_value():
        return str(int(value))
    return format(value.normalize(), "f")


def _first_number(text: str) -> str | None:
    match = _NUMBER_RE.search(text.translate(_MINUS_SIGNS))
    return normalize_number(match.group(0)) if match else None


def _last_number(text: str) -> str | None:
    matches = _NUMBER_RE.findall(text.translate(_MINUS_SIGNS))
    return normalize_number(matches[-1]) if matches else None


# --------------------------------------------------------------------------- extraction


def _last_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` with balanced braces, or None."""
    start = text.rfind("\\boxed")
    while start != -1:
        i = start + len("\\boxed")
        while i < len(text) and text[i] == " ":
            i += 1
        if i < len(text) and text[i] == "{":
            depth = 0
            for j in range(i, len(text)):
                if text[j] == "{":
                    depth += 1
                elif text[j] == "}":
                    depth -= 1
                    if depth == 0:
                        return text[i + 1 : j]
        start = text.rfind("\\boxed", 0, start)
    return None


def _clean_boxed(content: str) -> str:
    """Numeric value of a boxed answer if it has one, else the tidied LaTeX."""
    s = _TEXT_CMD_RE.sub(r"\1", content)
    for junk in ("\\!", "\\,", "\\;", "\\ ", "~", "^\\circ", "^{\\circ}", "\\left", "\\right"):
        s = s.replace(junk, "")
    s = " ".join(s.split())
    if "=" in s:
        s = s.rsplit("=", 1)[1].strip()
    number = normalize_number(s)
    if number is not None:
        return number
    unit = _NUMBER_WITH_UNIT_RE.fullmatch(s)
    if unit is not None and normalize_number(unit.group(1)) is not None:
        return normalize_number(unit.group(1))  # type: ignore[return-value]
    return s


def extract_answer(text: str) -> str | None:
    """Final answer of a model reply.

    Strategies, first hit wins: the last ``\\boxed{...}``; the number after the last
    ``#### ``; the number after the last "answer is" / "answer:"; the last number
    anywhere in the text. Numbers may be negative, decimal, use thousands commas or end
    a sentence with a period.

    Parameters
    ----------
    text : str
        The completion, as decoded text.

    Returns
    -------
    str or None
        The answer, normalised by :func:`normalize_number` when numeric (``"1234"``,
        ``"-3"``, ``"4.5"``); for a non-numeric boxed answer, its LaTeX with ``\\text``
        wrappers and spacing commands removed. ``None`` when the text holds no answer
        (or is not a string).
    """
    if not isinstance(text, str) or not text:
        return None
    boxed = _last_boxed(text)
    if boxed is not None and boxed.strip():
        return _clean_boxed(boxed)
    hashes = _HASH_RE.findall(text)
    if hashes:
        number = _first_number(hashes[-1])
        if number is not None:
            return number
    stated = _ANSWER_IS_RE.findall(text)
    if stated:
        number = _first_number(stated[-1])
        if number is not None:
            return number
    return _last_number(text)


# --------------------------------------------------------------------------- reward


_MATH_VERIFY_LOGGERS = ("math_verify.parser", "math_verify.grader")
"""The loggers of ``parse`` and ``verify``."""


class _TimeoutOffOnPurpose(logging.Filter):
    """Drops ``math_verify``'s "Timeout is disabled ..." warning, which ``parse`` and
    ``verify`` log once per process when called with the timeout switched off: this module
    switches it off on purpose off the main thread and bounds the input instead (see
    :func:`_math_verify_match`). Its other records, such as a timeout that struck, pass."""

    def filter(self, record: logging.LogRecord) -> bool:
        """False for the timeout-disabled warning only."""
        return not record.getMessage().startswith("Timeout is disabled")


_TIMEOUT_FILTER = _TimeoutOffOnPurpose()


def _math_verify_match(completion_text: str, predicted: str | None, gold: str) -> bool:
    """Symbolic equivalence through ``math_verify``; False on any failure.

    ``math_verify`` enforces its timeouts with ``signal.alarm``, which Python allows only
    on the main thread (elsewhere ``parse`` raises ``ValueError``). Off the main thread
    the timeout is therefore switched off (``parsing_timeout`` / ``timeout_seconds`` None,
    as math_verify asks for threads) and the input is capped at ``_MATH_VERIFY_MAX_CHARS``
    characters instead; math_verify's warning that its timeout is off is not shown.
    """
    try:
        from math_verify import parse, verify
        from math_verify.errors import TimeoutException
    except ImportError:
        return False
    on_main = threading.current_thread() is threading.main_thread()
    timeout = MATH_VERIFY_TIMEOUT_S if on_main else None
    if timeout is None:
        for name in _MATH_VERIFY_LOGGERS:  # adding the same filter twice keeps one
            logging.getLogger(name).addFilter(_TIMEOUT_FILTER)
    try:
        gold_parsed = parse(f"${gold}$", parsing_timeout=timeout)
        if not gold_parsed:
            return False
        candidates = [completion_text[-_MATH_VERIFY_MAX_CHARS:]]
        if predicted:
            candidates.insert(0, f"${predicted[:_MATH_VERIFY_MAX_CHARS]}$")
        for candidate in candidates:
            target = parse(candidate, parsing_timeout=timeout)
            if target and verify(gold_parsed, target, timeout_seconds=timeout):
                return True
    except (Exception, TimeoutException):  # TimeoutException derives from BaseException
        return False
    return False


def _same_text(a: str, b: str) -> bool:
    return " ".join(a.split()).lower() == " ".join(b.split()).lower()


def math_reward(completion_text: str, gold: str) -> float:
    """1.0 if the completion's final answer equals the gold answer, else 0.0.

    Numeric gold answers are compared numerically with :data:`NUMERIC_TOLERANCE`
    (absolute) after :func:`extract_answer`. When either side is not a plain number the
    answers are compared as text (case and spacing ignored) and then with ``math_verify``
    (symbolic equivalence, e.g. ``\\frac{1}{2}`` vs ``0.5``). Safe to call from any
    thread; see :func:`_math_verify_match` for the timeout caveat off the main thread.

    Parameters
    ----------
    completion_text : str
        Decoded model reply. Any content is accepted; malformed text scores 0.0.
    gold : str
        Reference answer, normally :attr:`MathProblem.answer`.

    Returns
    -------
    float
        1.0 or 0.0.

    Raises
    ------
    TypeError
        If ``gold`` is not a string (a caller bug, not a model failure).
    """
    if not isinstance(gold, str):
        raise TypeError(f"gold answer must be a str, got {type(gold).__name__}")
    if not isinstance(completion_text, str):
        return 0.0
    try:
        predicted = extract_answer(completion_text)
        gold_number = normalize_number(gold)
        predicted_number = normalize_number(predicted)
        if gold_number is not None and predicted_number is not None:
            close = abs(Decimal(gold_number) - Decimal(predicted_number)) <= NUMERIC_TOLERANCE
            return 1.0 if close else 0.0
        if predicted is None:
            return 0.0
        if _same_text(predicted, gold):
            return 1.0
        return 1.0 if _math_verify_match(completion_text, predicted, gold) else 0.0
    except Exception:
        return 0.0


# --------------------------------------------------------------------------- prompts


def build_prompt_messages(question: str, instruction: str = DEFAULT_INSTRUCTION) -> list[dict]:
    """Chat messages for one problem: a single user turn.

    Parameters
    ----------
    question : str
        Problem text.
    instruction : str, optional
        Answer-format instruction placed on the line after the question; an empty
        string sends the question alone. Defaults to :data:`DEFAULT_INSTRUCTION`.

    Returns
    -------
    list of dict
        ``[{"role": "user", "content": question + "\\n" + instruction}]``.
    """
    content = f"{question}\n{instruction}" if instruction else question
    return [{"role": "user", "content": content}]


def _as_token_list(encoded: Any) -> list[int]:
    """Token ids from whatever ``apply_chat_template(tokenize=True)`` returned."""
    if isinstance(encoded, Mapping) or hasattr(encoded, "input_ids"):
        encoded = encoded["input_ids"]
    if hasattr(encoded, "tolist"):
        encoded = encoded.tolist()
    if isinstance(encoded, Sequence) and len(encoded) == 1 and isinstance(encoded[0], Sequence):
        encoded = encoded[0]
    return [int(t) for t in encoded]


def apply_chat_template(tokenizer: Any, messages: list[dict]) -> list[int]:
    """Prompt token ids for ``messages``, ending where the assistant reply starts.

    Parameters
    ----------
    tokenizer : transformers tokenizer
        Any Hugging Face tokenizer. If it has a chat template, it is applied with
        ``add_generation_prompt=True``; the result may be a list, a tensor or a
        ``BatchEncoding`` (transformers 5 returns the latter), all are accepted.
        Without a chat template the prompt is the plain text
        ``"<message contents joined by newlines>\\nAnswer:"``, encoded with the
        tokenizer's default special tokens.
    messages : list of dict
        Chat messages, e.g. from :func:`build_prompt_messages`.

    Returns
    -------
    list of int
        Prompt token ids.
    """
    if getattr(tokenizer, "chat_template", None):
        encoded = tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
        return _as_token_list(encoded)
    text = "\n".join(str(m["content"]) for m in messages) + "\nAnswer:"
    return [int(t) for t in tokenizer.encode(text)]
