"""Training that survives a dead worker: periodic checkpoints and an exact resume.

``ringrun --max-restarts K`` restarts the whole job when a worker dies; :class:`Resumable`
makes the script pick up where the last checkpoint left off, so at most ``every`` steps
are redone and the result is the same as an uninterrupted run (bit for bit on CPU with
fixed seeds: model, optimizer, the loader's position and every rank's random number
generators are restored). A restart gives every attempt a fresh process group and
rendezvous (a dead attempt's store keys are never read again, see
:mod:`ringtrain.runtime.rendezvous`), and costs one interpreter start plus the work since
the last checkpoint.

In a resizable job (:mod:`.resize`) the same state also commits in memory at every step
(:meth:`Resumable.commit`), and a resize restores and syncs it without touching disk.

Every rank must call :meth:`Resumable.resume`, :meth:`Resumable.step_done` and
:meth:`Resumable.save` at the same steps (they exchange the per-rank states).
"""

from __future__ import annotations

import copy
import logging
import os
import random
import re
from pathlib import Path
from typing import Any

import torch

from ringtrain import checkpoint, collectives, replicate, runtime
from ringtrain.elastic.gather import gather_to_root, scatter_from_root
from ringtrain.elastic.resize import drop_steps, follow_models, follow_world, hosts_updated, resizable
from ringtrain.elastic.state import ElasticState, HostsUpdated, Stateful, copy_states, load_states
from ringtrain.errors import CheckpointError, ConfigError

__all__ = ["Resumable", "attempt"]

log = logging.getLogger("ringtrain.elastic")

_NAME = "step-{:09d}" + checkpoint.SUFFIX
_STEP = re.compile(r"step-(\d+)" + re.escape(checkpoint.SUFFIX) + "$")


def attempt() -> int:
    """How many times ringrun (or torchrun) has restarted this job; 0 on the first start."""
    return runtime.world().env.attempt if runtime.is_initialized() else 0


def _rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    try:
        import numpy as np
    except ImportError:
        return state
    # numpy.random too (augmentations drawn in the training process, num_workers=0):
    # before, a resumed run drew other ones. Its key array as an int64 tensor, since a
    # safe load (weights_only) refuses numpy arrays.
    name, keys, pos, has_gauss, gauss = np.random.get_state(legacy=True)
    state["numpy"] = (str(name), torch.from_numpy(np.asarray(keys, dtype=np.int64)), int(pos), int(has_gauss),
                      float(gauss))
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    if "numpy" in state:  # absent from checkpoints written before it was saved
        try:
            import numpy as np
        except ImportError:
            return
        name, keys, pos, has_gauss, gauss = state["numpy"]
        np.random.set_state((name, keys.numpy().astype(np.uint32), pos, has_gauss, gauss))


def _local_state(optimizer: Any) -> Any:
    """What only this rank's optimizer holds (``rt.LocalSGD``/``rt.DiLoCo`` between syncs:
    its parameters and inner state), saved per rank with the loader's position; None for
    other optimizers."""
    local = getattr(optimizer, "local_state_dict", None)
    return local() if callable(local) else None


def _load_local_state(optimizer: Any, state: Any) -> None:
    load = getattr(optimizer, "load_local_state_dict", None)
    if callable(load):
        load(state)


