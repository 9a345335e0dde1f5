"""``hvd.run``: Horovod's Python launcher (``horovod.run`` / ``horovod.runner.run``).

``run(func, args, kwargs, num_proc, hosts, ...)`` starts a job with ringtrain's
``horovodrun``, calls ``func(*args, **kwargs)`` in every process and returns the values
in rank order. The function travels pickled (cloudpickle, so a function of ``__main__``,
a closure or a lambda works, as in Horovod) in each process's environment, or, when it
is larger than an environment variable may be, in a file in the working directory,
which remote hosts then need to see (ringrun already asks for the same working
directory on every host). Each process prints its pickled return value on its stdout,
between markers of a per-job random token; ``run`` takes those lines out of the output
it passes on (and ringrun out of ``output_filename``'s files), so the values come back
from remote hosts over ringrun's own output stream, with no other connection.
"""

from __future__ import annotations

import base64
import os
import pickle
import re
import secrets
import signal
import subprocess
import sys
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from ringtrain.processes import RESULT_MARKER_ENV

__all__ = ["run"]

#: Where the task finds the function: inline (base64) or a file path; the job's marker
#: (ringrun keeps its lines out of the --output-filename files).
FUNC_ENV, FUNC_FILE_ENV, TOKEN_ENV = "RINGTRAIN_RUN_FUNC", "RINGTRAIN_RUN_FUNC_FILE", RESULT_MARKER_ENV
# Linux refuses to start a process one of whose environment strings exceeds 128 KiB
# (MAX_ARG_STRLEN); larger functions go through a file.
_INLINE_LIMIT = 96 << 10
# One rank's line prefix under horovodrun ("[3] ").
_PREFIX = re.compile(rb"\[\d+\] ?")
# Result lines stay under ringrun's 64 KiB output pieces, so none is split.
CHUNK = 32 << 10


def _flags(num_proc: int | None, min_num_proc: int | None, max_num_proc: int | None,
           slots: int | None, reset_limit: int | None, cooldown_range: Sequence[int] | None,
           hosts: str | None, hostfile: str | None, host_discovery_script: str | None,
           start_timeout: int | None, ssh_port: int | None, ssh_identity_file: str | None,
           disable_cache: bool | None, output_filename: str | None, verbose: bool | None,
           use_gloo: bool | None, use_mpi: bool | None, mpi_args: str | None,
           network_interfaces: Sequence[str] | None) -> list[str]:
    """horovodrun's command line for ``run``'s arguments (horovodrun checks them)."""
    out: list[str] = []
    valued = (("-np", num_proc), ("--min-np", min_num_proc), ("--max-np", max_num_proc),
              ("--slots-per-host", slots), ("--reset-limit", reset_limit), ("-H", hosts),
              ("--hostfile", hostfile), ("--host-discovery-script", host_discovery_script),
              ("--start-timeout", start_timeout), ("-p", ssh_port),
              ("-i", ssh_identity_file), ("--output-filename", output_filename),
              ("--mpi-args", mpi_args))
    for flag, value in valued:
        if value is not None:
            out += [flag, str(value)]
    if cooldown_range is not None:
        out += ["--blacklist-cooldown-range", *(str(v) for v in cooldown_range)]
    if network_interfaces:
        out += ["--network-interfaces", ",".join(network_interfaces)]
    for flag, on in (("--disable-cache", disable_cache), ("--verbose", verbose),
                     ("--gloo", use_gloo), ("--mpi", use_mpi)):
        if on:
            out.append(flag)
    return out


