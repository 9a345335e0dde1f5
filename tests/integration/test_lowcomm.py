"""rt.LocalSGD and rt.DiLoCo on 3 real Gloo ranks against one-process references.

One world runs every scenario (process start-up, not training, dominates the cost);
the tests read its results through a module-scoped fixture:

- DiLoCo with sync_every=1, SGD inner and outer SGD(lr=1.0) equals synchronous data
  parallelism on the global batch; LocalSGD with sync_every=1 equals per-step parameter
  averaging; with sync_every=3, fragments=2, AdamW inner and Nesterov outer both equal
  the written-out algorithm (tests/lowcomm_reference.py), also with bf16 on the wire.
- ranks hold bit-identical parameters after every sync (and differ between syncs);
- a checkpoint taken mid-interval (each rank's local part included, with rt.data.Loader)
  resumes bit-exactly; a rank that (re)joins starts from the synced copy while the
  others keep their local steps;
- bad input is one clear error on every rank: different sync_every or outer settings
  (MismatchError naming the argument), sync_every < 1, an outer optimizer over other
  parameters, mixing with DistributedOptimizer (ConfigError).
"""

from __future__ import annotations

import copy
import hashlib
import io
from typing import Any

import lowcomm_reference as ref
import pytest
import torch
from ringtest import run_world

# Every test may be the one that starts the shared world (run_world's own limit is
# 180 s): each gets room for it, not the suite's default.
pytestmark = pytest.mark.timeout(200)

N = 3
ROWS = 4  # rows per rank per step
# The MLP's four tensors ([16, 4], [16], [2, 16], [2]) split in two fragments by size:
# the first weight alone, then the rest (ringtrain.lowcomm.fragments.split).
PARTS = [[0], [1, 2, 3]]


def _mlp() -> torch.nn.Module:
    g = torch.Generator().manual_seed(3)
    m = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2))
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.5)
    return m


def _batch(step: int, worker: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + worker)
    return torch.randn(ROWS, 4, generator=g), torch.randn(ROWS, 2, generator=g)


