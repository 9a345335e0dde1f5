"""Tunable settings: one dataclass field each, one environment variable derived from it.

Precedence, everywhere: an explicit argument in code (or a CLI flag, which ringrun
forwards as the environment variable) > ``RINGTRAIN_<FIELD>`` in the environment >
the default below. Launcher rank variables are not settings; they live in
:mod:`ringtrain.env`.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, fields

from ringtrain.errors import ConfigError

__all__ = ["Settings", "env_name", "load_settings"]

_BACKENDS = ("auto", "gloo", "nccl")


@dataclass(frozen=True)
class Settings:
    """Settings that apply to the whole process."""

    #: "auto" picks NCCL when every local rank has a CUDA device, Gloo otherwise.
    backend: str = "auto"
    #: Seconds to wait for all ranks at the rendezvous (slow ssh starts need minutes).
    init_timeout: float = 300.0
    #: Seconds a rank waits at a gradient exchange before naming the missing ranks
    #: (Horovod's stall check fires after 60 s; we use the same default).
    stall_timeout: float = 60.0
    #: Fusion bucket size in MB (PyTorch DDP's default bucket is 25 MB).
    fusion_mb: float = 25.0
    #: Path of a Chrome trace-event JSON timeline to write; empty: off.
    timeline: str = ""
    #: Show rank 0's progress bar / log lines.
    progress: bool = True

    def __post_init__(self) -> None:
        if self.backend not in _BACKENDS:
            raise ConfigError(
                f"backend {self.backend!r} is not one of {', '.join(_BACKENDS)}; "
                f"set {env_name('backend')} or pass backend= accordingly"
            )
        for name in ("init_timeout", "stall_timeout", "fusion_mb"):
            if getattr(self, name) <= 0:
                raise ConfigError(
                    f"{name} must be > 0, got {getattr(self, name)}; fix {env_name(name)}"
                )


def env_name(field: str) -> str:
    """The environment variable that sets ``field``."""
    return f"RINGTRAIN_{field.upper()}"


def _convert(field: str, kind: type, raw: str) -> object:
    try:
        if kind is bool:
            low = raw.strip().lower()
            if low in ("1", "true", "yes", "on"):
                return True
            if low in ("0", "false", "no", "off", ""):
                return False
            raise ValueError(raw)
        return kind(raw)
    except ValueError:
        raise ConfigError(
            f"{env_name(field)}={raw!r} is not a valid {kind.__name__}"
        ) from None


def load_settings(environ: Mapping[str, str] | None = None, **overrides: object) -> Settings:
    """Settings from ``environ`` (default ``os.environ``) with explicit overrides on top."""
    environ = os.environ if environ is None else environ
    values: dict[str, object] = {}
    kinds = {"str": str, "float": float, "bool": bool, "int": int}
    for f in fields(Settings):
        raw = environ.get(env_name(f.name))
        if raw is not None:
            values[f.name] = _convert(f.name, kinds[str(f.type)], raw)
    for key, value in overrides.items():
        if value is not None:
            values[key] = value
    return Settings(**values)  # type: ignore[arg-type]
