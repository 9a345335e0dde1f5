"""The command lines' parser: a bad flag is one error line, not a usage block and exit 2.

``ringrun``, ``horovodrun``, ``ringtrain plan`` and ``ringtrain doctor`` parse with
:class:`OneLineParser`; each ``main`` prints the error and returns its exit code (the
style rule: only ``main`` turns errors into messages and codes). Standard library only.
"""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Sequence
from typing import Any, NoReturn

from ringtrain.errors import ConfigError

__all__ = ["OneLineParser"]

# A negative number is a value (``--seed -1``), not a flag, as argparse decides for a
# parser without flags that look like numbers.
_NUMBER = re.compile(r"^-\d+$|^-\d*\.\d+$")


class OneLineParser(argparse.ArgumentParser):
    """argparse, but a bad flag raises ``error`` (a ConfigError by default) with one line
    that says where the help is.

    ``hints`` maps flags of another tool (``--nproc-per-node``; ``_`` and ``-`` alike) to
    what to use here: an unrecognized one of them gets that instead of the help pointer.
    """

    def __init__(self, *args: Any, error: type[Exception] = ConfigError,
                 hints: dict[str, str] | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._error = error
        self._hints = {k.replace("_", "-"): v for k, v in (hints or {}).items()}

    def parse_known_args(self, args: Sequence[str] | None = None,  # type: ignore[override]
                         namespace: argparse.Namespace | None = None) -> tuple[argparse.Namespace, list[str]]:
        argv = list(sys.argv[1:] if args is None else args)
        return super().parse_known_args(self._command_apart(argv), namespace)

    def _command_apart(self, argv: list[str]) -> list[str]:
        """``argv`` with ``--`` before the command (the parser's ``REMAINDER`` positional),
        where there is one and no ``--`` yet.

        argparse matches every token that starts with ``-`` against its own flags, the
        command's too: ``ringrun -np 2 python train.py --max 5`` failed with "ambiguous
        option: --max could match --max-np, --max-restarts". After ``--`` it matches none,
        so the command's flags reach the command whatever they are called."""
        if not any(a.nargs == argparse.REMAINDER for a in self._get_positional_actions()):
            return argv
        i = 0
        while i < len(argv):
            token = argv[i]
            if token == "--":
                return argv
            if not token.startswith("-") or token == "-" or _NUMBER.match(token):
                return [*argv[:i], "--", *argv[i:]]  # the command starts here
            try:
                found = self._parse_optional(token)
            except argparse.ArgumentError as err:  # 3.13.0: an ambiguous flag raises here,
                self.error(str(err))  # outside parse_known_args, which turns it into error()
            if isinstance(found, list):  # Python 3.12+: every match
                found = found[0] if len(found) == 1 else None
            # (action, flag, explicit value); 3.12+ puts the separator before the value
            action, explicit = (found[0], found[-1]) if found else (None, None)
            i += 1
            if action is None or explicit is not None:
                continue
            if action.nargs is None:
                i += 1
            elif isinstance(action.nargs, int):
                i += action.nargs
            elif action.nargs == argparse.OPTIONAL and i < len(argv) and not argv[i].startswith("-"):
                i += 1
        return argv

    def error(self, message: str) -> NoReturn:
        hint = self._hint(message)
        if hint is not None:
            raise self._error(f"{message}: {hint}")
        raise self._error(f"{message} (see '{self.prog} --help')")

    def _hint(self, message: str) -> str | None:
        prefix = "unrecognized arguments: "
        if not message.startswith(prefix):
            return None
        for token in message[len(prefix):].split():
            flag = token.split("=", 1)[0]
            if flag.startswith("--"):
                flag = flag.replace("_", "-")
            if flag in self._hints:
                return self._hints[flag]
        return None