def _loss(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.mse_loss(model(x), y)


def _sgd(params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.1)


def _momentum(params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def _adamw(params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=0.02)


def _outer_plain(params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=1.0)


def _nesterov(params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.7, momentum=0.9, nesterov=True)


#: name -> (mode, inner, outer, sync_every, fragments, steps, strategy, compression)
CONFIGS: dict[str, tuple[str, Any, Any, int, int, int, str, str]] = {
    "diloco_h1_is_sync": ("DiLoCo", _sgd, _outer_plain, 1, 1, 4, "native", "none"),
    "localsgd_h1_is_averaging": ("LocalSGD", _momentum, None, 1, 1, 4, "native", "none"),
    "localsgd_h3_f2_ring": ("LocalSGD", _adamw, None, 3, 2, 8, "ring", "none"),
    "diloco_h3_f2": ("DiLoCo", _adamw, _nesterov, 3, 2, 8, "native", "none"),
    "diloco_h2_bf16_ring": ("DiLoCo", _adamw, _nesterov, 2, 1, 6, "ring", "bf16"),
}


def _digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.detach().contiguous().numpy().tobytes()).hexdigest()[:16]


def _build(cfg: tuple[str, Any, Any, int, int, int, str, str], model: torch.nn.Module) -> Any:
    import ringtrain as rt

    mode, inner, outer, h, f, _steps, strategy, comp = cfg
    compression = getattr(rt.Compression, comp)
    if mode == "LocalSGD":
        return rt.LocalSGD(model, inner(list(model.parameters())), sync_every=h, fragments=f,
                           compression=compression, strategy=strategy)
    return rt.DiLoCo(model, inner(list(model.parameters())), outer(list(model.parameters())),
                     sync_every=h, compression=compression, fragments=f, strategy=strategy)


def _train(cfg: tuple[str, Any, Any, int, int, int, str, str]) -> dict[str, Any]:
    import ringtrain as rt
    from ringtrain import events

    seen: dict[str, int] = {}

    def listen(kind: str, _a: float, _b: float, _info: dict[str, Any]) -> None:
        seen[kind] = seen.get(kind, 0) + 1

    model = _mlp()
    opt = _build(cfg, model)
    digests = []
    events.subscribe(listen)
    try:
        for step in range(cfg[5]):
            x, y = _batch(step, rt.rank())
            opt.zero_grad()
            _loss(model, x, y).backward()
            opt.step()
            digests.append([_digest(p) for p in model.parameters()])
    finally:
        events.unsubscribe(listen)
    return {"params": [p.detach().clone() for p in model.parameters()], "digests": digests,
            "events": seen, "bytes": opt.exchanged_bytes, "syncs": opt.syncs, "same_start": opt.same_start}


def _errors() -> dict[str, str]:
    """Every bad input, on every rank; each caught and returned as its text."""
    import ringtrain as rt

    out: dict[str, str] = {}

    def catch(key: str, fn: Any) -> None:
        try:
            fn()
            out[key] = "no error"
        except Exception as exc:  # noqa: BLE001 - the test reads the class and text
            out[key] = f"{type(exc).__name__}: {exc}"

    def one_step(opt: Any, model: torch.nn.Module) -> None:
        x, y = _batch(0, rt.rank())
        opt.zero_grad()
        _loss(model, x, y).backward()
        opt.step()

    def differing_sync_every() -> None:
        m = _mlp()
        one_step(rt.DiLoCo(m, _sgd(list(m.parameters())), _nesterov(list(m.parameters())),
                           sync_every=4 if rt.rank() == 2 else 3), m)

    def differing_outer_lr() -> None:
        m = _mlp()
        outer = torch.optim.SGD(m.parameters(), lr=0.5 if rt.rank() == 1 else 0.7, momentum=0.9)
        one_step(rt.DiLoCo(m, _sgd(list(m.parameters())), outer, sync_every=2), m)

    def zero_sync_every() -> None:
        m = _mlp()
        rt.LocalSGD(m, _sgd(list(m.parameters())), sync_every=0)

    def outer_over_other_parameters() -> None:
        m, other = _mlp(), _mlp()
        rt.DiLoCo(m, _sgd(list(m.parameters())), _nesterov(list(other.parameters())), sync_every=5)

    def outer_over_part_of_the_model() -> None:
        m = _mlp()
        rt.DiLoCo(m, _sgd(list(m.parameters())), _nesterov(list(m[0].parameters())), sync_every=5)

    def distributed_then_diloco() -> None:
        m = _mlp()
        keep = rt.DistributedOptimizer(_sgd(list(m.parameters())), named_parameters=m.named_parameters())
        try:
            rt.DiLoCo(m, _sgd(list(m.parameters())), _nesterov(list(m.parameters())), sync_every=5)
        finally:
            del keep

    def diloco_then_distributed() -> None:
        m = _mlp()
        keep = rt.LocalSGD(m, _sgd(list(m.parameters())), sync_every=5)
        try:
            rt.DistributedOptimizer(_sgd(list(m.parameters())), named_parameters=m.named_parameters())
        finally:
            del keep

    def inner_is_distributed() -> None:
        m = _mlp()
        inner = rt.DistributedOptimizer(_sgd(list(m.parameters())), named_parameters=m.named_parameters())
        rt.DiLoCo(m, inner, _nesterov(list(m.parameters())), sync_every=5)

    def unfrozen_after_localsgd() -> None:
        m = _mlp()
        m[0].requires_grad_(False)  # the head first, then everything
        opt = rt.LocalSGD(m, _sgd(list(m.parameters())), sync_every=5)
        one_step(opt, m)
        m[0].requires_grad_(True)
        one_step(opt, m)

    def unfrozen_after_diloco() -> None:
        m = _mlp()
        m[0].requires_grad_(False)
        trainable = [p for p in m.parameters() if p.requires_grad]
        opt = rt.DiLoCo(m, _sgd(list(m.parameters())), _nesterov(trainable), sync_every=5)
        one_step(opt, m)
        m[0].requires_grad_(True)
        one_step(opt, m)

    for fn in (differing_sync_every, differing_outer_lr, zero_sync_every, outer_over_other_parameters,
               outer_over_part_of_the_model, distributed_then_diloco, diloco_then_distributed,
               inner_is_distributed, unfrozen_after_localsgd, unfrozen_after_diloco):
        catch(fn.__name__, fn)
    # After every refusal the world still trains: a correct DiLoCo syncs.
    m = _mlp()
    opt = rt.DiLoCo(m, _sgd(list(m.parameters())), _nesterov(list(m.parameters())), sync_every=1)
    one_step(opt, m)
    out["after"] = _digest(torch.cat([p.detach().reshape(-1) for p in m.parameters()]))
    return out


def _dataset() -> torch.utils.data.TensorDataset:
    g = torch.Generator().manual_seed(5)
    return torch.utils.data.TensorDataset(torch.randn(48, 4, generator=g), torch.randn(48, 2, generator=g))


def _resume() -> dict[str, Any]:
    """Train 10 steps with rt.data.Loader; at step 4 (mid-interval) save each rank's
    whole state as a checkpoint would (bytes), then resume it into fresh objects."""
    import ringtrain as rt

    def build() -> tuple[torch.nn.Module, Any, Any]:
        model = _mlp()
        opt = rt.DiLoCo(model, _adamw(list(model.parameters())), _nesterov(list(model.parameters())),
                        sync_every=3)
        loader = rt.data.Loader(_dataset(), batch_size=ROWS, shuffle=True, seed=1, num_workers=0)
        return model, opt, loader

    def run(model: torch.nn.Module, opt: Any, loader: Any, start: int, stop: int,
            save_at: int | None = None) -> bytes | None:
        saved = None
        step = start
        epoch = step // len(loader)
        while step < stop:
            loader.set_epoch(epoch)
            for x, y in loader:
                opt.zero_grad()
                _loss(model, x, y).backward()
                opt.step()
                step += 1
                if step == save_at:
                    buf = io.BytesIO()
                    torch.save({"model": model.state_dict(), "opt": opt.state_dict(),
                                "local": opt.local_state_dict(), "loader": loader.state_dict(),
                                "step": step}, buf)
                    saved = buf.getvalue()
                if step == stop:
                    break
            epoch += 1
        return saved

    model, opt, loader = build()
    saved = run(model, opt, loader, 0, 10, save_at=4)
    assert saved is not None
    straight = [p.detach().clone() for p in model.parameters()]
    model, opt, loader = build()
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(-3.0)  # everything must come from the checkpoint
    state = torch.load(io.BytesIO(saved), weights_only=False)
    model.load_state_dict(state["model"])
    opt.load_state_dict(copy.deepcopy(state["opt"]))
    opt.load_local_state_dict(state["local"])
    loader.load_state_dict(state["loader"])
    run(model, opt, loader, state["step"], 10)
    resumed = [p.detach().clone() for p in model.parameters()]
    return {"straight": straight, "resumed": resumed, "per_epoch": len(loader)}


def _join(directory: str) -> dict[str, Any]:
    """Rank 2 builds a fresh model (another start) and optimizer mid-interval, as a
    joining worker does; world_changed() on every rank, then on to the next sync."""
    import ringtrain as rt

    model = _mlp()
    opt = rt.DiLoCo(model, _adamw(list(model.parameters())), _nesterov(list(model.parameters())), sync_every=4)
    for step in range(6):  # one sync (step 4), then 2 local steps
        x, y = _batch(step, rt.rank())
        opt.zero_grad()
        _loss(model, x, y).backward()
        opt.step()
    before = [p.detach().clone() for p in model.parameters()]
    if rt.rank() == 2:
        model = _mlp()
        with torch.no_grad():
            for p in model.parameters():
                p.add_(5.0)
        opt = rt.DiLoCo(model, _adamw(list(model.parameters())), _nesterov(list(model.parameters())),
                        sync_every=4)
    # What rt.elastic does after a resize (Resumable.sync calls the optimizer's hook).
    rt.elastic.Resumable(directory, model=model, optimizer=opt).sync()
    handled = opt.world_changed()  # the hook itself: collective, idempotent here
    after = [p.detach().clone() for p in model.parameters()]
    copy_now = [t.clone() for t in opt.synced_copy]
    outer_state = len(opt.outer.state_dict()["state"])
    steps = opt.steps
    for step in range(6, 8):  # the next sync is after step 8
        x, y = _batch(step, rt.rank())
        opt.zero_grad()
        _loss(model, x, y).backward()
        opt.step()
    return {"handled": handled, "before": before, "after": after, "copy": copy_now, "steps": steps,
            "outer_state": outer_state,
            "final": _digest(torch.cat([p.detach().reshape(-1) for p in model.parameters()]))}


def _start() -> list[torch.Tensor]:
    """Rank 1 starts from other parameters; with a zero learning rate the first step
    leaves every rank with rank 0's."""
    import ringtrain as rt

    model = _mlp()
    if rt.rank() == 1:
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1.0)
    opt = rt.LocalSGD(model, torch.optim.SGD(model.parameters(), lr=0.0), sync_every=2)
    x, y = _batch(0, rt.rank())
    _loss(model, x, y).backward()
    opt.step()
    assert not opt.same_start
    return [p.detach().clone() for p in model.parameters()]


