"""Mismatch detection: before the first exchange, ranks compare what they will exchange.

Ranks that submit different tensors either hang or silently average unrelated numbers
(Horovod's most reported hang, horovod/horovod#2107 and #1559). So at the first step,
and whenever the bucket layout changes, every rank publishes the *signature* of its
exchange (each tensor's name, shape and dtype in exchange order, plus the settings all
ranks must share, like the strategy) to the job's store and compares. A difference is a
:class:`MismatchError` on every rank, naming the first differing tensor and the ranks
that differ; a rank that never publishes is a :class:`StallError` after
``stall_timeout``.

The store, not a collective, carries the signatures: a collective would itself hang on
the ranks that are out of step. One hash per rank is read; full lists only when hashes
differ. :func:`describe_mismatch` is pure and unit-tested.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import threading
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

import torch

from ringtrain import runtime
from ringtrain.agreement.ranks import group_ranks
from ringtrain.errors import CollectiveError, MismatchError, StallError, ranks_phrase
from ringtrain.settings import env_name

__all__ = [
    "Entry", "entry", "describe_mismatch", "check_signature", "check_exchange", "strategy_settings",
]

#: (name, shape, dtype) of one exchanged tensor.
Entry = tuple[str, tuple[int, ...], str]

_PREFIX = "ringtrain/sync/signature/"
# Checks are numbered per world: a resizable job's ranks that joined at a grow start at
# #0, and so must the survivors, or each side waited for keys the other never writes
# (every rank a StallError after stall_timeout, and the job ended instead of growing).
_counter: tuple[object, Iterator[int]] | None = None
_counter_lock = threading.Lock()


def _next_index() -> int:
    global _counter
    world = runtime.world()
    with _counter_lock:
        if _counter is None or _counter[0] is not world:
            _counter = (world, itertools.count())
        return next(_counter[1])


def entry(name: str, shape: Sequence[int], dtype: torch.dtype | str) -> Entry:
    dt = str(dtype).replace("torch.", "")
    return (str(name), tuple(int(s) for s in shape), dt)


def _fmt(e: Entry) -> str:
    return f"{e[0]!r} {list(e[1])} {e[2]}"


def _first_difference(ref: Sequence[Entry], other: Sequence[Entry]) -> tuple[int, str, str]:
    for i, (x, y) in enumerate(zip(ref, other, strict=False)):
        if x != y:
            return i, _fmt(x), _fmt(y)
    i = min(len(ref), len(other))
    a = _fmt(ref[i]) if i < len(ref) else "nothing (its list ends here)"
    b = _fmt(other[i]) if i < len(other) else "nothing (its list ends here)"
    return i, a, b


def describe_mismatch(
    entries: Mapping[int, Sequence[Entry]],
    settings: Mapping[int, Mapping[str, str]] | None = None,
    what: str = "gradients",
) -> str | None:
    """None when every rank's signature equals rank 0's, else the error message.

    Ranks are grouped by identical signature and each differing group is compared with
    the group of the lowest rank, so the message is the same on every rank.
    """
    settings = settings or {}
    ordered = group_ranks({r: (entries[r], settings.get(r, {})) for r in entries},
                          key=lambda both: json.dumps(list(both), sort_keys=True, default=list))
    if len(ordered) <= 1:
        return None
    ref_ranks = ordered[0]
    ref = ref_ranks[0]
    lines = []
    for ranks in ordered[1:4]:
        r = ranks[0]
        # Tensors first: a different model also changes derived settings (bucket sizes),
        # and the tensor is what the user can act on.
        if list(entries[ref]) != list(entries[r]):
            i, a, b = _first_difference(entries[ref], entries[r])
            lines.append(f"tensor #{i} is {a} on {ranks_phrase(ref_ranks)} but {b} on {ranks_phrase(ranks)}")
            continue
        ref_set, other_set = dict(settings.get(ref, {})), dict(settings.get(r, {}))
        diff_keys = sorted(k for k in set(ref_set) | set(other_set) if ref_set.get(k) != other_set.get(k))
        k = diff_keys[0]
        lines.append(
            f"setting {k}={ref_set.get(k)!r} on {ranks_phrase(ref_ranks)} but "
            f"{other_set.get(k)!r} on {ranks_phrase(ranks)}"
        )
    differing = sorted(r for rs in ordered[1:] for r in rs)
    more = f" (and {len(ordered) - 4} more groups)" if len(ordered) > 4 else ""
    return (
        f"ranks would exchange different {what}: " + "; ".join(lines) + more
        + f". {ranks_phrase(differing).capitalize()} differ from rank {ref}. Every rank must build "
        "the same model (same parameters, shapes, dtypes and order) and pass the same "
        "DistributedOptimizer settings"
    )


def _wait_keys(store: Any, keys: list[str], timeout_s: float) -> list[int]:
    """Poll until every key exists; the indices of the keys still missing at the deadline.

    Polling with ``check`` instead of ``store.wait`` keeps a timeout quiet (the store
    logs a C++ warning per timed-out wait) and lets us list who is missing.
    """
    deadline = time.monotonic() + timeout_s
    pause = 0.001
    while True:
        missing = [i for i, k in enumerate(keys) if not store.check([k])]
        if not missing or time.monotonic() >= deadline:
            return missing
        time.sleep(pause)
        pause = min(pause * 2, 0.05)


def check_signature(
    entries: Sequence[Entry],
    settings: Mapping[str, str] | None = None,
    timeout: float | None = None,
    what: str = "gradients",
    when: str = "first step",
) -> None:
    """Compare this rank's signature with every other rank's; raise on any difference.

    Every rank must call it at the same point (it is a rendezvous through the store).
    ``when`` only words the error ("first step", "bucket layout change").
    """
    size, rank = runtime.size(), runtime.rank()
    if size == 1:
        return
    timeout = runtime.settings().stall_timeout if timeout is None else timeout
    index = _next_index()
    prefix = f"{_PREFIX}{index}/"
    mine = [list(e) for e in entries]
    blob = json.dumps({"entries": mine, "settings": dict(settings or {})}, sort_keys=True)
    digest = hashlib.sha256(blob.encode()).hexdigest()
    store = runtime.store()
    seal = runtime.signer()
    store.set(f"{prefix}full/{rank}", seal.seal(f"{prefix}full/{rank}", blob))
    store.set(f"{prefix}hash/{rank}", seal.seal(f"{prefix}hash/{rank}", digest))
    keys = [f"{prefix}hash/{r}" for r in range(size)]
    missing = _wait_keys(store, keys, timeout)
    if missing:
        span = f"{entries[0][0]!r}" + (f" .. {entries[-1][0]!r}" if len(entries) > 1 else "")
        raise StallError(
            f"signature check #{index} ({when}, before exchanging {len(entries)} {what}: "
            f"{span}): {ranks_phrase(missing)} did not arrive within {timeout:g} s (stall_timeout; "
            f"{env_name('stall_timeout')}), seen from rank {rank}; those ranks are behind, "
            "stuck or gone: look at their logs"
        )
    def read(key: str) -> str:
        value = seal.open(key, store.get(key))
        if value is None:
            raise CollectiveError(
                f"signature check #{index}: the value under {key!r} in the job's store was not "
                "written by this job (someone else wrote to its store; see docs/launch.md)"
            )
        return value

    hashes = {r: read(k) for r, k in enumerate(keys)}
    if len(set(hashes.values())) == 1:
        return
    # Read each distinct signature once (every rank reads the same, so all raise alike).
    first_of: dict[str, int] = {}
    for r in range(size):
        first_of.setdefault(hashes[r], r)
    decoded = {h: json.loads(read(f"{prefix}full/{r}")) for h, r in first_of.items()}
    all_entries = {r: [entry(e[0], e[1], e[2]) for e in decoded[hashes[r]]["entries"]] for r in range(size)}
    all_settings = {r: decoded[hashes[r]]["settings"] for r in range(size)}
    message = describe_mismatch(all_entries, all_settings, what)
    raise MismatchError(message or f"ranks would exchange different {what} ({when})")


def strategy_settings(strategy: object) -> dict[str, str]:
    """What every rank's strategy must agree on, without addresses or other per-process
    details: a sync strategy's own ``signature()``, else the function's or class's name."""
    sig = getattr(strategy, "signature", None)
    if callable(sig):
        return dict(sig())
    if isinstance(strategy, str):
        return {"strategy": strategy}
    target = strategy if hasattr(strategy, "__qualname__") else type(strategy)
    return {"strategy": f"{getattr(target, '__module__', '?')}.{getattr(target, '__qualname__', '?')}"}


def check_exchange(
    strategy: object,
    tensors: Iterable[tuple[str, Sequence[int], torch.dtype | str]],
    settings: Mapping[str, str] | None = None,
    when: str = "first step",
    what: str = "gradients",
) -> None:
    """The optimizer's check: ``tensors`` are (name, shape, dtype) in exchange order;
    the strategy's own settings (e.g. ps_servers) and stall timeout are added here."""
    shared = dict(settings or {})
    shared.update(strategy_settings(strategy))
    timeout_fn = getattr(strategy, "timeout", None)
    timeout = timeout_fn() if callable(timeout_fn) else None
    check_signature([entry(*t) for t in tensors], shared, timeout=timeout, what=what, when=when)
