"""ringtrain.horovod's optimizer and job-level calls: uneven data with join(), process
sets, Adasum, re-initialisation, the timeline and a rank that never comes."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from ringtest import run_world


def _data(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * rank + step)
    return torch.randn(4, 3, generator=g), torch.randn(4, 1, generator=g)


BATCHES = {0: 2, 1: 5}  # rank -> batches: rank 0 runs out of data first


def _joined_training() -> dict[str, Any]:
    import ringtrain.horovod as hvd

    hvd.init()
    r = hvd.rank()
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    for step in range(BATCHES[r]):
        x, y = _data(step, r)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    last = hvd.join()
    # A rank that joined stopped updating; the one that joined last has the trained model.
    hvd.broadcast_parameters(model.state_dict(), root_rank=last)
    out = {"last": last, "params": [p.detach().clone() for p in model.parameters()]}
    hvd.shutdown()
    return out


def _joined_reference() -> list[torch.Tensor]:
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(max(BATCHES.values())):
        opt.zero_grad()
        total: Any = 0
        for rank, batches in BATCHES.items():
            if step < batches:  # a joined rank contributes zeros; the average is over both
                x, y = _data(step, rank)
                total = total + torch.nn.functional.mse_loss(model(x), y) / len(BATCHES)
        total.backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.timeout(120)
def test_uneven_batches_finish_with_join_instead_of_a_stall() -> None:
    r0, r1 = run_world(_joined_training, 2, init=False, timeout=110)
    assert r0["last"] == r1["last"] == 1  # the rank that joined last, the same everywhere
    for got, want in zip(r0["params"], _joined_reference(), strict=True):
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
    for a, b in zip(r0["params"], r1["params"], strict=True):
        assert torch.equal(a, b)


def _adasum_step() -> list[float]:
    import ringtrain.horovod as hvd

    hvd.init()
    w = torch.nn.Parameter(torch.tensor([1.0, 2.0, -1.0], dtype=torch.float64))
    opt = hvd.DistributedOptimizer(torch.optim.SGD([w], lr=0.5), named_parameters=[("w", w)],
                                   op=hvd.Adasum)
    assert isinstance(opt, torch.optim.SGD)
    c = torch.tensor(_grads()[hvd.rank()])
    (w * c).sum().backward()
    opt.step()
    out = w.detach().tolist()
    hvd.shutdown()
    return out


def _grads() -> list[list[float]]:
    return [[1.0, 0.5, -2.0], [0.25, 1.0, 1.0]]


@pytest.mark.timeout(120)
def test_adasum_optimizer_combines_the_ranks_updates_as_the_formula_says() -> None:
    results = run_world(_adasum_step, 2, init=False, timeout=110)
    a, b = (-0.5 * np.array(g) for g in _grads())  # each rank's own SGD step
    dot = a @ b
    combined = (1 - dot / (2 * (a @ a))) * a + (1 - dot / (2 * (b @ b))) * b
    expected = np.array([1.0, 2.0, -1.0]) + combined
    for got in results:
        np.testing.assert_allclose(got, expected, rtol=1e-12)


def _sets_and_reinit(path: str) -> dict[str, Any]:
    import ringtrain.horovod as hvd

    out: dict[str, Any] = {}
    hvd.init()
    first = (hvd.rank(), hvd.size())
    hvd.shutdown()
    out["initialized_after_shutdown"] = hvd.is_initialized()
    hvd.init()
    out["same_after_reinit"] = first == (hvd.rank(), hvd.size())
    r = hvd.rank()
    solo = [hvd.add_process_set([0]), hvd.add_process_set([1])]
    mine = solo[r]
    out["set"] = (mine.size(), mine.rank(), mine.included(), solo[1 - r].included())
    # The same name in two process sets is two operations.
    out["in_set"] = hvd.allreduce(torch.tensor([float(r + 1)]), name="x", op=hvd.Sum, process_set=mine).item()
    model = torch.nn.Linear(2, 1)
    torch.manual_seed(r)
    with torch.no_grad():
        model.weight.normal_()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters(), process_set=solo[0])
    model(torch.ones(1, 2)).sum().backward()
    opt.step()  # rank 1 is not in the set: it steps on its own gradient
    # Sparse gradients over a process set: a clear error (they were averaged over the
    # whole world, the rank outside the set included).
    emb = torch.nn.Embedding(4, 2, sparse=True)
    sparse = hvd.DistributedOptimizer(torch.optim.SGD(emb.parameters(), lr=1.0),
                                      named_parameters=emb.named_parameters(), process_set=solo[0])
    emb(torch.tensor([r])).sum().backward()
    try:
        sparse.step()
        out["sparse_in_set"] = "no error"
    except ValueError as exc:
        out["sparse_in_set"] = str(exc)
    # No ranks: every rank (Horovod's convention), a set apart from the global one.
    everyone = hvd.add_process_set([])
    out["empty_set"] = (everyone.ranks, everyone.process_set_id > 0, hvd.allreduce(
        torch.tensor([float(r + 1)]), op=hvd.Sum, process_set=everyone).item())
    out["removed"] = [hvd.remove_process_set(s) for s in [*solo, everyone]]
    hvd.start_timeline(path, mark_cycles=True)
    hvd.allreduce(torch.ones(3), name="traced")
    hvd.stop_timeline()
    hvd.shutdown()
    return out


def _set_used_before_registered_here() -> list[float]:
    import os
    import time

    os.environ["RINGTRAIN_STALL_TIMEOUT"] = "20"
    import ringtrain.horovod as hvd
    from ringtrain.horovod import _coordinator

    hvd.init()
    if hvd.rank() == 0:
        # Rank 0 is slow to register the set (a loaded machine): rank 1 registers it and
        # submits an allreduce on it before rank 0's coordinator knows the set.
        bind = _coordinator.ProcessSet._bind

        def slow_bind(self: Any, *args: Any) -> None:
            time.sleep(1.5)
            bind(self, *args)

        _coordinator.ProcessSet._bind = slow_bind  # type: ignore[method-assign]
    both = hvd.add_process_set([0, 1])
    got = [hvd.allreduce(torch.tensor([float(hvd.rank() + 1)]), op=hvd.Sum, process_set=both).item()
           for _ in range(2)]
    hvd.shutdown()
    return got


@pytest.mark.timeout(60)
def test_a_set_used_by_a_faster_rank_before_this_one_registered_it() -> None:
    """The race behind a rare CI stall: the cycle that brought rank 1's operation in a set
    rank 0 had not registered yet failed it on rank 0 as "not registered on every rank"
    (silently: rank 0 had not submitted it yet), and rank 0's own submission then waited
    for rank 1 for ever. Now rank 0 waits for its add_process_set."""
    assert run_world(_set_used_before_registered_here, 2, init=False, timeout=50) == [[3.0, 3.0]] * 2


@pytest.mark.timeout(120)
def test_process_sets_reinit_and_timeline(tmp_path: Path) -> None:
    path = tmp_path / "timeline.json"
    r0, r1 = run_world(_sets_and_reinit, 2, str(path), init=False, timeout=110)
    for r, o in enumerate((r0, r1)):
        assert o["initialized_after_shutdown"] is False and o["same_after_reinit"]
        assert o["set"] == (1, 0, True, False)
        assert o["in_set"] == float(r + 1)
        assert o["removed"] == [True, True, True]
        assert o["empty_set"] == ([0, 1], True, 3.0)
        assert "sparse_as_dense=True" in o["sparse_in_set"]
    trace = json.loads(path.read_text())  # Horovod's form: an array, the start time first
    names = {e.get("name") for e in trace}
    assert {"NEGOTIATE_ALLREDUCE", "ALLREDUCE", "CYCLE_START"} <= names
    tracks = [e["args"]["name"] for e in trace if e.get("ph") == "M"]
    assert "allreduce.traced" in tracks
    assert "start_time_since_epoch_in_micros" in trace[0]["args"]


def _absent() -> str:
    import time

    import ringtrain.horovod as hvd

    hvd.init()
    if hvd.rank() == 1:
        time.sleep(8)  # never submits 'grad', never joins
        return "absent"
    out = []
    try:
        hvd.allreduce(torch.ones(2), name="grad")
        out.append("no error")
    except hvd.HorovodInternalError as exc:
        out.append(str(exc))
    try:  # a join the other rank never makes: the same error class (a StallError before)
        hvd.join()
        out.append("no error")
    except hvd.HorovodInternalError as exc:
        out.append(str(exc))
    return "\n".join(out)


@pytest.mark.timeout(60)
def test_a_rank_that_never_submits_is_named_after_the_stall_timeout() -> None:
    message, join = run_world(_absent, 2, init=False, env={"RINGTRAIN_STALL_TIMEOUT": "3"},
                              timeout=50)[0].split("\n")
    assert "'allreduce.grad' did not complete within 3 s" in message
    assert "submitted by rank(s) [0], still missing rank(s) [1]" in message
    assert "did not complete within 3 s" in join and "still missing rank(s) [1]" in join


def _late() -> str:
    import logging
    import os
    import time

    import ringtrain.horovod as hvd

    os.environ.pop("RINGTRAIN_STALL_TIMEOUT", None)  # Horovod's default: no limit
    seen: list[str] = []

    class Catch(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            seen.append(record.getMessage())

    logging.getLogger("ringtrain.coordinator").addHandler(Catch())
    hvd.init()
    if hvd.rank() == 1:
        time.sleep(2.5)  # a long evaluation on one rank: past two warnings, no limit set
    total = hvd.allreduce(torch.full((2,), float(hvd.rank() + 1)), name="grad", op=hvd.Sum)
    hvd.shutdown()
    return f"{total.tolist()}|{len(seen)}|{seen[0] if seen else ''}"


@pytest.mark.timeout(60)
def test_a_late_rank_is_warned_about_as_horovod_does_and_the_operation_completes() -> None:
    """Horovod's stall check warns and never gives up by default; before, the drop-in
    raised after 60 s (ringtrain's own limit), failing a rank 0 that evaluated longer."""
    rank0, rank1 = run_world(_late, 2, init=False, env={"HOROVOD_STALL_CHECK_TIME_SECONDS": "1"},
                             timeout=50)
    total, warnings, first = rank0.split("|")
    assert total == "[3.0, 3.0]" and rank1.startswith("[3.0, 3.0]|0|")
    assert int(warnings) >= 2  # every second while rank 1 was away
    assert first.startswith("allreduce 'allreduce.grad' has waited 1 s: submitted by rank(s) [0], "
                            "still missing rank(s) [1]")
    assert "still waiting" in first


@pytest.mark.timeout(180)
def test_elastic_job_survives_a_killed_worker_and_processes_every_sample_once(tmp_path: Path) -> None:
    import os
    import subprocess
    import sys
    import uuid

    from hosts.harness import assert_no_orphans, env_for

    marker = uuid.uuid4().hex
    script = Path(__file__).parent / "scripts" / "hvd_elastic_train.py"
    out = tmp_path / "out.pt"
    env = env_for(marker)
    env.update(RINGTRAIN_ELASTIC_DIR=str(tmp_path / "commits"), RINGTRAIN_ELASTIC_PERSIST_S="0")
    res = subprocess.run([str(Path(sys.executable).parent / "ringrun"), "-np", "2", "--max-restarts", "1",
                          "python", str(script), str(out), "17"],
                         capture_output=True, text=True, timeout=170, env=env)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert "restarting" in (res.stdout + res.stderr).lower()
    got = torch.load(out)
    assert got["attempt"] == "1" and got["resets"] == [2]
    for epoch in range(3):
        assert sorted(got["seen"][epoch]) == list(range(96)), f"epoch {epoch}: a sample lost or repeated"
    assert not (tmp_path / "commits" / "commit.ckpt").exists(), "a finished job leaves no commit behind"
    assert os.path.getsize(out) > 0
    assert_no_orphans(marker)


def _state_before_wrapping() -> dict[str, Any]:
    import warnings

    import ringtrain as rt
    import ringtrain.horovod as hvd

    hvd.init()
    out: dict[str, Any] = {}
    model = torch.nn.Linear(2, 1)
    adam = torch.optim.Adam(model.parameters(), lr=0.1)
    hvd.broadcast_optimizer_state(adam, root_rank=0)  # before wrapping: Adam step 1 of zeros
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        opt = hvd.DistributedOptimizer(adam, named_parameters=model.named_parameters())
    out["warned"] = any("empty optimizer state" in str(w.message) for w in caught)
    model(torch.ones(1, 2)).sum().backward()
    opt.step()
    out["hvd_step"] = float(opt.state[model.weight]["step"])  # Horovod: 1, not 2
    # Horovod's pytorch_mnist.py: SGD with momentum broadcast before wrapping leaves zero
    # momentum buffers, the same as an empty state: dropping them is no news.
    sgd_model = torch.nn.Linear(2, 1)
    sgd = torch.optim.SGD(sgd_model.parameters(), lr=0.1, momentum=0.5)
    hvd.broadcast_optimizer_state(sgd, root_rank=0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        hvd.DistributedOptimizer(sgd, named_parameters=sgd_model.named_parameters())
    out["sgd_warned"] = any("empty optimizer state" in str(w.message) for w in caught)
    # rt.DistributedOptimizer shares the state it is given (a checkpoint loaded first)
    other = torch.nn.Linear(2, 1)
    adam2 = torch.optim.Adam(other.parameters(), lr=0.1)
    other(torch.ones(1, 2)).sum().backward()
    adam2.step()
    adam2.zero_grad()
    opt2 = rt.DistributedOptimizer(adam2, named_parameters=other.named_parameters())
    other(torch.ones(1, 2)).sum().backward()
    opt2.step()
    out["rt_step"] = float(opt2.state[other.weight]["step"])
    return out


@pytest.mark.timeout(60)
def test_horovods_wrapper_starts_with_an_empty_state_and_says_so() -> None:
    for o in run_world(_state_before_wrapping, 2, init=False, timeout=50):
        assert o == {"warned": True, "hvd_step": 1.0, "rt_step": 2.0, "sgd_warned": False}


def _resume_recipe() -> dict[str, Any]:
    """Horovod's resume recipe: rank 0 loads a checkpoint into the wrapped optimizer, the
    others start empty, then broadcast_parameters and broadcast_optimizer_state."""
    import ringtrain.horovod as hvd

    hvd.init()
    torch.manual_seed(hvd.rank())  # every rank builds its own model: the broadcast fixes it
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    opt = hvd.DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=0.1, weight_decay=0.1),
                                   named_parameters=model.named_parameters())
    if hvd.rank() == 0:  # "checkpoint": one local update's state and parameters
        torch.manual_seed(9)
        plain = torch.optim.AdamW(model.parameters(), lr=0.1, weight_decay=0.1)
        model(torch.randn(6, 4)).sum().backward()
        plain.step()
        model.zero_grad()
        opt.load_state_dict(plain.state_dict())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    before = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    after = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    everyone = hvd.allgather(after.reshape(1, -1))
    hvd.shutdown()
    return {"moved": float((after - before).abs().max()), "apart": float((everyone[0] - everyone[1]).abs().max())}


