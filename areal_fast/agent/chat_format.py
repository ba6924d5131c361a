"""Chat messages ↔ token ids for agent sessions, without re-tokenising model output.

:class:`ChatFormat` wraps a Hugging Face tokenizer's chat template:

- :meth:`ChatFormat.prompt_ids` renders a fresh conversation (generation prompt appended) and
  tokenises it.
- :meth:`ChatFormat.continuation_ids` gives the tokens that follow a previous call's *exact*
  input + output ids when the agent sends that reply back with new messages: the template's
  turn closing after the model's stop token, then the new messages and the generation prompt.
  Only environment text is tokenised; the model's tokens are reused as generated. It returns
  None when the template does not render the longer conversation as an extension of the
  shorter one (e.g. templates that rewrite earlier turns), and the caller starts afresh.
- :meth:`ChatFormat.parse_output` turns output ids into the reply text and OpenAI-style
  ``tool_calls``.

Tools use the JSON-in-tags convention of Hermes/Qwen2.5 models: the model writes
``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``. Templates that take ``tools``
and ``tool_calls`` themselves render them; for templates that do not (e.g. SmolLM2's), the
tool list goes into the system message and earlier tool calls into the assistant text in the
same convention, so every model sees one format.
"""

from __future__ import annotations

import json
import re
import uuid
from typing import Any, Optional

TOOL_CALL_RE = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)
_SENTINEL = "\u2063areal-fast-reply\u2063"


def _tools_system_text(tools: list[dict]) -> str:
    specs = "\n".join(json.dumps(t.get("function", t), ensure_ascii=False) for t in tools)
    return (
        "You can call functions. Their JSON signatures are inside <tools></tools>:\n"
        f"<tools>\n{specs}\n</tools>\n"
        "To call one, reply with a JSON object holding its name and arguments inside "
        "<tool_call></tool_call> tags:\n<tool_call>\n"
        '{"name": "<function-name>", "arguments": {<arguments>}}\n</tool_call>'
    )


def tool_call_text(tool_calls: list[dict]) -> str:
    """The ``<tool_call>`` blocks of OpenAI-style ``tool_calls`` (arguments parsed if JSON)."""
    blocks = []
    for call in tool_calls:
        fn = call["function"]
        args = _as_obj(fn["arguments"])
        blocks.append(
            "<tool_call>\n"
            + json.dumps({"name": fn["name"], "arguments": args}, ensure_ascii=False)
            + "\n</tool_call>"
        )
    return "\n".join(blocks)


def parse_tool_calls(text: str) -> tuple[str, list[dict]]:
    """Split generated text into its plain content and OpenAI-style tool calls.

    A ``<tool_call>`` block counts only if it holds a JSON object with a string ``name``
    (``arguments`` an object or a JSON string); anything else stays in the content, so a
    malformed call reaches the agent as text.

    Returns
    -------
    content : str
        ``text`` without the parsed blocks, stripped.
    tool_calls : list[dict]
        ``{"id": "call_<hex>", "type": "function", "function": {"name", "arguments"}}``
        with ``arguments`` a JSON string, as the OpenAI API returns them.
    """
    calls, kept, last = [], [], 0
    for match in TOOL_CALL_RE.finditer(text):
        try:
            obj = json.loads(match.group(1))
        except json.JSONDecodeError:
            continue
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            continue
        args = obj.get("arguments", {})
        if not isinstance(args, str):
            args = json.dumps(args, ensure_ascii=False)
        calls.append(
            {
                "id": "call_" + uuid.uuid4().hex[:24],
                "type": "function",
                "function": {"name": obj["name"], "arguments": args},
            }
        )
        kept.append(text[last : match.start()])
        last = match.end()
    kept.append(text[last:])
    return "".join(kept).strip(), calls


