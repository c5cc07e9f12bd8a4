"""Sharded data parallelism and mixed-precision recipes in the planner, against the published tables.

The expected numbers are the cited tables themselves (ZeRO paper table 1 and §3.1;
Megatron-LM's README "bytes per parameter" table), not re-derived from the code.
"""

from __future__ import annotations

import pytest

from pipeplan.costmodels.comm import allreduce_time_s, group_link, half_ring_time_s
from pipeplan.costmodels.grad_passes import dp_flatten_s
from pipeplan.costmodels.memory import gathered_bytes, model_state_bytes
from pipeplan.errors import InfeasibleError, UserError
from pipeplan.hardware_profiles.profile import Link
from pipeplan.planner.configs import Config, sharding_levels
from pipeplan.planner.predict import evaluate
from pipeplan.planner.replay import simulate_from_plan
from pipeplan.planner.request import PlanRequest
from pipeplan.planner.search import search
from search_fixtures import GIB, gpt_like, profile


@pytest.mark.parametrize("sharding,per_gpu_gb", [("none", 120.0), ("zero1", 31.4), ("zero2", 16.6), ("zero3", 1.9)])
def test_zero_paper_table(sharding, per_gpu_gb):
    """ZeRO table 1 / figure 1: Ψ = 7.5B, N_d = 64, mixed-precision Adam (K = 12)."""
    psi = 7_500_000_000
    got = model_state_bytes(4 * psi, optimizer="adam", dtype="fp16", mixed_precision="deepspeed", sharding=sharding,
                           shards=64).total_bytes
    assert got / 1e9 == pytest.approx(per_gpu_gb, abs=0.05)


@pytest.mark.parametrize("dtype,plain,fixed,sharded", [("fp16", 20, 4, 16), ("bf16", 18, 6, 12), ("fp32", 16, 8, 8)])
@pytest.mark.parametrize("d", [2, 8, 64])
def test_megatron_bytes_per_parameter_table(dtype, plain, fixed, sharded, d):
    """Megatron-LM README: non-distributed 20/18/16 bytes; distributed optimizer 4+16/d, 6+12/d, 8+8/d."""
    psi = 1024 * 1024 * d  # divisible by every d: the table's numbers exactly
    kw = dict(optimizer="adam", dtype=dtype, mixed_precision="megatron")
    assert model_state_bytes(4 * psi, **kw).total_bytes == plain * psi
    assert model_state_bytes(4 * psi, **kw, sharding="zero1", shards=d).total_bytes == fixed * psi + sharded * psi // d


def test_deepspeed_recipe_is_the_zero_paper_and_sharding_only_divides():
    psi = 3 * 2**20
    for level, fixed, sharded in (("zero1", 4, 12), ("zero2", 2, 14), ("zero3", 0, 16)):
        got = model_state_bytes(4 * psi, optimizer="adamw", dtype="bf16", mixed_precision="deepspeed", sharding=level,
                                shards=3)
        assert got.total_bytes == fixed * psi + sharded * psi // 3
    for mp in ("deepspeed", "megatron", "autocast"):
        one = model_state_bytes(4 * psi, optimizer="adam", dtype="bf16", mixed_precision=mp, sharding="zero3", shards=1)
        assert one == model_state_bytes(4 * psi, optimizer="adam", dtype="bf16", mixed_precision=mp)


def test_gathered_layers_are_zero3s_two_weights_and_a_gradient():
    layer = 4 * 10**6  # 1M parameters
    kw = dict(optimizer="adam", dtype="bf16", mixed_precision="deepspeed")
    assert gathered_bytes(layer, **kw, sharding="zero1") == 0
    assert gathered_bytes(layer, **kw, sharding="zero2") == 2 * 10**6
    assert gathered_bytes(layer, **kw, sharding="zero3") == 6 * 10**6
    assert gathered_bytes(layer, optimizer="adam", dtype="bf16", mixed_precision="megatron", sharding="zero3") == 8 * 10**6


def _plan(sharding, *, d=4, mp="deepspeed", dtype="bf16"):
    g = gpt_like(blocks=8, hidden=1024, seq=512, vocab=32000, batch=4)
    assignment = [0] * 5 + [1] * 5
    return g, evaluate(g, profile(80), assignment, schedule="1f1b", microbatches=8, batch_size=8 * 4 * d,
                       data_parallel=d, dtype=dtype, sharding=sharding, mixed_precision=mp)


