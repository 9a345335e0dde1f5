"""An independent check of the Chrome trace-event format (JSON object form).

Written from the format's specification, not from ringtrain's writer, so a test that
passes says the file opens in Perfetto / chrome://tracing as intended:

* the document is a JSON object with a ``traceEvents`` list;
* every event has ``name``, ``ph``, ``pid``, ``tid``; complete events (``"X"``) have
  numeric ``ts`` and ``dur >= 0`` in microseconds; metadata events (``"M"``) name
  processes and threads through ``args.name``;
* within one (pid, tid) track, complete events are well nested: any two are either
  disjoint or one contains the other;
* every pid and every (pid, tid) that carries spans is named by metadata.
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path
from typing import Any


def load(path: str | Path) -> dict[str, Any]:
    doc = json.loads(Path(path).read_text(encoding="utf-8"))
    assert isinstance(doc, dict), "a trace file in object form is a JSON object"
    return doc


def check_trace(doc: dict[str, Any]) -> list[str]:
    """Problems found (empty: valid)."""
    problems: list[str] = []
    events = doc.get("traceEvents")
    if not isinstance(events, list):
        return ["no traceEvents list"]
    tracks: dict[tuple[int, int], list[tuple[float, float, str]]] = defaultdict(list)
    named_pids: set[int] = set()
    named_tids: set[tuple[int, int]] = set()
    for i, e in enumerate(events):
        for key in ("name", "ph", "pid"):
            if key not in e:
                problems.append(f"event {i} lacks {key!r}: {e}")
        ph = e.get("ph")
        if ph == "X":
            if not isinstance(e.get("ts"), (int, float)) or not isinstance(e.get("dur"), (int, float)):
                problems.append(f"complete event {i} needs numeric ts and dur: {e}")
                continue
            if e["dur"] < 0:
                problems.append(f"event {i} has negative dur")
            if "tid" not in e:
                problems.append(f"event {i} lacks tid")
                continue
            tracks[(e["pid"], e["tid"])].append((e["ts"], e["ts"] + e["dur"], e["name"]))
        elif ph == "M":
            if not isinstance(e.get("args"), dict):
                problems.append(f"metadata event {i} lacks args")
            elif e["name"] == "process_name":
                named_pids.add(e["pid"])
            elif e["name"] == "thread_name":
                named_tids.add((e["pid"], e["tid"]))
        else:
            problems.append(f"event {i}: unexpected phase {ph!r}")
    for (pid, tid), spans in tracks.items():
        if pid not in named_pids:
            problems.append(f"pid {pid} has no process_name")
        if (pid, tid) not in named_tids:
            problems.append(f"track ({pid}, {tid}) has no thread_name")
        # Sorted by start, longest first: a stack of open spans must contain each next one.
        stack: list[tuple[float, float, str]] = []
        for a, b, name in sorted(spans, key=lambda s: (s[0], -s[1])):
            while stack and stack[-1][1] <= a:
                stack.pop()
            if stack and b > stack[-1][1]:
                problems.append(f"track ({pid}, {tid}): {name!r} [{a}, {b}] overlaps "
                                f"{stack[-1][2]!r} [{stack[-1][0]}, {stack[-1][1]}] without nesting")
            stack.append((a, b, name))
    return problems
