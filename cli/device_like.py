"""`analyze` on a local profile re-times the chosen configuration like a device before it reports (issue 16).

The first search prices layers from a trace on all cores at a small batch: the
roofline, or measured times scaled per sample. A rank of `pipeplan run` is one
core running `threads_per_device` threads over microbatches of the chosen size,
and on a CPU neither scales (the roofline was 1.5-2x optimistic on skinny
matmuls here, and time per sample changed 5x between 1 and 32 rows on
examples/mlp.py: docs/runtime.md). So when the best plan's stage times are not a
device's own (`costmodels.compute.local_times_note`), the model is traced again
at the plan's microbatch size on one core with the device's threads, and the
search runs again on those times over the configurations that keep that
microbatch size (the plan's replica and microbatch counts fixed), which the new
times describe exactly. A zero-bubble plan's split backward is then timed on its
own stages (`measure_split_like_device`, runtime/split_cost.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any


def retime_like_device(graph: Any, profile: Any, request: Any, result: Any, retrace: Callable[[int], Any],
                       progress: Callable | None = None) -> tuple[Any, Any]:
    """(graph, search result) to report: the given ones, or re-traced like a device and searched again.

    `retrace(batch)` traces the model at `batch` samples with layer times (the caller's loader);
    `request` is already resolved for the profile.
    """
    from pipeplan.cli.workflow import run_search
    from pipeplan.costmodels.compute import device_threads, local_times_note
    from pipeplan.hardware_profiles.local_device import DeviceLikeThreads
    from pipeplan.schedules import facts

    best = result.best
    note = local_times_note(graph, profile, dtype=request.training_dtype, times=request.times,
                            samples=best.microbatch_size)
    if note is None:
        return graph, result
    with DeviceLikeThreads(device_threads(profile)):
        timed = retrace(best.microbatch_size)
    narrowed = replace(request, microbatches=best.microbatches)
    if facts(best.schedule).replicates_whole_pipeline:  # PipeDream's replicas are per stage
        narrowed = replace(narrowed, data_parallel=best.data_parallel)
    return timed, run_search(timed, profile, narrowed, progress=progress)


def measure_split_like_device(graph: Any, profile: Any, request: Any, result: Any) -> Any:
    """The search result with its best plan re-predicted on its stages' measured split-backward extras, or as given.

    Only where that is what `pipeplan run` will see: a local profile, a zero-bubble schedule (its backward split
    into B and W) and a plan built from a model file on this machine (runtime/split_cost.py says why the model of
    the extra is not enough). Timed like a device, as the re-trace above.
    """
    from pipeplan.costmodels.compute import device_threads
    from pipeplan.hardware_profiles.local_device import DeviceLikeThreads
    from pipeplan.planner.replay import with_split_extra
    from pipeplan.runtime.split_cost import measure_split_extra_s
    from pipeplan.schedules import facts

    best = result.best
    if not (profile.local and facts(best.schedule).splits_backward and best.graph.get("model_file")):
        return result
    try:
        with DeviceLikeThreads(device_threads(profile)):
            extra_s = measure_split_extra_s(best)
    except Exception as e:  # a refinement: the plan stands on the model's figure, and says so
        best.notes.append(f"the split backward could not be timed on this plan's stages ({type(e).__name__}: "
                          f"{str(e)[:120]}); its extra is the calibrated model's")
        return result
    return replace(result, best=with_split_extra(best, graph, profile, extra_s, request))