class Resumable(ElasticState):
    """Saves the training state every ``every`` steps and restores the newest on start.

    ``scheduler`` (an LR scheduler, e.g. ``rt.warmup``'s) and ``scaler`` (a
    ``torch.amp.GradScaler``) are saved and restored with the model and optimizer: without
    them a resumed run would start its warm-up again and its loss scale from the initial
    one. Call :meth:`step_done` after ``scheduler.step()`` and ``scaler.update()``.
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
        scheduler: Stateful | None = None,
        scaler: Stateful | None = None,
        every: int = 100,
        keep: int = 2,
        extra: dict[str, Any] | None = None,
    ) -> None:
        if every < 1:
            raise ConfigError(f"every must be >= 1 step, got {every}")
        if keep < 1:
            raise ConfigError(f"keep must be >= 1 checkpoint, got {keep}")
        super().__init__()
        self.directory = Path(directory)
        self.model = model
        self.optimizer = optimizer
        self.loader = loader
        self.scheduler = scheduler
        self.scaler = scaler
        self.every = every
        self.keep = keep
        self.extra: dict[str, Any] = dict(extra or {})
        #: The step the last :meth:`resume` started from (0 on a fresh start).
        self.start_step = 0
        #: The checkpoint :meth:`resume` loaded, if any.
        self.resumed_from: Path | None = None
        #: The step to go on from: the last resume, step_done or commit (what :func:`run` restarts at).
        self.step = 0
        # Steps done at the last step_done(), resume, restore or sync: step_done() must
        # pass more (see there).
        self._last_done = 0
        self._commit: dict[str, Any] | None = None

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
        found = self._find() if rank == 0 or size == 1 else {}
        if size > 1:
            # Rank 0 decides: the directory may not be shared, or may change under us.
            found = collectives.broadcast_object(found, root_rank=0, name="elastic.resume")
        if found.get("error"):
            raise CheckpointError(found["error"])
        chosen = found.get("path")
        path = Path(chosen) if chosen else None
        if path is None:
            if size > 1:
                for name, tensor in self.model.state_dict().items():
                    collectives.broadcast_(tensor, root_rank=0, name=f"elastic.init {name}")
            self.start_step = self.step = self._last_done = 0
            return 0
        state, mine, saved_ranks, first_loader = self._read(path, size, rank)
        self._check_fits(path, state)
        self.model.load_state_dict(state["model"])
        if self.optimizer is not None and state.get("optimizer") is not None:
            self.optimizer.load_state_dict(state["optimizer"])
        if mine is None and saved_ranks:
            log.warning("checkpoint %s was written by %d ranks, this job has %d: loader positions "
                        "come from rank 0, random generators are not restored, and the learning "
                        "rates (optimizer, scheduler) are those saved for %d ranks: set them for "
                        "this size after resume() if they scale with it (rt.scale_lr)",
                        path, saved_ranks, size, saved_ranks)
        if self.optimizer is not None:
            _load_local_state(self.optimizer, (mine or {}).get("optimizer"))
        # After the optimizer: a scheduler's state names the rates it set in it.
        for part in ("scheduler", "scaler"):
            if getattr(self, part) is not None:
                getattr(self, part).load_state_dict(state[part])
        if self.loader is not None:
            loader_state = mine["loader"] if mine is not None else first_loader
            if loader_state is not None:
                self.loader.load_state_dict(loader_state)
        if mine is not None:
            _set_rng_state(mine["rng"])
        self.extra.update(state.get("extra", {}))
        self.start_step = self.step = self._last_done = int(state["step"])
        self.resumed_from = path
        log.info("resumed from %s at step %d", path, self.start_step)
        return self.start_step

    def _read(self, path: Path, size: int, rank: int) -> tuple[Any, dict[str, Any] | None, int, Any]:
        """The checkpoint's shared state (without the per-rank part), this rank's own
        state (None when the file was written by another number of ranks), how many ranks
        wrote it, and rank 0's loader state (what every rank resumes from then).

        Rank 0 reads the file; every rank gets the shared state and only its own per-rank
        state (with rt.LocalSGD/rt.DiLoCo that is each rank's parameters and inner
        optimizer state: the whole file on every rank would be N copies of it)."""
        state: Any = None
        error: str | None = None
        if rank == 0:
            try:
                state = checkpoint.read(path)  # safe: only what Resumable itself saves
            except CheckpointError as exc:
                error = str(exc)
        per_rank = (state.pop("per_rank", None) if isinstance(state, dict) else None) or []
        saved = len(per_rank)
        first_loader = per_rank[0].get("loader") if per_rank and saved != size else None
        if size > 1:
            head = (error, state, saved, first_loader) if rank == 0 else None
            error, state, saved, first_loader = collectives.broadcast_object(head, root_rank=0,
                                                                             name="elastic.resume state")
        if error is not None:
            raise CheckpointError(error)
        if saved != size:
            return state, None, saved, first_loader
        mine = scatter_from_root(per_rank if rank == 0 else None, name="elastic.resume per-rank") \
            if size > 1 else per_rank[0]
        return state, mine, saved, first_loader

    def _find(self) -> dict[str, str | None]:
        """Rank 0's choice: the newest intact checkpoint, or why there is none to use.
        Only an empty (or missing) directory starts from scratch: when every checkpoint
        in it is damaged, starting over would train from step 0 and the next saves would
        prune the damaged files, so the job stops and says so instead."""
        if self.directory.exists() and not self.directory.is_dir():
            return {"error": f"checkpoint directory {self.directory} is a file; give Resumable a folder"}
        path = checkpoint.latest(self.directory, pattern="step-*" + checkpoint.SUFFIX)
        if path is not None:
            return {"path": str(path)}
        damaged = sorted(p.name for p in self.directory.glob("step-*" + checkpoint.SUFFIX)
                         if p.is_file() and checkpoint.is_final_name(p.name)) if self.directory.is_dir() else []
        if damaged:
            shown = ", ".join(damaged[:3]) + (f" and {len(damaged) - 3} more" if len(damaged) > 3 else "")
            return {"error": f"every checkpoint in {self.directory} is damaged ({shown}); restore one "
                             "from a copy, or move them away to start from step 0"}
        return {}

    def _check_fits(self, path: Path, state: Any) -> None:
        """A checkpoint Resumable did not write, or of another model or optimizer: one line
        naming it, before anything is loaded (torch's own errors come after some tensors
        were already copied in)."""
        if not isinstance(state, dict) or "model" not in state or "step" not in state:
            raise CheckpointError(f"{path} was not written by Resumable (no 'model' and 'step'); "
                                  "point Resumable at its own directory")
        mine = self.model.state_dict()
        theirs = state["model"]
        missing = [k for k in mine if k not in theirs]
        extra = [k for k in theirs if k not in mine]
        shapes = [k for k in mine if k in theirs and tuple(theirs[k].shape) != tuple(mine[k].shape)]
        if missing or extra or shapes:
            what = (f"missing {missing[:3]}" if missing else f"unexpected {extra[:3]}" if extra else
                    f"{shapes[0]} is {tuple(theirs[shapes[0]].shape)} there, {tuple(mine[shapes[0]].shape)} here")
            raise CheckpointError(f"{path} holds another model ({what}); resume with the model that "
                                  "wrote it, or point Resumable at another directory")
        for part in ("scheduler", "scaler"):
            if getattr(self, part) is not None and state.get(part) is None:
                # Going on without it would restart the warm-up (or the loss scale) silently.
                raise CheckpointError(f"{path} holds no {part} state (it was saved without "
                                      f"{part}=...); resume without {part}= and restore it yourself, "
                                      "or point Resumable at another directory")
        saved = state.get("optimizer")
        if self.optimizer is not None and isinstance(saved, dict) and saved.get("param_groups"):
            want = set(self.optimizer.state_dict()["param_groups"][0]) - {"params"}
            have = set(saved["param_groups"][0]) - {"params"}
            if want - have:
                raise CheckpointError(f"{path} holds another optimizer's state (no {sorted(want - have)[:3]}); "
                                      "resume with the optimizer class that wrote it")

    def step_done(self, step: int) -> bool:
        """Call after each step with the number of steps completed (``state.step`` is then
        ``step``); saves on multiples of ``every`` (and, in a resizable job, commits in
        memory every step)."""
        if step <= self._last_done:
            # A loop that passes its 0-based index (step_done(step)) saved "after step k"
            # with k + 1 steps done: every resume ran one step twice and the schedule went
            # off by one, silently. Its first call is step_done(<the step resumed at>).
            raise ConfigError(
                f"step_done({step}) after {self._last_done} steps were done: pass the number of "
                "steps completed, step_done(step + 1) in `for step in range(state.resume(), total)` "
                "or step_done(state.step + 1)")
        # Before, only a resizable job's commit moved state.step: in a fixed-size job the
        # documented `state.step_done(state.step + 1)` passed 1 forever and never saved.
        self.step = self._last_done = step
        if resizable():
            self.commit(step)
        saved = step % self.every == 0
        if saved:
            self.save(step)
        if resizable() and hosts_updated():
            # A grow is taken here, at a commit, on every rank alike (rank 0's view
            # decides): rt.elastic.run moves the job to ringrun's larger world and the new
            # ranks take this state. Before, nothing asked, and a Resumable job never grew
            # (ringrun said "growing to N ranks"; the new worker sat idle to the end).
            raise HostsUpdated()
        return saved

    # -- resizing in place (see ringtrain.elastic.resize) ------------------------------------

    def _parts(self) -> dict[str, Stateful | None]:
        return {"model": self.model, "optimizer": self.optimizer, "loader": self.loader,
                "scheduler": self.scheduler, "scaler": self.scaler}

    def commit(self, step: int) -> None:
        """Remember the state after ``step`` steps in memory (no collective, no disk);
        :meth:`restore` goes back to it."""
        self.step = step
        self._commit = {"step": step, "extra": copy.deepcopy(self.extra), **copy_states(self._parts())}

    def drop_steps(self) -> None:
        drop_steps([self.model, self.optimizer])

    def restore(self) -> None:
        """Go back to the last :meth:`commit` (after a peer failed mid-step)."""
        if self._commit is None:
            return
        snap = copy.deepcopy(self._commit)
        load_states(self._parts(), snap)
        self.extra = snap["extra"]
        self.step = self._last_done = int(snap["step"])

    def sync(self) -> None:
        """Every rank takes rank 0's state (collective; after the job changed size)."""
        own = self.optimizer is not None and follow_world(self.optimizer)
        # A DistributedOptimizer over the model that the state does not hold (a second
        # one, or the wrapped optimizer given as optimizer=) averages over the new size too.
        follow_models([self.model], followed=[self.optimizer])
        if runtime.size() > 1:
            if not own:
                # Its tensors only: a module's non-tensor extra state (get_extra_state) is
                # not overwritten in place; broadcast_parameters refuses such an entry.
                tensors = {k: v for k, v in self.model.state_dict().items() if isinstance(v, torch.Tensor)}
                replicate.broadcast_parameters(tensors, root_rank=0)
            from ringtrain.lowcomm import PeriodicSync

            # rt.LocalSGD / rt.DiLoCo are torch optimizers too, but each rank keeps its own
            # local state (follow_world, the per-rank resume): rank 0's must not replace it.
            if isinstance(self.optimizer, torch.optim.Optimizer) and not isinstance(self.optimizer, PeriodicSync):
                replicate.broadcast_optimizer_state(self.optimizer, root_rank=0)
            mine = {"step": self.step, "extra": self.extra,
                    **{name: part.state_dict() if part is not None else None
                       for name, part in (("loader", self.loader), ("scheduler", self.scheduler),
                                          ("scaler", self.scaler))}}
            got = collectives.broadcast_object(mine if runtime.rank() == 0 else None, root_rank=0,
                                               name="elastic.sync")
            self.step, self.extra = int(got["step"]), dict(got["extra"])
            for name in ("scheduler", "scaler"):  # a joining rank's are fresh
                part = getattr(self, name)
                if part is not None and got[name] is not None:
                    part.load_state_dict(got[name])
            if self.loader is not None and got["loader"] is not None:
                # The rest of the epoch is split over the new world (the loader's state is
                # a global position, see ringtrain.data.order).
                self.loader.load_state_dict(got["loader"])
        self._last_done = self.step
        self.commit(self.step)

    def save(self, step: int) -> Path | None:
        """Save now (every rank must call it); rank 0 writes ``step-<step>.ckpt``."""
        pending = getattr(self.optimizer, "pending_passes", 0)
        if pending:
            # The accumulated gradients are not part of a checkpoint: a resume from it
            # would take that update with fewer passes, silently.
            raise ConfigError(
                f"Resumable.save in the middle of a gradient accumulation ({pending} of "
                f"{getattr(self.optimizer, 'backward_passes_per_step', '?')} backward passes done, "
                "not yet stepped): call step_done() after optimizer.step(), counting optimizer "
                "steps, not backward passes")
        size, rank = self._size_rank()
        mine = {
            "rng": _rng_state(),
            "loader": self.loader.state_dict() if self.loader is not None else None,
            "optimizer": _local_state(self.optimizer),
        }
        # Only rank 0 writes, so only rank 0 receives the ranks' states (before, every rank
        # did: N copies of LocalSGD's parameters and inner state on each, see .gather).
        per_rank = gather_to_root(mine, name="elastic.save") if size > 1 else [mine]
        if rank != 0 or per_rank is None:
            return None
        state = {
            "step": step,
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict() if self.optimizer is not None else None,
            "per_rank": per_rank,
            "scheduler": self.scheduler.state_dict() if self.scheduler is not None else None,
            "scaler": self.scaler.state_dict() if self.scaler is not None else None,
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