def _elastic(directory: str) -> dict[str, Any]:
    """rt.elastic.Resumable saves every 4 steps (mid-interval for H=3) with each rank's
    local part; a fresh job resumes from step 8 and runs to 10 as the first did."""
    import ringtrain as rt

    def build(sub: str) -> tuple[torch.nn.Module, Any, Any, Any]:
        model = _mlp()
        opt = rt.DiLoCo(model, _adamw(list(model.parameters())), _nesterov(list(model.parameters())),
                        sync_every=3)
        loader = rt.data.Loader(_dataset(), batch_size=ROWS, shuffle=True, seed=1, num_workers=0)
        return model, opt, loader, rt.elastic.Resumable(f"{directory}/{sub}", model=model, optimizer=opt,
                                                        loader=loader, every=4)

    def run(model: torch.nn.Module, opt: Any, loader: Any, state: Any, stop: int) -> None:
        step = state.resume()
        while step < stop:
            loader.set_epoch(loader.state_dict()["epoch"])
            for x, y in loader:
                opt.zero_grad()
                _loss(model, x, y).backward()
                opt.step()
                step += 1
                state.step_done(step)
                if step == stop:
                    break

    model, opt, loader, state = build("a")
    run(model, opt, loader, state, 10)
    straight = [p.detach().clone() for p in model.parameters()]
    model, opt, loader, state = build("a")
    run(model, opt, loader, state, 10)  # resumes at 8 (the newest checkpoint)
    return {"straight": straight, "resumed": [p.detach().clone() for p in model.parameters()],
            "from": state.start_step}