def run(func: Callable[..., Any], args: Sequence[Any] = (), kwargs: dict[str, Any] | None = None,
        num_proc: int | None = None, min_num_proc: int | None = None,
        max_num_proc: int | None = None, slots: int | None = None,
        reset_limit: int | None = None, cooldown_range: Sequence[int] | None = None,
        hosts: str | None = None, hostfile: str | None = None,
        host_discovery_script: str | None = None, start_timeout: int | None = None,
        ssh_port: int | None = None, ssh_identity_file: str | None = None,
        disable_cache: bool | None = None, output_filename: str | None = None,
        verbose: bool | None = None, use_gloo: bool | None = None, use_mpi: bool | None = None,
        mpi_args: str | None = None, network_interface: str | None = None,
        network_interfaces: Sequence[str] | None = None, executable: str | None = None,
        np: int | None = None, min_np: int | None = None, max_np: int | None = None) -> list[Any]:
    """Run ``func(*args, **kwargs)`` in a job of ``num_proc`` processes (Horovod's
    signature; ``np``/``min_np``/``max_np``/``network_interface`` are its deprecated
    spellings) and return the values in rank order; with ``min_num_proc``, the first
    ``min_num_proc`` of them, as Horovod. A job that fails raises ``RuntimeError``."""
    if hosts is not None and hostfile is not None:
        raise ValueError("run() takes hosts or hostfile, not both")
    if use_gloo and use_mpi:
        raise ValueError("run() takes use_gloo or use_mpi, not both")
    num_proc = np if np is not None else num_proc
    min_num_proc = min_np if min_np is not None else min_num_proc
    max_num_proc = max_np if max_np is not None else max_num_proc
    if network_interface and not network_interfaces:
        network_interfaces = network_interface.split(",")
    if num_proc is None and min_num_proc is None and host_discovery_script is None:
        num_proc = 1  # Horovod's default
    import cloudpickle  # a dependency of ringtrain; pickles __main__'s functions by value

    payload = cloudpickle.dumps((func, tuple(args), dict(kwargs or {})))
    token = secrets.token_hex(16)
    env = dict(os.environ, **{TOKEN_ENV: token})
    env.pop(FUNC_ENV, None)
    env.pop(FUNC_FILE_ENV, None)
    spill: Path | None = None
    if len(payload) * 4 // 3 + 4 <= _INLINE_LIMIT:
        env[FUNC_ENV] = base64.b64encode(payload).decode()
    else:
        spill = Path.cwd() / f".ringtrain-run-{token[:12]}.pkl"
        tmp = spill.with_name(spill.name + ".tmp")
        tmp.write_bytes(payload)
        os.replace(tmp, spill)
        env[FUNC_FILE_ENV] = str(spill)
    cmd = [sys.executable, "-m", "ringtrain.launch.horovodrun",
           *_flags(num_proc, min_num_proc, max_num_proc, slots, reset_limit, cooldown_range,
                   hosts, hostfile, host_discovery_script, start_timeout, ssh_port,
                   ssh_identity_file, disable_cache, output_filename, verbose, use_gloo,
                   use_mpi, mpi_args, network_interfaces),
           executable or sys.executable, "-m", "ringtrain.horovod._task"]
    try:
        code, results, last = _drive(cmd, env, token)
    finally:
        if spill is not None:
            spill.unlink(missing_ok=True)
    if code != 0:
        raise RuntimeError(f"the hvd.run job failed (horovodrun exited with {code})"
                           + (f": {last}" if last else ""))
    if not results:
        raise RuntimeError("the hvd.run job ended without any process returning a value")
    ranks = sorted(results)
    if ranks != list(range(len(ranks))):
        raise RuntimeError(f"the hvd.run job returned values for ranks {ranks} only")
    values = [results[r] for r in ranks]
    return values[:min_num_proc] if min_num_proc is not None else values


#: A rank's line on horovodrun's stderr: ``[N] ``, after the time with
#: ``prefix_output_with_timestamp`` (``time.asctime()``'s form).
_RANK_LINE = re.compile(r"(\w{3} \w{3} [ \d]\d \d\d:\d\d:\d\d \d{4})?\[\d+\] ")


