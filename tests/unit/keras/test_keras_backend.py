"""ringtrain.keras refuses clearly when Keras is missing or on another backend.

Each case runs in a fresh interpreter: Keras picks its backend once per process, and
the pytest process must not import Keras at all. None of these needs Keras installed.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

_CASES = {
    # An explicit KERAS_BACKEND other than torch, Keras not imported yet.
    "env_says_jax": ("KERAS_BACKEND", "jax", ""),
    # Keras already imported with the jax backend (a stand-in module, no jax needed).
    "imported_with_jax": ("", "", """
        import sys, types
        fake = types.ModuleType("keras")
        fake.__version__ = "3.9.0"
        fake.backend = types.SimpleNamespace(backend=lambda: "jax")
        sys.modules["keras"] = fake
    """),
    # Keras 2 (tf.keras era) has no torch backend.
    "keras_2": ("", "", """
        import sys, types
        fake = types.ModuleType("keras")
        fake.__version__ = "2.15.0"
        sys.modules["keras"] = fake
    """),
    # Keras not installed: None in sys.modules makes "import keras" raise ImportError.
    "missing": ("", "", """
        import sys
        sys.modules["keras"] = None
    """),
}

_EXPECTED = {
    "env_says_jax": ("ConfigError", "KERAS_BACKEND='jax'"),
    "imported_with_jax": ("ConfigError", "imported with the 'jax' backend"),
    "keras_2": ("ConfigError", "found Keras 2.15.0"),
    "missing": ("ImportError", "pip install 'ringtrain[keras]'"),
}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("case", sorted(_CASES))
def test_import_fails_with_the_fix_in_the_message(case: str) -> None:
    var, value, prelude = _CASES[case]
    script = textwrap.dedent(prelude) + textwrap.dedent("""
        try:
            import ringtrain.keras
        except Exception as exc:
            print(type(exc).__name__, "|", exc)
        else:
            print("imported")
    """)
    env = {k: v for k, v in os.environ.items() if k != "KERAS_BACKEND"}
    if var:
        env[var] = value
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                          text=True, timeout=50)
    assert done.returncode == 0, done.stderr
    kind, _, message = done.stdout.strip().partition(" | ")
    want_kind, want_text = _EXPECTED[case]
    assert kind == want_kind, done.stdout
    assert want_text in message
