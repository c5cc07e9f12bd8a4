"""The typed plan request and the search space it spans: checks, defaults, and the enumeration."""

from __future__ import annotations

import dataclasses
import itertools

import pytest

from pipeplan.errors import UserError
from pipeplan.hardware_profiles import load_profile
from pipeplan.planner.configs import CHUNK_CHOICES, Config, configurations, shape_pairs
from pipeplan.planner.request import PlanRequest
from pipeplan.schedules import AUTO_SCHEDULES, SCHEDULE_NAMES, SCHEDULES, facts, inflight_microbatches


def test_request_is_frozen_and_keyword_only():
    r = PlanRequest(devices=8, batch_size=64)
    with pytest.raises(dataclasses.FrozenInstanceError):
        r.devices = 4  # type: ignore[misc]
    with pytest.raises(TypeError):
        PlanRequest(8, 64)  # type: ignore[misc]


@pytest.mark.parametrize("kwargs, message", [
    (dict(devices=0), "--devices must be at least 1"),
    (dict(batch_size=0), "--batch-size must be at least 1"),
    (dict(schedule="chimera"), "unknown schedule 'chimera'"),
    (dict(dtype="int8"), "unknown dtype 'int8'"),
    (dict(optimizer="lion"), "unknown optimizer 'lion'"),
    (dict(solver="cp-sat"), "unknown solver 'cp-sat'"),
    (dict(times="guessed"), "unknown times 'guessed'"),
    (dict(recompute="maybe"), "unknown recompute setting 'maybe'"),
    (dict(stages=0), "--stages must be at least 1, got 0"),
    (dict(stages=9), "--stages 9 needs at least 9 devices but --gpus is 8"),
    (dict(microbatches=3), "--microbatches 3 does not divide --batch-size 64"),
    (dict(microbatches=128), "--microbatches 128 is more than the batch size 64"),
    (dict(schedule="interleaved", stages=1), "--schedule interleaved needs at least 2 stages"),
    (dict(stages=4, data_parallel=4), "--data-parallel 4 does not fit on 8 devices"),
])
def test_request_rejects_what_no_search_could_satisfy(kwargs, message):
    with pytest.raises(UserError, match=message):
        PlanRequest(**{"devices": 8, "batch_size": 64, **kwargs})


@pytest.mark.parametrize("option, offered", [
    (dict(sharding="zero1"), {"gpipe", "1f1b", "interleaved", "zb-h1", "zb-v", "dualpipev"}),
    (dict(recompute="on", recompute_granularity="block"), {"gpipe", "1f1b", "interleaved"}),
])
def test_a_refused_schedule_offers_every_schedule_that_accepts_the_option(option, offered):
    """Each schedule the option is refused under names, in its hint, the schedules to pick instead, read off their
    facts (the --sharding refusal named three of the six flushing schedules): exactly those that accept it."""
    hints = {}
    for name in SCHEDULE_NAMES:
        try:
            PlanRequest(devices=8, batch_size=64, schedule=name, **option)
        except UserError as e:
            hints[name] = e.hint
    assert set(SCHEDULE_NAMES) - set(hints) == offered
    for hint in hints.values():
        assert set(hint.split(" pick ")[1].replace(" or ", ", ").split(", ")) == offered, hint


def test_dtype_auto_is_resolved_per_profile():
    r = PlanRequest(devices=8, batch_size=64, dtype="auto")
    with pytest.raises(ValueError, match="for_profile"):
        r.training_dtype  # noqa: B018
    assert r.for_profile(load_profile("a100-80gb-sxm")).training_dtype == "bf16"
    assert r.for_profile(load_profile("v100-32gb-sxm2")).training_dtype == "fp16"  # Volta: no bf16
    assert PlanRequest(devices=1, batch_size=1, dtype="tf32").for_profile(load_profile("a100-80gb-sxm")).dtype == "tf32"


