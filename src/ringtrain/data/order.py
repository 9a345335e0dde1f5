"""Sample order and sharding: a pure function of (seed, epoch, rank, world size).

Nothing here touches processes or files. The order of one epoch is a keyed
pseudo-random permutation of ``[0, N)`` evaluated on demand, so a process never holds
an O(N) list: a 10-million-sample epoch costs a handful of 64-bit keys, and the
indices of any batch are computed in O(batch) with vectorised numpy.

The permutation is a balanced Feistel network over the smallest even power of two
``>= N`` with *cycle walking* (Black & Rogaway, "Ciphers with Arbitrary Finite
Domains", CT-RSA 2002): outputs that fall outside ``[0, N)`` are encrypted again
until they land inside, which keeps it a bijection on ``[0, N)``. Six rounds of a
splitmix64-style round function are plenty for shuffling (Luby-Rackoff needs four
for a pseudo-random permutation).

Layout of one epoch (``W`` ranks, batch ``B``)::

    global position p in [start, start + W * per_rank)   (p >= N wraps: padding)
    rank r owns positions start + i*W + r, i = 0 .. per_rank-1
    batch b of rank r  = its positions i in [b*B, (b+1)*B)
    sample index       = perm(p mod N)       (identity when shuffle=False)

Because every rank consumes its shard in lockstep, "k batches done" on every rank is
the same as "global positions [start, start + k*B*W) consumed"; a resume simply
starts a new plan at that position, with any world size, and costs O(1).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ringtrain.errors import DataError

__all__ = ["FeistelPermutation", "EpochPlan", "BatchIndexer", "ShardPlan", "ShardIndexer",
           "Stage", "epoch_batches", "batch_seed"]

_M64 = np.uint64(0xFFFFFFFFFFFFFFFF)
_C1 = np.uint64(0xBF58476D1CE4E5B9)  # splitmix64 finaliser constants (Steele et al. 2014)
_C2 = np.uint64(0x94D049BB133111EB)
_S30, _S27, _S31 = np.uint64(30), np.uint64(27), np.uint64(31)


def _mix64(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser: a fast, well-mixing bijection on uint64 (wraps by design)."""
    x = x ^ (x >> _S30)
    x = x * _C1
    x = x ^ (x >> _S27)
    x = x * _C2
    return x ^ (x >> _S31)


