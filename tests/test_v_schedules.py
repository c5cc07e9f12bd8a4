"""Issue 19 point 3: the V-shaped zero-bubble schedules (ZB-V, DualPipeV) in the simulator, the memory model and
the search.

Checked against independent sources: torch's own op orders (`pipeline_order`, as ScheduleZBVZeroBubble and
ScheduleDualPipeV build them), torch's V placement (`generate_stage_to_rank_mapping(style="v")`), an
independent replay of torch's orders written here (each op starts when its device is free and its inputs
are done), a closed form for one device, and the papers' memory claims (ZB-V: 1F1B's peak, Qi et al. 2024
§6; DualPipe: PP + 1 microbatches, DeepSeek-V3 §3.2.1).
"""

from __future__ import annotations

import random
from fractions import Fraction as Fr

import pytest

from pipeplan.planner.simulate import simulate
from pipeplan.schedules import facts, inflight_microbatches, microbatch_problem, stage_device
from pipeplan.v_orders import dualpipev_order, zbv_order

S = pytest.importorskip("torch.distributed.pipelining.schedules")
V = ("zb-v", "dualpipev")
KIND = {"F": "F", "I": "B", "W": "W", "B": "BW"}  # torch's F, BACKWARD_INPUT, BACKWARD_WEIGHT, FULL_BACKWARD


def torch_order(schedule: str, ranks: int, microbatches: int, rank: int) -> list[tuple[str, int, int]]:
    """torch's own order for one rank, its OVERLAP_F_B actions as their sub-actions in turn, idle slots dropped."""
    cls = S.ScheduleZBVZeroBubble if schedule == "zb-v" else S.ScheduleDualPipeV
    sched = cls.__new__(cls)  # the order needs only these attributes, not process groups
    sched.pp_group_size, sched._n_microbatches = ranks, microbatches
    sched.num_stages = sched._num_stages = 2 * ranks
    out = []
    for action in sched._calculate_single_rank_operations(rank):
        if action is None:
            continue
        parts = action.sub_actions if action.computation_type == S.OVERLAP_F_B else [action]
        out += [(KIND[a.computation_type.value], a.stage_index, a.microbatch_index) for a in parts]
    return out


def cases() -> list[tuple[str, int, int]]:
    out = [("zb-v", K, M) for K in range(1, 6) for M in range(1, 14)]
    return out + [("dualpipev", K, M) for K in range(1, 6) for M in range(2 * K, 14)]


@pytest.mark.parametrize("schedule,K,M", cases())
def test_orders_are_torchs(schedule, K, M):
    ours = zbv_order if schedule == "zb-v" else dualpipev_order
    for rank in range(K):
        assert ours(rank, K, M) == torch_order(schedule, K, M, rank), (rank, K, M)


@pytest.mark.parametrize("K", [1, 2, 3, 4, 8])
def test_placement_is_torchs_v(K):
    from torch.distributed.pipelining._utils import generate_stage_to_rank_mapping

    torch_map = generate_stage_to_rank_mapping(K, 2 * K, style="v")
    for schedule in V:
        assert [stage_device(schedule, s, K) for s in range(2 * K)] == [torch_map[s] for s in range(2 * K)]
    assert [stage_device("interleaved", s, K) for s in range(2 * K)] == [s % K for s in range(2 * K)]


def test_dualpipev_microbatch_rule_is_torchs():
    """At least as many microbatches as stages (2K): the check in ScheduleDualPipeV.__init__."""
    import inspect

    assert "n_microbatches < self._num_stages" in inspect.getsource(S.ScheduleDualPipeV.__init__)
    for K in range(1, 6):
        for M in range(1, 13):
            assert (microbatch_problem("dualpipev", K, M) is None) == (M >= 2 * K)
            assert microbatch_problem("zb-v", K, M) is None


