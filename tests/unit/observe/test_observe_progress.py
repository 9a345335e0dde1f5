"""Rank 0's progress: plain lines on a schedule, a tqdm bar on a terminal, off by flag."""

from __future__ import annotations

import io
from typing import Any

from ringtrain import events
from ringtrain.observe import session
from ringtrain.observe.meter import Meter
from ringtrain.observe.progress import Progress, format_duration, format_status, status_of


def _feed(meter: Meter, n: int, t: float = 0.0, batches: int = 100, epoch: int = 0) -> float:
    for k in range(n):
        meter.feed("data_wait", t, t + 0.25, {"samples": 10, "batch": k, "batches": batches,
                                               "epoch": epoch})
        meter.feed("exchange_wait", t + 0.75, t + 0.85, {})
        meter.feed("step_end", t + 1.0, t + 1.0, {})
        t += 1.0
    return t


def test_status_text_has_rate_shares_and_eta() -> None:
    meter = Meter(warmup=0)
    _feed(meter, 10)
    stats = status_of(meter)
    assert stats["eta_s"] == 90.0  # 90 batches left at 1 s each
    text = format_status(stats)
    assert text == ("step 10 | epoch 0 batch 10/100 | 10 samples/s | data wait 25% | "
                    "exchange 10% | epoch ETA 1:30")
    assert format_status(stats, with_position=False) == "10 samples/s | data wait 25% | exchange 10%"
    assert format_duration(3725) == "1:02:05"


def test_plain_lines_come_at_most_once_per_interval() -> None:
    now = [0.0]
    out = io.StringIO()
    progress = Progress(out, tty=False, clock=lambda: now[0], line_interval_s=10.0)
    meter = Meter(warmup=0)
    t = 0.0
    for _ in range(25):  # 25 steps, one per simulated second
        t = _feed(meter, 1, t)
        now[0] = t
        progress.update(meter)
    lines = out.getvalue().splitlines()
    assert len(lines) == 2 and progress.lines_written == 2
    assert lines[0].startswith("ringtrain: step 10 |") and "samples/s" in lines[0]


class FakeBar:
    made: list[FakeBar] = []

    def __init__(self, **kwargs: Any) -> None:
        self.kwargs, self.n, self.postfix, self.resets, self.closed = kwargs, kwargs["initial"], "", 0, False
        FakeBar.made.append(self)

    def update(self, k: int) -> None:
        self.n += k

    def reset(self, total: int | None = None) -> None:
        self.n, self.resets, self.kwargs["total"] = 0, self.resets + 1, total

    def set_description(self, text: str, refresh: bool = True) -> None:
        self.desc = text

    def set_postfix_str(self, text: str, refresh: bool = True) -> None:
        self.postfix = text

    def close(self) -> None:
        self.closed = True


def test_bar_counts_steps_and_restarts_each_epoch() -> None:
    now = [0.0]
    progress = Progress(io.StringIO(), tty=True, clock=lambda: now[0], bar_factory=FakeBar)
    meter = Meter(warmup=0)
    t = 0.0
    for _ in range(4):
        t = _feed(meter, 1, t, batches=4)
        now[0] = t
        progress.update(meter)
    bar = FakeBar.made[-1]
    assert bar.kwargs["total"] == 4 and bar.n == 4 and bar.desc == "epoch 0"
    assert "samples/s" in bar.postfix and "data wait 25%" in bar.postfix
    meter.data_info.update(epoch=1, batch=0)
    _feed(meter, 1, t, batches=4, epoch=1)
    progress.update(meter)
    assert bar.resets == 1 and bar.n == 1 and bar.desc == "epoch 1"
    progress.close()
    assert bar.closed


def test_progress_is_off_when_the_setting_says_so() -> None:
    out = io.StringIO()
    s = session.start(progress=False, warmup=0, gpu=False, stream=out)
    events.emit("step_end", 1.0, 1.0)
    assert s.progress is None


def test_progress_is_shown_on_rank_zero_by_default() -> None:
    out = io.StringIO()
    s = session.start(progress=True, warmup=0, gpu=False, stream=out)
    events.emit("step_end", 1.0, 1.0)
    assert s.progress is not None