@pytest.mark.parametrize("mp", ["deepspeed", "megatron"])
@pytest.mark.parametrize("sharding", ["none", "zero1", "zero2", "zero3"])
def test_device_memory_of_a_stated_plan_equals_the_formula(sharding, mp):
    """2 stages x 4 replicas, bf16: each device's weights + gradients + optimizer state are the table's bytes per
    parameter for its own parameters; ZeRO-2/3 add their largest layer's full gradient (and two weights)."""
    g, plan = _plan(sharding, mp=mp)
    per_param = {"deepspeed": (2, 2, 12), "megatron": (2, 4, 12)}[mp]  # weights, grads, master + Adam
    level = ["none", "zero1", "zero2", "zero3"].index(sharding)
    for st in plan.stages:
        layers = [next(lyr for lyr in g.layers if lyr.name == n) for n in st.layers]
        psi = sum(lyr.param_bytes for lyr in layers) // 4
        w, gr, o = per_param
        want_w = w * psi // (4 if level >= 3 else 1)
        want_g = gr * psi // (4 if level >= 2 else 1)
        want_o = o * psi // (4 if level >= 1 else 1)
        assert st.predicted.weights_bytes == want_w
        assert st.predicted.grad_bytes == want_g
        assert st.predicted.optimizer_bytes == want_g + want_o
        big = max(lyr.param_bytes for lyr in layers) // 4
        assert st.predicted.gathered_bytes == {0: 0, 1: 0, 2: gr * big, 3: gr * big + 2 * w * big}[level]


def test_collectives_where_the_frameworks_put_them():
    """Unsharded: one all-reduce of the gradients; ZeRO-1: reduce-scatter + all-gather at the end (the same
    time for equal dtypes); ZeRO-2: reduce-scatter every backward; ZeRO-3: all-gathers every forward and backward."""
    prof = profile(80)
    g, none = _plan("none")
    _, z1 = _plan("zero1")
    _, z2 = _plan("zero2")
    _, z3 = _plan("zero3")
    for a, b1, b2, b3 in zip(none.stages, z1.stages, z2.stages, z3.stages, strict=True):
        grad, weights = a.predicted.grad_bytes, a.predicted.weights_bytes
        link = group_link(prof, a.devices)
        # unsharded, the runtime also copies the gradients into one buffer and back around the all-reduce
        tensors = len({p for layer in g.layers if layer.name in a.layers for p in layer.params})
        flatten = dp_flatten_s(grad, profile=prof, tensors=tensors)
        assert a.predicted.allreduce_s == pytest.approx(allreduce_time_s(grad, 4, link) + flatten)
        assert b1.predicted.allreduce_s == pytest.approx(half_ring_time_s(grad, 4, link) + half_ring_time_s(weights, 4, link))
        assert b1.predicted.allreduce_s == pytest.approx(a.predicted.allreduce_s - flatten)  # 2 B grads and weights
        assert (b2.predicted.bwd_comm_s, b2.predicted.allreduce_s) == pytest.approx(
            (half_ring_time_s(grad, 4, link), half_ring_time_s(weights, 4, link)))
        assert (b3.predicted.fwd_comm_s, b3.predicted.allreduce_s) == pytest.approx((half_ring_time_s(weights, 4, link), 0))
        assert b3.predicted.bwd_comm_s == pytest.approx(2 * half_ring_time_s(grad, 4, link))
    # (ZeRO-3's timing, its collectives beside compute that they slow: test_collectives_beside_compute_on_gpus...)
    # the plan file alone replays the same timeline (per-microbatch collectives stored per stage)
    for plan in (none, z1, z2, z3):
        assert simulate_from_plan(plan).iteration_s == pytest.approx(plan.predicted.iteration_s)


def test_megatron_zero1_moves_fp32_gradients_and_bf16_weights():
    """Megatron's distributed optimizer reduce-scatters fp32 gradients and all-gathers bf16 parameters:
    6 bytes a parameter against the unsharded fp32 all-reduce's 8."""
    prof = profile(80)
    _, none = _plan("none", mp="megatron")
    _, z1 = _plan("zero1", mp="megatron")
    st = z1.stages[0]
    assert st.predicted.grad_bytes == 2 * st.predicted.weights_bytes
    link = group_link(prof, st.devices)
    assert st.predicted.allreduce_s == pytest.approx(
        half_ring_time_s(st.predicted.grad_bytes, 4, link) + half_ring_time_s(st.predicted.weights_bytes, 4, link))
    assert z1.stages[0].predicted.allreduce_s < none.stages[0].predicted.allreduce_s


