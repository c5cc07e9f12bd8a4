"""A measured collective is priced at its size off the sizes calibrate timed (hardware_profiles/collectives.py).

Why: gloo's time per byte is not one number; the two-parameter line fitted through calibrate's four sizes priced
examples/gpt.py's 550 KB all-reduce at 0.6 ms where `pipeplan run` spent 2.1-2.4 ms on it, and every data-parallel
plan of that example read 10-14% under its run (benchmarks/RESULTS.md, "Defaults only").
"""

from __future__ import annotations

import dataclasses
import math

import pytest

from pipeplan.costmodels.comm import allreduce_time_s, collective_link, half_ring_time_s
from pipeplan.hardware_profiles import load_profile
from pipeplan.hardware_profiles.collectives import link_at_size, links_from_times, time_at_size_s
from pipeplan.units import KIB, MIB

# all-reduce seconds by whole-tensor bytes, as this machine's calibrate measured them (one profile, 2026-11-27)
MEASURED_S = {16 * KIB: 200.2e-6, 256 * KIB: 1497.7e-6, 4 * MIB: 4398.9e-6, 16 * MIB: 12609.6e-6}


def test_a_size_between_two_measured_ones_reads_log_log_between_them_and_none_outside():
    assert time_at_size_s(MEASURED_S, 256 * KIB) == pytest.approx(1497.7e-6)
    # 1 MiB is half way in log size from 256 KiB to 4 MiB (4x of their 16x): the geometric mean of their times
    t = time_at_size_s(MEASURED_S, 1 * MIB)
    assert t == pytest.approx(math.sqrt(1497.7e-6 * 4398.9e-6))
    assert time_at_size_s(MEASURED_S, 8 * KIB) is None and time_at_size_s(MEASURED_S, 32 * MIB) is None


def test_the_priced_time_at_a_measured_size_is_the_measured_time_for_two_ranks_and_a_ring_beyond():
    line = links_from_times({"allreduce": MEASURED_S})["allreduce"]
    assert allreduce_time_s(256 * KIB, 2, line) < 0.4 * 1497.7e-6  # what the line alone said
    at = link_at_size(line, "allreduce", MEASURED_S, 256 * KIB)
    assert allreduce_time_s(256 * KIB, 2, at) == pytest.approx(1497.7e-6)
    assert at.latency_s == line.latency_s
    # four ranks: the ring formula with that bandwidth, 2 (r-1)/r n/bw + 2 (r-1) lat
    assert allreduce_time_s(256 * KIB, 4, at) == pytest.approx(1.5 * 256 * KIB / at.bandwidth_bytes_per_s
                                                                + 6 * line.latency_s)
    # a reduce-scatter's ring for two ranks is n / (2 bw) + lat
    rs_line = dataclasses.replace(line, kind="gloo reduce-scatter")
    rs = link_at_size(rs_line, "reduce_scatter", MEASURED_S, 4 * MIB)
    assert half_ring_time_s(4 * MIB, 2, rs) == pytest.approx(4398.9e-6)
    assert link_at_size(line, "allreduce", MEASURED_S, 64 * MIB) is line  # outside: the line


def test_a_local_profile_prices_its_all_reduce_by_size_and_without_a_size_by_its_line():
    line = links_from_times({"allreduce": MEASURED_S})["allreduce"]
    base = load_profile("a100-80gb-sxm")
    prof = dataclasses.replace(base, collectives={"allreduce": line},
                               calibration={"collectives_us": {"allreduce": {k: v * 1e6 for k, v in MEASURED_S.items()}}})
    assert collective_link(prof, [0, 1], "allreduce") is line
    sized = collective_link(prof, [0, 1], "allreduce", 550_000)
    assert allreduce_time_s(550_000, 2, sized) == pytest.approx(time_at_size_s(MEASURED_S, 550_000))
    assert 1.5e-3 < allreduce_time_s(550_000, 2, sized) < 4.4e-3
    assert collective_link(prof, [0, prof.devices_per_node], "allreduce", 550_000) is prof.inter_node
