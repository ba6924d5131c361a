"""A tool-calling math agent: the model may call a ``calculator`` tool before answering.

The tool list goes to the model in the OpenAI ``tools`` format; the model's calls come back as
``message.tool_calls`` and each result goes back as a ``{"role": "tool"}`` message. The
expression is evaluated by a small arithmetic interpreter (numbers, + - * / // % **,
parentheses), never by ``eval``. Reward: 1 if the final answer is right, else 0.

    areal-fast train --config examples/agent_calculator.yaml
"""

import ast
import json
import operator

from areal_fast.data.rewards import build_prompt_messages, math_reward

CALCULATOR = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluate an arithmetic expression, e.g. '(12 + 7) * 3'.",
        "parameters": {
            "type": "object",
            "properties": {"expression": {"type": "string"}},
            "required": ["expression"],
        },
    },
}
INSTRUCTION = (
    "You may call the calculator tool for arithmetic. End with the final answer as a number."
)
_BINARY = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}


def calculate(expression: str) -> str:
    """Value of an arithmetic expression as text, or "error: ..." (never raises)."""

    def value(node):
        if (
            isinstance(node, ast.Constant)
            and isinstance(node.value, (int, float))
            and not isinstance(node.value, bool)
        ):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
            left, right = value(node.left), value(node.right)
            if isinstance(node.op, ast.Pow) and abs(right) > 64:
                raise ValueError("exponent too large")
            return _BINARY[type(node.op)](left, right)
        if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
            return _UNARY[type(node.op)](value(node.operand))
        raise ValueError(f"unsupported expression element {type(node).__name__}")

    try:
        if len(expression) > 200:
            raise ValueError("expression too long")
        result = value(ast.parse(expression, mode="eval").body)
    except (SyntaxError, ValueError, ZeroDivisionError, OverflowError, TypeError) as exc:
        return f"error: {exc}"
    return str(int(result)) if float(result).is_integer() else f"{result:.6g}"


class CalculatorAgent:
    """Answers ``data["question"]``, running the model's calculator calls (at most
    ``max_calls`` model calls in all)."""

    def __init__(self, max_calls: int = 3):
        self.max_calls = max_calls

    async def run_agent_return_reward(self, data: dict, client) -> float:
        """One episode; returns 1.0 if the final answer is right."""
        messages = build_prompt_messages(data["question"], INSTRUCTION)
        for _ in range(self.max_calls):
            response = await client.chat.completions.create(
                model="policy", messages=messages, tools=[CALCULATOR]
            )
            message = response.choices[0].message
            if not message.tool_calls:
                return math_reward(message.content or "", data["answer"])
            messages = messages + [message.model_dump(exclude_none=True)]
            for call in message.tool_calls:
                try:
                    expression = json.loads(call.function.arguments).get("expression", "")
                except (json.JSONDecodeError, AttributeError):
                    expression = ""
                messages.append(
                    {"role": "tool", "tool_call_id": call.id, "content": calculate(str(expression))}
                )
        return 0.0
