"""The partitioner's memory (RangeMemory, prefix sums the DP calls) against the prediction's walk of a device, and
the search's caches of it and of the DP's answers.

torch's multi-stage runtime keeps every send to the step's end (costmodels/memory.py `Sends`); the prediction walks
each device over its order, the DP prices a walked device's sends at its fullest point (planner/walks.py
`kept_send_counts`). References: hand counts on torch's interleaved order, the prediction itself (`predict`, which
walks), a fresh `range_memory` of the configuration, and the DP's own memory callback.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from pipeplan.planner import search as search_module
from pipeplan.planner.configs import Config
from pipeplan.planner.predict import predict
from pipeplan.planner.problem import build_problem, memory_signature, range_memory
from pipeplan.planner.request import PlanRequest
from pipeplan.planner.walks import kept_send_counts, walk_orders
from search_fixtures import gpt_like, profile


def test_sends_are_counted_where_the_device_holds_the_most():
    """Interleaved 1F1B, 2 devices x 2 chunks, M = 2. Device 0 (stages 0, 2) holds 4 (chunk-)microbatches after F2,1
    and still during BW2,0, the last such op: by then both stages' two outputs went to device 1 (4) and BW2,0 sent
    one input gradient (stage 0's would not cross: the model's first). Device 1 (stages 1, 3) holds 3 last during
    BW3,1: stage 1's two outputs sent, stage 3's two input gradients, and the logits of microbatch 1 (F3,1 to its
    BW)."""
    cfg = Config(schedule="interleaved", stages=2, data_parallel=1, microbatches=2, chunks=2)
    assert walk_orders(cfg, 2)[0] == [("F", 0, 0), ("F", 0, 1), ("F", 2, 0), ("F", 2, 1), ("BW", 2, 0),
                                      ("BW", 2, 1), ("BW", 0, 0), ("BW", 0, 1)]
    assert kept_send_counts(cfg) == [(4, 1, 0), (2, 2, 1)]


@pytest.mark.parametrize("schedule", ["zb-v", "dualpipev"])
@pytest.mark.parametrize("microbatches", [4, 8, 16])
def test_range_memory_of_a_v_device_is_the_walks(schedule, microbatches):
    """A V's second device runs two middle chunks of equal blocks: the DP's price of either chunk (copies of it,
    its sends at the fullest point) is the prediction's walk of the device to the byte, at every M (the sends grow
    with it). Without the sends it was 0.2-0.9% under."""
    graph, prof = gpt_like(blocks=16, batch=2), profile(80)
    request = PlanRequest(devices=2, batch_size=16, dtype="fp32", optimizer="adam")
    cfg = Config(schedule=schedule, stages=2, data_parallel=1, microbatches=microbatches, chunks=2)
    prob = build_problem(graph, prof, microbatch_size=2, dtype="fp32")
    assignment = [0] + [i // 4 for i in range(16)] + [3]
    walked = predict(graph, prof, assignment, cfg, request, problem=prob).plan.stages[1].predicted.memory_bytes
    mem = range_memory(prob, cfg, request)
    assert mem(1, 5, 9) == mem(2, 9, 13) == walked
    mem.sends = None  # the counts' kept outputs in their place
    assert mem(1, 5, 9) < walked


def test_the_memory_cache_tells_microbatch_counts_apart():
    """Interleaved keeps a receive buffer per microbatch and every send to the step's end, so M = 8 and M = 16 need
    different memory where their in-flight counts agree; the search's cache gave the second the first's."""
    graph, prof = gpt_like(blocks=8, batch=2), profile(80)
    request = PlanRequest(devices=2, batch_size=32, dtype="fp32", optimizer="adam")
    small = Config(schedule="interleaved", stages=2, data_parallel=1, microbatches=8, chunks=2)
    large = replace(small, microbatches=16)
    assert memory_signature(small)[:-1] == memory_signature(large)[:-1]
    state = search_module._Search(graph, prof, request)
    prob = state.problem(2)
    state.memory(small, prob)
    fresh = range_memory(prob, large, request)
    assert state.memory(large, prob)(1, 3, 6) == fresh(1, 3, 6) > range_memory(prob, small, request)(1, 3, 6)


def test_the_dp_cache_tells_recompute_granularities_apart():
    """A checkpoint per block keeps less than one per stage; the DP's answer for one must not serve the other: each
    DP partition the search keeps fits under its own configuration's memory callback."""
    graph, prof = gpt_like(blocks=12, batch=8), profile(6)  # the block DP's split needs 110% per stage
    request = PlanRequest(devices=4, batch_size=64, dtype="fp32", optimizer="adam")
    state = search_module._Search(graph, prof, request)
    prob = state.problem(8, True)
    base = Config(schedule="1f1b", stages=4, data_parallel=1, microbatches=8, chunks=1, recompute=True)
    for granularity in ("block", "stage"):
        cfg = replace(base, recompute_granularity=granularity)
        mem = state.memory(cfg, prob)
        for part in state.partition_and_predict(cfg, prob, mem, 8):
            if part.solver.get("name") != "dp":
                continue
            bounds = [(part.assignment.index(s), len(part.assignment) - part.assignment[::-1].index(s))
                      for s in range(4)]
            assert all(mem(s, a, b) <= state.cap for s, (a, b) in enumerate(bounds)), granularity


