"""simulate's receives_wait=True: a tensor crosses its link once the receiving device reaches the op that needs it,
and the op starts when it has arrived (torch.distributed.pipelining posts a receive when it comes to the op).
Exact, with Fractions, against a closed form worked out by hand and against the rule itself, op by op."""

from __future__ import annotations

from dataclasses import replace
from fractions import Fraction as Fr

import pytest

from pipeplan.errors import UserError
from pipeplan.hardware_profiles.profile import Link
from pipeplan.planner.plan import Plan
from pipeplan.planner.predict import evaluate
from pipeplan.planner.replay import simulate_from_plan
from pipeplan.planner.simulate import simulate
from search_fixtures import gpt_like, profile

F, B, C = Fr(1), Fr(2), Fr(1, 4)  # forward, backward, one boundary's transfer


@pytest.mark.parametrize("K,M", [(2, 1), (2, 4), (3, 5), (4, 8), (8, 40)])
def test_gpipe_pays_every_transfer_on_its_critical_path(K, M):
    """Uniform GPipe. Stage 0 runs its forwards back to back; stage s >= 1 starts F(m) after its own F(m - 1) and
    the upstream F(m), whichever ends later, plus C: F(s, m) ends at (s + m + 1) F + (s + m) C. The last stage's
    backwards need no transfer and start at T = (K + M - 1) F + (K + M - 2) C; stage K - 1 - k (k >= 1) ends B(m)
    at T + (k + m + 1) B + (k + m) C. Stage 0's last, k = K - 1 and m = M - 1: the iteration is
    (K + M - 1)(F + B) + 2 (K + M - 2) C, where transfers that start at the producer's end cost 2 (K - 1) C."""
    waits = simulate("gpipe", [F] * K, [B] * K, [C] * (K - 1), M, receives_wait=True)
    overlapped = simulate("gpipe", [F] * K, [B] * K, [C] * (K - 1), M)
    assert waits.iteration_s == (K + M - 1) * (F + B) + 2 * (K + M - 2) * C
    assert overlapped.iteration_s == (K + M - 1) * (F + B) + 2 * (K - 1) * C
    fwd_ends = {(e.stage, e.microbatch): e.end_s for e in waits.events if e.kind == "fwd"}
    assert all(end == (s + m + 1) * F + (s + m) * C for (s, m), end in fwd_ends.items() if s >= 1)


def _previous_end(events, e) -> Fr:
    """When the device of compute op `e` finished the compute op before it (0 for its first)."""
    mine = sorted((x for x in events if x.device == e.device and x.kind in ("fwd", "bwd", "wgrad", "recompute")),
                  key=lambda x: x.start_s)
    before = [x.end_s for x in mine if x.end_s <= e.start_s]
    return max(before, default=Fr(0))


