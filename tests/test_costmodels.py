"""Cost models against hand-computed values and published formulas.

Oracles: ZeRO §3.1 and the Megatron-LM README (bytes per parameter), Megatron-LM
§2.2 and Korthikanti et al. 2022 (in-flight microbatches, activation memory),
the ring all-reduce volume (checked by actually running a ring on numpy arrays),
the roofline's two regimes, and the reference doc's test vectors.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from pipeplan.costmodels import analytic, comm, compute, memory
from pipeplan.costmodels.graph import Graph, Layer
from pipeplan.errors import UserError
from pipeplan.hardware_profiles.profile import HardwareProfile, Link

NVLINK = Link("nvlink", 100e9, 2e-6)
IB = Link("infiniband", 25e9, 5e-6)


def make_profile(**kw) -> HardwareProfile:
    base = dict(
        name="test-gpu", device="Test GPU", memory_bytes=80 << 30, usable_memory_bytes=79 << 30,
        mem_bw_bytes_per_s=2e12, peak_flops={"fp32": 20e12, "tf32": 150e12, "bf16": 300e12, "fp16": 300e12},
        devices_per_node=4, intra_node=NVLINK, inter_node=IB,
    )
    base.update(kw)
    return HardwareProfile(**base)


# ---------------------------------------------------------------- communication
def test_p2p_is_latency_plus_bytes_over_bandwidth():
    assert comm.p2p_time_s(1e9, NVLINK) == pytest.approx(2e-6 + 1e9 / 100e9, rel=1e-12)
    assert comm.p2p_time_s(4096, IB) == pytest.approx(5e-6 + 4096 / 25e9, rel=1e-12)
    assert comm.p2p_time_s(0, IB) == 0.0  # nothing to send: no message, no latency


def test_send_uses_the_right_level_of_the_hierarchy():
    p = make_profile()
    same_node = comm.send_time_between_s(1e8, p, 2, 3)  # ranks 0-3 are node 0
    across = comm.send_time_between_s(1e8, p, 3, 4)
    assert same_node == pytest.approx(2e-6 + 1e8 / 100e9)
    assert across == pytest.approx(5e-6 + 1e8 / 25e9)
    assert comm.group_link(p, [0, 1, 2, 3]) is NVLINK
    assert comm.group_link(p, [0, 4]) is IB


@pytest.mark.parametrize("r", [2, 3, 4, 8])
def test_ring_allreduce_formula(r):
    n, bw, lat = 1e9, 50e9, 1e-5
    link = Link("x", bw, lat)
    expected = 2 * (r - 1) / r * n / bw + 2 * (r - 1) * lat
    assert comm.allreduce_time_s(n, r, link) == pytest.approx(expected, rel=1e-12)
    assert comm.allreduce_time_s(n, 1, link) == 0.0


def _run_ring_allreduce(data: list[np.ndarray]) -> tuple[list[np.ndarray], list[int], int]:
    """A real ring all-reduce (reduce-scatter + all-gather) counting what each device sends."""
    r = len(data)
    bufs = [d.astype(np.float64).copy() for d in data]
    chunks = [np.array_split(np.arange(len(bufs[0])), r) for _ in range(r)][0]
    sent = [0] * r
    steps = 0
    for phase in ("reduce_scatter", "all_gather"):
        for step in range(r - 1):
            msgs = []
            for dev in range(r):
                c = (dev - step + (1 if phase == "all_gather" else 0)) % r
                msgs.append((dev, (dev + 1) % r, c, bufs[dev][chunks[c]].copy()))
            for src, dst, c, payload in msgs:
                sent[src] += payload.nbytes
                if phase == "reduce_scatter":
                    bufs[dst][chunks[c]] += payload
                else:
                    bufs[dst][chunks[c]] = payload
            steps += 1
    return bufs, sent, steps


@pytest.mark.parametrize("r", [2, 4, 5])
def test_ring_allreduce_volume_matches_a_real_ring(r):
    rng = np.random.default_rng(0)
    n = 1000
    data = [rng.standard_normal(n) for _ in range(r)]
    out, sent, steps = _run_ring_allreduce(data)
    total = np.sum(data, axis=0)
    for b in out:
        np.testing.assert_allclose(b, total, rtol=1e-12)
    nbytes = n * 8
    bw = 1e9
    link = Link("x", bw, 0.0)
    # every device sends 2(r-1)/r of the buffer, all links busy at once
    assert max(sent) == pytest.approx(2 * (r - 1) / r * nbytes, rel=0.01)
    assert steps == 2 * (r - 1)
    assert comm.allreduce_time_s(nbytes, r, link) == pytest.approx(max(sent) / bw, rel=0.01)


# ---------------------------------------------------------------- model state
def test_zero_16_bytes_per_parameter_for_mixed_precision_adam():
    psi = 1_000_000
    for dtype in ("bf16", "fp16"):
        s = memory.model_state_bytes(4 * psi, optimizer="adam", dtype=dtype, mixed_precision="deepspeed")
        assert (s.weights_bytes, s.grad_bytes, s.optimizer_bytes) == (2 * psi, 2 * psi, 12 * psi)
        assert s.total_bytes == 16 * psi
    # ZeRO §3.1: GPT-2 1.5B needs at least 24 GB of model state
    assert memory.model_state_bytes(4 * 1_500_000_000, optimizer="adam", dtype="fp16",
                                    mixed_precision="deepspeed").total_bytes == 24 * 10**9
    # ZeRO table: Psi = 7.5B baseline 120 GB
    assert memory.model_state_bytes(4 * 7_500_000_000, optimizer="adamw", dtype="bf16",
                                    mixed_precision="deepspeed").total_bytes == 120 * 10**9


def test_megatron_table_fp32_params_fp32_grads_is_16():
    psi = 12345
    for dtype in ("fp32", "tf32"):
        s = memory.model_state_bytes(4 * psi, optimizer="adam", dtype=dtype)
        assert (s.weights_bytes, s.grad_bytes, s.optimizer_bytes, s.total_bytes) == (4 * psi, 4 * psi, 8 * psi, 16 * psi)


@pytest.mark.parametrize("optimizer,fp32_per_param,mixed_per_param", [
    ("sgd", 8, 8),         # 4+4 ; 2+2+4 (master)
    ("momentum", 12, 12),  # 4+4+4 ; 2+2+4+4
    ("adam", 16, 16),
    ("adamw", 16, 16),
])
def test_bytes_per_parameter_by_optimizer(optimizer, fp32_per_param, mixed_per_param):
    psi = 1000
    assert memory.model_state_bytes(4 * psi, optimizer=optimizer, dtype="fp32").total_bytes == fp32_per_param * psi
    assert memory.model_state_bytes(4 * psi, optimizer=optimizer, dtype="bf16",
                                    mixed_precision="deepspeed").total_bytes == mixed_per_param * psi
    # the default recipe, autocast (`pipeplan run`): fp32's state plus a 16-bit copy of the weights
    assert memory.model_state_bytes(4 * psi, optimizer=optimizer, dtype="bf16").total_bytes == (fp32_per_param + 2) * psi


def test_bad_names_are_user_errors():
    with pytest.raises(UserError, match="optimizer"):
        memory.model_state_bytes(4, optimizer="lamb", dtype="fp32")
    with pytest.raises(UserError, match="dtype"):
        memory.model_state_bytes(4, optimizer="adam", dtype="fp8")
    with pytest.raises(UserError, match="schedule"):
        memory.inflight_microbatches("chimera", 4, 0, 8)


# ---------------------------------------------------------------- in-flight microbatches
@pytest.mark.parametrize("K,M", [(4, 8), (8, 32), (4, 2), (1, 5), (6, 6)])
def test_inflight_counts(K, M):
    gpipe = [memory.inflight_microbatches("gpipe", K, s, M) for s in range(K)]
    assert gpipe == [M] * K
    ofob = [memory.inflight_microbatches("1f1b", K, s, M) for s in range(K)]
    assert ofob == [min(K - s, M) for s in range(K)]
    assert ofob[-1] == 1
    if M >= K:
        assert ofob[0] == K  # Megatron §2.2.1: "p or fewer microbatches"
    # async PipeDream: same steady state, but no flush, so M never caps it
    assert [memory.inflight_microbatches("pipedream", K, s, M) for s in range(K)] == [K - s for s in range(K)]


def _one_f_one_b_order(K: int, s: int, M: int) -> list[str]:
    """PipeDream-Flush op order of stage s (Megatron schedules.py structure)."""
    warm = min(K - s - 1, M)
    order = ["F"] * warm
    for _ in range(M - warm):
        order += ["F", "B"]
    order += ["B"] * warm
    return order


@pytest.mark.parametrize("K,M", [(4, 8), (8, 3), (5, 5)])
def test_inflight_equals_peak_of_the_op_order(K, M):
    for s in range(K):
        live = peak = 0
        for op in _one_f_one_b_order(K, s, M):
            live += 1 if op == "F" else -1
            peak = max(peak, live)
        assert memory.inflight_microbatches("1f1b", K, s, M) == peak


@pytest.mark.parametrize("p,v,m", [(4, 2, 16), (8, 4, 64), (4, 3, 8)])
def test_interleaved_first_device_matches_korthikanti_factor(p, v, m):
    """Korthikanti §4.2.3: first stage holds p microbatches x (1 + (p-1)/(p v)) of its layers."""
    chunk_mbs = memory.inflight_microbatches("interleaved", p, 0, m, chunks=v)
    assert chunk_mbs / v == pytest.approx(p * memory.interleaved_activation_factor(p, v))
    assert chunk_mbs / v == pytest.approx(p + (p - 1) / v)
    # later devices hold fewer, the last still more than one chunk-microbatch per chunk
    counts = [memory.inflight_microbatches("interleaved", p, d, m, chunks=v) for d in range(p)]
    assert counts == sorted(counts, reverse=True)
    assert counts[-1] == (v - 1) * p + 1


def test_interleaved_with_m_equal_p_keeps_torchs_warm_up():
    """torch's ScheduleInterleaved1F1B warms device d up with 2(p-d-1) + (v-1)p forwards even when M == p (Megatron
    would run all M*v first): device 2 of 4 holds 6 + 1, device 0 all 8."""
    assert memory.inflight_microbatches("interleaved", 4, 2, 4, chunks=2) == 7
    assert memory.inflight_microbatches("interleaved", 4, 0, 4, chunks=2) == 8


# ---------------------------------------------------------------- stage memory
def test_stage_memory_hand_computed():
    kw = dict(param_bytes=400, saved_bytes_per_mb=1000, input_bytes_per_mb=100, output_bytes_per_mb=50,
              stages=4, microbatches=8, optimizer="adam", dtype="fp32")
    m = memory.stage_memory(schedule="1f1b", stage=1, recompute=False, **kw)
    # buffers under pipeplan's 1F1B (pipeplan/lean_gpipe.py): the inputs of the 3 microbatches in flight and the
    # gradient its send list still holds (4 x 100), one gradient buffer (50), and the output of each microbatch in
    # flight, kept until its backward (3 x 50)
    assert (m.weights_bytes, m.optimizer_bytes, m.activation_bytes, m.buffer_bytes) == (400, 1200, 3000, 600)
    assert m.total_bytes == 5200
    z = memory.stage_memory(schedule="zb-h1", stage=1, recompute=False, **kw)
    # torch's own loops: a receive buffer per microbatch each way (8 x 100 in, 8 x 50 for the gradients), and the
    # kept outputs of the microbatches in flight (4 under ZB-H1 on every stage)
    assert z.buffer_bytes == 8 * 100 + 8 * 50 + z.inflight * 50
    r = memory.stage_memory(schedule="1f1b", stage=1, recompute=True, **kw)
    assert r.activation_bytes == 3 * 100 + 1000  # 3 in-flight inputs + one microbatch's activations
    g = memory.stage_memory(schedule="gpipe", stage=1, recompute=False, **kw)
    assert g.activation_bytes == 8000
    last = memory.stage_memory(schedule="1f1b", stage=3, recompute=False, **kw)
    # no gradient arrives at the last stage: its one input in flight and the gradient sent before it, and its one
    # microbatch's output kept
    assert last.buffer_bytes == 2 * 100 + 50 and last.activation_bytes == 1000
    pd0 = memory.stage_memory(schedule="pipedream", stage=0, recompute=False, **kw)
    # weight stashing: K versions on stage 0, each a copy beside the module's own weights (pipeplan's runtime)
    assert pd0.weight_versions == 5 and pd0.weights_bytes == 2000
    pd3 = memory.stage_memory(schedule="pipedream", stage=3, recompute=False, **kw)
    assert pd3.weights_bytes == 800


def test_stage_memory_interleaved_counts_chunks():
    m = memory.stage_memory(param_bytes=0, saved_bytes_per_mb=2000, input_bytes_per_mb=10, output_bytes_per_mb=10,
                            schedule="interleaved", stages=4, stage=0, microbatches=16, optimizer="sgd",
                            dtype="fp32", recompute=False, chunks=2)
    assert m.inflight == 11
    assert m.activation_bytes == 11 * 1000  # 11 chunk-microbatches of half the device's layers
    # device 0 runs virtual stages 0 and 4 of 8: the first's input is the microbatch (1), the other receives
    # one per microbatch (16); both receive gradients (2 x 16); 11 chunk-microbatches keep their outputs
    assert m.buffer_bytes == (1 + 16) * 10 + 32 * 10 + 11 * 10
    one = memory.stage_memory(param_bytes=0, saved_bytes_per_mb=2000, input_bytes_per_mb=10, output_bytes_per_mb=10,
                              schedule="interleaved", stages=4, stage=3, microbatches=16, optimizer="sgd",
                              dtype="fp32", recompute=False, chunks=1)
    # one chunk is plain 1F1B: the last device gets no gradient, receives 16 inputs and keeps one output
    assert (one.inflight, one.buffer_bytes) == (1, 16 * 10 + 10)


def test_recompute_never_costs_more_than_storing():
    m = memory.stage_memory(param_bytes=0, saved_bytes_per_mb=100, input_bytes_per_mb=90, output_bytes_per_mb=0,
                            schedule="gpipe", stages=2, stage=0, microbatches=4, optimizer="sgd", dtype="fp32",
                            recompute=True)
    assert m.activation_bytes == 400


def test_gpt3_activation_vectors_and_full_recompute_stage():
    """Korthikanti et al. 2022 Eq. (1) test vector and the 'full recompute: 2sbh per layer' row."""
    s, b, h, a = 2048, 1, 12288, 96
    per_layer = analytic.transformer_layer_activation_bytes(s, b, h, a)
    assert per_layer / 1e9 == pytest.approx(2.869, abs=0.001)
    # a 1F1B stage 0 with 12 such layers, p = 8: 8 microbatches in flight
    layers, p = 12, 8
    stored = memory.stage_memory(param_bytes=0, saved_bytes_per_mb=int(layers * per_layer), input_bytes_per_mb=2 * s * b * h,
                                 output_bytes_per_mb=2 * s * b * h, schedule="1f1b", stages=p, stage=0,
                                 microbatches=32, optimizer="sgd", dtype="bf16", recompute=False)
    assert stored.activation_bytes == pytest.approx(p * layers * per_layer, rel=1e-9)
    recomputed = memory.stage_memory(param_bytes=0, saved_bytes_per_mb=int(layers * per_layer),
                                     input_bytes_per_mb=2 * s * b * h, output_bytes_per_mb=2 * s * b * h,
                                     schedule="1f1b", stages=p, stage=0, microbatches=32, optimizer="sgd",
                                     dtype="bf16", recompute=True)
    assert recomputed.activation_bytes == pytest.approx(p * 2 * s * b * h + layers * per_layer, rel=1e-9)


def test_activation_scale():
    assert memory.activation_bytes_scale("fp32") == 1.0
    assert memory.activation_bytes_scale("tf32") == 1.0
    assert memory.activation_bytes_scale("bf16") == 0.5
    assert memory.activation_bytes_scale("fp16") == 0.5


# ---------------------------------------------------------------- roofline
def test_roofline_compute_bound_and_memory_bound():
    # intensity 1e6 FLOP/B >> ridge (1000): compute bound
    assert compute.roofline_time_s(1e12, 1e6, 1e12, 1e9, 1.0, 1.0) == pytest.approx(1.0)
    assert compute.roofline_time_s(1e12, 1e6, 1e12, 1e9, 0.5, 1.0) == pytest.approx(2.0)
    # intensity 1e-3 FLOP/B: memory bound, compute efficiency irrelevant
    assert compute.roofline_time_s(1e6, 1e9, 1e12, 1e9, 0.1, 1.0) == pytest.approx(1.0)
    assert compute.roofline_time_s(1e6, 1e9, 1e12, 1e9, 0.1, 0.8) == pytest.approx(1.25)
    # at the ridge point both limits agree
    assert compute.roofline_time_s(1e12, 1e9, 1e12, 1e9, 1.0, 1.0) == pytest.approx(1.0)
    assert compute.roofline_time_s(0, 0, 1e12, 1e9, 1.0) == 0.0
    with pytest.raises(ValueError):
        compute.roofline_time_s(1, 1, 1e12, 1e9, 0.0)


def _graph(layers, batch=8, device="cpu") -> Graph:
    return Graph(name="g", layers=layers, edges=[], batch_size=batch, source={"device": device})


def test_layer_times_hand_computed():
    p = make_profile()
    mm = Layer("fc", kind="matmul", fwd_flops=int(2e12), bwd_flops=int(4e12), param_bytes=int(4e8),
               bytes_moved=int(1e9), fwd_s=9.0, bwd_s=9.0)
    ew = Layer("act", kind="elementwise", fwd_flops=int(1e9), bwd_flops=int(1e9), bytes_moved=int(8e9))
    g = _graph([mm, ew])
    fwd, bwd = compute.layer_times_s(g, p, dtype="fp32")
    # matmul: compute bound on fp32 peak x 0.70
    assert fwd[0] == pytest.approx(2e12 / (20e12 * 0.70))
    assert bwd[0] == pytest.approx(4e12 / (20e12 * 0.70))
    # elementwise: memory bound at 0.80 of 2 TB/s; backward moves twice the bytes
    assert fwd[1] == pytest.approx(8e9 / (2e12 * 0.80))
    assert bwd[1] == pytest.approx(2 * 8e9 / (2e12 * 0.80))
    # bf16: the matmul uses the tensor peak; elementwise traffic halves but its compute stays on fp32 units
    fwd16, _ = compute.layer_times_s(g, p, dtype="bf16")
    assert fwd16[0] == pytest.approx(max(2e12 / (300e12 * 0.70), 0.5 * 1e9 / (2e12 * 0.8)))
    assert fwd16[1] == pytest.approx(4e9 / (2e12 * 0.80))
    assert compute.peak_flops_for_kind(p, "elementwise", "bf16") == 20e12
    # tf32 matmul
    assert compute.layer_times_s(g, p, dtype="tf32")[0][0] == pytest.approx(2e12 / (150e12 * 0.70))


def test_samples_scaling():
    p = make_profile()
    mm = Layer("fc", kind="matmul", fwd_flops=int(8e12), bwd_flops=int(16e12), param_bytes=int(1e6), bytes_moved=int(2e6))
    weights = Layer("w", kind="other", fwd_flops=0, bwd_flops=0, param_bytes=int(1e9), bytes_moved=int(1e9 + 8e6))
    g = _graph([mm, weights], batch=8)
    f8, _ = compute.layer_times_s(g, p)
    f2, _ = compute.layer_times_s(g, p, samples=2)
    assert f2[0] == pytest.approx(f8[0] / 4)  # compute-bound layer: linear in samples
    # weight traffic is paid once per pass whatever the batch
    assert f2[1] == pytest.approx((1e9 + 2e6) / (2e12 * 0.8))
    fm8, bm8 = compute.layer_times_s(_graph([Layer("x", fwd_s=0.8, bwd_s=1.6)]), p, times="measured")
    fm2, bm2 = compute.layer_times_s(_graph([Layer("x", fwd_s=0.8, bwd_s=1.6)]), p, times="measured", samples=2)
    assert (fm8[0], bm8[0]) == (0.8, 1.6)
    assert (fm2[0], bm2[0]) == pytest.approx((0.2, 0.4))


def test_profile_efficiency_overrides():
    p = make_profile(efficiency={"matmul": 0.5, "memory": 0.5})
    mm = Layer("fc", kind="matmul", fwd_flops=int(1e12), bwd_flops=0, bytes_moved=0)
    ew = Layer("e", kind="elementwise", bytes_moved=int(1e9))
    fwd, _ = compute.layer_times_s(_graph([mm, ew]), p)
    assert fwd[0] == pytest.approx(1e12 / (20e12 * 0.5))
    assert fwd[1] == pytest.approx(1e9 / (2e12 * 0.5))
    assert compute.efficiency_for(p, "conv") == (compute.DEFAULT_EFFICIENCY["conv"], 0.5)


def test_local_profile_uses_measured_times_only_when_traced_here():
    local = make_profile(local=True)
    layer = Layer("fc", kind="matmul", fwd_flops=int(1e9), bwd_flops=int(2e9), bytes_moved=10, fwd_s=0.3, bwd_s=0.6)
    here = _graph([layer], device="cpu")
    assert compute.layer_times_s(here, local) == ([0.3], [0.6])
    assert compute.layer_times_s(here, local, samples=4) == ([0.15], [0.3])
    roof = compute.layer_times_s(here, local, times="roofline")
    assert roof[0][0] == pytest.approx(1e9 / 20e12)  # local: calibrated peaks are achieved rates, efficiency 1
    assert compute.layer_times_s(here, local, dtype="bf16")[0][0] == pytest.approx(1e9 / 300e12)
    elsewhere = _graph([layer], device="cuda:0")
    assert compute.layer_times_s(elsewhere, local)[0][0] == pytest.approx(1e9 / 20e12)
    # a graph timed with 2 threads is not one 1-thread local device's times
    two = Graph(name="g", layers=[layer], edges=[], batch_size=8, source={"device": "cpu", "threads": 2})
    assert compute.layer_times_s(two, local)[0][0] == pytest.approx(1e9 / 20e12)
    one = Graph(name="g", layers=[layer], edges=[], batch_size=8, source={"device": "cpu", "threads": 1})
    assert compute.layer_times_s(one, local) == ([0.3], [0.6])
    remote = make_profile()  # a catalogue-like profile never takes the measurements
    assert compute.layer_times_s(here, remote)[0][0] == pytest.approx(1e9 / (20e12 * 0.7))


def test_local_times_note_says_which_trace_a_device_needs():
    local = make_profile(local=True)  # calibration: None -> a device is one thread
    layer = Layer("fc", kind="matmul", fwd_flops=int(1e9), bwd_flops=int(2e9), bytes_moved=10, fwd_s=0.3, bwd_s=0.6)

    def graph(threads):
        return Graph(name="g", layers=[layer], edges=[], batch_size=8, source={"device": "cpu", "threads": threads})

    def note(g, profile=local, samples=8, dtype="fp32", times="model"):
        return compute.local_times_note(g, profile, dtype=dtype, times=times, samples=samples)

    assert note(graph(1)) is None  # one thread, traced at the microbatch size: the device's own times
    scaled = note(graph(1), samples=32)
    assert scaled.startswith(compute.LOCAL_TIMES_NOTE_PREFIX + " measured times scaled from the traced batch 8 to the microbatch 32")
    assert "OMP_NUM_THREADS=1 with --trace-batch-size 32" in scaled
    roof = note(graph(2))
    assert roof.startswith(compute.LOCAL_TIMES_NOTE_PREFIX + " the roofline's") and "ran on 2 threads" in roof
    assert "--trace-batch-size 8" in roof
    # nothing to say where measured times were never meant to apply
    assert note(graph(2), profile=make_profile()) is None
    assert note(graph(2), times="roofline") is None and note(graph(2), dtype="bf16") is None
    assert note(_graph([layer], device="cuda:0")) is None


def test_layer_times_rejects_bad_modes():
    g = _graph([Layer("x")])
    with pytest.raises(UserError, match="times"):
        compute.layer_times_s(g, make_profile(), times="fast")
    with pytest.raises(UserError, match="dtype"):
        compute.layer_times_s(g, make_profile(), dtype="int8")


# ---------------------------------------------------------------- closed forms (reference doc §3.5)
@pytest.mark.parametrize("K,M,gpipe,megatron,interleaved", [
    (4, 4, 0.4286, 0.75, 0.375),
    (4, 16, 0.1579, 0.1875, 0.09375),
    (8, 32, 0.1795, 0.21875, 0.109375),
    (8, 64, 0.0986, 0.109375, 0.0546875),
])
def test_bubble_table(K, M, gpipe, megatron, interleaved):
    assert analytic.gpipe_bubble_fraction(K, M) == pytest.approx(gpipe, abs=5e-5)
    assert analytic.megatron_bubble_ratio(K, M) == pytest.approx(megatron)
    assert analytic.megatron_bubble_ratio(K, M, chunks=2) == pytest.approx(interleaved)
    # the two definitions describe the same schedule: bubble / total == ratio / (1 + ratio)
    r = analytic.megatron_bubble_ratio(K, M)
    assert analytic.gpipe_bubble_fraction(K, M) == pytest.approx(r / (1 + r))
    t = analytic.pipeline_iteration_s(1.0, K, M)
    assert (t - M) / t == pytest.approx(analytic.gpipe_bubble_fraction(K, M))


def test_gpt3_flops_and_params_vectors():
    l, h, s, V = 96, 12288, 2048, 51200
    assert analytic.transformer_params(l, h, V, s) / 1e9 == pytest.approx(174.6, abs=0.1)
    assert analytic.transformer_training_flops(1536, s, l, h, V) == pytest.approx(4.511e18, rel=1e-3)
    # per layer forward x 4 passes (recompute) + logits 6BshV = Eq. (3)
    B = 3
    total = 4 * l * analytic.transformer_layer_fwd_flops(B, s, h) + 6 * B * s * h * V
    assert analytic.transformer_training_flops(B, s, l, h, V) == pytest.approx(total, rel=1e-12)


def test_resnet_conv1_flops_vector():
    assert analytic.conv2d_fwd_flops(1, 3, 64, 112, 112, 7, 7) == pytest.approx(236.0e6, rel=1e-3)


def test_catalogue_a100_gemm_roofline():
    """A big fp32 GEMM on a catalogue A100 is compute bound at 0.70 of 19.5 TFLOP/s."""
    from pipeplan.hardware_profiles import load_profile
    p = load_profile("a100-80gb-sxm")
    n = 8192
    layer = Layer("gemm", kind="matmul", fwd_flops=2 * n**3, bwd_flops=4 * n**3, param_bytes=4 * n * n,
                  bytes_moved=3 * 4 * n * n)
    fwd, bwd = compute.layer_times_s(_graph([layer], batch=n, device="cuda"), p)
    eff = p.efficiency.get("matmul", 0.70)
    assert fwd[0] == pytest.approx(2 * n**3 / (p.flops_for("fp32") * eff))
    assert bwd[0] == pytest.approx(2 * fwd[0])
    assert math.isclose(p.flops_for("fp32"), 19.5e12, rel_tol=0.01)


# ---------------------------------------------------------------- properties
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

_sizes = st.integers(min_value=0, max_value=10**10)


@settings(max_examples=150, deadline=None)
@given(K=st.integers(1, 16), M=st.integers(1, 64), saved=_sizes, inp=_sizes, out=_sizes, params=_sizes,
       schedule=st.sampled_from(["gpipe", "1f1b", "pipedream"]), dtype=st.sampled_from(["fp32", "bf16"]),
       optimizer=st.sampled_from(memory.OPTIMIZERS), data=st.data())
def test_stage_memory_properties(K, M, saved, inp, out, params, schedule, dtype, optimizer, data):
    s = data.draw(st.integers(0, K - 1))
    kw = dict(param_bytes=params, saved_bytes_per_mb=saved, input_bytes_per_mb=inp, output_bytes_per_mb=out,
              schedule=schedule, stages=K, microbatches=M, optimizer=optimizer, dtype=dtype)
    m = memory.stage_memory(stage=s, recompute=False, **kw)
    r = memory.stage_memory(stage=s, recompute=True, **kw)
    assert m.total_bytes == m.weights_bytes + m.optimizer_bytes + m.activation_bytes + m.buffer_bytes
    assert r.activation_bytes <= m.activation_bytes  # recomputation never costs memory
    assert r.activation_bytes >= min(saved, m.activation_bytes)  # ...but one microbatch is always rebuilt
    # flushing schedules never hold more than M, and 1F1B never more than GPipe; async PipeDream holds K - s
    g = memory.stage_memory(stage=s, recompute=False, **{**kw, "schedule": "gpipe"})
    if schedule == "pipedream":
        assert m.inflight == K - s and m.weight_versions == K - s + 1
    else:
        assert 1 <= m.inflight <= M
        assert m.activation_bytes <= g.activation_bytes
    # earlier stages hold at least as much as later ones (same byte counts)
    if s + 1 < K:
        later = memory.stage_memory(stage=s + 1, recompute=False, **kw)
        assert later.activation_bytes <= m.activation_bytes
    # DeepSpeed's mixed precision: the same 16 bytes/param for adam, never more model state than fp32
    st32 = memory.model_state_bytes(params, optimizer=optimizer, dtype="fp32").total_bytes
    assert memory.model_state_bytes(params, optimizer=optimizer, dtype=dtype,
                                    mixed_precision="deepspeed").total_bytes <= st32 + 2


@settings(max_examples=150, deadline=None)
@given(p=st.integers(2, 12), v=st.integers(1, 6), groups=st.integers(2, 8), data=st.data())
def test_interleaved_inflight_properties(p, v, groups, data):
    m = p * groups  # Megatron requires m to be a multiple of p
    d = data.draw(st.integers(0, p - 1))
    n = memory.inflight_microbatches("interleaved", p, d, m, chunks=v)
    assert 1 <= n <= m * v
    if v == 1:  # one chunk per device is plain 1F1B
        assert n == memory.inflight_microbatches("1f1b", p, d, m)
    # per full-stage equivalent, interleaving never holds less than 1F1B on the same device
    assert n / v >= memory.inflight_microbatches("1f1b", p, d, m) - 1e-9


@settings(max_examples=200, deadline=None)
@given(f=st.floats(0, 1e15), b=st.floats(0, 1e12), peak=st.floats(1e9, 1e16), bw=st.floats(1e8, 1e13),
       ce=st.floats(0.05, 1.0), me=st.floats(0.05, 1.0))
def test_roofline_properties(f, b, peak, bw, ce, me):
    t = compute.roofline_time_s(f, b, peak, bw, ce, me)
    assert t >= f / peak and t >= b / bw  # never faster than peak
    assert t == pytest.approx(max(f / (peak * ce), b / (bw * me)))
    assert compute.roofline_time_s(2 * f, 2 * b, peak, bw, ce, me) == pytest.approx(2 * t)


@pytest.mark.parametrize("schedule,K,M,v", [
    ("gpipe", 4, 8, 1), ("1f1b", 4, 8, 1), ("1f1b", 4, 2, 1), ("1f1b", 6, 6, 1), ("pipedream", 3, 6, 1),
    ("interleaved", 4, 8, 2), ("interleaved", 4, 4, 2), ("interleaved", 3, 9, 3), ("interleaved", 2, 8, 4),
])
def test_inflight_agrees_with_the_event_simulator(schedule, K, M, v):
    """The closed form equals the peak the SEARCH helper's event-driven replay observes (1 byte per microbatch)."""
    from pipeplan.planner.simulate import simulate
    n = K * v
    r = simulate(schedule, [1.0] * n, [2.0] * n, [0.0] * (n - 1), M, chunks=v, static_bytes=[0] * K,
                 activation_bytes_per_mb=[1] * n)
    assert r.peak_memory_bytes == [memory.inflight_microbatches(schedule, K, d, M, v) for d in range(K)]