def _horovod() -> dict[str, Any]:
    """hvd.DiLoCo with hvd.Compression.fp16 in hvd.elastic.TorchState: commit, restore,
    sync (a fixed-size job: rank 0's state to all, through hvd.broadcast_optimizer_state)."""
    import ringtrain.horovod as hvd

    hvd.init()
    model = _mlp()
    opt = hvd.DiLoCo(model, _adamw(list(model.parameters())), _nesterov(list(model.parameters())),
                     sync_every=2, compression=hvd.Compression.fp16)
    state = hvd.elastic.TorchState(model=model, optimizer=opt, epoch=0)

    def step(i: int) -> None:
        x, y = _batch(i, hvd.rank())
        opt.zero_grad()
        _loss(model, x, y).backward()
        opt.step()

    for i in range(3):
        step(i)
    state.commit()
    committed = [p.detach().clone() for p in model.parameters()]
    step(3)  # a sync: every rank's parameters change
    state.restore()
    restored = all(torch.equal(a, b) for a, b in zip(model.parameters(), committed, strict=True))
    state.sync()
    return {"restored": restored, "is_rt": hvd.DiLoCo.__module__,
            "synced": _digest(torch.cat([p.detach().reshape(-1) for p in model.parameters()])),
            "steps": opt.steps}


def _world(directory: str) -> dict[str, Any]:
    torch.manual_seed(0)
    return {"train": {name: _train(cfg) for name, cfg in CONFIGS.items()}, "errors": _errors(),
            "resume": _resume(), "join": _join(directory), "start": _start(),
            "elastic": _elastic(directory), "horovod": _horovod()}


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return run_world(_world, N, str(tmp_path_factory.mktemp("lowcomm")), timeout=180)


def _expected(name: str) -> list[list[torch.Tensor]]:
    """Each rank's parameters after the last step, by the one-process reference."""
    mode, inner, outer, h, f, steps, _strategy, comp = CONFIGS[name]
    if name == "diloco_h1_is_sync":
        return [ref.synchronous(_mlp, _batch, _loss, N, steps, inner)] * N
    if name == "localsgd_h1_is_averaging":
        return [ref.averaging(_mlp, _batch, _loss, N, steps, inner)] * N
    parts = PARTS if f == 2 else [[0, 1, 2, 3]]
    wire = torch.bfloat16 if comp == "bf16" else None
    _synced, workers = ref.periodic(_mlp, _batch, _loss, N, steps, h, parts, inner,
                                    outer if mode == "DiLoCo" else None, wire)
    return workers


