"""The calculator agent written with LangGraph (``pip install areal-fast[agents]``).

A ReAct loop as a LangGraph ``StateGraph``: a model node (``ChatOpenAI`` with the tool bound)
and a ``ToolNode``, joined by ``tools_condition``. The only training-specific line is the
model: ``ChatOpenAI`` points at the endpoint this project serves for the session
(``agent.mode: http``; the client it hands the agent carries the URL and the session's key),
so every model call goes to the policy being trained and is recorded token-exactly, tool calls
and tool results included.

Reward: 1 if the final answer is right; 0 if it is wrong or the graph hit its recursion limit
(``max_calls`` model calls).

    areal-fast train --config examples/agent_langgraph.yaml
"""

import sys
from pathlib import Path

from langchain_core.messages import HumanMessage, SystemMessage
from langchain_core.tools import tool
from langchain_openai import ChatOpenAI
from langgraph.errors import GraphRecursionError
from langgraph.graph import START, MessagesState, StateGraph
from langgraph.prebuilt import ToolNode, tools_condition

from areal_fast.data.rewards import math_reward

sys.path.insert(0, str(Path(__file__).resolve().parent))
from calculator import INSTRUCTION, calculate  # noqa: E402 - the sibling example's tool


@tool
def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression, e.g. '(12 + 7) * 3'."""
    return calculate(expression)


def build_graph(llm: ChatOpenAI):
    """The ReAct graph: model → (tool calls? → tools → model) → end."""
    model = llm.bind_tools([calculator])

    async def call_model(state: MessagesState) -> dict:
        return {"messages": [await model.ainvoke(state["messages"])]}

    graph = StateGraph(MessagesState)
    graph.add_node("model", call_model)
    graph.add_node("tools", ToolNode([calculator]))
    graph.add_edge(START, "model")
    graph.add_conditional_edges("model", tools_condition)
    graph.add_edge("tools", "model")
    return graph.compile()


class LangGraphCalculator:
    """Answers ``data["question"]`` with a LangGraph ReAct agent that may call ``calculator``.

    Parameters
    ----------
    max_calls : int
        Model calls allowed per run (the graph's recursion limit is 2 · max_calls - 1 steps).
    streaming : bool
        Let ``ChatOpenAI`` stream (``stream: true``, server-sent events).
    """

    def __init__(self, max_calls: int = 3, streaming: bool = False):
        self.max_calls, self.streaming = max_calls, streaming

    async def run_agent_return_reward(self, data: dict, client) -> float:
        """One episode; returns 1.0 if the final answer is right."""
        llm = ChatOpenAI(
            model="policy",
            base_url=str(client.base_url),
            api_key=client.api_key,
            max_retries=0,
            streaming=self.streaming,
        )
        messages = [SystemMessage(INSTRUCTION), HumanMessage(data["question"])]
        try:
            state = await build_graph(llm).ainvoke(
                {"messages": messages}, {"recursion_limit": 2 * self.max_calls - 1}
            )
        except GraphRecursionError:
            return 0.0
        return math_reward(str(state["messages"][-1].content), data["answer"])
