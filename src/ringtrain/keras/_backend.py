"""Import Keras 3 on the PyTorch backend, or say clearly why it cannot be.

Keras picks its backend once, at import, from ``KERAS_BACKEND`` (then
``~/.keras/keras.json``, then TensorFlow). ringtrain's gradient exchange works on torch
tensors, so Keras must run on ``"torch"``: this module sets ``KERAS_BACKEND=torch``
when Keras is not imported yet and nobody chose a backend, and refuses, with the fix,
when another backend was chosen or is already loaded.
"""

from __future__ import annotations

import os
import sys
from types import ModuleType

from ringtrain.errors import ConfigError

__all__ = ["load_keras", "INSTALL_HINT"]

INSTALL_HINT = "pip install 'ringtrain[keras]'  (Keras 3; it runs on the torch you already have)"


def load_keras() -> ModuleType:
    """Return the ``keras`` module, imported on the torch backend.

    Raises:
        ImportError: Keras is not installed (the message says how to install it).
        ConfigError: Keras is on another backend, or is Keras 2.
    """
    already = sys.modules.get("keras")
    if already is None:
        chosen = os.environ.setdefault("KERAS_BACKEND", "torch")
        if chosen != "torch":
            raise ConfigError(
                f"KERAS_BACKEND={chosen!r} but ringtrain.keras needs Keras on the PyTorch "
                "backend; set KERAS_BACKEND=torch (or unset it) before starting Python"
            )
    try:
        import keras
    except ImportError as exc:
        raise ImportError(
            f"ringtrain.keras needs Keras 3 ({exc.name or 'keras'} could not be imported): "
            + INSTALL_HINT
        ) from None
    version = getattr(keras, "__version__", "0")
    if int(version.split(".")[0]) < 3:
        raise ConfigError(
            f"ringtrain.keras needs Keras 3 on the torch backend, found Keras {version}; "
            + INSTALL_HINT
        )
    backend = keras.backend.backend()
    if backend != "torch":
        raise ConfigError(
            f"Keras was imported with the {backend!r} backend before ringtrain.keras; "
            "ringtrain needs the torch backend: set KERAS_BACKEND=torch before anything "
            "imports keras (or import ringtrain.keras first)"
        )
    return keras
