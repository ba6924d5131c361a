"""What one experiment run carries from step to step: its config, its run directory once
prepared, and where it is (the phase and the steps trained), which the line of an
interrupted run names."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from areal_fast.launch.config import ExperimentConfig


@dataclass
class RunContext:
    """One experiment run, as the launcher's steps pass it along.

    Attributes
    ----------
    cfg : ExperimentConfig
        The run's config.
    show_progress : bool
        Draw the training progress bar.
    run_dir : Path or None
        The run directory, set once it is prepared (None: nothing was written yet).
    phase : str
        What the run is doing ("training", "evaluating before training", ...).
    version : int
        Steps trained so far.
    started : float
        ``time.perf_counter()`` at the launch.
    """

    cfg: ExperimentConfig
    show_progress: bool = True
    run_dir: Optional[Path] = None
    phase: str = "loading the data and the tokenizer"
    version: int = 0
    started: float = field(default_factory=time.perf_counter)
