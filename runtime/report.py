"""Turn the ranks' raw measurements into the measured-vs-predicted report.

Iteration time is the slowest rank's step (the pipeline is done when its last
rank is), median over the measured steps; where PipeDream's replicas take turns
by step (fewer microbatches a step than replicas), over rounds of steps, per step.
Per stage, compute is the summed forward/backward time of its microbatches in one
step and everything else in the step is waiting/communication, the same split the
planner predicts.
This module only computes (the `--json` document); cli/run_report.py draws the table.
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from pipeplan.runtime.measure import median
from pipeplan.runtime.placement import steps_per_round
from pipeplan.schedules import facts


def summarize(result: dict[str, Any], plan) -> dict[str, Any]:
    """The `--json` document: {"measured", "predicted", "losses", ...}."""
    ranks = [r for r in result["ranks"] if r is not None]
    steps = min(len(r["step_s"]) for r in ranks)
    window = steps_per_round(plan)  # 1 but for replicas taking turns: then one rank's steps read a round, 0, ...
    per_step = [max(sum(r["step_s"][i:i + window]) for r in ranks) / window
                for i in range(0, steps - window + 1, window)]
    iteration_s = median(per_step)
    stage_to_rank = {(st["index"], r.get("replica", 0)): r["rank"] for r in ranks for st in r["stages"]}
    stages = []
    for r in ranks:
        for st in r["stages"]:
            compute_s = (st["fwd_total_s"] + st["bwd_total_s"]) / max(1, steps)
            rank_compute = sum(x["fwd_total_s"] + x["bwd_total_s"] for x in r["stages"]) / max(1, steps)
            stages.append({
                "index": st["index"],
                "rank": r["rank"],
                "replica": r.get("replica", 0),
                "fwd_s": st["fwd_s"],  # one microbatch, median
                "bwd_s": st["bwd_s"],  # zero bubble: the input-gradient pass B only; recomputation: with the re-run
                "wgrad_s": st.get("wgrad_s", 0.0),  # zero bubble's weight-gradient pass W (0 elsewhere)
                "compute_s": compute_s,  # all microbatches of one step
                "wait_s": max(0.0, iteration_s - rank_compute),  # the rank's idle + communication time per step
                "peak_memory_bytes": st["peak_memory_bytes"],
                "device_peak_bytes": r.get("device_peak_bytes", st["peak_memory_bytes"]),  # the rank's device
                "weights_bytes": st["weights_bytes"],
                "grad_bytes": st["grad_bytes"],
                "optimizer_bytes": st["optimizer_bytes"],
                "activation_bytes": st["activation_bytes"],
            })
    stages.sort(key=lambda s: (s["index"], s["replica"]))
    from pipeplan.runtime.placement import combine_losses

    losses = combine_losses([r["losses"] for r in ranks if r.get("losses") is not None],
                            mean=all(r.get("loss_reduction", "mean") == "mean" for r in ranks))
    predicted = asdict(plan.predicted)
    predicted["stages"] = [{"index": s.index, **asdict(s.predicted)} for s in plan.stages]
    return {
        "format": "pipeplan.run/v1",
        "plan": {"schedule": plan.schedule, "microbatches": plan.microbatches, "batch_size": plan.batch_size,
                 "stages": len(plan.stages), "devices": len(set(stage_to_rank.values())), "fingerprint": plan.graph.get("fingerprint"),
                 "data_parallel": plan.data_parallel, "sharding": plan.sharding, "recompute": plan.recompute},
        "measured": {
            "iteration_s": iteration_s,
            "samples_per_s": plan.batch_size / iteration_s if iteration_s > 0 else 0.0,
            "steps_measured": steps,
            "step_s": per_step,
            "stages": stages,
        },
        "predicted": predicted,
        "losses": losses,
        # fp16: the loss scale after the last step and the steps skipped for an overflow (runtime/loss_scale.py)
        "loss_scale": next((r["loss_scale"] for r in ranks if r.get("loss_scale")), None),
        "first_step": result.get("first_step", 0),
        "resumed": result.get("resumed"),  # {"step", "dir", "skipped"} after --resume, else None
    }


def measured_events(result: dict[str, Any], plan) -> list[dict[str, Any]]:
    """The last measured step's forward/backward spans, as timeline events (planner.timeline format)."""
    out = []
    interleaves = facts(plan.schedule).interleaves  # several stages (chunks) per device
    for r in result["ranks"]:
        if r is None:
            continue
        for stage, events in r["events"].items():
            for kind, mb, start, end in events:
                chunk = int(stage) // max(1, plan.devices or 1) if interleaves else 0
                out.append({"device": r["rank"], "stage": int(stage), "chunk": chunk, "microbatch": mb,
                            "kind": kind, "start_s": start, "end_s": end})
    return out