def _tight():
    """A 1.3B-parameter GPT on 8 devices of 10 GiB: unsharded Adam state (16 B/param under the `deepspeed` recipe,
    10.5 GB a stage) cannot fit on 2 stages."""
    return gpt_like(blocks=24, hidden=2048, seq=1024, vocab=50257, batch=1), profile(10)


def test_auto_shards_wherever_there_are_replicas_and_keeps_the_fastest_level_that_fits():
    g, prof = _tight()
    auto = search(g, prof, PlanRequest(devices=8, batch_size=64, stages=2, data_parallel=4, microbatches=16,
                                       dtype="bf16", schedule="1f1b", recompute="on", mixed_precision="deepspeed")).best
    pinned = {lv: _best(g, prof, lv) for lv in ("none", "zero1", "zero2", "zero3")}
    assert pinned["none"] is None  # the case needs sharding
    fastest = max((p for p in pinned.values() if p), key=lambda p: p.predicted.samples_per_s)
    assert auto.sharding == fastest.sharding
    assert auto.predicted.samples_per_s == pytest.approx(fastest.predicted.samples_per_s)
    one = search(g, prof, PlanRequest(devices=8, batch_size=64, stages=8, data_parallel=1, dtype="bf16",
                                      mixed_precision="deepspeed")).best
    assert one.sharding == "none"  # nothing to shard over without replicas


def _best(g, prof, level):
    try:
        return search(g, prof, PlanRequest(devices=8, batch_size=64, stages=2, data_parallel=4, microbatches=16,
                                           dtype="bf16", schedule="1f1b", recompute="on", sharding=level,
                                           mixed_precision="deepspeed")).best
    except InfeasibleError:
        return None


def test_sharding_lets_a_model_fit_that_does_not_without():
    g, prof = _tight()
    req = dict(devices=8, batch_size=64, stages=2, data_parallel=4, microbatches=16, dtype="bf16", schedule="1f1b",
               recompute="on")
    with pytest.raises(InfeasibleError, match="nothing fits"):
        search(g, prof, PlanRequest(**req, sharding="none"))
    best = search(g, prof, PlanRequest(**req)).best
    assert best.sharding != "none" and best.predicted.fits
    assert best.predicted.peak_memory_bytes <= 10 * GIB


def test_pipedream_is_never_sharded_and_pinning_it_is_refused():
    with pytest.raises(UserError, match="--sharding zero1 needs a schedule that flushes"):
        PlanRequest(devices=4, batch_size=8, schedule="pipedream", sharding="zero1")
    auto = PlanRequest(devices=4, batch_size=8, schedule="all")
    assert sharding_levels(auto, "pipedream", 4) == ("none",)
    assert sharding_levels(auto, "1f1b", 4) == ("zero1", "zero2", "zero3")
    assert sharding_levels(auto, "1f1b", 1) == ("none",)
    cfg = Config(schedule="1f1b", stages=2, data_parallel=2, microbatches=4, sharding="zero2")
    assert "ZeRO-2" in cfg.describe()


@pytest.mark.parametrize("r", [1, 2, 8, 64])
def test_reduce_scatter_and_all_gather_time_is_half_a_ring_all_reduce(r):
    """nccl-tests PERFORMANCE.md: bus bandwidth factor (n-1)/n; r-1 latency hops."""
    link = profile().inter_node
    n = 3e9
    want = 0.0 if r == 1 else (r - 1) / r * n / link.bandwidth_bytes_per_s + (r - 1) * link.latency_s
    assert half_ring_time_s(n, r, link) == pytest.approx(want, rel=1e-12)
    assert allreduce_time_s(n, r, link) == pytest.approx(2 * want, rel=1e-12)