def _drive(cmd: list[str], env: dict[str, str], token: str) -> tuple[int, dict[int, Any], str]:
    """Start horovodrun, pass its output on without the result lines, and collect them.

    A Ctrl-C (KeyboardInterrupt here) is passed on to horovodrun, which stops the ranks
    as on Ctrl-C (a second press: at once; a third kills horovodrun, whose watchdog ends
    the ranks); its output is still passed on until it ends (ringrun's message, the
    ranks' last lines), then the KeyboardInterrupt is raised again."""
    marker = token.encode()
    parts: dict[int, dict[int, bytes]] = {}
    counts: dict[int, int] = {}
    err_lines: list[str] = []
    # A process group of its own: a terminal's Ctrl-C reaches the whole foreground group,
    # so horovodrun got it from the terminal and again from us below, and a second SIGINT
    # is ringrun's "kill at once" (no grace for the ranks' KeyboardInterrupt handlers),
    # whichever arrived first. This way each Ctrl-C reaches it once, from us.
    # (Popen's process_group is Python 3.11's; preexec_fn, unsafe with threads, on 3.10)
    group: dict[str, Any] = ({"process_group": 0} if sys.version_info >= (3, 11)
                             else {"preexec_fn": os.setpgrp})
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, **group)

    def pass_stderr() -> None:
        assert proc.stderr is not None
        for raw in proc.stderr:
            text = raw.decode(errors="replace")
            # Not the ranks' lines: their stderr (tracebacks) comes here too, and may end
            # after the launcher's own summary of the job, the line the error names.
            if text.strip() and not _RANK_LINE.match(text):
                err_lines.append(text.strip())
            sys.stderr.write(text)
            sys.stderr.flush()

    errs = threading.Thread(target=pass_stderr, daemon=True)
    errs.start()
    presses = 0
    while True:
        try:
            _pass_stdout(proc, marker, parts, counts)  # until horovodrun's stdout ends
            code = proc.wait()
            break
        except KeyboardInterrupt:
            presses += 1
            if presses < 3:
                proc.send_signal(signal.SIGINT)
            else:
                proc.kill()
    errs.join(5)
    if presses:
        raise KeyboardInterrupt
    return code, _values(parts, counts), err_lines[-1] if err_lines else ""


def _pass_stdout(proc: subprocess.Popen[bytes], marker: bytes, parts: dict[int, dict[int, bytes]],
                 counts: dict[int, int]) -> None:
    """horovodrun's stdout on ours, but the result lines, which go to ``parts``; returns
    at its end (a KeyboardInterrupt leaves the rest unread, for the next call)."""
    assert proc.stdout is not None
    for raw in proc.stdout:
        at = raw.find(marker)
        if at < 0:
            sys.stdout.write(raw.decode(errors="replace"))
        else:
            head = raw[:at]  # the rank's prefix, and a print the function did not end
            if head and not _PREFIX.fullmatch(head):
                sys.stdout.write(head.decode(errors="replace") + "\n")
            _take(raw[at + len(marker):], parts, counts)
        sys.stdout.flush()


def _take(line: bytes, parts: dict[int, dict[int, bytes]], counts: dict[int, int]) -> None:
    """One result line after the marker: ``rank:index:count:base64 piece``."""
    fields = line.strip().split(b":", 3)
    rank, index, total, chunk = int(fields[0]), int(fields[1]), int(fields[2]), fields[3]
    if index == 0:
        parts[rank] = {}  # a later attempt's value replaces an earlier one's
    parts.setdefault(rank, {})[index] = chunk
    counts[rank] = total


def _values(parts: dict[int, dict[int, bytes]], counts: dict[int, int]) -> dict[int, Any]:
    results: dict[int, Any] = {}
    for rank, chunks in parts.items():
        if len(chunks) != counts[rank]:
            raise RuntimeError(f"the hvd.run job's rank {rank} returned a value cut short "
                               f"({len(chunks)} of {counts[rank]} pieces)")
        data = base64.b64decode(b"".join(chunks[i] for i in range(counts[rank])))
        results[rank] = pickle.loads(data)
    return results
