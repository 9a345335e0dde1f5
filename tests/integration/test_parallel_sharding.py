"""Sharded data parallelism (FSDP2): the same training as one process, 1/N of the state.

Per-rank state is measured (``Parallel.state_memory``: the storages parameters,
gradients and AdamW's moments occupy on the rank, FSDP's padding included) after the
last backward, before its update, and compared with one process training the same
model on the same global batches.

The 4 sharded ranks also save a checkpoint, which loads on 2 ranks (2 pipeline stages,
each reading only its own layers) and on 1 with bit-identical parameters; the
optimizer state comes along, so the next step's loss is the one the 4 ranks computed.
(One world of each size: the 2-rank world trains sharded, then replicated, then
resumes the 4-rank checkpoint.)
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from ringtest import run_world
from test_parallel_common import STEPS, assert_identical, max_difference, resume, train

from ringtrain import checkpoint

TOLERANCE = 1e-5
MEMORY = 0.15  # the bound: within 15% of 1/N


@pytest.fixture(scope="module")
def single() -> dict[str, Any]:
    result = train({})
    assert result is not None
    return result


@pytest.fixture(scope="module")
def four(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    path = str(tmp_path_factory.mktemp("ckpt") / f"step-{STEPS}.dcp")
    result = run_world(train, 4, {"shard": True}, STEPS, None, 8, path, timeout=200)[0]
    return {**result, "path": path}


def two_ranks(path: str) -> dict[str, Any]:
    return {"sharded": train({"shard": True}), "replicated": train({"shard": False}),
            "resumed": resume(path, {"pipeline": 2, "microbatches": 2})}


@pytest.fixture(scope="module")
def two(four: dict[str, Any]) -> dict[str, Any]:
    return run_world(two_ranks, 2, four["path"], timeout=200)[0]


def _check_training(got: dict[str, Any], single: dict[str, Any]) -> None:
    loss_error = max(abs(a - b) for a, b in zip(got["losses"], single["losses"], strict=True))
    param_error = max_difference(got["params"], single["params"])
    print(f"{got['describe']}: loss error {loss_error:.2e}, parameter error {param_error:.2e}, "
          f"state {got['state_bytes']} B per rank (one process: {single['state_bytes']} B)")
    assert len(got["losses"]) == STEPS
    assert loss_error <= TOLERANCE and param_error <= TOLERANCE


@pytest.mark.timeout(300)
def test_four_sharded_ranks(four: dict[str, Any], single: dict[str, Any]) -> None:
    _check_training(four, single)
    assert abs(four["state_bytes"] / single["state_bytes"] * 4 - 1) <= MEMORY


@pytest.mark.timeout(300)
def test_two_ranks_sharded_and_replicated(two: dict[str, Any], single: dict[str, Any]) -> None:
    sharded, replicated = two["sharded"], two["replicated"]
    for got in (sharded, replicated):
        _check_training(got, single)
    assert abs(sharded["state_bytes"] / single["state_bytes"] * 2 - 1) <= MEMORY
    assert abs(replicated["state_bytes"] / single["state_bytes"] - 1) <= MEMORY
    # The gathers and scatters were timed for the doctor (replicated has none).
    assert sharded["events"].get("shard_comm", 0) >= 2 * STEPS
    assert replicated["events"].get("shard_comm", 0) == 0
    assert sharded["events"]["step_end"] == STEPS


@pytest.mark.timeout(300)
def test_the_four_rank_checkpoint_loads_at_two_and_one(four: dict[str, Any],
                                                       two: dict[str, Any]) -> None:
    checkpoint.verify_sharded(four["path"])  # complete, every checksum holds
    one = resume(four["path"], {})  # this process alone
    assert one is not None
    for loaded in (two["resumed"], one):
        assert_identical(loaded["params"], four["params"])
        assert abs(loaded["next_loss"] - four["next_loss"]) <= TOLERANCE
    assert checkpoint.latest(Path(four["path"]).parent, "*.dcp") == Path(four["path"])