@pytest.mark.parametrize("schedule,chunks", [("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("zb-h1", 1),
                                             ("zb-v", 2)])
def test_every_op_starts_one_transfer_after_its_device_and_its_input_are_ready(schedule, chunks):
    """The rule itself, on unequal stages and transfers: a forward of m on stage s > 0 starts at max(its device's
    previous op end, F(s - 1, m) end) + send[s - 1] when s - 1 is on another device, at the max alone when it is on
    the same one (the V's turn); a backward (zero bubble's B) likewise after B(s + 1, m) with send[s]."""
    K, M = 4, 8
    S = K * chunks
    fwd = [Fr(1 + (s % 3), 2) for s in range(S)]
    bwd = [2 * f + Fr(s % 2, 3) for s, f in enumerate(fwd)]
    send = [Fr(1 + (s % 4), 5) for s in range(S - 1)]
    r = simulate(schedule, fwd, bwd, send, M, chunks=chunks, receives_wait=True)
    ev = r.events
    fw = {(e.stage, e.microbatch): e for e in ev if e.kind == "fwd"}
    bw = {(e.stage, e.microbatch): e for e in ev if e.kind == "bwd"}
    checked = 0
    for (s, m), e in fw.items():
        if s > 0:
            up = fw[s - 1, m]
            ready = max(_previous_end(ev, e), up.end_s)
            assert e.start_s == ready + (send[s - 1] if up.device != e.device else 0), (s, m)
            checked += 1
    for (s, m), e in bw.items():
        if s < S - 1:
            down = bw[s + 1, m]
            ready = max(_previous_end(ev, e), down.end_s)
            assert e.start_s == ready + (send[s] if down.device != e.device else 0), (s, m)
            checked += 1
    assert checked == 2 * (S - 1) * M


def test_without_transfers_or_devices_to_cross_nothing_changes():
    """No bytes to move, or one device: waiting for a transfer is waiting for nothing."""
    for schedule, chunks in (("1f1b", 1), ("interleaved", 2), ("zb-v", 2)):
        S = 3 * chunks
        fwd, bwd = [F * (1 + s % 2) for s in range(S)], [B] * S
        free = simulate(schedule, fwd, bwd, [0] * (S - 1), 6, chunks=chunks)
        waits = simulate(schedule, fwd, bwd, [0] * (S - 1), 6, chunks=chunks, receives_wait=True)
        assert waits.iteration_s == free.iteration_s
    one = simulate("gpipe", [F], [B], [C], 4, receives_wait=True)
    assert one.iteration_s == 4 * (F + B)


@pytest.mark.parametrize("measured_gap", [False, True])
def test_a_plan_waits_for_its_receives_unless_its_profile_measured_the_gap(measured_gap):
    """A GPU profile's plan is simulated with receives waiting; a profile whose per-op gap was measured
    (`op_overhead_s`, `profiles calibrate`) holds the wait in that gap and starts transfers at the producer's end.
    The plan records which, and its file replays to its prediction either way (an older file, without the key,
    as it was predicted: from the producer's end)."""
    g = gpt_like(blocks=4, hidden=256, seq=128, vocab=1000, batch=2)
    prof = replace(profile(80), intra_node=Link("slow", 1e9, 1e-5))  # sends a sizeable share of the ops
    if measured_gap:
        prof = replace(prof, op_overhead_s={"gpipe": 1e-6})
    half = len(g.layers) // 2
    plan = evaluate(g, prof, [0] * half + [1] * (len(g.layers) - half), schedule="gpipe", microbatches=4,
                    batch_size=16)
    assert plan.receives_wait is not measured_gap
    p = [s.predicted for s in sorted(plan.stages, key=lambda s: s.index)]
    fwd = [x.fwd_s + x.op_overhead_s for x in p]
    bwd = [x.bwd_s + x.op_overhead_s for x in p]
    args = ("gpipe", fwd, bwd, [p[0].send_s], 4)
    steps = [x.optimizer_s for x in p]
    waits = simulate(*args, optimizer_s=steps, receives_wait=True)
    overlapped = simulate(*args, optimizer_s=steps, receives_wait=False)
    assert waits.iteration_s > overlapped.iteration_s + 2 * p[0].send_s  # more than the fill's one way and back
    expected = (waits if not measured_gap else overlapped).iteration_s
    assert plan.predicted.iteration_s == pytest.approx(expected, rel=1e-9)
    # a framework that hides its copies behind compute (torchgpipe's copy streams) replays the plan without the wait
    assert simulate_from_plan(plan, receives_wait=False).iteration_s == pytest.approx(overlapped.iteration_s, rel=1e-9)
    doc = plan.to_dict()
    assert Plan.from_dict(doc).receives_wait is not measured_gap
    assert simulate_from_plan(Plan.from_dict(doc)).iteration_s == pytest.approx(plan.predicted.iteration_s, rel=1e-9)
    older = Plan.from_dict({k: v for k, v in doc.items() if k != "receives_wait"})
    assert older.receives_wait is False
    with pytest.raises(UserError, match="receives_wait"):
        Plan.from_dict({**doc, "receives_wait": "yes"})


@pytest.mark.parametrize("schedule", ["pipedream", "pipedream-2bw"])
def test_pipedreams_own_loop_posts_its_receives_ahead_so_nothing_waits(schedule):
    """PipeDream's loop (runtime/pipedream_comm.py) posts a microbatch's receives ahead, the gradient's with the
    forward's send, so its transfers run while the stage computes: its plans start them at the producer's end,
    also on a GPU profile, where the torch schedules' plans wait."""
    g = gpt_like(blocks=4, hidden=256, seq=128, vocab=1000, batch=2)
    prof = replace(profile(80), intra_node=Link("slow", 1e9, 1e-5))
    half = len(g.layers) // 2
    split = [0] * half + [1] * (len(g.layers) - half)
    plan = evaluate(g, prof, split, schedule=schedule, microbatches=4, batch_size=16)
    torch_plan = evaluate(g, prof, split, schedule="1f1b", microbatches=4, batch_size=16)
    assert plan.receives_wait is False and torch_plan.receives_wait is True
    assert simulate_from_plan(plan).iteration_s == pytest.approx(plan.predicted.iteration_s, rel=1e-9)
