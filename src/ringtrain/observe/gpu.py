"""How busy the device is: NVML sampling on NVIDIA GPUs, CUDA-event step timing.

* :class:`NvmlSampler` reads utilisation and memory through NVML (``nvidia-ml-py``,
  the optional extra ``ringtrain[gpu]``) in a background thread. NVML's utilisation is
  the share of the last sample period (1/6 s to 1 s, by product) in which a kernel ran,
  which is exactly the "0% .. 90%" the article's symptom is about.
* :class:`DeviceStepTimer` brackets each step, from its batch's arrival to the step's
  end, with CUDA events and reads them back only once the GPU has passed them, so it
  never synchronises the training loop.

Without a GPU (or without ``pynvml``) both are absent and the meter reports the
host-side estimate: device busy = 1 - (data wait + copy + exchange wait) / step
(:attr:`ringtrain.observe.meter.StepRecord.busy`). Everything here takes its NVML
module / event factory as an argument, so the logic is tested on CPU with fakes.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any, NamedTuple

from ringtrain.observe.meter import percentile

__all__ = ["GpuSample", "NvmlSampler", "open_nvml_sampler", "DeviceStepTimer"]

log = logging.getLogger("ringtrain.observe")

#: Seconds between NVML readings; NVML itself averages over >= 1/6 s.
SAMPLE_INTERVAL_S = 0.1
# One hour of readings at the interval above.
_MAX_SAMPLES = 36_000


class GpuSample(NamedTuple):
    t: float  #: ``time.perf_counter()`` of the reading
    util: float  #: percent of the sample period a kernel ran
    mem_used: int  #: bytes
    mem_total: int  #: bytes


class NvmlSampler:
    """Samples one GPU in a daemon thread until :meth:`stop`."""

    def __init__(self, nvml: Any, handle: Any, name: str = "",
                 interval_s: float = SAMPLE_INTERVAL_S, max_samples: int = _MAX_SAMPLES,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        self._nvml = nvml
        self._handle = handle
        self.name = name
        self.interval_s = interval_s
        self._clock = clock
        # deque.append is atomic under the GIL: the thread appends, readers copy.
        self._samples: deque[GpuSample] = deque(maxlen=max_samples)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def sample(self) -> GpuSample:
        util = self._nvml.nvmlDeviceGetUtilizationRates(self._handle)
        mem = self._nvml.nvmlDeviceGetMemoryInfo(self._handle)
        s = GpuSample(self._clock(), float(util.gpu), int(mem.used), int(mem.total))
        self._samples.append(s)
        return s

    def start(self) -> None:
        if self._thread is not None:
            return
        self._thread = threading.Thread(target=self._run, name="ringtrain-nvml", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.sample()
            except Exception as exc:  # a GPU that falls off the bus must not kill training
                log.warning("NVML sampling stopped: %s", exc)
                return

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2.0)

    def samples(self, t_from: float | None = None, t_to: float | None = None) -> list[GpuSample]:
        return [s for s in list(self._samples)
                if (t_from is None or s.t >= t_from) and (t_to is None or s.t <= t_to)]

    def summary(self, t_from: float | None = None, t_to: float | None = None) -> dict[str, Any] | None:
        """Utilisation and memory over ``[t_from, t_to]`` as plain data (None: no reading)."""
        got = self.samples(t_from, t_to)
        if not got:
            return None
        utils = [s.util for s in got]
        return {
            "name": self.name,
            "samples": len(got),
            "util_mean": sum(utils) / len(utils),
            "util_p10": percentile(utils, 10),
            "util_p90": percentile(utils, 90),
            "mem_used_max": max(s.mem_used for s in got),
            "mem_total": got[-1].mem_total,
        }


def _handle_for(nvml: Any, device_index: int) -> Any:
    """The NVML handle of CUDA device ``device_index``.

    CUDA numbers devices after ``CUDA_VISIBLE_DEVICES`` and by speed; NVML numbers all
    of them by PCI order. Match by UUID, then PCI bus id, then (last resort) index.
    """
    try:
        import torch

        props = torch.cuda.get_device_properties(device_index)
        uuid = str(getattr(props, "uuid", "") or "")
        if uuid:
            for text in (uuid, f"GPU-{uuid}"):
                try:
                    return nvml.nvmlDeviceGetHandleByUUID(text)
                except Exception:
                    continue
        domain, bus, dev = (getattr(props, f"pci_{k}_id", None) for k in ("domain", "bus", "device"))
        if None not in (domain, bus, dev):
            bus_id = f"{domain:08X}:{bus:02X}:{dev:02X}.0"
            try:
                return nvml.nvmlDeviceGetHandleByPciBusId(bus_id)
            except Exception:
                pass
    except Exception:
        pass
    return nvml.nvmlDeviceGetHandleByIndex(device_index)


def open_nvml_sampler(device_index: int, interval_s: float = SAMPLE_INTERVAL_S,
                      nvml: Any | None = None) -> NvmlSampler | None:
    """A started sampler for CUDA device ``device_index``; None without NVML or a GPU."""
    if nvml is None:
        try:
            import pynvml  # nvidia-ml-py: optional (pip install 'ringtrain[gpu]')
        except ImportError:
            return None
        nvml = pynvml
    try:
        nvml.nvmlInit()
        handle = _handle_for(nvml, device_index)
        name = nvml.nvmlDeviceGetName(handle)
        name = name.decode() if isinstance(name, bytes) else str(name)
        sampler = NvmlSampler(nvml, handle, name, interval_s)
        sampler.sample()  # fail here, not in the thread, when the driver refuses
    except Exception as exc:
        log.info("no NVML sampling (%s); device busy is estimated from the host side", exc)
        return None
    sampler.start()
    return sampler


class DeviceStepTimer:
    """GPU time of each step, from its batch's arrival to the step's end, via CUDA events.

    ``event_factory()`` returns an object with ``record()``, ``query()`` and
    ``elapsed_time(other)`` (ms), e.g. ``torch.cuda.Event(enable_timing=True)``.
    """

    def __init__(self, event_factory: Callable[[], Any], max_pending: int = 64) -> None:
        self._factory = event_factory
        self._open: Any | None = None
        self._pending: deque[tuple[int, Any, Any]] = deque()
        self._max_pending = max_pending
        #: ``(step index, device seconds)`` of the latest steps read back.
        self.times: deque[tuple[int, float]] = deque(maxlen=10_000)

    def data_ready(self) -> None:
        """The loop got its batch; the first call of a step opens it."""
        if self._open is None:
            self._open = self._factory()
            self._open.record()

    def step_end(self, index: int) -> None:
        if self._open is None:
            return
        end = self._factory()
        end.record()
        self._pending.append((index, self._open, end))
        self._open = None
        if len(self._pending) > self._max_pending:  # never read back: drop the oldest
            self._pending.popleft()
        self.poll()

    def poll(self) -> None:
        """Read back the steps the GPU has finished (non-blocking).

        This runs inside the loop's own calls (an event listener), so it never raises:
        ``elapsed_time`` is CUDA's error unless both marks are complete and on one device
        (a step ended on another stream than the one its batch mark is on, or after the
        current device changed), so both are queried and a pair that still cannot be
        compared is dropped.
        """
        while self._pending:
            index, start, end = self._pending[0]
            if not (end.query() and start.query()):
                return
            self._pending.popleft()
            try:
                seconds = start.elapsed_time(end) / 1e3
            except RuntimeError:
                continue
            self.times.append((index, seconds))