def test_schedules_and_recompute_options():
    assert PlanRequest(devices=1, batch_size=1).schedules == AUTO_SCHEDULES
    assert "pipedream" not in AUTO_SCHEDULES  # async changes the training semantics: opt-in only
    assert set(PlanRequest(devices=1, batch_size=1, schedule="all").schedules) == set(SCHEDULE_NAMES)
    assert PlanRequest(devices=1, batch_size=1, schedule="gpipe").schedules == ("gpipe",)
    assert PlanRequest(devices=1, batch_size=1, recompute="on").recompute_options == (True,)


def _brute_configs(request: PlanRequest, n_layers: int) -> set[Config]:
    """The search space written out from its rules, independently of configs.py's loops."""
    out = set()
    N, B = request.devices, request.batch_size
    for K, d, sched, M in itertools.product(range(1, N + 1), range(1, N + 1), request.schedules, range(1, B + 1)):
        if K * d > N or K > n_layers:
            continue
        per_replica = B if sched == "pipedream" else B / d
        if per_replica != int(per_replica) or per_replica % M:
            continue
        if sched == "pipedream" and M < K:
            continue
        if sched in ("1f1b", "pipedream-2bw") and M < K:  # torch's Schedule1F1B refuses it; 2BW's window >= K
            continue
        if sched == "gpipe" and (K == 1 or M == 1) and "1f1b" in request.schedules and M >= K:
            continue  # the same as 1f1b there, which is tried
        chunks = [1]
        if sched == "interleaved":
            chunks = [v for v in CHUNK_CHOICES if K >= 2 and M % K == 0 and K * v <= n_layers]
        if sched in ("zb-v", "dualpipev"):  # exactly two stages a rank (torch); DualPipeV: M >= its 2K stages
            chunks = [2] if K >= 2 and 2 * K <= n_layers and (sched == "zb-v" or M >= 2 * K) else []
        for v, rc in itertools.product(chunks, request.recompute_options):
            out.add(Config(schedule=sched, stages=K, data_parallel=d, microbatches=M, chunks=v, recompute=rc))
    return out


@pytest.mark.parametrize("devices, batch, schedule, n_layers", [(4, 8, "auto", 10), (6, 12, "all", 5), (3, 9, "1f1b", 2)])
def test_enumeration_is_the_whole_space_once(devices, batch, schedule, n_layers):
    request = PlanRequest(devices=devices, batch_size=batch, schedule=schedule)
    got = [c for K, d in shape_pairs(request, n_layers) for c in configurations(request, K, d, n_layers)]
    assert len(got) == len(set(got))
    assert set(got) == _brute_configs(request, n_layers)


def test_whole_machine_configurations_come_first():
    pairs = shape_pairs(PlanRequest(devices=4, batch_size=8), 10)
    assert pairs[0] == (1, 4) and pairs[-1] == (1, 1)
    assert [k * d for k, d in pairs] == sorted((k * d for k, d in pairs), reverse=True)


@pytest.mark.parametrize("name", SCHEDULE_NAMES)
def test_schedule_facts_agree_with_the_published_rules(name):
    rule = facts(name)
    K, M = 4, 8
    held = [inflight_microbatches(name, K, s, M) for s in range(K)]
    expected = {"gpipe": [M] * K,  # GPipe §2.3: every forward before any backward
                "1f1b": [K - s for s in range(K)],  # Megatron-LM §2.2.1: stage s holds K - s
                "pipedream": [K - s for s in range(K)],  # PipeDream §3.2: NOAM, no flush
                "pipedream-2bw": [K - s for s in range(K)],  # 2BW (ICML 2021) §3.1: 1F1B without flush
                "interleaved": [K - s for s in range(K)],  # one chunk per device is 1F1B
                "zb-h1": [min(K, M)] * K,  # Qi et al. 2024 §3.1: every stage up to p microbatches
                "zb-v": [2 * K] * K,  # §6: 1F1B's peak (K stages' worth) in 2K half-size chunk-microbatches
                "dualpipev": [2 * K + 1] * K}[name]  # DeepSeek-V3 §3.2.1: DualPipe's PP + 1, in chunks
    assert held == expected
    assert rule.flushes == (name not in ("pipedream", "pipedream-2bw")) and rule.stashes_weights == (name == "pipedream")
    assert SCHEDULES[name] is rule
    with pytest.raises(UserError, match="unknown schedule"):
        facts("zero-bubble")