@pytest.mark.parametrize("name", list(CONFIGS))
def test_training_equals_the_one_process_reference(world: list[dict[str, Any]], name: str) -> None:
    expected = _expected(name)
    # bf16 on the wire rounds each rank's change and every partial sum (docs/sync.md's
    # bound: N x 2^-8 x sum|change / N| per sync; the change of 2 AdamW steps of 0.02 is
    # <= 0.04, so ~5e-4), where the reference rounds only the changes; the Nesterov
    # step carries it on (x 0.7 x 1.9) over 3 syncs.
    tol = 2e-3 if CONFIGS[name][7] == "bf16" else 1e-5
    for rank, res in enumerate(world):
        got = res["train"][name]["params"]
        for i, (a, b) in enumerate(zip(got, expected[rank], strict=True)):
            assert torch.allclose(a, b, atol=tol, rtol=0), (name, rank, i, (a - b).abs().max().item())
    # The tolerance can fail: local steps alone (no sync) land far from the reference.
    alone = ref.periodic(_mlp, _batch, _loss, N, CONFIGS[name][5], 10**6, [[0, 1, 2, 3]],
                         CONFIGS[name][1], None)[1]
    assert max((a - b).abs().max().item() for a, b in zip(alone[0], expected[0], strict=True)) > 10 * tol


