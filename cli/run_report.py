"""The measured-vs-predicted table of `pipeplan run` (rich).

runtime/report.py computes the numbers (the `--json` document); this module only
draws them, so the runtime layer does no display work.
"""

from __future__ import annotations

from typing import Any

from pipeplan.planner.configs import SHARDING_NAMES
from pipeplan.planner.plan import StagePrediction
from pipeplan.schedules import ScheduleFacts, facts


def render_table(doc: dict[str, Any], console) -> None:
    """Measured vs. predicted, per stage and for the iteration (rich)."""
    from rich.table import Table

    m, p = doc["measured"], doc["predicted"]
    pstages = {s["index"]: s for s in p.get("stages", [])}
    mb = doc["plan"]["microbatches"]
    plan = doc["plan"]
    sharded = f", {SHARDING_NAMES[plan['sharding']]}" if plan.get("sharding", "none") != "none" else ""
    k, steps = plan["stages"], m["steps_measured"]
    t = Table(title=f"pipeplan run: {plan['schedule']}, {k} stage{'s' if k != 1 else ''}, M={mb}{sharded}, "
                    f"{steps} measured step{'s' if steps != 1 else ''}",
              caption="ms/mb: one microbatch; device peak: the whole device (all its stages), as the plan predicts it"
                      + ("; bwd: with the recomputed forward" if plan.get("recompute") else ""))
    # the backward re-runs the forward up to its last save (runtime/recompute.py); compute_s counts every re-run.
    # bwd_s prices accumulating backwards; the measured mean counts the step's fresh ones (costmodels/accumulate.py)
    rule = facts(plan["schedule"])
    fresh_share = facts(plan["schedule"]).fresh_backwards(mb) / mb
    for col in ("stage", "rank", "fwd ms/mb", "pred", "bwd ms/mb", "pred", "compute ms/step", "wait ms/step",
                "device peak MiB", "pred"):
        t.add_column(col, justify="right")
    for s in m["stages"]:
        ps = pstages.get(s["index"], {})
        t.add_row(
            str(s["index"]), str(s["rank"]),
            _ms(s["fwd_s"]), _ms(ps.get("fwd_s")), _ms(s["bwd_s"]),
            _ms(_predicted_bwd_s(ps, rule, fresh_share)) if ps else _ms(None),
            _ms(s["compute_s"]), _ms(s["wait_s"]),
            f"{s.get('device_peak_bytes', s['peak_memory_bytes']) / 2**20:.1f}",
            f"{ps.get('memory_bytes', 0) / 2**20:.1f}" if ps else "-",
        )
    console.print(t)
    it, pit = m["iteration_s"], p.get("iteration_s") or 0.0
    err = f" ({(it - pit) / pit * 100:+.1f}% vs predicted)" if pit else ""
    console.print(f"iteration: measured {it * 1e3:.2f} ms, predicted {pit * 1e3:.2f} ms{err}; "
                  f"samples/s: measured {m['samples_per_s']:.1f}, predicted {p.get('samples_per_s', 0):.1f}")
    if doc["losses"]:
        console.print("losses: " + ", ".join(f"{x:.5g}" for x in doc["losses"]))
    scaled = doc.get("loss_scale")
    if scaled:  # fp16 (runtime/loss_scale.py): a skipped step trained nothing, which the losses alone do not show
        scale = scaled["scale"]
        console.print(f"loss scale: {scale:.0f}" if scale >= 1 else f"loss scale: {scale:g}",
                      f"after the last step; {scaled['skipped_steps']} step(s) skipped for an inf or NaN in the gradients")


def _predicted_bwd_s(ps: dict[str, Any], rule: ScheduleFacts, fresh_share: float) -> float:
    """A stage's predicted mean backward per microbatch, as the run measures it: with its re-run under
    recomputation, less its share of backwards into fresh gradients. Under zero bubble the run times B apart
    from W (runtime/measure.py), so this is B: the backward less W, re-run included but on the first stage,
    whose B torch leaves empty (its fresh-gradient saving is W's)."""
    pred = StagePrediction.from_dict(ps)
    rerun, _ = pred.reruns_s(rule.splits_backward)
    rerun *= rule.b_reruns(ps.get("index", 1))
    if rule.splits_backward:
        return pred.bwd_s - pred.wgrad_s + rerun
    return pred.bwd_s + rerun - pred.fresh_grad_s * fresh_share


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x * 1e3:.2f}"