class ChatFormat:
    """Renders and tokenises chat messages with a tokenizer's chat template.

    Parameters
    ----------
    tokenizer : transformers tokenizer with a ``chat_template``

    Raises
    ------
    ValueError
        If the tokenizer has no chat template.
    """

    def __init__(self, tokenizer: Any):
        template = getattr(tokenizer, "chat_template", None)
        if not template:
            raise ValueError("the tokenizer has no chat_template; agents need one")
        self.tokenizer = tokenizer
        self.native_tools = "tools" in template
        self.native_tool_calls = "tool_calls" in template
        self.turn_closing = self._turn_closing()
        self.stop_ids = self._stop_ids()
        self.max_token_chars = self._max_token_chars()

    # ---- rendering ----------------------------------------------------------------------
    def render(
        self, messages: list[dict], tools: Optional[list[dict]], add_generation_prompt: bool
    ) -> str:
        """Template text of a conversation.

        Parameters
        ----------
        messages : list[dict]
            Normalised by :func:`normalize_message`.
        tools : list[dict] or None
            OpenAI function tools (natively or in the system message, see the module
            docstring).
        add_generation_prompt : bool
            Append the opening of an assistant turn.

        Returns
        -------
        str
        """
        msgs = [self._for_template(m) for m in messages]
        kwargs = {}
        if tools and self.native_tools:
            kwargs["tools"] = tools
        elif tools:
            extra = _tools_system_text(tools)
            if msgs and msgs[0]["role"] == "system":
                msgs[0] = {**msgs[0], "content": msgs[0]["content"] + "\n\n" + extra}
            else:
                msgs.insert(0, {"role": "system", "content": extra})
        return self.tokenizer.apply_chat_template(
            msgs, tokenize=False, add_generation_prompt=add_generation_prompt, **kwargs
        )

    def _for_template(self, message: dict) -> dict:
        out = {"role": message["role"], "content": message.get("content") or ""}
        calls = message.get("tool_calls") or []
        if calls and self.native_tool_calls:
            out["tool_calls"] = [
                {
                    **c,
                    "function": {**c["function"], "arguments": _as_obj(c["function"]["arguments"])},
                }
                for c in calls
            ]
        elif calls:
            out["content"] = (out["content"] + "\n" if out["content"] else "") + tool_call_text(
                calls
            )
        for key in ("tool_call_id", "name"):
            if message.get(key):
                out[key] = message[key]
        return out

    def _turn_closing(self) -> str:
        text = self.render(
            [{"role": "user", "content": "q"}, {"role": "assistant", "content": _SENTINEL}],
            None,
            False,
        )
        return text[text.rindex(_SENTINEL) + len(_SENTINEL) :]

    def _stop_ids(self) -> set[int]:
        """End-of-sequence id, plus the special token that opens the turn closing (e.g.
        ``<|im_end|>`` for a base model whose eos is ``<|endoftext|>``)."""
        ids = {i for i in [self.tokenizer.eos_token_id] if i is not None}
        closing = self.encode_text(self.turn_closing)
        if closing and closing[0] in set(getattr(self.tokenizer, "all_special_ids", [])):
            ids.add(closing[0])
        return ids

    def _max_token_chars(self) -> int:
        """Characters of the longest token string (a byte-level token's string has one
        character per byte, at least as many as its text), so a text of ``c`` characters
        tokenises to at least ``c / max_token_chars`` tokens."""
        tokens = self.tokenizer.convert_ids_to_tokens(list(range(len(self.tokenizer))))
        return max([1] + [len(t) for t in tokens if isinstance(t, str)])

    def text_chars(self, messages: list[dict]) -> int:
        """Characters of the messages' text (contents and tool-call arguments), all of which
        a rendered prompt holds; with :attr:`max_token_chars` a cheap lower bound on its
        length in tokens, checked before anything is rendered.

        Parameters
        ----------
        messages : list[dict]
            Normalised messages.

        Returns
        -------
        int
        """
        return sum(
            len(m["content"])
            + sum(len(c["function"]["arguments"]) for c in m.get("tool_calls") or ())
            for m in messages
        )

    def encode_text(self, text: str) -> list[int]:
        """Token ids of template text (special tokens in it are parsed, none are added)."""
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    # ---- prompts ------------------------------------------------------------------------
    def prompt_ids(self, messages: list[dict], tools: Optional[list[dict]] = None) -> list[int]:
        """Token ids of a fresh conversation with the generation prompt appended (the
        template's text tokenised once; special tokens in it are parsed, none are added).

        Parameters
        ----------
        messages : list[dict]
            Normalised messages.
        tools : list[dict], optional

        Returns
        -------
        list[int]
        """
        return self.encode_text(self.render(messages, tools, True))

    def continuation_ids(
        self,
        history: list[dict],
        new_messages: list[dict],
        tools: Optional[list[dict]],
        output_ids: list[int],
    ) -> Optional[list[int]]:
        """Tokens that follow ``input_ids + output_ids`` of the call made with ``history``.

        The conversation is rendered with a placeholder in place of that call's reply; the
        text after the placeholder (the template's turn closing, ``new_messages`` and the
        generation prompt) is the environment's part, and only it is tokenised. The model's
        own tokens are never re-tokenised, so templates that re-render earlier turns (e.g.
        dropping reasoning from them) still continue token-exactly. When the output ended on
        a stop token whose text opens the closing, that text is not repeated.

        Parameters
        ----------
        history : list[dict]
            Messages of that call's request (normalised).
        new_messages : list[dict]
            Messages after its reply (user turns, tool results); not empty.
        tools : list[dict] or None
            The same tools as that call (the caller checks).
        output_ids : list[int]
            That call's output token ids.

        Returns
        -------
        list[int] or None
            The environment's tokens, or None if the template does not render the
            placeholder exactly once (the caller then starts a fresh prompt).
        """
        text = self.render(
            history + [{"role": "assistant", "content": _SENTINEL}] + new_messages, tools, True
        )
        if text.count(_SENTINEL) != 1:
            return None
        env = text[text.index(_SENTINEL) + len(_SENTINEL) :]
        if output_ids and output_ids[-1] in self.stop_ids:
            stop_text = self.tokenizer.decode([output_ids[-1]])
            if stop_text and env.startswith(stop_text):
                env = env[len(stop_text) :]
        return self.encode_text(env)

    # ---- outputs ------------------------------------------------------------------------
    def parse_output(self, output_ids: list[int], parse_tools: bool) -> tuple[str, list[dict]]:
        """Reply text and tool calls of generated tokens.

        Parameters
        ----------
        output_ids : list[int]
        parse_tools : bool
            Look for ``<tool_call>`` blocks (see :func:`parse_tool_calls`).

        Returns
        -------
        content : str
            Decoded text without special tokens (and without parsed tool-call blocks).
        tool_calls : list[dict]
        """
        text = self.tokenizer.decode(output_ids, skip_special_tokens=True)
        return parse_tool_calls(text) if parse_tools else (text, [])

    def token_texts(self, token_ids: list[int]) -> list[str]:
        """Text of each token on its own (for per-token log-prob entries)."""
        return [self.tokenizer.decode([t]) for t in token_ids]


