"""Training that survives a dead worker: periodic checkpoints and an exact resume.

``ringrun --max-restarts K`` restarts the whole job when a worker dies; this module
makes the script pick up where the last checkpoint left off, so at most ``every``
steps are redone and the result is the same as an uninterrupted run (bit for bit on
CPU with fixed seeds: model, optimizer, the loader's position and every rank's random
number generators are restored)::

    state = rt.elastic.Resumable("runs/ckpt", model=model, optimizer=opt,
                                 loader=loader, every=100)
    for step in range(state.resume(), total_steps):      # 0 on a fresh start
        ...one training step...
        state.step_done(step + 1)                         # saves every 100 steps

Why whole-job restarts rather than Horovod's in-process elastic mode: a restart gives
every attempt a fresh process group and rendezvous (FIELD-NOTES: reusing a dead
attempt's addresses hung torchrun restarts), and costs one interpreter start plus the
work since the last checkpoint.

Every rank must call :meth:`Resumable.resume`, :meth:`Resumable.step_done` and
:meth:`Resumable.save` at the same steps (they exchange the per-rank states).
"""

from __future__ import annotations

import logging
import os
import random
import re
from pathlib import Path
from typing import Any, Protocol

import torch

from ringtrain import checkpoint, collectives, runtime
from ringtrain.errors import ConfigError

__all__ = ["Resumable", "Stateful", "attempt"]

log = logging.getLogger("ringtrain.elastic")

_NAME = "step-{:09d}" + checkpoint.SUFFIX
_STEP = re.compile(r"step-(\d+)" + re.escape(checkpoint.SUFFIX) + "$")


class Stateful(Protocol):
    """Anything with ``state_dict()`` / ``load_state_dict()`` (a model, optimizer, loader)."""

    def state_dict(self) -> Any: ...
    def load_state_dict(self, state: Any) -> Any: ...


def attempt() -> int:
    """How many times ringrun (or torchrun) has restarted this job; 0 on the first start."""
    return runtime.world().env.attempt if runtime.is_initialized() else 0


def _rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


class Resumable:
    """Saves the training state every ``every`` steps and restores the newest on start.

    ``extra`` is a dict of plain values (epoch, best score...) saved and restored with
    the rest; read it after :meth:`resume`.
    """

    def __init__(
        self,
        directory: str | os.PathLike[str],
        *,
        model: Stateful,
        optimizer: Stateful | None = None,
        loader: Stateful | None = None,
        every: int = 100,
        keep: int = 2,
        extra: dict[str, Any] | None = None,
    ) -> None:
        if every < 1:
            raise ConfigError(f"every must be >= 1 step, got {every}")
        if keep < 1:
            raise ConfigError(f"keep must be >= 1 checkpoint, got {keep}")
        self.directory = Path(directory)
        self.model = model
        self.optimizer = optimizer
        self.loader = loader
        self.every = every
        self.keep = keep
        self.extra: dict[str, Any] = dict(extra or {})
        #: The step the last :meth:`resume` started from (0 on a fresh start).
        self.start_step = 0
        #: The checkpoint :meth:`resume` loaded, if any.
        self.resumed_from: Path | None = None

    def _size_rank(self) -> tuple[int, int]:
        if runtime.is_initialized():
            return runtime.size(), runtime.rank()
        return 1, 0

    def resume(self) -> int:
        """Load the newest complete checkpoint (every rank gets it); the step to go on from.

        Without a checkpoint, rank 0's model parameters are broadcast so every rank starts
        from the same weights, and 0 is returned.
        """
        size, rank = self._size_rank()
        path = checkpoint.latest(self.directory, pattern="step-*" + checkpoint.SUFFIX)
        if size > 1:
            # Rank 0 decides: the directory may not be shared, or may change under us.
            path = collectives.broadcast_object(str(path) if path else None, root_rank=0,
                                                name="elastic.resume")
            path = Path(path) if path else None
        if path is None:
            if size > 1:
                for name, tensor in self.model.state_dict().items():
                    collectives.broadcast_(tensor, root_rank=0, name=f"elastic.init {name}")
            self.start_step = 0
            return 0
        state = checkpoint.load(path)  # safe: only what Resumable itself saves
        self.model.load_state_dict(state["model"])
        if self.optimizer is not None and state.get("optimizer") is not None:
            self.optimizer.load_state_dict(state["optimizer"])
        per_rank = state.get("per_rank") or []
        mine = per_rank[rank] if len(per_rank) == size else None
        if mine is None and per_rank:
            log.warning("checkpoint %s was written by %d ranks, this job has %d: loader positions "
                        "come from rank 0 and random generators are not restored",
                        path, len(per_rank), size)
        if self.loader is not None:
            loader_state = (mine or per_rank[0])["loader"] if per_rank else None
            if loader_state is not None:
                self.loader.load_state_dict(loader_state)
        if mine is not None:
            _set_rng_state(mine["rng"])
        self.extra.update(state.get("extra", {}))
        self.start_step = int(state["step"])
        self.resumed_from = path
        log.info("resumed from %s at step %d", path, self.start_step)
        return self.start_step

    def step_done(self, step: int) -> bool:
        """Call after each step with the number of steps completed; saves on multiples of ``every``."""
        if step % self.every:
            return False
        self.save(step)
        return True

    def save(self, step: int) -> Path | None:
        """Save now (every rank must call it); rank 0 writes ``step-<step>.ckpt``."""
        size, rank = self._size_rank()
        mine = {
            "rng": _rng_state(),
            "loader": self.loader.state_dict() if self.loader is not None else None,
        }
        per_rank = collectives.allgather_object(mine, name="elastic.save") if size > 1 else [mine]
        if rank != 0:
            return None
        state = {
            "step": step,
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict() if self.optimizer is not None else None,
            "per_rank": per_rank,
            "extra": dict(self.extra),
        }
        path = checkpoint.save(self.directory / _NAME.format(step), state)
        self._prune()
        return path

    def _prune(self) -> None:
        found = sorted(
            (int(m.group(1)), p) for p in self.directory.glob("step-*" + checkpoint.SUFFIX)
            if (m := _STEP.search(p.name))
        )
        for _, old in found[: -self.keep]:
            old.unlink(missing_ok=True)
