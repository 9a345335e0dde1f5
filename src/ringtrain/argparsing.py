"""The command lines' parser: a bad flag is one error line, not a usage block and exit 2.

``ringrun``, ``horovodrun``, ``ringtrain plan`` and ``ringtrain doctor`` parse with
:class:`OneLineParser`; each ``main`` prints the error and returns its exit code (the
style rule: only ``main`` turns errors into messages and codes). Standard library only.
"""

from __future__ import annotations

import argparse
from typing import Any, NoReturn

from ringtrain.errors import ConfigError

__all__ = ["OneLineParser"]


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
