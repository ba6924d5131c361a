"""Which node a worker process runs on, and the address its servers tell their peers.

The Ray launcher sets ``AREAL_FAST_NODE_ID`` (the Ray node id) and ``AREAL_FAST_NODE_IP``
(the node's IP as Ray sees it) in each worker actor's process before the worker starts; local
processes have neither: they all share one node, ``"local"``.

A server bound to a wildcard address (``0.0.0.0``, every interface) cannot give that address
to its peers; :func:`reachable_host` names the node's own IP instead (127.0.0.1 on a local
node).
"""

from __future__ import annotations

import os
from typing import Optional

NODE_ID_ENV = "AREAL_FAST_NODE_ID"
NODE_IP_ENV = "AREAL_FAST_NODE_IP"
LOCAL_NODE = "local"
WILDCARD_HOSTS = frozenset({"0.0.0.0", "::", ""})


def node_id() -> str:
    """This process's node: the Ray node id under the Ray launcher, else ``"local"``."""
    return os.environ.get(NODE_ID_ENV) or LOCAL_NODE


def node_ip() -> Optional[str]:
    """This process's node IP under the Ray launcher (None for a local process)."""
    return os.environ.get(NODE_IP_ENV) or None


def is_wildcard(host: str) -> bool:
    """Whether binding ``host`` means every interface (``0.0.0.0``, ``::``, ``""``)."""
    return host in WILDCARD_HOSTS


def reachable_host(host: str, ip: Optional[str] = None) -> str:
    """The address peers use for a server bound to ``host``: ``host`` itself, or for a
    wildcard this node's IP (``ip``, default :func:`node_ip`; 127.0.0.1 for a local
    process)."""
    return (ip or node_ip() or "127.0.0.1") if is_wildcard(host) else host
