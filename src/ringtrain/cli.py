"""The ``ringtrain`` command: dispatches to its subcommands.

``ringtrain doctor ...`` (where a step's time goes) and ``ringtrain plan ...``
(scaling predictions). Each subcommand lives in its own module with its own
``main(argv) -> int``; this file only routes, so importing it stays cheap.
"""

from __future__ import annotations

import importlib
import os
import sys

__all__ = ["main"]

_SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "doctor": ("ringtrain.observe.doctor", "run a training script and show where each step's time goes"),
    "plan": ("ringtrain.plan.cli", "predict throughput and scaling efficiency for N GPUs"),
}


def _usage() -> str:
    lines = ["usage: ringtrain COMMAND [ARGS...]", "", "commands:"]
    for name, (_, text) in _SUBCOMMANDS.items():
        lines.append(f"  {name:<8} {text}")
    lines.append("")
    lines.append("Run 'ringtrain COMMAND --help' for a command's options.")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help"):
        print(_usage())
        return 0 if args else 2
    name, rest = args[0], args[1:]
    if name not in _SUBCOMMANDS:
        print(
            f"ringtrain: unknown command {name!r}; choose one of: {', '.join(_SUBCOMMANDS)}",
            file=sys.stderr,
        )
        return 2
    module = importlib.import_module(_SUBCOMMANDS[name][0])
    try:
        return int(module.main(rest))
    except BrokenPipeError:
        # The reader went away (``ringtrain plan ... | head``): nothing is wrong with the
        # command, so no traceback. Point stdout at /dev/null so the interpreter's last
        # flush at exit does not fail a second time; 141 is what a shell reports for SIGPIPE.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 141


if __name__ == "__main__":
    sys.exit(main())
