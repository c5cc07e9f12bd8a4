"""The search's lower bound on a partition's iteration (planner/bounds.iteration_lower_bound) never exceeds the
prediction it saves, is the closed form where that holds, and skipping by it leaves every search's answer alone."""

from __future__ import annotations

import itertools
import random
from dataclasses import replace

import pytest

from pipeplan.costmodels.graph import Edge, Graph, Layer
from pipeplan.hardware_profiles.loader import load_profile
from pipeplan.planner import search as search_mod
from pipeplan.planner.bounds import chain_ramp, iteration_lower_bound, split_within
from pipeplan.planner.configs import configurations
from pipeplan.planner.predict import predict
from pipeplan.planner.request import PlanRequest
from pipeplan.planner.simulate import simulate
from pipeplan.schedules import SCHEDULE_NAMES, facts
from search_fixtures import gpt_like, profile


def random_chain(rng: random.Random, n: int, batch: int) -> Graph:
    """Layers of unequal times and cut sizes, so stages are unbalanced and sends are not free."""
    layers = [Layer(f"l{i}", kind="matmul", param_bytes=rng.randrange(1, 64) << 16,
                    saved_bytes=rng.randrange(1, 64) << 16, output_bytes=rng.randrange(1, 32) << 16,
                    fwd_flops=0, bwd_flops=0, fwd_s=rng.uniform(1e-4, 3e-3), bwd_s=rng.uniform(2e-4, 6e-3))
              for i in range(n)]
    edges = [Edge(layers[i].name, layers[i + 1].name, layers[i].output_bytes) for i in range(n - 1)]
    return Graph(name="random", layers=layers, edges=edges, batch_size=batch, input_bytes=1 << 16,
                 source={"device": "cpu"})


def random_assignment(rng: random.Random, n: int, stages: int) -> list[int]:
    cuts = sorted(rng.sample(range(1, n), stages - 1))
    return [sum(i >= c for c in cuts) for i in range(n)]


def bound_and_prediction(graph, prof, request, cfg, assignment):
    """The search's bound on this partition and the prediction the search would otherwise run; checks that the
    configuration is not ruled out before partitioning when the best so far is just short of that bound."""
    sr = search_mod._Search(graph, prof, request)
    mb = cfg.microbatch_size(request.batch_size)
    plan = predict(graph, prof, assignment, cfg, request, problem=sr.problem(mb)).plan
    bound = sr.iteration_bound(cfg, assignment, mb)
    sr.top = [search_mod.Candidate(plan, cfg, None)]  # a best just short of this partition's bound: not ruled out
    plan.predicted.samples_per_s = request.batch_size / bound * (1 - 1e-9)
    assert not sr.config_beaten(cfg, mb), (cfg, assignment)
    return bound, plan.predicted.iteration_s


