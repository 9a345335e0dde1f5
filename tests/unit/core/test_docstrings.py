"""Every public class has its own docstring (``help(rt.data.Loader)`` once showed none:
a class attribute stood above the docstring, which made it a plain string expression)."""

from __future__ import annotations

import importlib
import inspect

import pytest

PUBLIC = ["ringtrain", "ringtrain.data", "ringtrain.elastic", "ringtrain.checkpoint", "ringtrain.sync",
          "ringtrain.observe", "ringtrain.parallel", "ringtrain.horovod", "ringtrain.errors"]


@pytest.mark.parametrize("module", PUBLIC)
def test_public_classes_have_docstrings(module: str) -> None:
    mod = importlib.import_module(module)
    bare = [name for name in mod.__all__
            if inspect.isclass(obj := getattr(mod, name)) and not obj.__dict__.get("__doc__")]
    assert bare == []