@pytest.mark.parametrize("name", list(CONFIGS))
def test_ranks_are_bit_identical_after_every_sync_and_only_then(world: list[dict[str, Any]], name: str) -> None:
    _mode, _i, _o, h, f, steps, _s, _c = CONFIGS[name]
    parts = PARTS if f == 2 else [[0, 1, 2, 3]]
    offsets = [((k + 1) * h // f) % h for k in range(f)]
    differed = 0
    for s in range(1, steps + 1):
        per_rank = [res["train"][name]["digests"][s - 1] for res in world]
        for k, part in enumerate(parts):
            for i in part:
                values = {d[i] for d in per_rank}
                if s % h == offsets[k]:
                    assert len(values) == 1, (name, s, i, values)
                else:
                    differed += len(values) > 1
    if h > 1:
        assert differed > 0  # between syncs the ranks' local steps differ (the check can fail)


def test_steps_syncs_and_bytes_reach_the_step_meter(world: list[dict[str, Any]]) -> None:
    for res in world:
        r = res["train"]["diloco_h3_f2"]
        # 8 steps; fragment 0 (64 numbers) syncs after steps 1, 4, 7, fragment 1 (50) after
        # 3 and 6: one bucket each, its wait, and an outer update besides the 8 inner ones.
        assert r["syncs"] == 5
        # opt_step: the session's hook on torch optimizers' step() (rt.observe), once per
        # update of the inner or the outer optimizer.
        assert r["events"] == {"update": 13, "step_end": 8, "exchange": 5, "exchange_wait": 5,
                               "opt_step": 13}
        assert r["bytes"] == (3 * 64 + 2 * 50) * 4
        # bf16 halves each sync: 3 syncs x 114 numbers x 2 bytes
        assert res["train"]["diloco_h2_bf16_ring"]["bytes"] == 3 * 114 * 2
        assert res["train"]["diloco_h1_is_sync"]["bytes"] == 4 * 114 * 4


def test_the_first_step_gives_every_rank_rank_0s_parameters(world: list[dict[str, Any]]) -> None:
    start = _mlp()
    for res in world:
        assert all(torch.equal(a, b) for a, b in zip(res["start"], start.parameters(), strict=True))
        # Ranks that start equal (the same seed) are only compared, not sent the model.
        assert all(res["train"][name]["same_start"] for name in CONFIGS)


def test_mismatched_settings_are_one_error_on_every_rank(world: list[dict[str, Any]]) -> None:
    texts = [res["errors"] for res in world]
    for key, arg in (("differing_sync_every", "sync_every"), ("differing_outer_lr", "outer_optimizer")):
        assert len({t[key] for t in texts}) == 1, key  # the same text everywhere
        assert texts[0][key].startswith("MismatchError: rt.DiLoCo: " + arg + " differs between ranks"), texts[0][key]
    assert "3 on ranks 0, 1; 4 on rank 2" in texts[0]["differing_sync_every"]
    assert "lr': 0.5" in texts[0]["differing_outer_lr"] and "rank 1" in texts[0]["differing_outer_lr"]
    assert len({t["after"] for t in texts}) == 1  # the world goes on, in step


@pytest.mark.parametrize("key,words", [
    ("zero_sync_every", ["ConfigError", "sync_every", ">= 1", "got 0"]),
    ("outer_over_other_parameters", ["ConfigError", "outer_optimizer", "not the model's"]),
    ("outer_over_part_of_the_model", ["ConfigError", "outer_optimizer", "holds 2 of the model's 4"]),
    ("distributed_then_diloco", ["ConfigError", "DistributedOptimizer", "one exchange mode per parameter"]),
    ("diloco_then_distributed", ["ConfigError", "rt.LocalSGD", "one exchange mode per parameter"]),
    ("inner_is_distributed", ["ConfigError", "inner_optimizer is a DistributedOptimizer", "SGD"]),
    # These trained the unfrozen layer on each rank's own data, never synced: replicas drifted.
    ("unfrozen_after_localsgd", ["OptimizerUsageError", "rt.LocalSGD", "'0.weight' was frozen", "drift"]),
    ("unfrozen_after_diloco", ["OptimizerUsageError", "rt.DiLoCo", "'0.weight' was frozen", "build it again"]),
])
def test_bad_arguments_are_a_config_error_naming_them(world: list[dict[str, Any]], key: str,
                                                       words: list[str]) -> None:
    for res in world:
        text = res["errors"][key]
        for w in words:
            assert w in text, (key, text)


def test_a_mid_interval_checkpoint_resumes_bit_exactly(world: list[dict[str, Any]]) -> None:
    for res in world:
        r = res["resume"]
        assert r["per_epoch"] == 48 // (ROWS * N)  # 10 steps cross an epoch boundary
        for a, b in zip(r["straight"], r["resumed"], strict=True):
            assert torch.equal(a, b)
    # the ranks were mid-interval (step 10 is after the sync at 9, one local step): they differ
    assert not all(torch.equal(a, b) for a, b in zip(world[0]["resume"]["straight"],
                                                      world[1]["resume"]["straight"], strict=True))


def test_a_joining_rank_starts_from_the_synced_copy_and_the_others_keep_their_steps(
        world: list[dict[str, Any]]) -> None:
    j = [res["join"] for res in world]
    assert all(x["handled"] is True for x in j)
    assert all(x["steps"] == 6 for x in j)
    for rank in (0, 1):  # survivors: their 2 local steps since the sync are kept
        assert all(torch.equal(a, b) for a, b in zip(j[rank]["before"], j[rank]["after"], strict=True))
        assert not all(torch.equal(a, b) for a, b in zip(j[rank]["after"], j[rank]["copy"], strict=True))
    assert all(torch.equal(a, b) for a, b in zip(j[2]["after"], j[0]["copy"], strict=True))
    assert j[2]["outer_state"] == j[0]["outer_state"] > 0  # rank 0's Nesterov momentum
    assert len({x["final"] for x in j}) == 1  # one model again after the next sync


def test_rt_elastic_saves_each_ranks_local_part_and_resumes_bit_exactly(world: list[dict[str, Any]]) -> None:
    for res in world:
        e = res["elastic"]
        assert e["from"] == 8
        assert all(torch.equal(a, b) for a, b in zip(e["straight"], e["resumed"], strict=True))
    # step 10 is one local step after the sync at 9: the ranks differ, each resumed its own
    assert not all(torch.equal(a, b) for a, b in zip(world[0]["elastic"]["straight"],
                                                      world[2]["elastic"]["straight"], strict=True))


def test_horovod_users_get_the_same_modes_and_elastic_state(world: list[dict[str, Any]]) -> None:
    h = [res["horovod"] for res in world]
    assert all(x["is_rt"] == "ringtrain.lowcomm.diloco" for x in h)
    assert all(x["restored"] for x in h)  # restore() went back to the commit
    assert len({x["synced"] for x in h}) == 1 and all(x["steps"] == 3 for x in h)  # sync(): rank 0's
