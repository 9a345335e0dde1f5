"""Counts Python interpreter starts per test for tests/times.py (on PYTHONPATH only there).

Each interpreter the suite starts inherits ``PYTEST_CURRENT_TEST`` from pytest (through
ringrun, subprocess or multiprocessing's spawn) and appends that test's id to the
``RINGTEST_STARTS`` file: one line per start, written with one ``write`` on an
``O_APPEND`` descriptor, so lines from concurrent starts do not mix.
"""

import os

_log = os.environ.get("RINGTEST_STARTS")
if _log:
    _line = os.environ.get("PYTEST_CURRENT_TEST", "").rsplit(" ", 1)[0] + "\n"
    _fd = os.open(_log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(_fd, _line.encode())
    finally:
        os.close(_fd)
