"""The calculator agent written with the OpenAI Agents SDK (``pip install areal-fast[agents]``).

The agent is plain Agents SDK code: an ``Agent`` with one function tool, run by
``Runner.run``. The only training-specific line is the model: the SDK's model classes take the
``openai.AsyncOpenAI`` client this project hands the agent (``agent.mode: http``), so every
model call of the run goes to the policy being trained and is recorded token-exactly, tool
calls and tool results included. ``api="responses"`` (the SDK's default, ``/v1/responses``)
or ``api="chat_completions"`` (``OpenAIChatCompletionsModel``) picks the API it speaks.

Reward: 1 if the final answer is right; 0 if it is wrong, if the run used up ``max_turns``
model calls, or if a reply was cut off by the token budget (the SDK raises on a response with
status "incomplete", as the OpenAI API returns it).

    areal-fast train --config examples/agent_openai_agents.yaml
"""

import sys
from pathlib import Path

from agents import (
    Agent,
    OpenAIChatCompletionsModel,
    OpenAIResponsesModel,
    RunConfig,
    Runner,
    function_tool,
)
from agents.exceptions import MaxTurnsExceeded, ModelBehaviorError

from areal_fast.data.rewards import math_reward

sys.path.insert(0, str(Path(__file__).resolve().parent))
from calculator import INSTRUCTION, calculate  # noqa: E402 - the sibling example's tool


@function_tool
def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression, e.g. '(12 + 7) * 3'."""
    return calculate(expression)


class OpenAIAgentsCalculator:
    """Answers ``data["question"]`` with an Agents SDK agent that may call ``calculator``.

    Parameters
    ----------
    api : str
        "responses" (``OpenAIResponsesModel``, the SDK's default) or "chat_completions".
    max_turns : int
        Model calls allowed per run (the SDK's ``max_turns``).
    """

    def __init__(self, api: str = "responses", max_turns: int = 3):
        if api not in ("responses", "chat_completions"):
            raise ValueError(f"api = {api!r} must be 'responses' or 'chat_completions'")
        self.api, self.max_turns = api, max_turns

    async def run_agent_return_reward(self, data: dict, client) -> float:
        """One episode; returns 1.0 if the final answer is right."""
        models = {"responses": OpenAIResponsesModel, "chat_completions": OpenAIChatCompletionsModel}
        agent = Agent(
            name="calculator",
            instructions=INSTRUCTION,
            tools=[calculator],
            model=models[self.api](model="policy", openai_client=client),
        )
        try:
            result = await Runner.run(
                agent,
                data["question"],
                max_turns=self.max_turns,
                run_config=RunConfig(tracing_disabled=True),
            )
        except (MaxTurnsExceeded, ModelBehaviorError):
            return 0.0
        return math_reward(str(result.final_output), data["answer"])