def test_times_only_graph_uses_its_measurements():
    """Imported PipeDream profiles carry times but no FLOPs/bytes: the roofline would say 0 s."""
    g = Graph(name="pd", layers=[Layer("a", fwd_s=0.01, bwd_s=0.02), Layer("b", fwd_s=0.03, bwd_s=0.05)], edges=[],
              batch_size=4, source={"device": "pipedream-profile"})
    for times in ("model", "roofline", "measured"):
        fwd, bwd = compute.layer_times_s(g, make_profile(), times=times, samples=2)
        assert fwd == pytest.approx([0.005, 0.015]) and bwd == pytest.approx([0.01, 0.025])
    # one layer with counts makes it a traced graph: roofline everywhere (a zero-count layer costs 0)
    g2 = Graph(name="t", layers=[Layer("a", fwd_s=0.01, bwd_s=0.02), Layer("b", kind="matmul", fwd_flops=int(1e12),
               fwd_s=0.03, bwd_s=0.05)], edges=[], batch_size=4, source={"device": "cuda"})
    fwd, _ = compute.layer_times_s(g2, make_profile())
    assert fwd == pytest.approx([0.0, 1e12 / (20e12 * 0.7)])


def test_real_pipedream_profile_gets_its_own_times():
    from pipeplan.costmodels.pipedream_import import load_pipedream_graph
    files = sorted((__import__("pathlib").Path(__file__).parent / "data" / "pipedream-profiles").glob("*graph.txt"))
    assert len(files) == 14
    g = load_pipedream_graph(files[0])
    fwd, bwd = compute.layer_times_s(g, make_profile())
    assert fwd == pytest.approx([l.fwd_s for l in g.layers]) and sum(fwd) > 0
    assert bwd == pytest.approx([l.bwd_s for l in g.layers])