def replay(schedule: str, K: int, M: int, fwd, bwd, wgrad) -> dict[tuple[str, int, int], Fr]:
    """When each op of torch's orders ends, sends free: a device runs its ops in order, each once its inputs
    are done (F after F of the stage before; B or BW after its own F and the backward of the stage after;
    W after its B). Written from the dependency rules alone, apart from planner/simulate.py's event loop."""
    orders = [torch_order(schedule, K, M, r) for r in range(K)]
    dur = {"F": lambda s: fwd[s], "B": lambda s: bwd[s] - wgrad[s], "W": lambda s: wgrad[s], "BW": lambda s: bwd[s]}
    end: dict[tuple[str, int, int], Fr] = {}

    def deps(kind, s, m):
        if kind == "F":
            return [("F", s - 1, m)] if s else []
        if kind == "W":
            return [("B", s, m)]
        return [("F", s, m)] + ([("back", s + 1, m)] if s < 2 * K - 1 else [])

    def done(key):
        kind, s, m = key
        if kind == "back":  # the input gradient of stage s, from a B or a whole BW
            return end.get(("B", s, m), end.get(("BW", s, m)))
        return end.get(key)

    pos, free = [0] * K, [Fr(0)] * K
    while any(pos[r] < len(orders[r]) for r in range(K)):
        moved = False
        for r in range(K):
            while pos[r] < len(orders[r]):
                op = orders[r][pos[r]]
                ready = [done(d) for d in deps(*op)]
                if any(t is None for t in ready):
                    break
                end[op] = max([free[r], *ready]) + dur[op[0]](op[1])
                free[r] = end[op]
                pos[r] += 1
                moved = True
        assert moved, "torch's order deadlocked in the replay"
    return end


@pytest.mark.parametrize("schedule,K,M", [("zb-v", 2, 1), ("zb-v", 2, 4), ("zb-v", 3, 7), ("zb-v", 4, 8),
                                          ("dualpipev", 2, 4), ("dualpipev", 2, 7), ("dualpipev", 3, 6),
                                          ("dualpipev", 4, 11)])
def test_simulated_iteration_is_the_replay_of_torchs_orders(schedule, K, M):
    rng = random.Random(K * 100 + M)
    for _ in range(3):
        fwd = [Fr(rng.randint(1, 9), 4) for _ in range(2 * K)]
        wgrad = [Fr(rng.randint(0, 8), 4) for _ in range(2 * K)]
        bwd = [w + Fr(rng.randint(1, 9), 4) for w in wgrad]
        r = simulate(schedule, fwd, bwd, [0] * (2 * K), M, chunks=2, wgrad_s=wgrad)
        ends = replay(schedule, K, M, fwd, bwd, wgrad)
        assert r.pipeline_s == max(ends.values())
        # every simulated op ends when the replay says (a whole backward drawn as its B and W parts)
        for e in r.events:
            if e.kind == "fwd":
                assert e.end_s == ends[("F", e.stage, e.microbatch)]
            if e.kind == "wgrad":
                assert e.end_s == ends.get(("W", e.stage, e.microbatch), ends.get(("BW", e.stage, e.microbatch)))


@pytest.mark.parametrize("schedule", V)
def test_one_device_runs_every_op_back_to_back(schedule):
    """K = 1: both chunks on one device, the turn of the V a hand-over with no transfer: the iteration is
    M times the sum of the op times whatever the send time."""
    fwd, bwd = [Fr(3), Fr(5)], [Fr(7), Fr(4)]
    r = simulate(schedule, fwd, bwd, [Fr(100), 0], 4, chunks=2, wgrad_s=[Fr(2), Fr(1)])
    assert r.pipeline_s == 4 * (sum(fwd) + sum(bwd)) and r.bubble_fraction == 0


@pytest.mark.parametrize("K", [2, 3, 4, 6])
def test_peak_activations_are_the_papers(K):
    """ZB-V holds 2K chunk-microbatches on every rank (K stages' worth: 1F1B's first stage, §6); DualPipeV one
    more (DualPipe's PP + 1). The memory model's count, the simulator's count in time and the claim agree."""
    M = 3 * K
    for schedule, want in (("zb-v", 2 * K), ("dualpipev", 2 * K + 1)):
        r = simulate(schedule, [1] * (2 * K), [2] * (2 * K), [0] * (2 * K), M, chunks=2,
                     activation_bytes_per_mb=[1] * (2 * K))
        rule = [inflight_microbatches(schedule, K, d, M, 2) for d in range(K)]
        assert r.inflight_device_peak == rule == [want] * K
        assert r.peak_memory_bytes == [want] * K


