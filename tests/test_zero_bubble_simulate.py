"""Issue 19 point 3: ZB-H1 in the simulator, the memory model and the search.

Checks against independent sources: the paper's closed form (Qi et al., "Zero Bubble Pipeline
Parallelism", ICLR 2024, §3.1: ZB-H1's bubble is (p-1)(T_F+T_B-T_W), 1F1B's (p-1)(T_F+T_B+T_W)), torch's
own op order (`_get_1f1b_rank_ops` as ScheduleInterleavedZeroBubble calls it), torch's own microbatch
check (constructing the class), and a brute-force count of held activations from the event list.
"""

from __future__ import annotations

from fractions import Fraction as Fr

import pytest

from pipeplan.costmodels.memory import inflight_microbatches
from pipeplan.planner.simulate import _order_zb_h1, simulate
from pipeplan.schedules import SCHEDULE_NAMES, facts, microbatch_problem

TIMES = [(Fr(1), Fr(1), Fr(1)), (Fr(3, 2), Fr(2), Fr(1)), (Fr(1), Fr(2), Fr(1, 2)), (Fr(2), Fr(1), Fr(1)),
         (Fr(3), Fr(3), Fr(0))]  # (T_F, T_B, T_W) with T_W <= min(T_F, T_B), the paper's assumption


def zb(p, M, tf, tb, tw, **kw):
    return simulate("zb-h1", [tf] * p, [tb + tw] * p, [0] * p, M, wgrad_s=[tw] * p, **kw)


@pytest.mark.parametrize("p,M", [(2, 2), (2, 7), (3, 3), (3, 10), (4, 4), (4, 8), (4, 13), (6, 19)])
@pytest.mark.parametrize("tf,tb,tw", TIMES)
def test_zb_h1_iteration_is_the_papers_closed_form(p, M, tf, tb, tw):
    r = zb(p, M, tf, tb, tw, keep_events=False)
    assert r.iteration_s == M * (tf + tb + tw) + (p - 1) * (tf + tb - tw)
    one_f_one_b = simulate("1f1b", [tf] * p, [tb + tw] * p, [0] * p, M, keep_events=False)
    assert one_f_one_b.iteration_s - r.iteration_s == 2 * (p - 1) * tw  # the W's moved into the bubble


@pytest.mark.parametrize("p,M", [(2, 1), (3, 2), (4, 4), (4, 9), (5, 3)])
def test_zb_h1_peak_inflight_matches_memory_model(p, M):
    """Held until W ends: every stage peaks at min(p, M) (1F1B's stage-0 peak), what memory.py charges."""
    r = zb(p, M, Fr(1), Fr(1), Fr(1), activation_bytes_per_mb=[1] * p)
    assert r.inflight_peak == [inflight_microbatches("zb-h1", p, s, M) for s in range(p)] == [min(p, M)] * p
    assert r.peak_memory_bytes == [min(p, M)] * p
    # brute force from the events: activations live from F's start to W's end, not B's end
    for s in range(p):
        spans = {}
        for e in r.events:
            if e.stage == s and e.kind in ("fwd", "wgrad"):
                spans.setdefault(e.microbatch, [None, None])[e.kind == "wgrad"] = e.start_s if e.kind == "fwd" else e.end_s
        marks = sorted([(a, 1) for a, _ in spans.values()] + [(b, 0) for _, b in spans.values()])
        n = best = 0
        for _, up in marks:
            n += 1 if up else -1
            best = max(best, n)
        assert best == min(p, M)