def test_embedding_gathers_rows_forward_and_writes_a_dense_table_gradient_backward():
    p = make_profile(efficiency={"memory": 1.0})
    table, out, idx = 400_000_000, 8_000_000, 16_000
    emb = Layer("wte", kind="embedding", param_bytes=table, output_bytes=out, bytes_moved=table + out + idx)
    fwd, bwd = compute.layer_times_s(_graph([emb], batch=8), p, samples=4)
    gathered = (idx + 2 * out) / 2  # indices + rows read + output written, half the batch
    assert fwd[0] == pytest.approx(gathered / 2e12)
    assert bwd[0] == pytest.approx((table + 2 * gathered) / 2e12)


def test_tied_weights_are_read_by_every_user():
    from pipeplan.costmodels.graph import SharedParam

    p = make_profile(efficiency={"memory": 1.0})
    w = 1_000_000
    emb = Layer("wte", kind="embedding", param_bytes=w, output_bytes=100, bytes_moved=w + 100 + 10)
    head = Layer("lm_head", kind="matmul", param_bytes=0, output_bytes=5000, bytes_moved=w + 100 + 5000)
    g = Graph(name="g", layers=[emb, head], edges=[], batch_size=2, source={"device": "cuda"},
              shared_params=[SharedParam("wte.weight", w, ["wte", "lm_head"])])
    assert compute.used_param_bytes(g) == [w, w]
    fwd, _ = compute.layer_times_s(g, p, samples=1)
    assert fwd[1] == pytest.approx((w + 5100 / 2) / 2e12)  # the table is read whole, whatever the batch


