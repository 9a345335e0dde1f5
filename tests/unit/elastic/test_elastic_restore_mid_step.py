"""A peer lost in the middle of a step: the survivors restore the last commit without
waiting on the broken world. DistributedOptimizer.load_state_dict (the restore) waits
for a step's launched exchanges; in the broken world that wait raises the peer's
failure again, and every survivor left the job instead of restoring (3 ranks under
``ringrun --min-np 2``, one SIGKILLed mid-step: the job ended below --min-np;
tests/integration/test_elastic_resize.py, system tier). ``drive()`` now calls the
state's ``drop_steps()`` first."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import ringtrain.horovod as hvd
from ringtrain import collectives
from ringtrain.elastic import Resumable
from ringtrain.elastic.state import ElasticState
from ringtrain.errors import CollectiveError
from ringtrain.horovod.elastic import TorchState


def _broken_world(monkeypatch: pytest.MonkeyPatch) -> None:
    def wait(self: object, *args: object, **kwargs: object) -> None:
        raise CollectiveError("the coordinator stopped: Connection reset by peer")

    monkeypatch.setattr(collectives.Handle, "wait", wait)


def _mid_step(model: torch.nn.Module) -> None:
    with torch.no_grad():
        model.weight.fill_(5.0)
    model(torch.ones(3, 2)).sum().backward()  # the exchanges are launched; then a peer dies


@pytest.mark.parametrize("kind", ["TorchState", "Resumable"])
def test_a_restore_after_a_lost_peer_does_not_wait_for_the_step_in_progress(
        hvd_one_rank: None, monkeypatch: pytest.MonkeyPatch, tmp_path: Path, kind: str) -> None:
    model = torch.nn.Linear(2, 1)
    with torch.no_grad():
        model.weight.fill_(1.0)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters())
    state: ElasticState
    if kind == "TorchState":
        state = TorchState(model, opt, epoch=0)
    else:
        state = Resumable(tmp_path, model=model, optimizer=opt)
        state.commit(0)
    _mid_step(model)
    _broken_world(monkeypatch)
    state.drop_steps()  # what drive() does on a world failure, before restore()
    state.restore()
    assert torch.all(model.weight == 1.0)