def check_every_configuration(graph, prof, rng, *, devices, batch, partitions):
    """Bound <= prediction for every configuration the search enumerates (all schedules, chunks, recomputation,
    replicas; over several replicas ZeRO-3 too, whose gathers and reduce-scatters run beside or in series with each
    op), each on `partitions` random splits; returns how many were checked."""
    request = PlanRequest(devices=devices, batch_size=batch, schedule="all", recompute="auto",
                          recompute_granularity="auto", sharding="none").for_profile(prof)
    n, checked = len(graph.layers), 0
    for K in range(1, devices + 1):
        for d in range(1, devices // K + 1):
            for cfg in configurations(request, K, d, n):
                if cfg.virtual_stages > n or cfg.stage_replicas:
                    continue
                for _ in range(partitions):
                    assignment = random_assignment(rng, n, cfg.virtual_stages)
                    for sharding in ("none", "zero3") if d > 1 and facts(cfg.schedule).flushes else ("none",):
                        sharded = replace(cfg, sharding=sharding)
                        bound, iteration = bound_and_prediction(graph, prof, request, sharded, assignment)
                        assert 0 < bound <= iteration * (1 + 1e-9), (sharded, assignment, bound, iteration)
                        checked += 1
    return checked


def test_bound_is_the_closed_form_on_equal_stages_and_the_simulation_meets_it():
    """Equal stages, free sends: 1F1B and GPipe take (M + K - 1)(t_f + t_b) (Narayanan et al. 2021 §2.2, Huang et
    al. 2019 §2.2); the bound is that number and so is the event simulation's iteration."""
    f, b = 2e-3, 5e-3
    for K, M in [(2, 2), (4, 4), (4, 9), (8, 16)]:
        assignment = [s for s in range(K) for _ in range(3)]
        fwd, bwd = [f / 3] * (3 * K), [b / 3] * (3 * K)
        want = (M + K - 1) * (f + b)
        got = iteration_lower_bound(fwd, bwd, [f + b] * K, assignment, list(range(K)), M, tail=True)
        assert got == pytest.approx(want, rel=1e-12)
        for schedule in ("1f1b", "gpipe"):
            sim = simulate(schedule, [f] * K, [b] * K, [0.0] * (K - 1), M)
            assert sim.iteration_s == pytest.approx(want, rel=1e-12)
        # no drain where a W can follow the device's last input-gradient op: the ramp alone is counted
        head_only = iteration_lower_bound(fwd, bwd, [f + b] * K, assignment, list(range(K)), M, tail=False)
        assert head_only == pytest.approx(M * (f + b) + (K - 1) * f, rel=1e-12)


def test_bound_on_interleaved_devices_starts_at_each_devices_lowest_stage():
    """Two devices, two chunks (stages 0..3 on devices 0, 1, 0, 1): device 1 waits for stage 0's forward and its
    last gradient then runs back through stage 0; device 0 has nothing below it."""
    fwd, bwd = [1.0, 2.0, 3.0, 4.0], [10.0, 20.0, 30.0, 40.0]
    busy = [1 + 10 + 3 + 30, 2 + 20 + 4 + 40]
    got = iteration_lower_bound(fwd, bwd, busy, [0, 1, 2, 3], [0, 1, 0, 1], 2, tail=True)
    assert got == max(2 * busy[0], 1.0 + 2 * busy[1] + 10.0)


def all_splits(n, stages):
    for cuts in itertools.combinations(range(1, n), stages - 1):
        yield [sum(i >= c for c in cuts) for i in range(n)]


def test_split_within_decides_the_least_partition_bound_over_every_split():
    """Brute force over every contiguous split of small random chains: `split_within` says yes exactly when some split
    has every device's ramp + work + drain (its `iteration_lower_bound`) within the limit, or without a ramp every
    stage's work; so it never rules out the split the DP will choose."""
    rng = random.Random(5)
    for _ in range(25):
        n = rng.randrange(2, 9)
        fwd = [rng.uniform(0.1, 1) for _ in range(n)]
        bwd = [rng.uniform(0.1, 2) for _ in range(n)]
        compute = [f + b + (f if rng.random() < 0.5 else 0) for f, b in zip(fwd, bwd, strict=True)]  # some recomputed
        for K in range(1, n + 1):
            splits = list(all_splits(n, K))
            for M in (1, 2, 5):
                busy = [[sum(compute[i] for i in range(n) if a[i] == k) for k in range(K)] for a in splits]
                least = {None: M * min(map(max, busy))}
                for tail in (True, False):
                    least[tail] = min(iteration_lower_bound(fwd, bwd, bz, a, list(range(K)), M, tail=tail)
                                      for a, bz in zip(splits, busy, strict=True))
                for tail, want in least.items():
                    ramp = None if tail is None else chain_ramp(fwd, bwd, tail=tail)
                    for limit in (want * (1 + 1e-9), want * (1 - 1e-9), want * rng.uniform(0.5, 1.5)):
                        assert split_within(compute, K, limit, microbatches=M, ramp_s=ramp) == (limit >= want)


@pytest.mark.parametrize("seed", [0, 1])
def test_bound_never_exceeds_the_prediction_on_a_gpu_profile(seed):
    rng = random.Random(seed)
    graph = random_chain(rng, 10, batch=16)
    assert check_every_configuration(graph, profile(40.0, per_node=2), rng, devices=4, batch=16, partitions=2) > 200


def test_bound_never_exceeds_the_prediction_on_a_catalogue_gpu():
    """A catalogue profile (its per-op efficiencies and collectives) on a GPT-shaped chain with an embedding and a
    head far from a block's time."""
    rng = random.Random(2)
    graph = gpt_like(blocks=6, hidden=256, seq=128, vocab=4000, batch=1)
    assert check_every_configuration(graph, load_profile("h100-sxm"), rng, devices=4, batch=8, partitions=1) > 100


def test_bound_never_exceeds_the_prediction_on_a_calibrated_local_profile(real_calibration):
    """This machine's measured profile: the runtime's per-op overheads, side-by-side slowdown, gloo sends."""
    result, path, _ = real_calibration
    assert result.exit_code == 0, result.output
    rng = random.Random(3)
    graph = random_chain(rng, 8, batch=16)
    assert check_every_configuration(graph, load_profile(str(path)), rng, devices=4, batch=16, partitions=1) > 100


def _busiest_only(self, cfg, assignment, mb):
    """The bound before the ramp and drain: the busiest device's compute for every microbatch."""
    prob = self.problem(mb, cfg.recompute)
    busy = [0.0] * cfg.stages
    for i, s in enumerate(assignment):
        busy[search_mod.stage_device(cfg.schedule, s, cfg.stages)] += prob.compute_s[i]
    return cfg.microbatches * max(busy)


def _busiest_config(self, cfg, mb):
    """Ruling out a configuration before the ramp and drain: its work spread evenly, or no split whose busiest stage
    stays under the iteration to beat."""
    if not self.top:
        return False
    limit, M = self.B / self.threshold(), cfg.microbatches
    compute = self.problem(mb, cfg.recompute).compute_s
    return M * sum(compute) / cfg.stages >= limit or (cfg.chunks == 1 and not split_within(compute, cfg.stages, limit,
                                                                                          microbatches=M))


@pytest.mark.parametrize("schedule", ["auto", *[s for s in SCHEDULE_NAMES if facts(s).flushes]])
def test_searches_choose_the_same_with_the_tighter_bound(schedule, monkeypatch):
    """Every flushing schedule: the best plan is the one an exhaustive search finds (no bound skips a configuration
    or a partition), and the bounds do skip predictions: more than the busiest device's work
    alone skips, where the pipeline's ramp and drain count (1F1B, GPipe)."""
    graph = gpt_like(blocks=8, hidden=512, seq=256, vocab=8000, batch=4)
    prof = profile(2.0, per_node=4)
    request = PlanRequest(devices=8, batch_size=32, schedule=schedule, recompute="auto", sharding="none", top=4)
    tight = search_mod.search(graph, prof, request)
    with monkeypatch.context() as m:
        m.setattr(search_mod._Search, "iteration_bound", lambda *args: 0.0)
        m.setattr(search_mod._Search, "config_beaten", lambda *args: False)
        loose = search_mod.search(graph, prof, request)

    def best(res):
        p = res.best
        return (p.schedule, len(p.stages), p.data_parallel, p.microbatches, p.recompute, p.sharding,
                p.predicted.samples_per_s, [len(s.layers) for s in p.stages])

    def ranked(res):
        return [p.predicted.samples_per_s for p in [res.best, *res.alternatives]]

    assert best(tight) == best(loose)
    # runners-up are the best of what was evaluated (search.py `threshold`): none above the exhaustive search's
    assert all(t <= x * (1 + 1e-12) for t, x in zip(ranked(tight), ranked(loose), strict=False))
    assert tight.evaluated < loose.evaluated
    with monkeypatch.context() as m:
        m.setattr(search_mod._Search, "iteration_bound", _busiest_only)
        m.setattr(search_mod._Search, "config_beaten", _busiest_config)
        busiest = search_mod.search(graph, prof, request)
    assert best(busiest) == best(tight)
    assert tight.evaluated <= busiest.evaluated
    if schedule in ("auto", "1f1b", "gpipe"):
        assert tight.evaluated < busiest.evaluated


def test_asynchronous_schedules_keep_the_busiest_device_bound():
    """PipeDream has no flush: no ramp or drain per iteration, so the bound stays its steady state's work."""
    rng = random.Random(4)
    graph = random_chain(rng, 6, batch=8)
    prof = profile(40.0)
    request = PlanRequest(devices=2, batch_size=8, schedule="pipedream-2bw", sharding="none").for_profile(prof)
    cfg = next(c for c in configurations(request, 2, 1, 6) if c.microbatches == 4)
    sr = search_mod._Search(graph, prof, request)
    assignment = [0, 0, 0, 1, 1, 1]
    mb = cfg.microbatch_size(8)
    assert sr.iteration_bound(cfg, assignment, mb) == pytest.approx(_busiest_only(sr, cfg, assignment, mb))


def test_a_configuration_is_ruled_out_by_its_ramp_and_drain_before_partitioning():
    """4 stages, 4 microbatches of 1F1B: a best so far just faster than the least busiest-stage work allows
    rules the configuration out only with the ramp and drain counted (they add about (K - 1) / M to the work)."""
    graph = gpt_like(blocks=6, hidden=256, seq=128, vocab=4000, batch=1)
    prof = profile(40.0)
    request = PlanRequest(devices=4, batch_size=4, schedule="1f1b", recompute="off", sharding="none").for_profile(prof)
    cfg = next(c for c in configurations(request, 4, 1, len(graph.layers)) if c.microbatches == 4)
    sr = search_mod._Search(graph, prof, request)
    mb = cfg.microbatch_size(4)
    compute = sr.problem(mb).compute_s
    busiest = min(max(sum(compute[i] for i in range(len(a)) if a[i] == k) for k in range(4))
                  for a in all_splits(len(compute), 4))
    plan = predict(graph, prof, [0] * 2 + [1] * 2 + [2] * 2 + [3] * 2, cfg, request, problem=sr.problem(mb)).plan
    sr.top = [search_mod.Candidate(plan, cfg, None)]
    plan.predicted.samples_per_s = 4 / (4 * busiest * 1.05)  # beats any split's busiest work by 5%: not enough
    assert not _busiest_config(sr, cfg, mb)
    assert sr.config_beaten(cfg, mb)
    sr.ramp = lambda mb, tail: [0.0] * (len(compute) + 1)  # the same decision without the ramp
    assert not sr.config_beaten(cfg, mb)
