"""simulate's recompute_last=False: recomputation that spares one microbatch per stage, as torchgpipe's default
checkpoint="except_last" does. Exact, with Fractions, against closed forms worked out by hand."""

from __future__ import annotations

from fractions import Fraction as Fr

import pytest

from pipeplan.planner.simulate import simulate

F, B = Fr(1), Fr(2)  # a backward does twice a forward's work; a re-run is one forward


def test_one_stage_two_microbatches_is_seven_forwards_against_six():
    """torchgpipe's pipeline-1 rows: 2 microbatches, one re-run (of the first), so 2F + 2B + F = 7F where the plain
    model takes 6F: 6/7 = 0.857 of its throughput (torchgpipe measured 0.858 for U-Net, 0.853 for ResNet-101)."""
    plain = simulate("gpipe", [F], [B], [0], 2)
    every = simulate("gpipe", [F], [B], [0], 2, recompute_s=[F])
    spared = simulate("gpipe", [F], [B], [0], 2, recompute_s=[F], recompute_last=False)
    assert (plain.iteration_s, every.iteration_s, spared.iteration_s) == (6, 8, 7)
    assert plain.iteration_s / spared.iteration_s == Fr(6, 7)
    assert spared.busy_s == [7] and sum(e.kind == "recompute" for e in spared.events) == 1


def test_a_gpipe_pipeline_saves_one_rerun_on_its_critical_path():
    """K = 3 uniform stages, M = 4, no sends. Forwards end at (M + K - 1) F = 6 on the last stage. Backwards: the last
    stage runs B(0) bare at [6, 8], then B(1..3) with their re-runs, 3 each, to 17; stage 1 follows each of them:
    B(0) [8, 10], then [11, 14], [14, 17], [17, 20]; stage 0 likewise: [10, 12], [14, 17], [17, 20], [20, 23]. So 23,
    one re-run less than (M + K - 1)(F + B + F) = 24 with every microbatch re-run."""
    K, M = 3, 4
    every = simulate("gpipe", [F] * K, [B] * K, [0] * K, M, recompute_s=[F] * K)
    spared = simulate("gpipe", [F] * K, [B] * K, [0] * K, M, recompute_s=[F] * K, recompute_last=False)
    assert every.iteration_s == 24 and spared.iteration_s == 23
    assert spared.busy_s == [M * (F + B) + (M - 1) * F] * K
    b0 = sorted((e.device, e.start_s, e.end_s) for e in spared.events if e.kind == "bwd" and e.microbatch == 0)
    assert b0 == [(0, 10, 12), (1, 8, 10), (2, 6, 8)]


def test_the_spared_microbatch_holds_its_activations_whole_from_its_forward():
    """One stage, act 10 bytes a microbatch kept (the checkpoint), 1000 more re-made by a re-run: microbatch 0 is not
    re-run, so it holds 10 + 1000 from its forward start to its backward's end; the others hold 10 until their re-run."""
    spared = simulate("gpipe", [F], [B], [0], 3, recompute_s=[F], activation_bytes_per_mb=[10],
                      recompute_bytes=[1000], recompute_last=False)
    use = [(t, b) for t, _, b in spared.memory_timeline]
    assert use[:4] == [(0, 0), (0, 1010), (1, 1020), (2, 1030)]  # forwards of 0, 1, 2
    after_b0 = next(b for t, b in use if t == 3 + B)  # B(0) runs bare over [3, 5] and frees 1010
    assert after_b0 == 20 and spared.peak_memory_bytes == [1030]


@pytest.mark.parametrize("schedule", ["zb-h1", "pipedream", "pipedream-2bw"])
def test_only_flushing_schedules_with_whole_backwards_take_it(schedule):
    with pytest.raises(ValueError, match="recompute_last"):
        simulate(schedule, [F] * 2, [B] * 2, [0] * 2, 4, recompute_s=[F] * 2, recompute_last=False)