def test_a_dp_partition_the_prediction_finds_over_is_refit_under_less(monkeypatch):
    """Where the DP's memory is under the prediction's (here made 15% under on purpose), its partition is rejected by
    the exact check; the search asks the DP again under the capacity less the excess and keeps a DP partition that
    fits, where without the refit only the heuristics' splits remain."""
    real = search_module.range_memory

    class Under:
        def __init__(self, mem):
            self.mem = mem

        def __call__(self, s, a, b):
            return int(self.mem(s, a, b) * 0.85)

        def __getattr__(self, name):
            return getattr(self.mem, name)

    monkeypatch.setattr(search_module, "range_memory", lambda *args, **kw: Under(real(*args, **kw)))
    graph, prof = gpt_like(blocks=24, batch=8), profile(24)
    request = PlanRequest(devices=4, batch_size=64, dtype="fp32", optimizer="adam", schedule="1f1b")
    cfg = Config(schedule="1f1b", stages=4, data_parallel=1, microbatches=8, chunks=1)

    def dp_fits(refits: int) -> list[bool]:
        monkeypatch.setattr(search_module, "REFITS", refits)
        state = search_module._Search(graph, prof, request)
        prob = state.problem(8)
        state.partition_and_predict(cfg, prob, state.memory(cfg, prob), 8)
        return [c.plan.predicted.fits for c in state.top if c.partition.solver.get("name") == "dp"]

    refits = search_module.REFITS
    assert dp_fits(0) == []
    assert dp_fits(refits) == [True]


def test_zb_h1_keeps_its_sends_to_the_steps_end_too():
    """ZB-H1 runs on torch's multi-stage runtime (ScheduleInterleavedZeroBubble), which waits on its sends only at the
    step's end, one stage a device. 2 devices, M = 4: device 0 holds 2 microbatches last during W0,2, when it has
    sent all 4 outputs; device 1 last during W1,2, when it has sent all 4 input gradients; its model output is the
    counts' one (`walks`: it stands in for what the last stage's B keeps for W)."""
    cfg = Config(schedule="zb-h1", stages=2, data_parallel=1, microbatches=4, chunks=1)
    assert walk_orders(cfg, 2)[0] == [("F", 0, 0), ("F", 0, 1), ("B", 0, 0), ("W", 0, 0), ("F", 0, 2), ("B", 0, 1),
                                      ("W", 0, 1), ("F", 0, 3), ("B", 0, 2), ("W", 0, 2), ("B", 0, 3), ("W", 0, 3)]
    assert kept_send_counts(cfg) == [(4, 0, 0), (0, 4, 1)]


@pytest.mark.parametrize("stage", [0, 1])
def test_zb_h1_memory_grows_with_m_by_its_sends_and_buffers(stage):
    """From M = 4 to M = 8 (in flight 2 either way) a ZB-H1 device holds 4 more receive buffers and 4 more sends,
    each one cut: 8 cuts more (the counts held a cut per microbatch in flight, whatever M); the partitioner's memory
    of the split is the prediction's."""
    graph, prof = gpt_like(blocks=8, batch=2), profile(80)
    request = PlanRequest(devices=2, batch_size=16, dtype="fp32", optimizer="adam")
    prob = build_problem(graph, prof, microbatch_size=2, dtype="fp32")
    assignment = [0] * 5 + [1] * 5
    cut = prob.cut_bytes[4]
    peak = {}
    for M in (4, 8):
        cfg = Config(schedule="zb-h1", stages=2, data_parallel=1, microbatches=M, chunks=1)
        peak[M] = predict(graph, prof, assignment, cfg, request, problem=prob).plan.stages[stage].predicted.memory_bytes
        assert range_memory(prob, cfg, request)(stage, 5 * stage, 5 * stage + 5) == peak[M]
    assert peak[8] - peak[4] == 8 * cut
