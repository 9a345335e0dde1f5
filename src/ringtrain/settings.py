"""Tunable settings: one dataclass field each; the environment variable and the ringrun
flag are derived from the field.

Precedence, everywhere: an explicit argument in code > ``RINGTRAIN_<FIELD>`` in the
environment (which is what a ringrun flag sets for its workers) > the default below.
Launcher rank variables are not settings; they live in :mod:`ringtrain.env`.

``ringrun`` builds its settings flags from :func:`flag_specs` (``--stall-timeout``,
``--no-progress``, ...) and validates them by building a :class:`Settings`, so a bad
value is refused before any worker starts, with the same message a worker would give.
This module imports no torch (the launcher uses it).
"""

from __future__ import annotations

import difflib
import math
import os
from collections.abc import Mapping
from dataclasses import MISSING, dataclass, field, fields
from typing import Any

from ringtrain.errors import ConfigError

__all__ = ["BACKENDS", "LOG_LEVELS", "FlagSpec", "OTHER_VARIABLES", "Settings", "env_name", "flag_specs",
           "load_settings", "settings_env", "unknown_variables"]

BACKENDS = ("auto", "gloo", "nccl")
#: Levels of ringtrain's log lines (the ``logging`` module's names, lower case).
LOG_LEVELS = ("debug", "info", "warning", "error", "critical")


def _setting(default: Any, help: str, choices: tuple[str, ...] | None = None) -> Any:
    return field(default=default, metadata={"help": help, "choices": choices})


@dataclass(frozen=True)
class Settings:
    """Settings that apply to the whole process."""

    #: "auto" picks NCCL when every local rank has a CUDA device, Gloo otherwise.
    backend: str = _setting("auto", "process-group backend", BACKENDS)
    #: Seconds to wait for all ranks at the rendezvous (slow ssh starts need minutes).
    init_timeout: float = _setting(300.0, "seconds to wait for every rank at the rendezvous")
    #: Seconds a rank waits at a gradient exchange before naming the missing ranks
    #: (Horovod's stall check fires after 60 s; we use the same default).
    stall_timeout: float = _setting(60.0, "seconds an exchange may wait before naming the "
                                          "missing ranks")
    #: Fusion bucket size in MB (PyTorch DDP's default bucket is 25 MB).
    fusion_mb: float = _setting(25.0, "megabytes per fused gradient bucket")
    #: Path of a Chrome trace-event JSON timeline to write; empty: off.
    timeline: str = _setting("", "write a Chrome trace (Perfetto) timeline to this path")
    #: Show rank 0's progress bar / log lines.
    progress: bool = _setting(True, "rank 0's progress output")
    #: Meter the training step (step meter, timeline, progress, doctor). Off: the event
    #: bus has no listener at all and publishing costs one list check.
    observe: bool = _setting(True, "step metering (timeline, progress and the doctor need it)")
    #: The least severe of ringtrain's log lines a rank prints (Horovod's --log-level).
    log_level: str = _setting("warning", "level of ringtrain's log lines", LOG_LEVELS)
    #: Start each of ringtrain's log lines with the time (Horovod's log timestamps).
    log_time: bool = _setting(False, "a timestamp at the start of ringtrain's log lines")

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise ConfigError(
                f"backend {self.backend!r} is not one of {', '.join(BACKENDS)}; "
                f"set {env_name('backend')} or pass backend= accordingly"
            )
        if self.log_level not in LOG_LEVELS:
            raise ConfigError(
                f"log_level {self.log_level!r} is not one of {', '.join(LOG_LEVELS)}; "
                f"set {env_name('log_level')} or pass --log-level accordingly"
            )
        for name in ("init_timeout", "stall_timeout", "fusion_mb"):
            value = getattr(self, name)
            # nan and inf pass a bare `> 0` test; they would break every wait later on.
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
                raise ConfigError(
                    f"{name} must be a finite number > 0, got {value}; fix {env_name(name)} "
                    f"(or --{name.replace('_', '-')})"
                )


def env_name(name: str) -> str:
    """The environment variable that sets the field ``name``."""
    return f"RINGTRAIN_{name.upper()}"