def test_facts_and_chunk_count():
    for schedule in V:
        f = facts(schedule)
        assert f.flushes and f.splits_backward and f.interleaves and f.placement == "v" and f.fixed_chunks == 2
        with pytest.raises(ValueError, match="exactly 2 chunks"):
            simulate(schedule, [1] * 6, [2] * 6, [0] * 6, 6, chunks=3)
    assert facts("zb-v").torch_class == "ScheduleZBVZeroBubble"
    assert facts("dualpipev").torch_class == "ScheduleDualPipeV"
    from pipeplan.errors import UserError

    with pytest.raises(UserError, match="at least as many microbatches"):
        simulate("dualpipev", [1] * 4, [2] * 4, [0] * 4, 3, chunks=2)


@pytest.mark.parametrize("schedule", V)
def test_search_plans_v_schedules_with_their_placement(schedule):
    """--schedule zb-v / dualpipev: two chunks a device, stage s on device s then 2K - 1 - s (replicas
    stage-major), each device's memory its two chunks', and the plan's time the simulator's."""
    from cli_fixtures import chain_graph
    from pipeplan.hardware_profiles import load_profile
    from pipeplan.planner.request import PlanRequest
    from pipeplan.planner.search import search

    profile = load_profile("a100-80gb-sxm")
    plan = search(chain_graph(), profile, PlanRequest(devices=4, batch_size=16, stages=2, microbatches=4,
                                                        schedule=schedule)).best
    assert plan.schedule == schedule and plan.chunks == 2 and len(plan.stages) == 4
    d = plan.data_parallel
    for st in plan.stages:
        assert st.devices == [stage_device(schedule, st.index, 2) * d + r for r in range(d)]
    for a, b in ((0, 3), (1, 2)):  # the two chunks of a device report the device's peak
        assert plan.stages[a].predicted.memory_bytes == plan.stages[b].predicted.memory_bytes


def test_search_offers_the_v_schedules_only_where_torch_runs_them():
    from pipeplan.planner.configs import configurations
    from pipeplan.planner.request import PlanRequest

    for schedule in V:
        request = PlanRequest(devices=8, batch_size=16, schedule=schedule)
        seen = set()
        for K in range(1, 9):
            for d in range(1, 8 // K + 1):
                for c in configurations(request, K, d, n_layers=16):
                    assert c.chunks == 2 and K >= 2 and microbatch_problem(schedule, K, c.microbatches) is None
                    seen.add((K, c.microbatches))
        assert (2, 4) in seen and (4, 8) in seen
        assert ((2, 1) in seen) == (schedule == "zb-v")


@pytest.mark.parametrize("schedule,torch_name", [("zb-h1", "InterleavedZeroBubble"), ("zb-v", "ZBVZeroBubble"),
                                                 ("dualpipev", "DualPipeV")])
def test_exports_name_the_schedule_or_refuse(schedule, torch_name):
    """torchtitan runs all three by torch's class name (get_schedule_class) and places ZBV/DualPipeV stages
    in a V itself; Megatron-LM has no zero-bubble schedule and says so (exit 2 from the CLI)."""
    from torch.distributed.pipelining.schedules import get_schedule_class

    from pipeplan.planner.frameworks import export_plan
    from pipeplan.planner.frameworks.names import Inexpressible
    from test_export_fixtures import counts_assignment, llama_graph, make_plan

    chunks = 1 if schedule == "zb-h1" else 2
    counts = [5, 5] if chunks == 1 else [3, 2, 2, 3]  # 10 layers: embedding, rotary, 6 blocks, norm, head
    plan = make_plan(llama_graph(6), counts_assignment(counts), schedule=schedule, chunks=chunks, microbatches=8,
                     batch_size=16)
    exp = export_plan(plan, "torchtitan")
    assert exp.settings["pipeline_parallel_schedule"] == torch_name
    assert get_schedule_class(torch_name).__name__ == facts(schedule).torch_class
    assert exp.settings["pipeline_parallel_degree"] == 2 and len(exp.settings["module_fqns_per_model_part"]) == 2 * chunks
    with pytest.raises(Inexpressible, match="no .*zero-bubble"):
        export_plan(plan, "megatron")
