"""Properties of the simulator that hold for any stage times (hypothesis)."""

from __future__ import annotations

from fractions import Fraction as Fr

from hypothesis import given, settings
from hypothesis import strategies as st

from pipeplan.planner.simulate import simulate

times = st.integers(min_value=0, max_value=20)
pos_times = st.integers(min_value=1, max_value=20)


@st.composite
def pipelines(draw, max_k=5):
    K = draw(st.integers(1, max_k))
    fwd = draw(st.lists(pos_times, min_size=K, max_size=K))
    bwd = draw(st.lists(pos_times, min_size=K, max_size=K))
    send = draw(st.lists(times, min_size=K - 1, max_size=K - 1))
    M = draw(st.integers(1, 8))
    return K, fwd, bwd, send, M


@settings(max_examples=60, deadline=None)
@given(pipelines(), st.sampled_from(["gpipe", "1f1b"]))
def test_lower_bounds(p, schedule):
    K, fwd, bwd, send, M = p
    r = simulate(schedule, fwd, bwd, send, M)
    # Each device must do all its work.
    assert r.iteration_s >= max(M * (f + b) for f, b in zip(fwd, bwd, strict=True))
    # One microbatch's path: down through every stage and sends, and back.
    assert r.iteration_s >= sum(fwd) + sum(bwd) + 2 * sum(send)
    # Fill + drain: the first microbatch's forward reaches the last stage, which then does all of its work.
    assert r.iteration_s >= sum(fwd[:-1]) + sum(send) + M * (fwd[-1] + bwd[-1]) + sum(bwd[:-1]) + sum(send)
    assert 0 <= r.bubble_fraction < 1


@settings(max_examples=40, deadline=None)
@given(pipelines(), st.sampled_from(["gpipe", "1f1b"]))
def test_one_more_microbatch_never_helps(p, schedule):
    """Same per-microbatch times, one more microbatch: the iteration cannot get shorter."""
    K, fwd, bwd, send, M = p
    a = simulate(schedule, fwd, bwd, send, M)
    b = simulate(schedule, fwd, bwd, send, M + 1)
    assert b.iteration_s >= a.iteration_s


@settings(max_examples=40, deadline=None)
@given(pipelines(max_k=4))
def test_gpipe_and_1f1b_memory_order(p):
    """1F1B never holds more microbatches than GPipe; GPipe holds all M."""
    K, fwd, bwd, send, M = p
    g = simulate("gpipe", fwd, bwd, send, M)
    f = simulate("1f1b", fwd, bwd, send, M)
    assert g.inflight_peak == [M] * K
    assert all(x <= min(K - s, M) for s, x in enumerate(f.inflight_peak))


@settings(max_examples=30, deadline=None)
@given(pipelines(max_k=4))
def test_pipedream_rate_bounds(p):
    """Steady state is at least the slowest stage's work (and each link's occupancy) per microbatch."""
    K, fwd, bwd, send, M = p
    r = simulate("pipedream", fwd, bwd, send, M)
    assert r.iteration_s >= M * max(f + b for f, b in zip(fwd, bwd, strict=True))
    assert r.iteration_s >= M * max(send, default=0)


@settings(max_examples=30, deadline=None)
@given(st.integers(1, 4), st.integers(1, 3), st.integers(1, 3), pos_times, pos_times)
def test_interleaved_uniform_closed_form(K, v, mult, tf, tb):
    M = K * mult
    S = K * v
    r = simulate("interleaved", [Fr(tf, v)] * S, [Fr(tb, v)] * S, [0] * S, M, chunks=v)
    assert r.iteration_s == (M + Fr(K - 1, v)) * (tf + tb)
