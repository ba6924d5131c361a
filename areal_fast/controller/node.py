"""Which node this worker process runs on, as its launcher says.

The Ray launcher sets ``AREAL_FAST_NODE_ID`` (the Ray node id) and ``AREAL_FAST_NODE_IP`` (the
node's address) in every actor before the worker starts; local processes have neither and
all share the node ``local``.
"""

from __future__ import annotations

import os

LOCAL_NODE = "local"
WILDCARDS = ("", "0.0.0.0", "::")


def node_id() -> str:
    """This process's node id (``local`` outside Ray)."""
    return os.environ.get("AREAL_FAST_NODE_ID", LOCAL_NODE)


def advertised_ip(bind_host: str) -> str:
    """The address peers on other nodes reach this process at: ``bind_host`` unless it is a
    wildcard, then the node's IP (127.0.0.1 outside Ray)."""
    if bind_host not in WILDCARDS:
        return bind_host
    return os.environ.get("AREAL_FAST_NODE_IP", "127.0.0.1")
