"""How much a local plan's own stages slow each other computing side by side (local profiles, before `analyze`
reports).

Why: calibrate measures how much busy cores slow each other on one probe, a training step of a Linear(1024) stack
(`concurrency_slowdown`, hardware_profiles/local_device.py), and the planner scales every stage's compute by it. How
much the cores collide depends on what the stages stream through the shared L3 and DRAM. examples/mlp.py's default
interleaved plan (layers of 2-8 MiB of weights at 32 rows) ran its stages 7-11% slower side by side than alone where
the probe read 1.04, and `pipeplan run` measured its forwards and backwards 5-20% above their prediction; run on
one core each, alone, its stages matched the prediction, also with the rank's two stages alternating as the schedule
runs them (by hand, benchmarks/RESULTS.md "Defaults only"). So, where the plan's stages can be built here (a model
file, as `pipeplan run` builds them), every device's stages run a forward each and then their backwards, on the core
the runtime pins that device to, alone in turn and then all at once, PROBE_ROUNDS times; the plan is re-predicted at
`slowdown_from_probes` of those rounds (the slowest device per round: stages wait for each other) in place of the
probe's figure, charged on the share of compute that runs beside another device's (planner/overlap.py,
planner/replay.with_measured_slowdown).
"""

from __future__ import annotations

import math
import multiprocessing as mp
import os
import queue as queue_mod
import time
from typing import Any

TIMED_STEP_S = 0.1  # each timed step repeats the device's stages this long, so that rounds overlap on every core
TIMEOUT_S = 180.0  # spawn, model build and the rounds; a bound on a hang, not the work (a few seconds here)


def stages_by_device(plan: Any) -> list[list[int]]:
    """The stage indices each device of `plan` runs, devices in rank order (a stage with replicas on each)."""
    devices = sorted({d for st in plan.stages for d in st.devices})
    return [sorted(st.index for st in plan.stages if d in st.devices) for d in devices]


def stages_step(split: Any, spec: Any, stages: list[int], microbatch: int, dtype: str = "fp32",
                schedule: str | None = None) -> Any:
    """A function running `stages`' forwards in model order, then their backwards in reverse (as a rank holding
    several stages meets them), on their own inputs (`split_cost.stage_inputs`), each seeded as the runtime seeds it;
    the forwards in the plan's precision, as `pipeplan run` trains it (pipeplan/precision.py)."""
    import torch

    from pipeplan.precision import training_precision
    from pipeplan.runtime.split_cost import _outputs, stage_inputs

    modules = [split.module(s, copy=True) for s in stages]
    inputs = [stage_inputs(split, spec, s, microbatch) for s in stages]

    def step() -> None:
        with training_precision(dtype, torch.device("cpu"), schedule):
            outs = [_outputs(m, x) for m, x in zip(modules, inputs, strict=True)]
        for o in reversed(outs):
            torch.autograd.backward(o, [torch.ones_like(v) for v in o])

    return step


def _worker(rank: int, world: int, plan_doc: dict[str, Any], threads: int, barrier: Any, out: Any) -> None:
    """One device: pinned and threaded as `pipeplan run`'s rank, its stages timed alone and together."""
    try:
        import torch

        from pipeplan.hardware_profiles.local_device import alone_and_together, become_local_device
        from pipeplan.planner.plan import Plan
        from pipeplan.runtime.worker import load_split_model

        become_local_device(rank, world)
        torch.set_num_threads(threads)
        plan = Plan.from_dict(plan_doc)
        spec, _, split = load_split_model(plan)
        one = stages_step(split, spec, stages_by_device(plan)[rank], plan.microbatch_size, plan.dtype, plan.schedule)
        one()  # warm-up, and the time of one pass
        t0 = time.perf_counter()
        one()
        repeats = max(1, math.ceil(TIMED_STEP_S / max(1e-6, time.perf_counter() - t0)))

        def step() -> None:
            for _ in range(repeats):
                one()

        out.put((rank, alone_and_together(step, rank, world, barrier=lambda: barrier.wait(TIMEOUT_S))))
    except BaseException as e:  # the parent reports it; the other devices must not wait for this one
        barrier.abort()
        out.put((rank, f"{type(e).__name__}: {str(e)[:200]}"))


def measure_slowdown(plan: Any, threads: int = 1) -> float | None:
    """The plan's stages' side-by-side slowdown on this machine, or None where it does not apply: one device, or
    more devices than the cores this process may use (then `pipeplan run` does not pin them either).

    Raises RuntimeError with the first device's failure (the caller keeps the calibrated figure and says so).
    """
    from pipeplan._procs import reap
    from pipeplan.hardware_profiles.local_device import slowdown_from_probes

    per_device = stages_by_device(plan)
    world = len(per_device)
    if world < 2 or world > len(os.sched_getaffinity(0)):
        return None
    ctx = mp.get_context("spawn")  # fork after OpenMP init can deadlock
    barrier, out = ctx.Barrier(world), ctx.Queue()
    doc = plan.to_dict()
    procs = [ctx.Process(target=_worker, args=(r, world, doc, threads, barrier, out), daemon=True)
             for r in range(world)]
    for p in procs:
        p.start()
    try:
        results: dict[int, Any] = {}
        deadline = time.monotonic() + TIMEOUT_S
        while len(results) < world:
            try:
                rank, value = out.get(timeout=1.0)
            except queue_mod.Empty:
                dead = [r for r, p in enumerate(procs) if r not in results and p.exitcode is not None]
                if dead:
                    raise RuntimeError(f"device {dead[0]} exited ({procs[dead[0]].exitcode})") from None
                if time.monotonic() > deadline:
                    raise RuntimeError(f"the side-by-side timing took over {TIMEOUT_S:.0f} s") from None
                continue
            if isinstance(value, str):
                raise RuntimeError(f"device {rank}: {value}")
            results[rank] = value
    finally:
        reap(procs, 5)
    # clamped as calibrate clamps its probe's (docs/profile-format.md): a noisy round may read faster together
    return min(4.0, max(1.0, slowdown_from_probes([results[r] for r in range(world)])))
