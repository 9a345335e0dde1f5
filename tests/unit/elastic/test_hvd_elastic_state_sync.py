"""hvd.elastic states against Horovod's (horovod/common/elastic.py, ObjectState;
horovod/torch/elastic/state.py, TorchState and its handlers), in one process: what
``sync()`` takes (the last commit, not the attributes now), what a commit keeps of a
plain value (the object itself), a second ``restore()`` before the next commit, and a
an optimizer or sampler replaced on the state. Each test failed before its fix (the
docstring says how)."""

from __future__ import annotations

import torch

import ringtrain.horovod as hvd
from ringtrain.horovod.elastic import ElasticSampler, ObjectState, TorchState


def _step(model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    opt.zero_grad()
    model(torch.ones(3, 2)).pow(2).sum().backward()
    opt.step()


def test_the_first_sync_takes_the_keywords_not_what_was_assigned_since(hvd_one_rank: None) -> None:
    """Horovod's first sync broadcasts the state's saved values (its keywords) and sets
    the attributes from them: ``state.epoch = 5`` between building the state and
    ``run`` is dropped, while the model (synced by its handler from its parameters now)
    keeps what was loaded into it. ringtrain broadcast the attributes as they were:
    epoch 5."""
    model = torch.nn.Linear(2, 1)
    state = TorchState(model, torch.optim.SGD(model.parameters(), lr=0.1), epoch=0, batch=0)
    with torch.no_grad():
        model.weight.fill_(2.0)
    state.epoch, state.batch = 5, 7

    @hvd.elastic.run
    def train(state: TorchState) -> tuple[int, int]:
        return state.epoch, state.batch

    assert train(state) == (0, 0)
    assert torch.all(model.weight == 2.0)


def test_sync_drops_what_was_assigned_after_the_last_commit(hvd_one_rank: None) -> None:
    """After a commit, sync() sets rank 0's committed values on every rank, rank 0 too;
    ringtrain kept rank 0's uncommitted ``state.batch``."""
    state = ObjectState(epoch=0, batch=0)
    state.epoch, state.batch = 1, 4
    state.commit()
    state.batch = 9
    state.sync()
    assert (state.epoch, state.batch) == (1, 4)


def test_a_commit_keeps_the_value_itself_as_horovods(hvd_one_rank: None) -> None:
    """Horovod saves ``getattr(self, attr)``, no copy: after restore() and sync() the
    attribute is still the script's own list, and what was appended in place stays.
    ringtrain restored a deep copy: the script's ``history`` was no longer the state's,
    and an in-place change was undone where Horovod's is not."""
    history: list[int] = []
    state = ObjectState(history=history, epoch=0)
    history.append(1)
    state.commit()
    history.append(2)
    state.epoch = 3
    state.restore()
    assert state.history is history and history == [1, 2] and state.epoch == 0
    state.sync()
    assert state.history is history


def test_a_second_restore_before_the_next_commit_goes_back_to_the_commit() -> None:
    """An optimizer's load_state_dict keeps the tensors it is given; restore() gave it
    the commit's own, so the steps after it changed the commit in place and a second
    restore() (two failures within one commit interval) brought back Adam's moments and
    step count of those steps."""
    torch.manual_seed(0)
    model = torch.nn.Linear(2, 1)
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    _step(model, opt)
    state = TorchState(model, opt)
    committed = {k: v.clone() for k, v in opt.state[model.weight].items()}
    weight = model.weight.detach().clone()
    for _ in range(2):
        _step(model, opt)
        _step(model, opt)
        state.restore()
        now = opt.state[model.weight]
        assert all(torch.equal(now[k], v) for k, v in committed.items())
        assert torch.equal(model.weight, weight)


def test_a_replaced_optimizer_and_sampler_are_the_ones_restored() -> None:
    """Horovod's TorchState.__setattr__ hands the new object to its handler and saves
    it: restore() goes back to the new object's state when it was set. ringtrain kept
    restoring the old sampler (the new one was never restored or synced) and loaded the
    old optimizer's commit into the new optimizer (here: another learning rate)."""
    model = torch.nn.Linear(2, 1)
    state = TorchState(model, torch.optim.SGD(model.parameters(), lr=0.1),
                       sampler=ElasticSampler(list(range(10))))
    opt2 = torch.optim.SGD(model.parameters(), lr=0.5)
    sampler2 = ElasticSampler(list(range(10)))
    sampler2.set_epoch(5)
    state.optimizer, state.sampler = opt2, sampler2
    sampler2.set_epoch(6)
    opt2.param_groups[0]["lr"] = 0.7
    state.restore()
    assert sampler2.epoch == 5 and opt2.param_groups[0]["lr"] == 0.5
    state.sampler.record_batch(0, 2)
    state.commit()
    sampler2.set_epoch(8)
    state.restore()
    assert (sampler2.epoch, sampler2.processed_num) == (5, 2)