def test_gpt3_layer_on_catalogue_a100_is_between_megatron_and_peak():
    """A GPT-3 layer (h=12288, s=2048, B=1) in bf16 on an A100: compute bound, and the predicted rate is
    at least what Megatron-LM achieved end to end (163 of 312 TFLOP/s, §5.1, all overheads included)
    and below the tensor peak."""
    from pipeplan.hardware_profiles import load_profile
    p = load_profile("a100-80gb-sxm")
    B, s, h, a = 1, 2048, 12288, 96
    flops = analytic.transformer_layer_fwd_flops(B, s, h)
    weights = 12 * h * h * 4  # fp32 bytes of one layer's weights
    acts = int(analytic.transformer_layer_activation_bytes(s, B, h, a) * 2)  # traced fp32 = 2x the 16-bit figure
    layer = Layer("block", kind="matmul", fwd_flops=flops, bwd_flops=2 * flops, param_bytes=weights,
                  bytes_moved=weights + acts)
    fwd, bwd = compute.layer_times_s(_graph([layer], batch=1, device="cuda"), p, dtype="bf16")
    rate = 3 * flops / (fwd[0] + bwd[0])
    peak = p.flops_for("bf16")
    assert peak == pytest.approx(312e12, rel=0.01)
    assert 163e12 <= rate < peak
