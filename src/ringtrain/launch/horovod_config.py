"""Horovod's ``--config-file`` (YAML) and its ``HOROVOD_*`` variables, as horovodrun values.

    controller: gloo
    params: {fusion_threshold_mb: 32, cycle_time_ms: 5, cache_capacity: 1024,
             hierarchical_allreduce: false, hierarchical_allgather: false, torus_allreduce: false}
    autotune: {enabled: false, log_file: at.csv, warmup_samples: 3, steps_per_sample: 10,
               bayes_opt_max_samples: 20, gaussian_process_noise: 0.8}
    timeline: {filename: tl.json, mark_cycles: false}
    stall_check: {enabled: true, warning_time_seconds: 60, shutdown_time_seconds: 0}
    library_options: {mpi_threads_disable: false, num_nccl_streams: 1, thread_affinity: 0,
                      gloo_timeout_seconds: 30}
    logging: {level: WARNING, with_timestamp: false}

Each key is the horovodrun flag of the same name (``section prefix + key``, as Horovod
reads it); a flag on the command line wins over the file, and the file over the
environment. Values are checked against the flag's type (:mod:`.horovod_flags`);
unknown sections and keys are named in a warning instead of being dropped silently.
Pure apart from reading the file.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ringtrain.errors import ConfigError
from ringtrain.launch.horovod_flags import FLAGS, Flag, by_dest

__all__ = ["SECTIONS", "config_values", "convert", "env_values", "read_config"]

#: section -> (the prefix of its keys' flag destinations, its keys)
SECTIONS: dict[str, tuple[str, tuple[str, ...]]] = {
    "params": ("", ("fusion_threshold_mb", "cycle_time_ms", "cache_capacity", "hierarchical_allreduce",
                    "hierarchical_allgather", "torus_allreduce")),
    "autotune": ("autotune_", ("log_file", "warmup_samples", "steps_per_sample", "bayes_opt_max_samples",
                               "gaussian_process_noise")),
    "timeline": ("timeline_", ("filename", "mark_cycles")),
    "stall_check": ("stall_check_", ("warning_time_seconds", "shutdown_time_seconds")),
    "library_options": ("", ("mpi_threads_disable", "num_nccl_streams", "thread_affinity",
                             "gloo_timeout_seconds")),
    "logging": ("log_", ("level", "with_timestamp")),
}

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off", "")


def convert(flag: Flag, raw: Any, where: str) -> Any:
    """``raw`` (from YAML or a variable) as the value ``flag`` takes; ConfigError naming
    ``where`` when it is not one."""
    try:
        if raw is None:  # a key without a value (``filename:``) would become "None"
            raise ValueError
        if flag.value == "flag":
            if isinstance(raw, bool):
                return raw
            text = str(raw).strip().lower()
            if text in _TRUE or text in _FALSE:
                return text in _TRUE
            raise ValueError
        if isinstance(raw, bool):
            raise ValueError
        if flag.value == "int":
            if isinstance(raw, float) and not raw.is_integer():
                raise ValueError
            return int(raw)
        if flag.value == "float":
            return float(raw)
        if flag.value == "choice":
            text = str(raw).strip().upper()
            if text not in flag.choices:
                raise ValueError
            return text
        if flag.value == "int int":
            pair = raw.split() if isinstance(raw, str) else list(raw)
            if len(pair) != 2:
                raise ValueError
            return [float(x) for x in pair]
        if isinstance(raw, bool) or not isinstance(raw, (str, int, float)):  # not a list's repr
            raise ValueError
        return str(raw)
    except (TypeError, ValueError):
        want = {"flag": "true or false", "int": "a whole number", "float": "a number",
                "choice": "one of " + ", ".join(flag.choices), "int int": "two numbers, e.g. [60, 300]",
                "str": "a string"}[flag.value]
        raise ConfigError(f"{where} = {raw!r} is not {want} (horovodrun {flag.names[-1]})") from None


def read_config(path: str) -> Any:
    """The parsed YAML of ``--config-file``."""
    try:
        import yaml
    except ImportError:
        raise ConfigError("--config-file needs PyYAML; pip install pyyaml (or give the settings "
                          "as flags)") from None
    try:
        with open(path, encoding="utf-8") as f:
            return yaml.safe_load(f) or {}
    except OSError as exc:
        raise ConfigError(f"--config-file {path} cannot be read ({exc.strerror}); check the path") from None
    except UnicodeDecodeError:
        raise ConfigError(f"--config-file {path} is not a text file (not UTF-8); give Horovod's "
                          "YAML config file") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        at = f" at line {mark.line + 1}" if mark is not None else ""
        raise ConfigError(f"--config-file {path} is not valid YAML{at}; fix the file") from None


def config_values(doc: Any, path: str) -> tuple[dict[str, tuple[Any, str]], list[str]]:
    """``{flag destination: (value, where it came from)}`` of a config file, and warnings
    for what it has that horovodrun does not know."""
    if not isinstance(doc, Mapping):
        raise ConfigError(f"--config-file {path} is not a mapping of sections (e.g. 'params:'); "
                          "see Horovod's config file format")
    rows = by_dest()
    out: dict[str, tuple[Any, str]] = {}
    warnings: list[str] = []
    for section, body in doc.items():
        where = f"{path}: {section}"
        if section == "controller":
            name = str(body).strip().lower()
            if name not in ("gloo", "mpi"):
                raise ConfigError(f"{where} = {body!r}: the controller is gloo (or mpi, not supported here)")
            out["use_gloo" if name == "gloo" else "use_mpi"] = (True, where)
            continue
        if section not in SECTIONS:
            warnings.append(f"{where}: unknown section, ignored (known: controller, {', '.join(SECTIONS)})")
            continue
        if not isinstance(body, Mapping):
            raise ConfigError(f"{where} must be a mapping of keys, got {body!r}")
        prefix, keys = SECTIONS[section]
        for key, raw in body.items():
            if key == "enabled" and section in ("autotune", "stall_check"):
                on = convert(rows["autotune" if section == "autotune" else "no_stall_check"], raw,
                             f"{where}.enabled")
                if section == "autotune":
                    out["autotune"] = (on, f"{where}.enabled")
                else:
                    out["no_stall_check"] = (not on, f"{where}.enabled")
                continue
            if key not in keys:
                warnings.append(f"{where}.{key}: unknown key, ignored (known: {', '.join(keys)})")
                continue
            dest = prefix + key
            out[dest] = (convert(rows[dest], raw, f"{where}.{key}"), f"{where}.{key}")
    return out, warnings


def env_values(environ: Mapping[str, str]) -> dict[str, tuple[Any, str]]:
    """``{flag destination: (value, variable)}`` of the ``HOROVOD_*`` variables set."""
    out: dict[str, tuple[Any, str]] = {}
    for flag in FLAGS:
        raw = environ.get(flag.env or "", "").strip()
        if not flag.env or not raw or flag.dest in out:
            continue
        where = flag.env
        if flag.env == "HOROVOD_FUSION_THRESHOLD":  # bytes there, megabytes in the flag
            try:
                value: Any = int(raw) / 2**20
            except ValueError:
                raise ConfigError(f"{where}={raw!r} is not a whole number of bytes") from None
        elif flag.env == "HOROVOD_LOG_HIDE_TIME":  # the inverse of --log-with-timestamp
            value = not convert(flag, raw, where)
        elif flag.env == "HOROVOD_START_TIMEOUT":
            value = convert(Flag(flag.names, flag.dest, flag.kind, "", value="float"), raw, where)
        else:
            value = convert(flag, raw, where)
        out[flag.dest] = (value, where)
    return out
