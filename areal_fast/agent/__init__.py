"""Agentic RL: user agents as the rollout workload, token-exact sessions, an OpenAI-compatible
endpoint, and a compressed trajectory store (see docs/agents.md).

Light to import: the endpoint (aiohttp) and the store's zstandard are imported where used.
"""

from areal_fast.agent.bridge import EngineBridge
from areal_fast.agent.chat_format import ChatFormat
from areal_fast.agent.client import AgentClient, ChatBackend, GenResult, SessionDefaults
from areal_fast.agent.protocol import BadRequest, ChatRequest, parse_chat_request
from areal_fast.agent.runner import (
    AgentConfig,
    AgentRunner,
    current_client,
    load_agent,
)
from areal_fast.agent.session import ModelCall, Session
from areal_fast.agent.store import (
    TrajectoryConfig,
    TrajectoryStoreError,
    TrajectoryWriter,
    read_trajectories,
)

__all__ = [
    "AgentClient",
    "AgentConfig",
    "AgentRunner",
    "BadRequest",
    "ChatBackend",
    "ChatFormat",
    "ChatRequest",
    "EngineBridge",
    "GenResult",
    "ModelCall",
    "Session",
    "SessionDefaults",
    "TrajectoryConfig",
    "TrajectoryStoreError",
    "TrajectoryWriter",
    "current_client",
    "load_agent",
    "parse_chat_request",
    "read_trajectories",
]
