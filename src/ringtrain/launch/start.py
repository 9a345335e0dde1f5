"""Which engine runs a job: a fixed-size job (:mod:`ringtrain.launch.job`) or a
resizable one (:mod:`ringtrain.launch.elastic.driver`, which builds on the fixed
engine's pieces). Kept apart so neither engine imports the other's caller."""

from __future__ import annotations

from ringtrain.launch.elastic.driver import run_elastic
from ringtrain.launch.job import JobConfig, run_fixed

__all__ = ["run_job"]


def run_job(cfg: JobConfig) -> int:
    """Run the job to completion; returns the launcher's exit code."""
    if cfg.elastic is not None:
        return run_elastic(cfg)
    return run_fixed(cfg)