def _as_obj(arguments):
    if isinstance(arguments, str):
        try:
            return json.loads(arguments)
        except json.JSONDecodeError:
            return arguments
    return arguments


def normalize_message(message: Any, index: int) -> dict:
    """One request message as a plain dict: role, content (str), tool_calls, tool_call_id.

    Accepts dicts and objects with ``model_dump`` (openai's pydantic messages). Content given
    as a list of ``{"type": "text", "text": ...}`` parts is joined.

    Raises
    ------
    ValueError
        Naming ``messages[index]`` and what is wrong with it.
    """
    if hasattr(message, "model_dump"):
        message = message.model_dump(exclude_none=True)
    where = f"messages[{index}]"
    if not isinstance(message, dict):
        raise ValueError(f"{where} must be an object, got {type(message).__name__}")
    role = message.get("role")
    if role not in ("system", "developer", "user", "assistant", "tool"):
        raise ValueError(
            f"{where}.role = {role!r} is not system, developer, user, assistant or tool"
        )
    out = {
        "role": "system" if role == "developer" else role,
        "content": _content_text(message.get("content"), where),
    }
    calls = message.get("tool_calls")
    if calls:
        if role != "assistant" or not isinstance(calls, list):
            raise ValueError(f"{where}.tool_calls must be a list on an assistant message")
        out["tool_calls"] = [
            _normalize_tool_call(c, f"{where}.tool_calls[{i}]") for i, c in enumerate(calls)
        ]
    if role == "tool":
        if not isinstance(message.get("tool_call_id"), str):
            raise ValueError(f"{where}.tool_call_id must be a string on a tool message")
        out["tool_call_id"] = message["tool_call_id"]
    if isinstance(message.get("name"), str) and message["name"]:
        out["name"] = message["name"]
    return out


def _content_text(content: Any, where: str) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for i, part in enumerate(content):
            if (
                not isinstance(part, dict)
                or part.get("type") != "text"
                or not isinstance(part.get("text"), str)
            ):
                raise ValueError(
                    f'{where}.content[{i}] must be a text part {{"type": "text", "text": ...}}'
                )
            parts.append(part["text"])
        return "".join(parts)
    raise ValueError(f"{where}.content must be a string or a list of text parts")


def _normalize_tool_call(call: Any, where: str) -> dict:
    fn = call.get("function") if isinstance(call, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise ValueError(f"{where}.function.name must be a string")
    args = fn.get("arguments", "{}")
    if not isinstance(args, str):
        args = json.dumps(args, ensure_ascii=False)
    return {
        "id": str(call.get("id", "")),
        "type": "function",
        "function": {"name": fn["name"], "arguments": args},
    }
