"""Turn the ranks' raw measurements into the measured-vs-predicted report.

Iteration time is the slowest rank's step (the pipeline is done when its last
rank is), median over the measured steps. Per stage, compute is the summed
forward/backward time of its microbatches in one step and everything else in
the step is waiting/communication, the same split the planner predicts.
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from pipeplan.runtime.measure import median


def summarize(result: dict[str, Any], plan) -> dict[str, Any]:
    """The `--json` document: {"measured", "predicted", "losses", ...}."""
    ranks = [r for r in result["ranks"] if r is not None]
    steps = min(len(r["step_s"]) for r in ranks)
    per_step = [max(r["step_s"][i] for r in ranks) for i in range(steps)]
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
                "bwd_s": st["bwd_s"],
                "compute_s": compute_s,  # all microbatches of one step
                "wait_s": max(0.0, iteration_s - rank_compute),  # the rank's idle + communication time per step
                "peak_memory_bytes": st["peak_memory_bytes"],
                "weights_bytes": st["weights_bytes"],
                "grad_bytes": st["grad_bytes"],
                "optimizer_bytes": st["optimizer_bytes"],
                "activation_bytes": st["activation_bytes"],
            })
    stages.sort(key=lambda s: (s["index"], s["replica"]))
    from pipeplan.runtime.worker import combine_losses

    losses = combine_losses([r["losses"] for r in ranks if r.get("losses") is not None],
                            mean=all(r.get("loss_reduction", "mean") == "mean" for r in ranks))
    predicted = asdict(plan.predicted)
    predicted["stages"] = [{"index": s.index, **asdict(s.predicted)} for s in plan.stages]
    return {
        "format": "pipeplan.run/v1",
        "plan": {"schedule": plan.schedule, "microbatches": plan.microbatches, "batch_size": plan.batch_size,
                 "stages": len(plan.stages), "devices": len(set(stage_to_rank.values())), "fingerprint": plan.graph.get("fingerprint")},
        "measured": {
            "iteration_s": iteration_s,
            "samples_per_s": plan.batch_size / iteration_s if iteration_s > 0 else 0.0,
            "steps_measured": steps,
            "step_s": per_step,
            "stages": stages,
        },
        "predicted": predicted,
        "losses": losses,
        "first_step": result.get("first_step", 0),
    }


def measured_events(result: dict[str, Any], plan) -> list[dict[str, Any]]:
    """The last measured step's forward/backward spans, as timeline events (planner.timeline format)."""
    out = []
    for r in result["ranks"]:
        if r is None:
            continue
        for stage, events in r["events"].items():
            for kind, mb, start, end in events:
                chunk = int(stage) // max(1, plan.devices or 1) if plan.schedule == "interleaved" else 0
                out.append({"device": r["rank"], "stage": int(stage), "chunk": chunk, "microbatch": mb,
                            "kind": kind, "start_s": start, "end_s": end})
    return out


def render_table(doc: dict[str, Any], console) -> None:
    """Measured vs. predicted, per stage and for the iteration (rich)."""
    from rich.table import Table

    m, p = doc["measured"], doc["predicted"]
    pstages = {s["index"]: s for s in p.get("stages", [])}
    mb = doc["plan"]["microbatches"]
    t = Table(title=f"pipeplan run: {doc['plan']['schedule']}, {doc['plan']['stages']} stages, M={mb}, "
                    f"{m['steps_measured']} measured step(s)")
    for col in ("stage", "rank", "fwd ms/mb", "pred", "bwd ms/mb", "pred", "compute ms/step", "wait ms/step", "peak MiB", "pred"):
        t.add_column(col, justify="right")
    for s in m["stages"]:
        ps = pstages.get(s["index"], {})
        t.add_row(
            str(s["index"]), str(s["rank"]),
            _ms(s["fwd_s"]), _ms(ps.get("fwd_s")), _ms(s["bwd_s"]), _ms(ps.get("bwd_s")),
            _ms(s["compute_s"]), _ms(s["wait_s"]),
            f"{s['peak_memory_bytes'] / 2**20:.1f}", f"{ps.get('memory_bytes', 0) / 2**20:.1f}" if ps else "-",
        )
    console.print(t)
    it, pit = m["iteration_s"], p.get("iteration_s") or 0.0
    err = f" ({(it - pit) / pit * 100:+.1f}% vs predicted)" if pit else ""
    console.print(f"iteration: measured {it * 1e3:.2f} ms, predicted {pit * 1e3:.2f} ms{err}; "
                  f"samples/s: measured {m['samples_per_s']:.1f}, predicted {p.get('samples_per_s', 0):.1f}")
    if doc["losses"]:
        console.print("losses: " + ", ".join(f"{x:.5g}" for x in doc["losses"]))


def _ms(x) -> str:
    return "-" if x is None else f"{x * 1e3:.2f}"
