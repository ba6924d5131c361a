"""areal-fast command line (the ``areal-fast`` script): see
:mod:`areal_fast.launch.command_line`, which parses the arguments and runs the command.

areal-fast train --config FILE [key=value ...]   asynchronous GRPO training
areal-fast sft   --config FILE [key=value ...]   supervised fine-tuning (prompt/completion, chat)
areal-fast eval  --config FILE model.path=...    greedy held-out accuracy of a model
areal-fast config [--markdown]                   every config key, its default and meaning
areal-fast compare RUN_A RUN_B [--json]          the first place where two run directories differ
"""

from __future__ import annotations

import sys

from areal_fast.launch.command_line import main, version

__all__ = ["main", "version"]

if __name__ == "__main__":
    sys.exit(main())