@pytest.mark.timeout(60)
def test_broadcasting_the_optimizer_state_leaves_the_parameters_where_they_are() -> None:
    # Before (as in Horovod), the ranks with an empty state took one zero-gradient AdamW
    # update to build it, and its weight decay moved only their parameters: 1e-2 apart.
    for o in run_world(_resume_recipe, 2, init=False, timeout=50):
        assert o == {"moved": 0.0, "apart": 0.0}


def _waiting_when_the_world_ends() -> str:
    import os
    import threading
    import time

    import ringtrain.horovod as hvd
    from ringtrain import runtime

    os.environ.pop("RINGTRAIN_STALL_TIMEOUT", None)  # no limit: only the world's end frees it
    hvd.init()
    if hvd.rank() == 0:
        time.sleep(2.5)  # never submits (as a rank the launcher lost); alive past the sever at 1 s
        return "away"
    # What the elastic watcher does when ringrun announces a world without a lost host.
    threading.Timer(1.0, runtime.sever, args=(["192.0.2.1"],)).start()
    try:
        hvd.allreduce(torch.ones(2), name="grad")
        return "no error"
    except hvd.HorovodInternalError as exc:
        return str(exc)


@pytest.mark.timeout(60)
def test_an_operation_waiting_for_a_lost_rank_fails_when_the_world_ends() -> None:
    # Without a stall limit (Horovod's default) nothing else would end this wait: a
    # resizable horovodrun job whose rank 0 was killed hung in world 0 (found by the
    # system tier's test_single_rank_failure[discovery-kill]).
    _, waiting = run_world(_waiting_when_the_world_ends, 2, init=False, timeout=50)
    assert "this world is over" in waiting
