"""Taking a timing instrument's own cost out of the per-layer times it measured.

Why: the tracer times layers by marking their boundaries (a perf_counter read on a CPU, a CUDA event on a GPU)
and by running the forward node by node through an interpreter. Each mark, node or hook costs host time of its
own, and where the device waits for the host (small ops on a fast GPU) that time lands in the layers' intervals.
The same pass timed once as a whole, without the instrument, says how much: the excess of the layers' sum over
it, spread evenly per instrumented item, comes out of each layer by its item count. Used for the interpreter's
nodes (measure._compiled_forward), a CUDA trace's backward hooks (measure._unhooked_backward) and its marks
around each gradient add (accumulate.accumulate_times).
"""

from __future__ import annotations


def take_out_excess(times: list[float], counts: list[int], plain_s: float) -> tuple[list[float], float]:
    """Per-layer times less the instrument's cost per item: (times, seconds per item taken out).

    `counts[i]`: the instrumented items (nodes, hooks, marked adds) of layer i; `plain_s`: the same pass timed
    without them. No layer goes below its proportional share of `plain_s` (a layer that computes is never 0),
    and nothing comes out where the layers do not exceed the plain pass.
    """
    excess = sum(times) - plain_s
    if excess <= 0 or not sum(counts):
        return times, 0.0
    per_item = excess / sum(counts)
    share = plain_s / sum(times)
    return [max(t * share, t - k * per_item) for t, k in zip(times, counts, strict=True)], per_item