class FeistelPermutation:
    """A keyed bijection of ``[0, n)``; ``perm(positions)`` is vectorised numpy.

    Memory is O(rounds) whatever ``n`` is; the cost per element is about
    ``rounds * (expected walks <= 4)`` numpy element operations.
    """

    __slots__ = ("n", "_half", "_mask", "_keys")

    def __init__(self, n: int, seed: int, epoch: int, rounds: int = 6,
                 stream: int | None = None) -> None:
        if n <= 0:
            raise DataError(f"cannot permute an empty range (n={n})")
        self.n = int(n)
        bits = max(2, (self.n - 1).bit_length())
        bits += bits % 2  # balanced halves: the domain is 2**bits, at most 4n
        self._half = np.uint64(bits // 2)
        self._mask = np.uint64((1 << (bits // 2)) - 1)
        # SeedSequence is stable across numpy versions and mixes (seed, epoch) fully.
        # ``stream`` tells apart permutations of one epoch (a shard's samples).
        entropy = [int(seed), int(epoch), 0x52494E47]  # "RING"
        if stream is not None:
            entropy.append(int(stream))
        ss = np.random.SeedSequence(entropy)
        self._keys = ss.generate_state(rounds, dtype=np.uint64)

    def _encrypt(self, x: np.ndarray) -> np.ndarray:
        left = x >> self._half
        right = x & self._mask
        for key in self._keys:
            left, right = right, left ^ (_mix64(right ^ key) & self._mask)
        return (left << self._half) | right

    def __call__(self, positions: np.ndarray) -> np.ndarray:
        """Map positions in ``[0, n)`` to sample indices in ``[0, n)`` (int64)."""
        if self.n == 1:
            return np.zeros(len(positions), dtype=np.int64)
        n = np.uint64(self.n)
        out = self._encrypt(np.asarray(positions, dtype=np.uint64))
        outside = np.flatnonzero(out >= n)
        while outside.size:  # cycle walking: terminates because the input is inside
            walked = self._encrypt(out[outside])
            out[outside] = walked
            outside = outside[walked >= n]
        return out.astype(np.int64)


def epoch_batches(num_samples: int, batch_size: int, world_size: int, drop_last: bool) -> int:
    """Batches each rank gets in a full epoch (the same number on every rank)."""
    per_rank = num_samples // world_size if drop_last else -(-num_samples // world_size)
    return per_rank // batch_size if drop_last else -(-per_rank // batch_size)


@dataclass(frozen=True)
class EpochPlan:
    """The order of one epoch (or of its remainder, from global position ``start``).

    Picklable and small, so it is sent to loader workers once per epoch; workers
    then compute the indices of each batch themselves from its number.
    """

    num_samples: int
    batch_size: int
    world_size: int = 1
    rank: int = 0
    shuffle: bool = True
    seed: int = 0
    epoch: int = 0
    drop_last: bool = False
    start: int = 0

    def __post_init__(self) -> None:
        if self.num_samples <= 0:
            raise DataError(f"the dataset is empty (len {self.num_samples}); give it samples")
        if self.batch_size <= 0:
            raise DataError(f"batch_size must be >= 1, got {self.batch_size}")
        if self.world_size <= 0 or not 0 <= self.rank < self.world_size:
            raise DataError(
                f"rank {self.rank} is not in a world of {self.world_size}; "
                "pass 0 <= rank < world_size"
            )
        if self.seed < 0 or self.epoch < 0:
            raise DataError(f"seed and epoch must be >= 0, got seed={self.seed} epoch={self.epoch}")
        if not 0 <= self.start <= self.num_samples:
            raise DataError(f"start position {self.start} is outside [0, {self.num_samples}]")

    # ---- sizes -------------------------------------------------------------------
    @property
    def remaining(self) -> int:
        """Samples of the dataset not yet consumed in this epoch (all ranks)."""
        return self.num_samples - self.start

    @property
    def per_rank(self) -> int:
        """Positions this rank owns from ``start`` on (padding included)."""
        w = self.world_size
        return self.remaining // w if self.drop_last else -(-self.remaining // w)

    @property
    def num_batches(self) -> int:
        b = self.batch_size
        return self.per_rank // b if self.drop_last else -(-self.per_rank // b)

    def batch_len(self, batch: int) -> int:
        return min(self.batch_size, self.per_rank - batch * self.batch_size)

    @property
    def first_batch(self) -> int:
        """Batches of the epoch each rank had before this plan's batch 0 (0 unless
        resumed): batch ``k`` of the plan is batch ``first_batch + k`` of the epoch.
        (After a resume at another world or batch size: the batches of this plan's
        size that the samples consumed before it fill, the last one counted whole.)"""
        return -(-self.start // (self.batch_size * self.world_size))

    # ---- positions and indices -------------------------------------------------------
    def batch_positions(self, batch: int) -> np.ndarray:
        """Global positions (before wrap-around) of batch ``batch`` of this rank."""
        if not 0 <= batch < self.num_batches:
            raise IndexError(f"batch {batch} outside [0, {self.num_batches})")
        i = np.arange(batch * self.batch_size, batch * self.batch_size + self.batch_len(batch),
                      dtype=np.int64)
        return self.start + i * self.world_size + self.rank

    def batch_indices(self, batch: int, perm: FeistelPermutation | None = None) -> np.ndarray:
        """Dataset indices (int64) of batch ``batch``; pass ``perm`` to reuse its keys."""
        pos = self.batch_positions(batch) % self.num_samples  # padding wraps to the start
        if not self.shuffle:
            return pos
        return (perm or self.permutation())(pos)

    def permutation(self) -> FeistelPermutation:
        return FeistelPermutation(self.num_samples, self.seed, self.epoch)

    def position_after(self, batches: int) -> int:
        """Global position reached once every rank has consumed ``batches`` batches."""
        return min(self.num_samples, self.start + batches * self.batch_size * self.world_size)

    def indexer(self) -> BatchIndexer:
        """``indexer(batch) -> dataset indices``, computed a chunk of batches at a time."""
        return BatchIndexer(self)

    def batch_seed(self, batch: int, offset: int = 0) -> int:
        """The augmentation RNG seed of batch ``batch`` from its ``offset``-th sample on
        (see :func:`batch_seed`): seeded by the position of that sample."""
        return batch_seed(self.seed, self.epoch, self.rank,
                          self.start + (batch * self.batch_size + offset) * self.world_size)


class BatchIndexer:
    """Indices of a plan's batches, computed a chunk of consecutive batches at a time.

    numpy's per-call overhead (about 1 us per operation) dominates a 256-element
    Feistel evaluation (~250 us per batch measured); over 16k positions at once it is
    ~50 ns per sample. A chunk is 128 KiB, so memory stays O(1) in the dataset size.
    """

    def __init__(self, plan: EpochPlan, chunk_samples: int = 16384) -> None:
        self.plan = plan
        self._perm = plan.permutation() if plan.shuffle else None
        self._chunk = max(1, chunk_samples // plan.batch_size)
        self._first = -1
        self._cache = np.empty(0, dtype=np.int64)

    def __call__(self, batch: int) -> np.ndarray:
        plan = self.plan
        if not 0 <= batch < plan.num_batches:
            raise IndexError(f"batch {batch} outside [0, {plan.num_batches})")
        first = batch - batch % self._chunk
        if first != self._first:
            lo = first * plan.batch_size
            hi = min(plan.per_rank, (first + self._chunk) * plan.batch_size)
            pos = (plan.start + np.arange(lo, hi, dtype=np.int64) * plan.world_size + plan.rank)
            pos %= plan.num_samples
            self._cache = pos if self._perm is None else self._perm(pos)
            self._first = first
        off = (batch - first) * plan.batch_size
        return self._cache[off:off + plan.batch_len(batch)]


def batch_seed(seed: int, epoch: int, rank: int, position: int) -> int:
    """A 63-bit RNG seed for the augmentation of one batch, independent of which
    worker loads it, so augmentations are reproducible and survive a resume."""
    x = np.array([(seed * 0x9E3779B97F4A7C15 + epoch) & 0xFFFFFFFFFFFFFFFF], dtype=np.uint64)
    x = _mix64(x ^ np.uint64((rank << 40) ^ position))
    return int(_mix64(x)[0] >> np.uint64(1))



# ---- sharded datasets ----------------------------------------------------------------
Stage = tuple[int, int, int]
"""An earlier stage of a resumed epoch: (world size, batch size, samples each rank consumed)."""


@dataclass(frozen=True)
class ShardPlan:
    """The order of one epoch of a sharded dataset (or of its rest, from ``start``).

    Shards are read whole and in place, so the split keeps each rank on a few shards
    (a remote shard is downloaded by one rank, not by all of them):

    * the epoch's shard order is a keyed permutation of the shards (identity without
      ``shuffle``), and with ``shuffle`` the samples of each shard are permuted too,
      keyed by (seed, epoch, shard);
    * the shards, in that order, form a stream of N samples, cut into ``W`` contiguous
      equal ranges, one per rank: rank ``r`` reads positions ``[r*L, (r+1)*L)``. So a
      rank reads about ``S/W`` whole shards plus at most two partial ones at its ends,
      whatever ``S mod W`` is: shard counts that do not divide evenly are split by
      sample count, with no duplicates and no drops;
    * ``drop_last=False``: ``L = ceil(N/W)``; positions past ``N`` wrap around to the
      start of the stream (padding: fewer than ``W`` samples in all), and each rank's
      last batch may be short. ``drop_last=True``: ``L`` is ``N // W`` rounded down to
      whole batches; the tail of the stream past ``W*L`` is dropped.

    Every rank gets the same number of batches. ``start`` counts the samples each rank
    has consumed of its range, so "k batches done" is ``start = k * batch_size``: a
    resume at the same world size continues inside a shard by sample count.

    A resume at another world size (or batch size, with ``drop_last``) starts a new
    *stage* of the same epoch: ``resumed`` lists the earlier stages as ``(world_size,
    batch_size, samples each rank consumed)``. What a stage's ranks had not consumed
    (each rank's range from its position on, padding left out) is, in rank order, the
    next stage's stream, cut into equal contiguous ranges again. So every sample of the
    epoch is still read once (padding aside), each rank still reads runs of a few
    shards, and a stage can itself be resumed at yet another world size.
    """

    shard_sizes: tuple[int, ...]
    batch_size: int
    world_size: int = 1
    rank: int = 0
    shuffle: bool = True
    seed: int = 0
    epoch: int = 0
    drop_last: bool = False
    start: int = 0
    shuffle_within: bool = True  # False for shards that can only be read in order
    resumed: tuple[Stage, ...] = ()
    _n: int = field(init=False, repr=False, compare=False, default=0)
    _stream_n: int = field(init=False, repr=False, compare=False, default=0)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_n", int(sum(self.shard_sizes)))
        if not self.shard_sizes or min(self.shard_sizes) < 0 or self._n == 0:
            raise DataError(f"a sharded dataset needs shards with samples, got sizes "
                            f"{list(self.shard_sizes)[:8]}")
        if self.batch_size <= 0:
            raise DataError(f"batch_size must be >= 1, got {self.batch_size}")
        if self.world_size <= 0 or not 0 <= self.rank < self.world_size:
            raise DataError(f"rank {self.rank} is not in a world of {self.world_size}; "
                            "pass 0 <= rank < world_size")
        if self.seed < 0 or self.epoch < 0:
            raise DataError(f"seed and epoch must be >= 0, got seed={self.seed} epoch={self.epoch}")
        n = self._n
        for stage in self.resumed:
            n = _stage_rest(n, stage, self.drop_last)[2]
        object.__setattr__(self, "_stream_n", n)
        if not 0 <= self.start <= self.range_len:
            raise DataError(f"start {self.start} is outside this rank's range of "
                            f"{self.range_len} samples")

    # ---- sizes -------------------------------------------------------------------
    @property
    def num_samples(self) -> int:
        return self._n

    @property
    def stream_len(self) -> int:
        """Samples in this stage's stream: the epoch's, or what earlier stages left."""
        return self._stream_n

    @property
    def range_len(self) -> int:
        """Stream positions each rank owns in this stage (padding included)."""
        return _range_len(self.stream_len, self.world_size, self.batch_size, self.drop_last)

    @property
    def per_rank(self) -> int:
        """Positions this rank has left from ``start`` on."""
        return self.range_len - self.start

    @property
    def num_batches(self) -> int:
        return -(-self.per_rank // self.batch_size)

    def batch_len(self, batch: int) -> int:
        return min(self.batch_size, self.per_rank - batch * self.batch_size)

    @property
    def first_batch(self) -> int:
        """Batches of the epoch each rank had before this plan's batch 0: those of the
        earlier stages (each rank's, a short last one counted) and of this stage before
        ``start``; batch ``k`` of the plan is batch ``first_batch + k`` of the epoch."""
        earlier = sum(-(-int(done) // int(batch)) for _, batch, done in self.resumed)
        return earlier + -(-self.start // self.batch_size)

    def position_after(self, batches: int) -> int:
        """This rank's samples consumed (from its range's start) after ``batches`` more."""
        return min(self.range_len, self.start + batches * self.batch_size)

    # ---- order -------------------------------------------------------------------
    def shard_order(self) -> np.ndarray:
        """Shard ids in this epoch's reading order."""
        s = len(self.shard_sizes)
        if not self.shuffle or s == 1:
            return np.arange(s, dtype=np.int64)
        return FeistelPermutation(s, self.seed, self.epoch)(np.arange(s))

    def indexer(self) -> ShardIndexer:
        return ShardIndexer(self)

    def batch_seed(self, batch: int, offset: int = 0) -> int:
        # The stage count keeps a resumed stage's seeds apart from the first stage's.
        return batch_seed(self.seed, self.epoch, self.rank + (len(self.resumed) << 16),
                          self.start + batch * self.batch_size + offset)


def _range_len(n: int, world: int, batch: int, drop_last: bool) -> int:
    return (n // world) // batch * batch if drop_last else -(-n // world)


def _stage_rest(n: int, stage: Stage, drop_last: bool) -> tuple[np.ndarray, np.ndarray, int]:
    """What a stage over a stream of ``n`` left unread: (run starts, cumulative run
    lengths from 0, total). Runs are each rank's range from its position on, in rank
    order, cut at ``n`` (positions past it are padding, repeats of rank 0's first ones)."""
    world, batch, done = (int(v) for v in stage)
    if world <= 0 or batch <= 0:
        raise DataError(f"a resumed stage needs world_size and batch_size >= 1, got {stage}")
    length = _range_len(n, world, batch, drop_last)
    if not 0 <= done <= length:
        raise DataError(f"a resumed stage consumed {done} samples per rank of ranges of "
                        f"{length}; the loader state does not fit this dataset")
    starts = np.arange(world, dtype=np.int64) * length
    lo = starts + done
    size = np.maximum(np.minimum(starts + length, n) - lo, 0)
    lo, size = lo[size > 0], size[size > 0]
    cum = np.concatenate([np.zeros(1, np.int64), np.cumsum(size)])
    if cum[-1] == 0:
        raise DataError(f"a resumed stage {stage} left nothing of the epoch; resume at the "
                        "next epoch instead")
    return lo, cum, int(cum[-1])


class ShardIndexer:
    """Dataset indices of a :class:`ShardPlan`'s batches (vectorised, O(shards) memory).

    A dataset index is ``shard_start[s] + i``: sample ``i`` of shard ``s``, shards
    numbered in the dataset's own order.
    """

    def __init__(self, plan: ShardPlan) -> None:
        self.plan = plan
        sizes = np.asarray(plan.shard_sizes, dtype=np.int64)
        self._starts = np.concatenate([[0], np.cumsum(sizes)])  # dataset order
        self._order = plan.shard_order()
        ordered = sizes[self._order]
        self._stream = np.concatenate([[0], np.cumsum(ordered)])  # epoch order
        self._range0 = plan.rank * plan.range_len + plan.start
        self._perms: dict[int, FeistelPermutation] = {}
        # Each earlier stage maps a position of the stream after it into its own.
        self._stages: list[tuple[np.ndarray, np.ndarray]] = []
        n = plan.num_samples
        for stage in plan.resumed:
            lo, cum, n = _stage_rest(n, stage, plan.drop_last)
            self._stages.append((lo, cum))
        self._runs: tuple[np.ndarray, np.ndarray] | None = None  # see next_shards

    def _perm(self, shard: int) -> FeistelPermutation:
        perm = self._perms.get(shard)
        if perm is None:
            if len(self._perms) > 64:
                self._perms.clear()
            plan = self.plan
            perm = FeistelPermutation(plan.shard_sizes[shard], plan.seed, plan.epoch,
                                      stream=shard)
            self._perms[shard] = perm
        return perm

    def next_shards(self, batch: int, count: int = 1) -> list[int]:
        """The next ``count`` shards this rank starts reading after batch ``batch``'s
        (for prefetching: the shard after the current one can download while it is read)."""
        if self._runs is None:
            self._runs = self._shard_runs()
        first, shards = self._runs
        i = int(np.searchsorted(first, batch, side="right"))
        out: list[int] = []
        for s in shards[i:].tolist():
            if s not in out:
                out.append(s)
                if len(out) == count:
                    break
        return out

    def _shard_runs(self) -> tuple[np.ndarray, np.ndarray]:
        """(first batch, shard) of each run of one shard in this rank's reading order,
        from the rank's range mapped back through the stages: O(shards), not O(samples)."""
        plan = self.plan
        n = plan.stream_len
        a, b = self._range0, self._range0 + plan.per_rank
        spans = [(a, min(b, n))] + ([(0, b - n)] if b > n else [])  # padding wraps
        for starts, cum in reversed(self._stages):
            mapped = []
            for lo, hi in spans:
                j0 = int(np.searchsorted(cum, lo, side="right")) - 1
                for j in range(j0, len(cum) - 1):
                    if cum[j] >= hi:
                        break
                    x, y = max(lo, int(cum[j])), min(hi, int(cum[j + 1]))
                    mapped.append((int(starts[j]) + x - int(cum[j]), int(starts[j]) + y - int(cum[j])))
            spans = mapped
        first: list[int] = []
        shards: list[int] = []
        offset = 0
        for lo, hi in spans:
            j0 = int(np.searchsorted(self._stream, lo, side="right")) - 1
            j1 = int(np.searchsorted(self._stream, hi - 1, side="right")) - 1
            for j in range(j0, j1 + 1):
                if shards and shards[-1] == int(self._order[j]):
                    continue  # the same shard goes on across two spans: one run
                first.append((offset + max(lo, int(self._stream[j])) - lo) // plan.batch_size)
                shards.append(int(self._order[j]))
            offset += hi - lo
        return np.asarray(first, dtype=np.int64), np.asarray(shards, dtype=np.int64)

    def positions(self, batch: int) -> np.ndarray:
        """Positions in the epoch's stream (after wrap-around) of batch ``batch``."""
        plan = self.plan
        if not 0 <= batch < plan.num_batches:
            raise IndexError(f"batch {batch} outside [0, {plan.num_batches})")
        lo = self._range0 + batch * plan.batch_size
        pos = np.arange(lo, lo + plan.batch_len(batch), dtype=np.int64) % plan.stream_len
        for starts, cum in reversed(self._stages):
            j = np.searchsorted(cum, pos, side="right") - 1
            pos = starts[j] + (pos - cum[j])
        return pos

    def locate(self, batch: int) -> tuple[np.ndarray, np.ndarray]:
        """(shard ids, sample numbers within the shard) of batch ``batch``."""
        pos = self.positions(batch)
        j = np.searchsorted(self._stream, pos, side="right") - 1
        shards = self._order[j]
        within = pos - self._stream[j]
        plan = self.plan
        if plan.shuffle and plan.shuffle_within:
            for s in np.unique(shards).tolist():
                if plan.shard_sizes[s] > 1:
                    sel = shards == s
                    within[sel] = self._perm(s)(within[sel])
        return shards, within

    def __call__(self, batch: int) -> np.ndarray:
        shards, within = self.locate(batch)
        return self._starts[shards] + within
