"""Bad layouts: the same one-line error, naming the fix, on every rank; nobody hangs."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from hosts.harness import RINGRUN, assert_no_orphans, env_for, new_marker
from ringtest import run_world
from test_parallel_common import EXAMPLE, ROOT, build

RANKS = 2
#: (layout, model, words the message must contain); the model None is a one-unit model.
BAD = [
    ({"pipeline": 3}, {"block": 16, "layers": 1, "width": 32, "heads": 4},
     ["does not divide the world size 2", "divisors: 1, 2"]),
    ({"pipeline": 2}, None, ["2 pipeline stages", "only 1 unit(s) (0)", "use pipeline <= 1"]),
    ({"tensor": 2}, {"block": 16, "layers": 1, "width": 27, "heads": 3},
     ["blocks.0.attn.q (colwise) has 27 output features", "tensor=2 does not divide",
      "choose tensor from [3, 9, 27]"]),
    ({"tensor": 2}, {"block": 16, "layers": 1, "width": 30, "heads": 3},
     ["blocks.0.attn has 3 heads", "tensor=2 does not divide", "choose tensor from [3]"]),
]


def try_all() -> list[str]:
    import torch

    from ringtrain.errors import ConfigError
    from ringtrain.parallel import parallelize

    messages = []
    for layout, model, _ in BAD:
        try:
            if model is None:
                parallelize(torch.nn.Sequential(torch.nn.Linear(4, 4)),
                            torch.nn.functional.mse_loss, **layout)
            else:
                build(layout, model)
        except ConfigError as exc:
            messages.append(str(exc))
        else:
            messages.append("no error")
    return messages


@pytest.mark.timeout(180)
def test_every_rank_gets_the_same_one_line_error() -> None:
    ranks = run_world(try_all, RANKS, timeout=150)
    for messages in ranks:
        assert messages == ranks[0]
    for message, (_, _, words) in zip(ranks[0], BAD, strict=True):
        assert "\n" not in message
        for word in words:
            assert word in message, message


@pytest.mark.timeout(180)
def test_the_example_exits_with_one_line_per_rank(tmp_path: Path) -> None:
    marker = new_marker()
    run = subprocess.run(
        [RINGRUN, "-np", "4", "--oversubscribe", sys.executable, str(EXAMPLE), "--pipeline", "3", "--steps", "1"],
        cwd=ROOT, env=env_for(marker), capture_output=True, text=True, timeout=150)
    assert run.returncode == 2, run.stderr[-2000:]
    lines = [line for line in (run.stdout + run.stderr).splitlines()
             if "gpt_parallel: error:" in line]
    assert sorted(line.split()[0] for line in lines) == ["[0]", "[1]", "[2]", "[3]"], lines
    assert all("does not divide the world size 4" in line for line in lines)
    assert "Traceback" not in run.stdout + run.stderr
    assert_no_orphans(marker)


def built_with_the_ranks_seed(layout: dict[str, int | bool]) -> str:
    import torch.distributed as dist

    from ringtrain.errors import ConfigError

    try:
        build(layout, seed=dist.get_rank())  # the user forgot to seed every rank alike
    except ConfigError as exc:
        return str(exc)
    return "no error"


@pytest.mark.timeout(180)
@pytest.mark.parametrize("layout", [{"shard": False}, {"tensor": 2}], ids=["replicated", "tensor"])
def test_a_model_that_differs_between_ranks_is_refused(layout: dict[str, int | bool]) -> None:
    # Before: accepted. FSDP2 and DTensor broadcast nothing, so the replicated copies (and
    # the tensor ranks' whole layers) started apart and stayed apart: 5.8 after 3 steps.
    messages = run_world(built_with_the_ranks_seed, RANKS, layout, timeout=150)
    assert messages[0] == messages[1]
    assert "differs from rank 0's" in messages[0] and "(on rank(s) 1)" in messages[0]
    assert "torch.manual_seed" in messages[0] and "\n" not in messages[0]


def steps_of_two_shapes() -> list[str]:
    from test_parallel_common import SMALL, global_batches, local_batch

    from ringtrain.errors import ConfigError

    par = build({"pipeline": 2, "microbatches": 4})
    data = global_batches(3, 8, SMALL["block"])
    outcomes = []
    for step, length in enumerate([16, 8, 16]):  # the second batch has shorter sequences
        x, y = local_batch(par, data[step][:, :length + 1])
        try:
            outcomes.append(f"{par.step(x, y):.4f}")
        except ConfigError as exc:
            outcomes.append(str(exc))
    return outcomes


@pytest.mark.timeout(180)
def test_a_pipelined_batch_of_another_shape_is_refused_on_every_stage() -> None:
    # Before: the last stage received into the first step's activation buffers and
    # failed in the loss ("Expected input batch_size (32) to match target batch_size
    # (16)"), its neighbour with Gloo's "Connection closed by peer".
    ranks = run_world(steps_of_two_shapes, RANKS, timeout=150)
    assert ranks[0] == ranks[1]
    first, refused, after = ranks[0]
    assert "inputs [8, 8] int64" in refused and "first step's inputs [8, 16] int64" in refused
    assert "same shapes" in refused and "\n" not in refused
    assert float(first) > 0 and float(after) > 0  # batches of the first shape still run


def tensor_ranks_sharding_by_global_rank() -> str:
    import torch.distributed as dist
    from test_parallel_common import TWO_BLOCKS_MODEL, global_batches

    from ringtrain.errors import ConfigError

    par = build({"tensor": 2}, TWO_BLOCKS_MODEL)
    batch = global_batches(1, 8, TWO_BLOCKS_MODEL["block"])[0]
    r, w = dist.get_rank(), dist.get_world_size()  # Horovod's habit, wrong here
    mine = batch[r * 8 // w:(r + 1) * 8 // w]
    try:
        return f"{par.step(mine[:, :-1], mine[:, 1:]):.4f}"
    except ConfigError as exc:
        return str(exc)


@pytest.mark.timeout(180)
def test_tensor_ranks_given_different_batches_are_refused() -> None:
    # Before: DTensor took each rank's batch as the replicated input without looking, and
    # the step trained on a mixture of the two halves, the same loss on both ranks.
    messages = run_world(tensor_ranks_sharding_by_global_rank, RANKS, timeout=150)
    assert messages[0] == messages[1]
    assert "ranks 0 and 1 split the same layers" in messages[0]
    assert "par.data_rank" in messages[0] and "\n" not in messages[0]