#: The ``RINGTRAIN_*`` variables that are not settings: what ringrun gives each rank
#: (docs/launch.md) and the knobs documented with their feature. A unit test checks that
#: every name the package uses is here or a setting.
OTHER_VARIABLES = frozenset({
    "RINGTRAIN_RANK", "RINGTRAIN_SIZE", "RINGTRAIN_LOCAL_RANK", "RINGTRAIN_LOCAL_SIZE",
    "RINGTRAIN_CROSS_RANK", "RINGTRAIN_CROSS_SIZE", "RINGTRAIN_ATTEMPT", "RINGTRAIN_RUN_ID",
    "RINGTRAIN_JOB_SECRET", "RINGTRAIN_STORE_FD", "RINGTRAIN_WORLD_VERSION",
    "RINGTRAIN_REFORM_WAIT", "RINGTRAIN_ELASTIC_DIR", "RINGTRAIN_ELASTIC_FILE",
    "RINGTRAIN_ELASTIC_PERSIST_S", "RINGTRAIN_DOCTOR", "RINGTRAIN_DOCTOR_STEPS",
    "RINGTRAIN_DOCTOR_WARMUP", "RINGTRAIN_TURBOJPEG", "RINGTRAIN_RUN_FUNC",
    "RINGTRAIN_RUN_FUNC_FILE", "RINGTRAIN_RUN_TOKEN",
})


def unknown_variables(environ: Mapping[str, str] | None = None) -> list[str]:
    """One warning per ``RINGTRAIN_*`` variable ringtrain does not read (a stall timeout
    variable with one letter missing would otherwise leave the default in force, silently)."""
    environ = os.environ if environ is None else environ
    known = OTHER_VARIABLES | {env_name(f.name) for f in fields(Settings)}
    out = []
    for name in sorted(environ):
        if name.startswith("RINGTRAIN_") and name not in known:
            near = difflib.get_close_matches(name, sorted(known), n=1, cutoff=0.8)
            hint = f"; did you mean {near[0]}?" if near else " and has no effect"
            out.append(f"{name} is not a ringtrain variable{hint}")
    return out


_KINDS: dict[str, type] = {"str": str, "float": float, "bool": bool, "int": int}


def _kind(name: str) -> type:
    return _KINDS[str(next(f.type for f in fields(Settings) if f.name == name))]


def _convert(name: str, kind: type, raw: str) -> object:
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
        raise ConfigError(f"{env_name(name)}={raw!r} is not a valid {kind.__name__}") from None


def load_settings(environ: Mapping[str, str] | None = None, **overrides: object) -> Settings:
    """Settings from ``environ`` (default ``os.environ``) with explicit overrides on top."""
    environ = os.environ if environ is None else environ
    values: dict[str, object] = {}
    for f in fields(Settings):
        raw = environ.get(env_name(f.name))
        if raw is not None:
            values[f.name] = _convert(f.name, _kind(f.name), raw)
    for key, value in overrides.items():
        if value is not None:
            values[key] = value
    return Settings(**values)  # type: ignore[arg-type]


@dataclass(frozen=True)
class FlagSpec:
    """One command-line flag derived from a settings field."""

    field: str
    flag: str  #: e.g. ``--stall-timeout``, or ``--no-progress`` for a bool that defaults on
    kind: type
    help: str
    choices: tuple[str, ...] | None


def flag_specs() -> list[FlagSpec]:
    """The launcher's settings flags, one per field."""
    out = []
    for f in fields(Settings):
        kind = _kind(f.name)
        dash = f.name.replace("_", "-")
        default = f.default if f.default is not MISSING else None
        if kind is bool:
            flag = f"--no-{dash}" if default else f"--{dash}"
            text = f"turn off {f.metadata['help']}" if default else f"turn on {f.metadata['help']}"
        else:
            flag = f"--{dash}"
            text = f"{f.metadata['help']} (default {default!r})" if default != "" else f.metadata["help"]
        out.append(FlagSpec(f.name, flag, kind, f"{text}; sets {env_name(f.name)}",
                            f.metadata["choices"]))
    return out


def settings_env(given: Mapping[str, object], environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The ``RINGTRAIN_*`` variables for the flags the user gave (field -> value; a bool
    flag's value is the field's new value). Validated by building the Settings the
    workers will see, so a bad value is a ConfigError here, before any worker starts."""
    env = {env_name(name): _format(value) for name, value in given.items() if value is not None}
    merged = dict(os.environ if environ is None else environ)
    merged.update(env)
    load_settings(merged)
    return env


def _format(value: object) -> str:
    if isinstance(value, bool):
        return "1" if value else "0"
    return str(value)
