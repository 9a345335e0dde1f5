"""rt.checkpoint's safe load is torch.load's default: TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD=1
lifts it for a call that leaves ``weights_only`` unset, as it does for torch.load (an
explicit ``weights_only=True`` still refuses, as torch's)."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from ringtrain import checkpoint
from ringtrain.errors import CheckpointError


def test_the_force_variable_lifts_the_safe_default_as_for_torch_load(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    path = checkpoint.save(tmp_path / "a.ckpt", {"args": argparse.Namespace(lr=0.1)})
    assert path is not None
    with pytest.raises(CheckpointError, match="Namespace"):
        checkpoint.load(path)
    monkeypatch.setenv("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "1")
    # torch says so each time, as for its own torch.load.
    with pytest.warns(UserWarning, match="TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD"):
        assert checkpoint.load(path)["args"].lr == 0.1
    with pytest.warns(UserWarning, match="TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD"):
        assert checkpoint.read(path)["args"].lr == 0.1
    with pytest.raises(CheckpointError, match="Namespace"):
        checkpoint.load(path, weights_only=True)
