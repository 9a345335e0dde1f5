"""docs/migrate.md's before/after scripts: the Horovod one changes one import and runs;
the DDP one trains to the same weights as the torchrun + DDP original."""

from __future__ import annotations

import re
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import torch
from hosts.harness import assert_no_orphans, env_for, run_torch_only

MIGRATE = Path(__file__).resolve().parents[2] / "examples" / "migrate"
BIN = Path(sys.executable).parent


def _losses(text: str) -> list[float]:
    return [float(v) for v in re.findall(r"epoch \d+ loss ([0-9.]+)", text)]


@pytest.mark.timeout(120)
def test_horovod_script_changes_one_import_and_trains(tmp_path: Path) -> None:
    before = (MIGRATE / "horovod_before.py").read_text().splitlines()
    after = (MIGRATE / "horovod_after.py").read_text().splitlines()
    assert len(before) == len(after)
    changed = [(b, a) for b, a in zip(before, after, strict=True) if b != a]
    # the docstring says which version it is; the code differs in the import only
    assert changed[1:] == [("import horovod.torch as hvd", "import ringtrain.horovod as hvd")]
    assert changed[0][0].startswith('"""') and len(changed) == 2
    marker = uuid.uuid4().hex
    res = subprocess.run([str(BIN / "horovodrun"), "-np", "2", "python", str(MIGRATE / "horovod_after.py")],
                         capture_output=True, text=True, timeout=110, cwd=tmp_path, env=env_for(marker))
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    losses = _losses(res.stdout)
    assert len(losses) == 5 and losses[-1] < losses[0] / 4, losses
    assert (tmp_path / "checkpoint.pt").is_file()
    assert_no_orphans(marker)


def _torchrun_reference(tmp_path: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """The plain-torch run that ringtrain's must match."""
    return run_torch_only([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                           "2", str(MIGRATE / "ddp_before.py")],
                          lambda res: "epoch 4 loss" in res.stdout, timeout=100, cwd=tmp_path, env=env)


@pytest.mark.timeout(250)
def test_ddp_script_and_its_ringtrain_version_train_the_same(tmp_path: Path) -> None:
    marker = uuid.uuid4().hex
    env = env_for(marker)
    env["OUT"] = str(tmp_path / "ddp.pt")
    ddp = _torchrun_reference(tmp_path, env)
    assert ddp.returncode == 0, ddp.stderr[-2000:]
    env["OUT"] = str(tmp_path / "rt.ckpt")
    rt = subprocess.run([str(BIN / "ringrun"), "-np", "2", "python", str(MIGRATE / "ddp_after.py")],
                        capture_output=True, text=True, timeout=100, cwd=tmp_path, env=env)
    assert rt.returncode == 0, rt.stdout[-2000:] + rt.stderr[-2000:]
    import ringtrain as rt_mod

    want = torch.load(tmp_path / "ddp.pt")
    got = rt_mod.checkpoint.load(tmp_path / "rt.ckpt")
    for key, value in want.items():
        torch.testing.assert_close(got[key], value, atol=1e-6, rtol=1e-5, msg=key)
    assert _losses(rt.stdout) == pytest.approx(_losses(ddp.stdout), rel=1e-4)
    assert_no_orphans(marker)
