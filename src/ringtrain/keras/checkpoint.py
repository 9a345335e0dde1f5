"""Rank-0 checkpoints of a Keras model and its optimizer, and resuming from them.

The article's fifth step: only rank 0 writes checkpoints, or the workers would corrupt
each other's files. :class:`CheckpointCallback` writes through
:func:`ringtrain.checkpoint.save` (temp file + rename, SHA-256), so a crash never
leaves a half-written checkpoint; :func:`restore` reads the newest intact one on rank 0
and gives every rank the same state, and returns the epoch to pass to
``fit(initial_epoch=...)``.

A checkpoint holds the model's state variables (weights and batch-norm statistics, not
random-number-generator states) and the optimizer's variables, as CPU tensors in Keras'
variable order, with their paths for error messages.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from ringtrain import checkpoint, runtime
from ringtrain.errors import CheckpointError, ConfigError
from ringtrain.keras._backend import load_keras
from ringtrain.keras.callbacks import model_state_variables

__all__ = ["CheckpointCallback", "restore", "keras_state"]

keras = load_keras()

_FORMAT = "ringtrain.keras/1"


def _optimizer_variables(model: Any) -> list[Any]:
    optimizer = getattr(model, "optimizer", None)
    if optimizer is None:
        return []
    if not optimizer.built:
        optimizer.build(model.trainable_variables)
    return list(optimizer.variables)


def keras_state(model: Any, epoch: int) -> dict[str, Any]:
    """What :class:`CheckpointCallback` saves: plain tensors, lists and strings only,
    so :func:`ringtrain.checkpoint.load` reads it with ``weights_only=True``."""
    weights = model_state_variables(model)
    opt_vars = _optimizer_variables(model)
    return {
        "format": _FORMAT,
        "epoch": int(epoch),
        "model": [v.value.detach().cpu().clone() for v in weights],
        "model_paths": [v.path for v in weights],
        "optimizer": [v.value.detach().cpu().clone() for v in opt_vars],
        "optimizer_paths": [v.path for v in opt_vars],
    }


class CheckpointCallback(keras.callbacks.Callback):  # type: ignore[misc,name-defined]
    """Rank 0 saves model and optimizer at the end of every ``every`` epochs.

    Files are ``directory / pattern.format(epoch=...)`` (default ``epoch-000.ckpt``,
    numbered from 0 like ``fit``'s epochs); other ranks write nothing and never wait,
    so the callback can be given to every rank. ``keep`` deletes all but the newest
    ``keep`` checkpoints written by this callback (older runs' files are left alone).
    """

    def __init__(self, directory: str | os.PathLike[str], every: int = 1,
                 pattern: str = "epoch-{epoch:03d}" + checkpoint.SUFFIX, keep: int | None = None) -> None:
        super().__init__()
        if every < 1:
            raise ConfigError(f"every must be >= 1 epoch, got {every}")
        if keep is not None and keep < 1:
            raise ConfigError(f"keep must be >= 1 (or None to keep all), got {keep}")
        if "{epoch" not in pattern:
            raise ConfigError(f"pattern {pattern!r} must contain '{{epoch}}' so files do not overwrite each other")
        self.directory = Path(directory)
        self.every = every
        self.pattern = pattern
        self.keep = keep
        self.saved: list[Path] = []

    def on_epoch_end(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        if _rank() != 0:
            return
        if (epoch + 1) % self.every:
            return
        path = checkpoint.save(self.directory / self.pattern.format(epoch=epoch),
                               keras_state(self.model, epoch))
        if path is None:
            return
        self.saved.append(path)
        if self.keep is not None:
            for old in self.saved[: -self.keep]:
                old.unlink(missing_ok=True)
            self.saved = self.saved[-self.keep :]


def _assign(variables: list[Any], values: list[Any], paths: list[str], what: str, source: Path) -> None:
    if len(variables) != len(values):
        raise CheckpointError(
            f"checkpoint {source} holds {len(values)} {what} variables but the model has "
            f"{len(variables)}; restore into the same architecture (and optimizer) it was saved from"
        )
    for variable, value, path in zip(variables, values, paths, strict=False):
        if tuple(variable.shape) != tuple(value.shape):
            raise CheckpointError(
                f"checkpoint {source}: {what} variable {path!r} has shape {tuple(value.shape)} "
                f"but the model's {variable.path!r} has {tuple(variable.shape)}; restore into "
                "the same architecture it was saved from"
            )
    for variable, value in zip(variables, values, strict=False):
        variable.assign(value)


def _rank() -> int:
    return runtime.rank() if runtime.is_initialized() else 0


def _resolve(path: Path) -> tuple[str, str]:
    """("file", path) to load, ("none", "") for a fresh start, or ("error", why)."""
    if path.is_dir():
        found = checkpoint.latest(path)
        return ("none", "") if found is None else ("file", str(found))
    if path.exists():
        return ("file", str(path))
    if path.suffix != checkpoint.SUFFIX:
        return ("none", "")  # a directory that does not exist yet
    return ("error", f"checkpoint {path} does not exist; check the path")


def restore(model: Any, path: str | os.PathLike[str]) -> int:
    """Load a checkpoint (a file, or a directory's newest intact one) into ``model``.

    Every rank must call it: rank 0 reads and verifies, every rank receives the same
    state. Returns the epoch to continue from (``fit(initial_epoch=...)``): the saved
    epoch + 1, or 0 when ``path`` is a directory without a checkpoint. The model must be
    built (give it an ``Input``) and compiled if its optimizer state should be restored.
    """
    # Rank 0 resolves the path and tells the others, so ranks without the files (no
    # shared disk) take the same branch and meet at the same collectives.
    kind, where = _resolve(Path(path)) if _rank() == 0 else ("", "")
    if runtime.is_initialized() and runtime.size() > 1:
        from ringtrain.collectives import broadcast_object

        kind, where = broadcast_object((kind, where), root_rank=0, name=f"checkpoint path {path}")
    if kind == "none":
        return 0
    if kind == "error":
        raise CheckpointError(where)
    source = Path(where)
    if not model.built:
        raise ConfigError(
            "build the model before restoring a checkpoint into it: start it with keras.Input(...) "
            "or call model.build(input_shape)"
        )
    state = checkpoint.load(source)
    if not isinstance(state, dict) or state.get("format") != _FORMAT:
        raise CheckpointError(f"{source} is not a ringtrain.keras checkpoint; restore it with rt.checkpoint.load")
    _assign(model_state_variables(model), state["model"], state["model_paths"], "model", source)
    if state["optimizer"] and getattr(model, "optimizer", None) is not None:
        _assign(_optimizer_variables(model), state["optimizer"], state["optimizer_paths"],
                "optimizer", source)
    return int(state["epoch"]) + 1