@pytest.mark.parametrize("p", [2, 3, 4])
@pytest.mark.parametrize("M", [1, 2, 3, 4, 8])
def test_zb_h1_order_is_torchs(p, M):
    S = pytest.importorskip("torch.distributed.pipelining.schedules")
    C = S._ComputationType
    name = {C.FORWARD: "F", C.BACKWARD_INPUT: "B", C.BACKWARD_WEIGHT: "W"}
    for r in range(p):
        warm = S._get_warmup_ops(r, 1, M // max(1, M // p), p, M, multiply_factor=1)
        ops = S._get_1f1b_rank_ops(1, p, warm, M - warm, warm, r, lambda s, r=r: r, lambda s, r=r: r, r, True)
        assert [(name[a.computation_type], a.microbatch_index) for a in ops if a is not None] == _order_zb_h1(r, p, M)


def test_w_runs_after_its_b_and_frees_after_w():
    r = zb(3, 6, Fr(1), Fr(1), Fr(1), activation_bytes_per_mb=[1] * 3)
    b = {(e.stage, e.microbatch): e for e in r.events if e.kind == "bwd"}
    w = {(e.stage, e.microbatch): e for e in r.events if e.kind == "wgrad"}
    assert set(b) == set(w) and all(w[k].start_s >= b[k].end_s for k in w)
    assert all(b[k].end_s - b[k].start_s == 1 and w[k].end_s - w[k].start_s == 1 for k in w)


def test_default_split_is_half_the_backward():
    r = simulate("zb-h1", [Fr(1)] * 2, [Fr(2)] * 2, [0] * 2, 4)
    assert r.iteration_s == zb(2, 4, Fr(1), Fr(1), Fr(1)).iteration_s


def test_wgrad_rejected_where_it_does_not_apply():
    with pytest.raises(ValueError):
        simulate("1f1b", [1, 1], [2, 2], [0, 0], 2, wgrad_s=[1, 1])
    with pytest.raises(ValueError):
        simulate("zb-h1", [1, 1], [2, 2], [0, 0], 2, wgrad_s=[3, 1])


@pytest.mark.parametrize("p,M", [(2, 4), (2, 5), (2, 3), (4, 3), (4, 9), (4, 8), (3, 7)])
def test_microbatch_rule_is_torchs(p, M):
    """The shared rule refuses exactly what ScheduleInterleavedZeroBubble's constructor refuses."""
    pytest.importorskip("torch")
    from torch.distributed.pipelining import schedules as S

    rounds = max(1, M // p)
    torch_refuses = M % rounds != 0  # the constructor's check, schedules.py ScheduleInterleavedZeroBubble
    assert (microbatch_problem("zb-h1", p, M) is not None) == torch_refuses
    assert "number of rounds" in __import__("inspect").getsource(S.ScheduleInterleavedZeroBubble.__init__)


def test_facts():
    f = facts("zb-h1")
    assert "zb-h1" in SCHEDULE_NAMES and f.flushes and f.splits_backward and not f.interleaves
    assert f.torch_class == "ScheduleInterleavedZeroBubble"


def _torch_refuses_zb(stages: int, microbatches: int) -> bool:
    """ScheduleInterleavedZeroBubble.__init__ (torch/distributed/pipelining/schedules.py), written out."""
    return microbatches % max(1, microbatches // stages) != 0


@pytest.mark.parametrize("batch", [1, 6, 8, 24])
def test_search_offers_zb_h1_only_where_torch_runs_it(batch):
    from pipeplan.planner.configs import configurations
    from pipeplan.planner.request import PlanRequest

    request = PlanRequest(devices=8, batch_size=batch, schedule="zb-h1")
    seen = set()
    for K in range(1, 9):
        for d in range(1, 8 // K + 1):
            for c in configurations(request, K, d, n_layers=16):
                assert c.schedule == "zb-h1" and not _torch_refuses_zb(c.stages, c.microbatches), c
                seen.add((K, c.microbatches))
    assert (2, 1) in seen
    if batch >= 8:
        assert (4, 4) in seen and (8, 8) in seen


def test_search_plans_zb_h1_and_all_includes_it():
    """--schedule zb-h1 plans it, with the simulator's ZB-H1 time; "all" puts it among the candidates and,
    with every W as long as an F, it beats 1F1B at the same shape (the paper's 2(p-1)T_W). Microbatches of 1024
    samples, so the layers' compute, not the optimizer phase's per-tensor launches, sets the time."""
    from cli_fixtures import chain_graph
    from pipeplan.hardware_profiles import load_profile
    from pipeplan.planner.request import PlanRequest
    from pipeplan.planner.search import search

    profile = load_profile("a100-80gb-sxm")
    best = {}
    for schedule in ("zb-h1", "1f1b"):
        plan = search(chain_graph(), profile, PlanRequest(devices=4, batch_size=4096, stages=4, microbatches=4,
                                                            schedule=schedule)).best
        assert plan.schedule == schedule and plan.microbatches == 4
        best[schedule] = plan.predicted.iteration_s
    assert best["zb-h1"] < best["1f1b"]
    plan = search(chain_graph(), profile, PlanRequest(devices=4, batch_size=4096, stages=4, microbatches=4,
                                                        schedule="all")).best
    assert "zb-h1" in {plan.schedule, *(a["schedule"] for a in plan.alternatives)}


def test_stage_inputs_wgrad_is_each_layers_share_of_its_backward():
    """StageInputs.wgrad: per stage, the sum of bwd_s x W share over its layers (the planner's W); on the first
    stage the whole backward, as torch runs it (its B is empty: test_zero_bubble_runtime measures that)."""
    from cli_fixtures import chain_graph
    from pipeplan.costmodels.graph import weight_grad_share
    from pipeplan.hardware_profiles import load_profile
    from pipeplan.planner.configs import Config
    from pipeplan.planner.predict_inputs import stage_inputs
    from pipeplan.planner.problem import build_problem
    from pipeplan.planner.request import PlanRequest

    graph = chain_graph()
    graph.layers[1].bwd_weight_flops = graph.layers[1].bwd_flops // 4  # a traced split on one layer
    profile = load_profile("a100-80gb-sxm")
    request = PlanRequest(devices=2, batch_size=4, stages=2, microbatches=2, schedule="zb-h1")
    problem = build_problem(graph, profile, microbatch_size=2)
    n = problem.n
    assignment = [0] * (n // 2) + [1] * (n - n // 2)
    cfg = Config(schedule="zb-h1", stages=2, data_parallel=1, microbatches=2, chunks=1, recompute=False)
    x = stage_inputs(problem, profile, graph, assignment, cfg, request, [1, 1], [[0], [1]])
    share = [weight_grad_share(layer) for layer in graph.layers]
    expected = [sum(problem.bwd_s[i] * share[i] for i in range(n) if assignment[i] == s) for s in range(2)]
    # beyond the shares, stage 1's W re-reads its layers' output gradients (costmodels/split_backward.py; a
    # catalogue profile has no host terms)
    cold = sum(layer.output_bytes * min(2, len(layer.params) or (1 if layer.param_bytes else 0))
               for i, layer in enumerate(graph.layers) if assignment[i] == 1)
    assert cold > 0 and x.split == [0.0, pytest.approx(cold / profile.mem_bw_bytes_per_s)]
    assert x.wgrad[1] == pytest.approx(expected[1] + x.split[1]) and 0 < x.wgrad[1] < x.bwd[1]
    assert x.wgrad[0] == pytest.approx(sum(problem.bwd_s[i] for i in range(n) if assignment[i] == 0)) == x.bwd[0]
    assert expected[0] < x.bwd[0] and share[1] == 0.25  # the layers' shares alone would have left a B


@pytest.mark.parametrize("schedule,p,chunks,M", [("zb-h1", 2, 1, 5), ("zb-h1", 4, 1, 8), ("zb-v", 4, 2, 6)])
@pytest.mark.parametrize("tf,tb,tw", TIMES[:3])
@pytest.mark.parametrize("groups", [1, 3])
def test_recomputation_reruns_the_forward_before_b_and_again_in_w(schedule, p, chunks, M, tf, tb, tw, groups):
    """The runtime's non-reentrant checkpoint frees the re-run's tensors after B, so W re-runs the forward again,
    once per parameter group (torch calls autograd.grad per group: costmodels/recompute.weight_grad_passes); the
    first stage's B, whose input-gradient pass torch skips, re-runs nothing. Folding each re-run into the op it
    precedes must give the same timeline: B lasts r + T_B (the first stage's T_B) and W k r + T_W."""
    S, r = p * chunks, tf
    sends = [Fr(1, 3)] * S
    rerun_w = [r] + [groups * r] * (S - 1)  # the first stage's W is one whole backward: one re-run
    rerun_b = [0] + [r] * (S - 1)
    with_rc = simulate(schedule, [tf] * S, [tb + tw] * S, sends, M, chunks=chunks, wgrad_s=[tw] * S,
                       recompute_s=[r] * S, recompute_w_s=rerun_w, keep_events=False)
    folded = simulate(schedule, [tf] * S, [tb + tw + b + w for b, w in zip(rerun_b, rerun_w, strict=True)],
                      sends, M, chunks=chunks, wgrad_s=[tw + w for w in rerun_w], keep_events=False)
    assert with_rc.iteration_s == folded.iteration_s
    assert sum(with_rc.busy_s) == M * (S * (tf + tb + tw) + sum(rerun_b) + sum(rerun_w))


def test_dualpipev_reruns_once_per_whole_backward_and_per_pass_of_a_split_one():
    """DualPipeV mixes whole backwards (one autograd call: one re-run) with split ones (B: one, but none on the
    first stage; W: one per parameter group): each device's busy time counts its own ops so, from torch's orders."""
    from pipeplan.v_orders import v_order

    p, M, S = 2, 4, 4
    tf, tb, tw, r = Fr(3), Fr(2), Fr(1), Fr(1, 2)
    rerun_w = [r] + [3 * r] * (S - 1)
    res = simulate("dualpipev", [tf] * S, [tb + tw] * S, [Fr(1, 5)] * S, M, chunks=2, wgrad_s=[tw] * S,
                   recompute_s=[r] * S, recompute_w_s=rerun_w, keep_events=False)
    expected = [Fr(0)] * p
    for d in range(p):
        for kind, s, _ in v_order("dualpipev", d, p, M):
            expected[d] += {"F": tf, "B": tb + (0 if s == 0 else r), "W": tw + rerun_w[s], "BW": tb + tw + r}[kind]
    assert res.busy_s == expected