@pytest.mark.parametrize("local", [False, True])
def test_collectives_beside_compute_on_gpus_and_in_series_in_the_local_runtime(local):
    """One stage x 2 replicas, ZeRO-3, M = 4: on a GPU profile every op takes max(compute, collective)
    (FSDP/DeepSpeed overlap them); on a local profile, whose plans run on runtime/sharding.py (gather,
    compute and reduce-scatter in series on one thread), it takes the sum. One stage has no bubble, so the
    iteration is M x (forward op + backward op) + the optimizer step, from the plan's own stage numbers;
    and `show`/`run` replay the same from the plan file."""
    from dataclasses import replace

    g = gpt_like(blocks=2, hidden=256, seq=128, vocab=1000, batch=2)
    prof = replace(profile(80), device="NVIDIA Test GPU", mem_bw_bytes_per_s=1e15,
                   intra_node=Link("slow", 1e8, 1e-4))  # comm > compute
    prof = replace(prof, local=True) if local else prof
    plan = evaluate(g, prof, [0] * len(g.layers), schedule="1f1b", microbatches=4, batch_size=16, data_parallel=2,
                    dtype="fp32", sharding="zero3")
    (st,) = plan.stages
    x = st.predicted
    assert x.fwd_comm_s > 0 and x.bwd_comm_s > 0 and x.allreduce_s == 0
    op = (lambda c, m: c + m) if local else (lambda c, m: max(c + 0.189 * min(c, m), m))
    expected = 4 * (op(x.fwd_s, x.fwd_comm_s) + op(x.bwd_s, x.bwd_comm_s) + 2 * x.op_overhead_s) + x.optimizer_s
    assert plan.collectives_overlap is not local
    assert plan.predicted.iteration_s == pytest.approx(expected, rel=1e-9)
    assert simulate_from_plan(plan).iteration_s == pytest.approx(plan.predicted.iteration_s, rel=1e-9)


def test_compute_beside_a_collective_runs_slower_for_as_long_as_they_overlap():
    """GPU frameworks overlap ZeRO's collectives with compute, which then runs 18.9% slower while they overlap
    (Lee et al. 2025): comm shorter than compute adds 18.9% of the comm; longer, the op is the comm (unless the
    slowed compute outlasts it); the local runtime runs them in series."""
    from dataclasses import replace

    from pipeplan.hardware_profiles import load_profile
    from pipeplan.planner.predict_inputs import op_times, overlap_slowdown

    got = op_times([10.0, 10.0, 10.0, 4.0], [2.0, 9.0, 30.0, 0.0], [1.0, 1.0, 1.0, 1.0], overlap=True, slowdown=0.189)
    assert got == pytest.approx([10 + 0.189 * 2 + 1, 10 + 0.189 * 9 + 1, 30 + 1, 4 + 1])
    assert op_times([10.0], [2.0], [1.0], overlap=False, slowdown=0.189) == pytest.approx([13.0])
    # the measured figure is a GPU's: none on TPUs (no source) or on a local profile (nothing overlaps there)
    assert [overlap_slowdown(load_profile(p)) for p in ("h100-sxm", "mi300x", "tpu-v5p")] == [0.189, 0.189, 0.0]
    assert overlap_slowdown(replace(load_profile("h100-sxm"), local=True)) == 0.0


def test_auto_on_a_local_profile_also_tries_unsharded_and_keeps_the_fastest():
    """A local profile's plans run on the bundled runtime, where ZeRO's collectives run in series on gloo:
    "auto" tries unsharded too and keeps the fastest of the four levels, each searched pinned."""
    from dataclasses import replace

    g = gpt_like(blocks=4, hidden=512, seq=256, vocab=8000, batch=2)
    gloo = {"allreduce": Link("gloo allreduce", 1.88e9, 72e-6), "reduce_scatter": Link("gloo rs", 0.56e9, 156e-6),
            "all_gather": Link("gloo ag", 0.92e9, 94e-6)}  # as `profiles calibrate` fitted them on this machine
    prof = replace(profile(80), local=True, intra_node=Link("loopback", 2e9, 5e-5), collectives=gloo)
    req = dict(devices=2, batch_size=16, stages=1, data_parallel=2, microbatches=2, dtype="fp32", schedule="1f1b")
    pinned = {lv: search(g, prof, PlanRequest(**req, sharding=lv)).best for lv in ("none", "zero1", "zero2", "zero3")}
    auto = search(g, prof, PlanRequest(**req)).best
    fastest = max(pinned.values(), key=lambda p: p.predicted.samples_per_s)
    assert fastest.sharding == "none"  # serial collectives: sharding only adds time here
    assert auto.sharding == "none"
    assert auto.predicted.samples_per_s == pytest.approx(fastest.predicted.samples_per_s)
    gpu = search(g, profile(80), PlanRequest(**req)).best
    assert gpu.sharding != "none"  # on a GPU profile ZeRO-1 moves no more than the all-reduce (ZeRO §7.2.1)
