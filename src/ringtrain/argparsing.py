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
    that says where the help is."""

    def __init__(self, *args: Any, error: type[Exception] = ConfigError, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._error = error

    def error(self, message: str) -> NoReturn:
        raise self._error(f"{message} (see '{self.prog} --help')")
