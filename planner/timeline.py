"""Chrome trace-event export of a pipeline timeline (opens in Perfetto / chrome://tracing).

A schedule is easiest to check by looking at it, and Perfetto is the viewer
people already have. The same function serves simulated events and the
runtime's measured ones: anything with the attributes (or keys) of
`planner.simulate.Event` works.

Format (Trace Event Format, "JSON Object Format"): complete events (ph "X")
with ts/dur in microseconds; pid is the device, tid 0 its compute stream and
tid 1 its communication (sends, all-reduce); metadata events (ph "M") name them.
"""

from __future__ import annotations

import os
from typing import Any, Iterable

from pipeplan._io import atomic_write_json

COMPUTE_TID, COMM_TID = 0, 1
_LETTER = {"fwd": "F", "bwd": "B", "recompute": "R", "send": "send ", "recv": "recv ", "allreduce": "allreduce",
           "optimizer": "optimizer", "wgrad": "W"}
_COLOR = {"fwd": "thread_state_running", "bwd": "rail_response", "recompute": "rail_idle", "send": "good", "recv": "good", "allreduce": "bad",
          "optimizer": "rail_load", "wgrad": "rail_animation"}


def _get(ev: Any, key: str, default: Any = None) -> Any:
    # Any: events are duck-typed (simulator Events, the runtime's measured records, plain dicts).
    if isinstance(ev, dict):
        return ev.get(key, default)
    return getattr(ev, key, default)


def event_name(kind: str, microbatch: int, chunk: int = 0, chunks: int = 1) -> str:
    """"F3"/"B3"/"R3" (recompute) for compute, "send 3" for comm; ".c" chunk suffix when interleaved."""
    if kind in ("allreduce", "optimizer"):
        return kind
    name = f"{_LETTER.get(kind, kind + ' ')}{microbatch}"
    if chunks > 1 and kind in ("fwd", "bwd", "recompute", "wgrad"):
        name += f".{chunk}"
    return name


def chrome_trace(events: Iterable[Any], *, title: str = "pipeplan") -> dict[str, object]:
    """Trace-event JSON document for `events` (Event objects or dicts with the same keys)."""
    events = list(events)
    chunks = 1 + max((int(_get(e, "chunk", 0) or 0) for e in events), default=0)
    devices = sorted({int(_get(e, "device")) for e in events})
    trace: list[dict[str, object]] = []
    for d in devices:
        trace.append({"ph": "M", "name": "process_name", "pid": d, "tid": 0, "args": {"name": f"device {d}"}})
        trace.append({"ph": "M", "name": "process_sort_index", "pid": d, "tid": 0, "args": {"sort_index": d}})
        trace.append({"ph": "M", "name": "thread_name", "pid": d, "tid": COMPUTE_TID, "args": {"name": "compute"}})
        trace.append({"ph": "M", "name": "thread_name", "pid": d, "tid": COMM_TID, "args": {"name": "comm"}})
    for e in events:
        kind = str(_get(e, "kind"))
        mb = int(_get(e, "microbatch", -1))
        chunk = int(_get(e, "chunk", 0) or 0)
        start, end = float(_get(e, "start_s")), float(_get(e, "end_s"))
        args: dict[str, object] = {"stage": int(_get(e, "stage", -1)), "chunk": chunk, "microbatch": mb, "kind": kind}
        peer = _get(e, "peer", -1)
        if peer is not None and peer >= 0:
            args["peer"] = int(peer)
        item: dict[str, object] = {
            "name": event_name(kind, mb, chunk, chunks),
            "cat": kind,
            "ph": "X",
            "pid": int(_get(e, "device")),
            "tid": COMPUTE_TID if kind in ("fwd", "bwd", "recompute", "wgrad") else COMM_TID,
            "ts": start * 1e6,
            "dur": max(0.0, end - start) * 1e6,
            "args": args,
        }
        if kind in _COLOR:
            item["cname"] = _COLOR[kind]
        trace.append(item)
    return {"traceEvents": trace, "displayTimeUnit": "ms", "otherData": {"title": title, "generator": "pipeplan"}}


def write_chrome_trace(path: str | os.PathLike[str], events: Iterable[Any], *, title: str = "pipeplan") -> None:
    """Write the trace atomically (never a half-written file)."""
    atomic_write_json(path, chrome_trace(events, title=title))
