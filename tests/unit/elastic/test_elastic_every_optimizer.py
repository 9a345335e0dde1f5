"""After a resize every DistributedOptimizer of the job averages over the new size, not
only the one the elastic state holds as ``optimizer``. Horovod reads ``size()`` at every
step; ringtrain's optimizer keeps the size it was built for until its
``world_changed()``, which the state's ``sync()`` called for ``state.optimizer`` alone:
a GAN's second optimizer (a TorchState keyword), one left out of the state, or the
wrapper of the optimizer given to the state kept dividing by the old size (with real
processes, 3 ranks -> 2: the discriminator's averaged gradient 1.0 where it is 1.5)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import ringtrain as rt
import ringtrain.horovod as hvd
from ringtrain import elastic
from ringtrain.elastic import Resumable
from ringtrain.horovod.elastic import TorchState


def _followed(monkeypatch: pytest.MonkeyPatch, *opts: object) -> list[int]:
    """Record, by position in ``opts``, which optimizers were brought to the new world."""
    calls: list[int] = []
    for i, opt in enumerate(opts):
        monkeypatch.setattr(opt, "world_changed", lambda i=i: calls.append(i))
    return calls


def _model() -> torch.nn.Module:
    return torch.nn.Linear(2, 1)


def test_a_torchstate_brings_every_optimizer_of_its_models_to_the_new_world(
        hvd_one_rank: None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(elastic, "resizable", lambda: True)
    g, d, e = _model(), _model(), _model()
    opt_g = hvd.DistributedOptimizer(torch.optim.SGD(g.parameters(), lr=0.1), named_parameters=g.named_parameters())
    opt_d = hvd.DistributedOptimizer(torch.optim.SGD(d.parameters(), lr=0.1), named_parameters=d.named_parameters())
    inner = torch.optim.SGD(e.parameters(), lr=0.1)
    opt_e = hvd.DistributedOptimizer(inner, named_parameters=e.named_parameters())
    calls = _followed(monkeypatch, opt_g, opt_d, opt_e)
    # G's optimizer is the state's; D's a keyword (a GAN); E's wrapper is not in the
    # state at all (the wrapped optimizer is).
    state = TorchState(g, opt_g, D=d, opt_d=opt_d, E=e, opt_e=inner, epoch=0)
    state.sync()
    assert sorted(calls) == [0, 1, 2]


def test_a_resumable_brings_a_second_optimizer_of_its_model_to_the_new_world(
        hvd_one_rank: None, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    model = _model()
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    opt = rt.DistributedOptimizer(inner, named_parameters=model.named_parameters())
    calls = _followed(monkeypatch, opt)
    state = Resumable(tmp_path, model=model, optimizer=inner)  # the wrapped one, not the wrapper
    state.sync()
    assert calls == [0]


def test_an_optimizer_no_state_holds_averages_over_the_world_its_step_runs_in() -> None:
    # An optimizer over a model that no elastic state holds is brought along by nothing
    # but its own next step: built in a world of 3 (its exchange averaging over 3), it
    # steps in a world of 1 after rt.shutdown() and rt.init() (as a survivor of a
    # resizable job steps in the re-formed world), and must average over 1.
    rt.init()
    try:
        model = torch.nn.Linear(3, 1)
        opt = rt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                      named_parameters=model.named_parameters())
        opt._fusion.size = 3  # the world it was built in had 3 ranks
        rt.shutdown()
        rt.init()
        opt.zero_grad()
        model(torch.ones(2, 3)).sum().backward()
        assert model.weight.grad is not None
        assert torch.equal(model.weight.grad, torch.full((1, 3), 2.0))  # not 2/3
    finally:
        rt.shutdown()
