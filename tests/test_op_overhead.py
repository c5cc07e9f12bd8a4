"""What a local machine adds to compute and link times: the runtime's per-op overhead (measured from op
timestamps of a 2-rank pipeline, stored per schedule) and the slowdown of cores computing side by side;
both stored in the profile and validated like every other field."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from pipeline_timeline import charged_per_op, mean_messages, messages, orders, per_rank_events, timeline
from pipeplan.cli.main import cli
from pipeplan.hardware_profiles import load_profile
from pipeplan.hardware_profiles.loader import save_profile
from pipeplan.hardware_profiles.op_overhead import (
    CHUNKS,
    LINE_SHAPES,
    SCHEDULES,
    SHAPES,
    SOLO,
    TENSORS,
    message_bytes,
    op_gaps_s,
    op_overhead_s,
    shape_schedules,
)
from pipeplan.schedules import SCHEDULE_NAMES


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_gaps_recover_the_delay_put_into_every_op(schedule):
    first, second = timeline(schedule, 8, f=3e-3, b=6e-3, gap=4e-4, transfer=1e-4)
    gaps = op_gaps_s(first, second, transfer_s=1e-4)
    # per rank: M microbatches x its stages x F and B (zero bubble: and W); ZB-V 8 x 2 x 3 = 48
    assert len(first) == len(second) == 8 * CHUNKS[schedule] * (3 if schedule in ("zb-h1", "zb-v") else 2)
    assert len(gaps) == len(first) + len(second) - 1  # every op but the very first has a "could start" time
    assert [g for _, g in gaps] == pytest.approx([4e-4] * len(gaps), abs=1e-12)
    assert [k for k, _ in gaps] == [e[0] for e in first[1:] + second]
    # charging the transfer to the op instead of the link: cross-rank waits look longer by it
    assert sum(g for _, g in op_gaps_s(first, second, transfer_s=0.0)) > sum(g for _, g in gaps)


def test_v_placement_charges_no_transfer_at_its_turn_and_one_to_the_last_stage_on_rank_0():
    """One microbatch through ZB-V's V, written out: rank 0 holds stages 0 and 3, rank 1 stages 1 and 2; 1 s ops,
    each started 0.1 s after it could have, a 0.5 s transfer where a dependency crossed ranks (0 -> 1, 2 -> 3 and
    back), none from stage 1 to 2 or back (the same rank) nor from a B to its W. A gap finder that charged the
    turn a transfer would see F2 and B1 start before they could (gap clamped to 0)."""
    first = [("F", 0, 0, 0.0, 1.0), ("F", 3, 0, 4.3, 5.3), ("B", 3, 0, 5.4, 6.4), ("W", 3, 0, 6.5, 7.5),
             ("B", 0, 0, 9.7, 10.7), ("W", 0, 0, 10.8, 11.8)]  # F3: F2's end 3.7 + 0.5; B0: B1's end 9.1 + 0.5
    second = [("F", 1, 0, 1.6, 2.6), ("F", 2, 0, 2.7, 3.7), ("B", 2, 0, 7.0, 8.0), ("B", 1, 0, 8.1, 9.1),
              ("W", 2, 0, 9.2, 10.2), ("W", 1, 0, 10.3, 11.3)]  # F1: F0's end 1 + 0.5; B2: B3's end 6.4 + 0.5
    first, second = [(*e, 0.0) for e in first], [(*e, 0.0) for e in second]
    gaps = op_gaps_s(first, second, transfer_s=0.5)
    assert [k for k, _ in gaps] == ["F", "B", "W", "B", "W", "F", "F", "B", "B", "W", "W"]
    assert [g for _, g in gaps] == pytest.approx([0.1] * 11, abs=1e-12)


def test_overhead_is_a_line_through_the_mean_gaps_of_the_message_sizes():
    """Gaps of fixed + per_byte x message, per schedule: the fit recovers both terms exactly (ZB-H1 and ZB-V: with
    their Ws' gaps charged to the forwards and backwards, which is where the simulator adds them), the per-byte term
    per byte an op sends and receives: interleaved's ops move 1.5 messages on average, so there a gap that grows
    with one message's bytes is two thirds of it per byte moved."""
    truth = {"gpipe": (9e-4, 0.0), "1f1b": (2e-4, 3e-10), "interleaved": (3e-4, 2e-10), "zb-h1": (1e-4, 1e-10),
             "zb-v": (7e-4, 6e-10), "pipedream": (5e-4, 4e-10)}  # s, s per byte
    assert set(truth) == set(SCHEDULES)
    link = lambda nbytes: 5e-5 + nbytes / 4e9  # noqa: E731 - the idle link's transfer time

    def steps_of(schedule: str, shape: str) -> list[tuple[list, list]]:
        n = message_bytes(shape)
        return [timeline(schedule, 8, 3e-3, 6e-3, truth[schedule][0] + truth[schedule][1] * n, link(n))
                for _ in range(3)]

    fixed, per_byte, _, detail = op_overhead_s(per_rank_events(steps_of), link)
    assert fixed == pytest.approx({k: charged_per_op(k, 8, v[0]) for k, v in truth.items()}, abs=1e-12)
    assert per_byte == pytest.approx({k: charged_per_op(k, 8, v[1]) / mean_messages(k, 8) for k, v in truth.items()},
                                     abs=1e-16)
    assert mean_messages("interleaved", 8) == 1.5 and {mean_messages(k, 8) for k in truth if k != "interleaved"} == {1}
    assert charged_per_op("zb-h1", 8, 1.0) == pytest.approx(47 / 31)  # 48 ops a step, 32 of them F or B
    assert charged_per_op("zb-v", 8, 1.0) == pytest.approx(95 / 63)  # 2 ranks x 2 stages x 8 x (F, B, W) = 96
    assert fixed["zb-v"] == pytest.approx(7e-4 * 95 / 63, abs=1e-12)
    assert per_byte["zb-v"] == pytest.approx(6e-10 * 95 / 63, abs=1e-16)
    assert charged_per_op("1f1b", 8, 1.0) == 1.0
    assert detail["small_1f1b"]["compute_per_op_ms"] == pytest.approx(4.5)  # 8 F of 3 ms and 8 B of 6 ms per rank


def test_the_line_is_the_least_squares_fit_over_the_three_message_sizes():
    """Charges off any one line (each shape's gap its own): the fitted terms are numpy's least-squares line through
    (bytes, charge) of the one-tensor shapes, 0.25, 1 and 2 MiB; charges that fall with the bytes give slope 0 and
    their mean."""
    import numpy as np

    assert sorted(message_bytes(s) for s in LINE_SHAPES) == [2**18, 2**20, 2**21]
    for gaps in ({"small": 3e-4, "large": 4e-4, "wide": 7e-4, "split": 9e-4},
                 {"small": 6e-4, "large": 5e-4, "wide": 2e-4, "split": 9e-4}):
        def steps_of(schedule: str, shape: str, gaps: dict = gaps) -> list[tuple[list, list]]:
            return [timeline(schedule, 8, 3e-3, 6e-3, gaps[shape], 1e-4) for _ in range(3)]

        fixed, per_byte, _, _ = op_overhead_s(per_rank_events(steps_of), lambda nbytes: 1e-4)
        xs = [message_bytes(s) for s in LINE_SHAPES]
        ys = [charged_per_op("1f1b", 8, gaps[s]) for s in LINE_SHAPES]
        slope, intercept = np.polyfit(xs, ys, 1)
        if slope > 0:
            assert (fixed["1f1b"], per_byte["1f1b"]) == pytest.approx((intercept, slope), rel=1e-9)
        else:
            assert (fixed["1f1b"], per_byte["1f1b"]) == pytest.approx((float(np.mean(ys)), 0.0), rel=1e-9)
    assert slope < 0  # the second case is the clamped one


@pytest.mark.parametrize("shape", list(SHAPES))
def test_every_shape_computes_alike_and_cuts_what_message_bytes_says(shape):
    """Counted by torch's own FLOP counter on the stage the calibration runs (2 FLOPs a multiply-add): the shapes
    differ in the bytes a cut carries, not in compute, so a charge's growth is the bytes'."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    from pipeplan.hardware_profiles.op_overhead import HIDDEN, WIDTH, multiply_adds
    from pipeplan.hardware_profiles.pipeline_ops import _stage_module

    rows, layers = SHAPES[shape]
    module = _stage_module(layers, hidden=HIDDEN.get(shape, WIDTH))
    with FlopCounterMode(display=False) as counter:
        out = module(torch.randn(rows, WIDTH))
    assert counter.get_total_flops() == 2 * multiply_adds(shape) == 2 * 2**27
    assert out.numel() * out.element_size() == message_bytes(shape)


def test_each_tensor_beyond_one_that_a_message_carries_is_charged_per_tensor():
    """The "split" shape sends the large shape's bytes as 4 tensors. Each op starts 0.2 ms late plus, at that shape,
    `per_tensor` for each of the 3 extra tensors of each of its messages (a middle stage of interleaved's 4 sends
    and receives: 6; ZB-V's turn none). The fit divides what the split shape is charged beyond the large one by
    the extra tensors of a mean op: each schedule's figure back, up to the first op's share (it has no gap)."""
    truth = {"gpipe": 3e-4, "1f1b": 2e-4, "interleaved": 1e-4, "zb-h1": 4e-4, "zb-v": 5e-4}
    assert set(truth) == set(shape_schedules("split")) and TENSORS["split"] == 4
    assert message_bytes("split") == message_bytes("large")

    def steps_of(schedule: str, shape: str) -> list[tuple[list, list]]:
        extra = (lambda kind, stage: 3 * truth[schedule] * messages(schedule, kind, stage)) if shape == "split" else None
        return [timeline(schedule, 8, 3e-3, 6e-3, 2e-4, 1e-4, gap_of=extra) for _ in range(3)]

    fixed, per_byte, per_tensor, _ = op_overhead_s(per_rank_events(steps_of), lambda nbytes: 1e-4)
    assert set(per_tensor) == set(truth)
    for schedule, want in truth.items():
        first, second = orders(schedule, 8)
        fb = [op for op in first + second if op[0] != "W"]
        total = sum(messages(schedule, kind, stage) for kind, stage, _ in fb)
        assert total == 32 * (1.5 if schedule == "interleaved" else 1) * CHUNKS[schedule]
        charged = want * (total - messages(schedule, *first[0][:2])) / (len(fb) - 1)  # all but the first op
        assert per_tensor[schedule] == pytest.approx(charged / (total / len(fb)), rel=1e-9)
        assert per_tensor[schedule] == pytest.approx(want, rel=0.02)
    assert fixed == pytest.approx({k: charged_per_op(k, 8, 2e-4) for k in SCHEDULES}, abs=1e-12)
    assert per_byte == pytest.approx({k: 0.0 for k in SCHEDULES}, abs=1e-16)


def test_cpu_that_gloo_threads_take_from_the_ops_is_charged_with_the_gaps():
    """Every op starts `gap` late and loses `stolen` of CPU to the process's other threads (gloo copying messages
    on the op's core), both a line in the message's bytes: the fit charges their sum per forward and backward,
    and the detail keeps the two apart."""
    link = lambda nbytes: 5e-5 + nbytes / 4e9  # noqa: E731
    gap_line, stolen_line = (2e-4, 1e-10), (4e-5, 2e-10)  # (s, s per byte)

    def steps_of(schedule: str, shape: str) -> list[tuple[list, list]]:
        n = message_bytes(shape)
        gap, stolen = gap_line[0] + gap_line[1] * n, stolen_line[0] + stolen_line[1] * n
        return [timeline(schedule, 8, 3e-3, 6e-3, gap, link(n), stolen) for _ in range(3)]

    fixed, per_byte, _, detail = op_overhead_s(per_rank_events(steps_of), link)
    for schedule in SCHEDULES:
        first, second = orders(schedule, 8)
        ops = first + second
        fb = sum(1 for kind, *_ in ops if kind != "W")
        # every op's theft (Ws' too) over the forwards and backwards; the gaps as test_overhead_is_a_line... fits
        want_fixed = charged_per_op(schedule, 8, gap_line[0]) + stolen_line[0] * len(ops) / fb
        want_per_byte = charged_per_op(schedule, 8, gap_line[1]) + stolen_line[1] * len(ops) / fb
        assert fixed[schedule] == pytest.approx(want_fixed, rel=1e-9)
        assert per_byte[schedule] == pytest.approx(want_per_byte / mean_messages(schedule, 8), rel=1e-9)
    n = message_bytes("large")
    assert detail["large_1f1b"]["stolen_us"] == pytest.approx((stolen_line[0] + stolen_line[1] * n) * 1e6, abs=0.1)


_STOLEN_PROBE = """
import json, threading, time
from pipeplan.hardware_profiles.pipeline_ops import cpu_clocks, stolen_since
spun = []
def spin():
    t0 = time.thread_time()
    while time.thread_time() - t0 < 0.15:
        pass
    spun.append(time.thread_time() - t0)
clocks = cpu_clocks()
worker = threading.Thread(target=spin)
worker.start()
worker.join()
stolen = stolen_since(clocks)
print(json.dumps({"spun": spun[0], "stolen": stolen, "idle": stolen_since(cpu_clocks())}))
"""


def test_stolen_cpu_is_what_another_thread_of_the_process_used():
    """`stolen_since` over a span in which this thread sleeps and another spins: the spinner's own CPU clock. In a
    fresh process, which has no other threads: pytest's has those of the tests before (torch's OpenMP workers spin a
    while after a parallel region), and one run there read 17 ms more than the spinner's own."""
    import json
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-c", _STOLEN_PROBE], capture_output=True, text=True, timeout=60, check=True)
    got = json.loads(r.stdout)
    assert got["stolen"] == pytest.approx(got["spun"], rel=0.1)
    assert got["idle"] < 0.01  # nothing else running: (almost) nothing stolen


def test_ops_longer_than_alone_are_reported_not_charged():
    """Pipeline ops of 3 and 6 ms that take 2.5 and 5 ms alone on the same busy cores: 0.75 ms a forward or
    backward on average beyond the solo ops (a zero-bubble W, the timeline's 6 ms, counts whole, its B being a
    whole backward's 6 - 5 = 1 ms; ZB-V has one F, B and W per stage and microbatch like ZB-H1, on twice the
    stages), recorded in the detail; the charge stays the gap."""
    gap = 2e-4
    per_rank = per_rank_events(lambda schedule, shape: [timeline(schedule, 8, 3e-3, 6e-3, gap, 1e-4)
                                                        for _ in range(2)])
    for shape in SHAPES:
        for rank in (0, 1):
            solo = [op for i in range(4) for op in (("F", rank, i, 0.0, 2.5e-3, 0.0), ("B", rank, i, 0.0, 5e-3, 0.0))]
            per_rank[rank][f"{shape}/{SOLO}"] = [solo]
    fixed, per_byte, _, detail = op_overhead_s(per_rank, lambda nbytes: 1e-4)
    M = 8
    excess_us = {k: 750.0 for k in SCHEDULES} | {"zb-h1": (M * 500 + M * 1000 + M * 6000) / (2 * M),
                                                 "zb-v": (2 * M * 500 + 2 * M * 1000 + 2 * M * 6000) / (4 * M)}
    assert {k: detail[f"large_{k}"]["excess_us"] for k in SCHEDULES} == pytest.approx(excess_us)
    assert fixed == pytest.approx({k: charged_per_op(k, M, gap) for k in SCHEDULES}, abs=1e-9)
    assert per_byte == pytest.approx({k: 0.0 for k in SCHEDULES}, abs=1e-12)


BASE = """format: pipeplan.profile/v1
name: box
device: test
memory_gib: 8
usable_memory_gib: 7
memory_bandwidth_gbps: 20
peak_tflops: {fp32: 0.1}
devices_per_node: 2
intra_node: {kind: loopback, bandwidth_gbps: 5, latency_us: 70}
inter_node: {kind: loopback, bandwidth_gbps: 5, latency_us: 70}
"""


def test_profile_keeps_overhead_per_schedule_and_falls_back_to_1f1b(tmp_path):
    path = tmp_path / "box.yaml"
    path.write_text(BASE + "op_overhead_us: {gpipe: 900, 1f1b: 250.5}\nop_overhead_us_per_mib: {1f1b: 300}\n")
    prof = load_profile(str(path))
    assert prof.op_overhead_s == pytest.approx({"gpipe": 9e-4, "1f1b": 2.505e-4})
    assert prof.overhead_for("gpipe", 2**21) == pytest.approx(9e-4)  # no per-byte term for gpipe
    assert prof.overhead_for("1f1b", 2**21) == pytest.approx(2.505e-4 + 2 * 3e-4)  # 2 MiB at 300 µs per MiB
    assert prof.overhead_for("interleaved") == prof.overhead_for("pipedream") == pytest.approx(2.505e-4)
    assert prof.overhead_for("zb-h1") == prof.overhead_for("pipedream-2bw") == pytest.approx(2.505e-4)
    assert prof.overhead_for("zb-v") == prof.overhead_for("dualpipev") == pytest.approx(2.505e-4)
    save_profile(prof, tmp_path / "again.yaml")
    again = load_profile(str(tmp_path / "again.yaml"))
    assert again.op_overhead_s == pytest.approx(prof.op_overhead_s)
    assert again.op_overhead_s_per_byte == pytest.approx(prof.op_overhead_s_per_byte)
    assert prof.op_overhead_s_per_tensor == again.op_overhead_s_per_tensor == {}
    assert prof.overhead_for("1f1b", 0, extra_tensors=3) == pytest.approx(2.505e-4)  # no per-tensor term measured
    path.write_text(BASE)
    assert load_profile(str(path)).overhead_for("gpipe") == 0.0  # catalogue profiles: not measured


def test_unmeasured_schedules_take_the_nearest_measured_runtime(tmp_path):
    """2BW runs PipeDream's loop; DualPipeV ZB-V's V (same placement, split backwards); the rest are measured."""
    path = tmp_path / "box.yaml"
    path.write_text(BASE + "op_overhead_us: {gpipe: 900, 1f1b: 200, interleaved: 600, zb-h1: 300, zb-v: 800, "
                    "pipedream: 700}\nop_overhead_us_per_mib: {pipedream: 1000, zb-v: 400}\n")
    prof = load_profile(str(path))
    want_us = {"gpipe": 900, "1f1b": 200, "interleaved": 600, "zb-h1": 300, "pipedream": 700 + 1000,
               "pipedream-2bw": 700 + 1000, "zb-v": 800 + 400, "dualpipev": 800 + 400}
    assert {k: prof.overhead_for(k, 2**20) * 1e6 for k in want_us} == pytest.approx(want_us)
    assert set(want_us) == set(SCHEDULE_NAMES)


def test_the_per_tensor_term_is_the_schedules_own_else_the_nearest_torch_schedules(tmp_path):
    """calibrate measures the per-tensor term for the torch schedules only: PipeDream's loop (and 2BW) take 1F1B's
    (one stage a rank; the loop, too, sends each tensor of a cut as its own message), DualPipeV ZB-V's; it adds to
    the fixed and per-byte terms and survives a save and load."""
    path = tmp_path / "box.yaml"
    path.write_text(BASE + "op_overhead_us: {gpipe: 900, 1f1b: 200, interleaved: 600, zb-h1: 300, zb-v: 800, "
                    "pipedream: 700}\nop_overhead_us_per_mib: {1f1b: 100}\n"
                    "op_overhead_us_per_tensor: {gpipe: 50, 1f1b: 30, interleaved: 70, zb-h1: 40, zb-v: 60}\n")
    prof = load_profile(str(path))
    fixed = {"gpipe": 900, "1f1b": 200 + 100, "interleaved": 600, "zb-h1": 300, "zb-v": 800, "dualpipev": 800,
             "pipedream": 700, "pipedream-2bw": 700}
    per_tensor = {"gpipe": 50, "1f1b": 30, "interleaved": 70, "zb-h1": 40, "zb-v": 60, "dualpipev": 60,
                  "pipedream": 30, "pipedream-2bw": 30}
    assert set(fixed) == set(SCHEDULE_NAMES)
    got = {k: prof.overhead_for(k, 2**20, extra_tensors=3) * 1e6 for k in fixed}
    assert got == pytest.approx({k: fixed[k] + 3 * per_tensor[k] for k in fixed})
    save_profile(prof, tmp_path / "again.yaml")
    assert load_profile(str(tmp_path / "again.yaml")).op_overhead_s_per_tensor == pytest.approx(
        {k: v * 1e-6 for k, v in per_tensor.items() if k in ("gpipe", "1f1b", "interleaved", "zb-h1", "zb-v")})


def test_a_profile_calibrated_before_zb_v_was_measured_gives_the_v_schedules_interleaved(tmp_path):
    """A profile without zb-v (calibrated before it was measured) still loads, and both V schedules take
    interleaved's figure (two stages a rank, each op posting its own sends), its per-byte part included."""
    path = tmp_path / "box.yaml"
    path.write_text(BASE + "op_overhead_us: {gpipe: 900, 1f1b: 200, interleaved: 600, zb-h1: 300, pipedream: 700}\n"
                    "op_overhead_us_per_mib: {interleaved: 250}\n")
    prof = load_profile(str(path))
    assert "zb-v" not in prof.op_overhead_s
    assert prof.overhead_for("zb-v", 2**21) * 1e6 == pytest.approx(600 + 2 * 250)
    assert prof.overhead_for("dualpipev", 2**21) * 1e6 == pytest.approx(600 + 2 * 250)


def test_concurrency_slowdown_round_trips_and_defaults_to_1(tmp_path):
    path = tmp_path / "box.yaml"
    path.write_text(BASE + "concurrency_slowdown: 1.15\n")
    prof = load_profile(str(path))
    assert prof.concurrency_slowdown == 1.15
    save_profile(prof, tmp_path / "again.yaml")
    assert load_profile(str(tmp_path / "again.yaml")).concurrency_slowdown == 1.15
    path.write_text(BASE)
    assert load_profile(str(path)).concurrency_slowdown == 1.0


def test_memory_concurrency_slowdown_round_trips_and_falls_back_to_the_compute_factor(tmp_path):
    path = tmp_path / "box.yaml"
    path.write_text(BASE + "concurrency_slowdown: 1.15\nmemory_concurrency_slowdown: 1.4\n")
    prof = load_profile(str(path))
    assert (prof.memory_concurrency_slowdown, prof.memory_slowdown()) == (1.4, 1.4)
    save_profile(prof, tmp_path / "again.yaml")
    assert load_profile(str(tmp_path / "again.yaml")).memory_concurrency_slowdown == 1.4
    path.write_text(BASE + "concurrency_slowdown: 1.15\n")  # calibrated before it was measured
    prof = load_profile(str(path))
    assert prof.memory_concurrency_slowdown is None and prof.memory_slowdown() == 1.15
    save_profile(prof, tmp_path / "again.yaml")
    assert "memory_concurrency_slowdown" not in (tmp_path / "again.yaml").read_text()


@pytest.mark.parametrize("text", ["concurrency_slowdown: 0.8", "concurrency_slowdown: 9", "concurrency_slowdown: fast",
                                  "memory_concurrency_slowdown: 0.5", "memory_concurrency_slowdown: 5",
                                  "memory_concurrency_slowdown: fast"])
def test_bad_concurrency_slowdown_exits_2(tmp_path, text):
    path = tmp_path / "box.yaml"
    path.write_text(BASE + text + "\n")
    r = CliRunner().invoke(cli, ["profiles", "show", str(path)])
    assert r.exit_code == 2 and text.split(":")[0] in r.stderr, r.output


@pytest.mark.parametrize("value, words", [
    ("{gpipe: -5}", "non-negative"),
    ("{zero-bubble: 5}", "op_overhead_us.zero-bubble"),
    ("900", "mapping"),
    ("{gpipe: '5 us'}", "plain number"),
])
@pytest.mark.parametrize("field", ["op_overhead_us", "op_overhead_us_per_mib", "op_overhead_us_per_tensor",
                                   "op_overhead_us_more_chunks"])
def test_bad_overhead_exits_2_naming_the_field(tmp_path, value, words, field):
    path = tmp_path / "box.yaml"
    path.write_text(BASE + f"{field}: {value}\n")
    r = CliRunner().invoke(cli, ["profiles", "show", str(path)])
    assert r.exit_code == 2, r.output
    assert field in r.stderr and words.replace("op_overhead_us", field) in r.stderr


def _plan_chain(tmp_path, schedule: str, overhead_yaml: str) -> tuple[str, list[dict]]:
    """`pipeplan plan` of a small chain on 2 devices (M = 4) with a profile carrying `overhead_yaml`: (stdout, the
    plan file's stages)."""
    import json

    from cli_fixtures import chain_graph

    chain_graph().save(tmp_path / "graph.json")
    (tmp_path / "box.yaml").write_text(BASE + overhead_yaml)
    args = ["plan", str(tmp_path / "graph.json"), "-p", str(tmp_path / "box.yaml"), "--gpus", "2", "--stages", "2",
            "-m", "4", "-b", "16", "--schedule", schedule, "-o", str(tmp_path / "plan.json")]
    r = CliRunner().invoke(cli, args)
    assert r.exit_code == 0, r.output
    return r.stdout, json.loads((tmp_path / "plan.json").read_text())["stages"]


def test_plan_report_says_the_runtime_overhead_is_in_the_iteration_time(tmp_path):
    stdout, stages = _plan_chain(tmp_path, "1f1b", "op_overhead_us: {gpipe: 900, 1f1b: 250}\n")
    assert "incl. the runtime's 250 µs per op" in " ".join(stdout.split())
    assert [s["predicted"]["op_overhead_s"] for s in stages] == pytest.approx([2.5e-4, 2.5e-4])


def test_the_turn_of_a_v_is_charged_no_message_bytes(tmp_path):
    """ZB-V on 2 devices: stages 1 and 2 share device 1, so the 1 -> 2 hand-over is in memory. Each stage's op is
    charged per byte for the messages that cross devices only: 0 and 3 one boundary each, 1 and 2 one each (not
    two), as the calibration's 2-rank V measured (one remote message per op)."""
    _, stages = _plan_chain(tmp_path, "zb-v", "op_overhead_us: {zb-v: 0}\nop_overhead_us_per_mib: {zb-v: 1000}\n")
    assert len(stages) == 4
    sent = [s["predicted"]["send_bytes"] for s in stages]
    assert all(b > 0 for b in sent[:3])
    crossing = [sent[0], sent[0], sent[2], sent[2]]  # in or out across devices; stage 1's output stays on device 1
    want = [1000 * b / 2**20 for b in crossing]  # µs
    assert [s["predicted"]["op_overhead_s"] * 1e6 for s in stages] == pytest.approx(want)


@pytest.mark.parametrize("schedule", ["1f1b", "pipedream"])
def test_a_step_that_met_a_hiccup_is_not_charged(schedule):
    """The runtime reports its median step, so the charge is the median over steps of each step's mean gap: of 3
    steps, one whose every op started 20 ms late (the OS, gloo's threads) leaves the fitted figures those of the
    2 clean ones. The asynchronous loop records one unbroken run, cut here into runs of 8 microbatches."""
    link = lambda nbytes: 5e-5 + nbytes / 4e9  # noqa: E731
    per_rank: list[dict] = [{}, {}]
    for shape in SHAPES:
        clean = 3e-4 + 2e-10 * message_bytes(shape)
        steps = [timeline(schedule, 8, 3e-3, 6e-3, gap, link(message_bytes(shape))) for gap in (clean, 0.02, clean)]
        if schedule == "pipedream":  # one list per rank: microbatches 0-23, each run 1 s after the one before
            steps = [tuple([[(k, s, m + 8 * i, t0 + i, t1 + i, c) for k, s, m, t0, t1, c in step[r]] for r in (0, 1)])
                     for i, step in enumerate(steps)]
            steps = [([e for st in steps for e in st[0]], [e for st in steps for e in st[1]])]
        for r in (0, 1):
            per_rank[r][f"{shape}/{schedule}"] = [s[r] for s in steps]
    fixed, per_byte = _fit_one(per_rank, schedule, link)
    assert fixed == pytest.approx(charged_per_op(schedule, 8, 3e-4), rel=1e-6)
    assert per_byte == pytest.approx(charged_per_op(schedule, 8, 2e-10), rel=1e-6)


def _fit_one(per_rank, schedule, link):
    """`op_overhead_s` on one schedule's timelines (the others filled with copies, which it also fits)."""
    full: list[dict] = [{}, {}]
    for r in (0, 1):
        for name in SCHEDULES:
            for shape in SHAPES:
                full[r][f"{shape}/{name}"] = per_rank[r][f"{shape}/{schedule}"]
    fixed, per_byte, _, _ = op_overhead_s(full, link)
    return fixed[schedule], per_byte[schedule]


def test_profiles_show_lists_the_runtime_cost_per_op(tmp_path):
    """`profiles show` of a calibrated profile states each schedule's terms as the prediction adds them."""
    path = tmp_path / "box.yaml"
    path.write_text(BASE + "op_overhead_us: {gpipe: 900, 1f1b: 250}\nop_overhead_us_per_mib: {1f1b: 300}\n"
                    "op_overhead_us_per_tensor: {1f1b: 40}\n")
    r = CliRunner().invoke(cli, ["profiles", "show", str(path)], env={"COLUMNS": "400"})
    assert r.exit_code == 0, r.output
    row = next(line for line in r.output.splitlines() if "runtime per op" in line)
    assert "gpipe 900 µs + 0 µs/MiB; 1f1b 250 µs + 300 µs/MiB + 40 µs/extra tensor" in row
    path.write_text(BASE)
    assert "runtime per op" not in CliRunner().invoke(cli, ["profiles", "show", str(path)]).output


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_a_gap_that_grows_with_the_bytes_each_op_moves_is_recovered_per_byte_moved(schedule):
    """Each op starts fixed + per_byte x (the bytes it sends and receives: one message's bytes times its messages,
    written from the placement) late, the charge the prediction adds (`HardwareProfile.overhead_for`): the fit
    gives back per_byte itself, up to rank 0's first op, which has no gap (its messages are left out of the mean)."""
    fixed_s, per_byte_s = 3e-4, 2e-10
    link = lambda nbytes: 5e-5 + nbytes / 4e9  # noqa: E731

    def steps_of(name: str, shape: str) -> list[tuple[list, list]]:
        n = message_bytes(shape)
        moved = lambda kind, stage: per_byte_s * n * messages(name, kind, stage)  # noqa: E731
        return [timeline(name, 8, 3e-3, 6e-3, fixed_s, link(n), gap_of=moved) for _ in range(3)]

    fixed_all, per_byte_all, _, _ = op_overhead_s(per_rank_events(steps_of), link)
    fixed, per_byte = fixed_all[schedule], per_byte_all[schedule]
    first, second = orders(schedule, 8)
    fb = [(kind, stage) for kind, stage, _ in first + second if kind != "W"]
    moved_all = sum(messages(schedule, k, s) for k, s in fb)
    gapped = moved_all - messages(schedule, *first[0][:2])  # rank 0's first op starts on time
    want = per_byte_s * (gapped / (len(fb) - 1)) / (moved_all / len(fb))
    assert per_byte == pytest.approx(want, rel=1e-9)
    assert per_byte == pytest.approx(per_byte_s, rel=0.01)
    assert fixed == pytest.approx(charged_per_op(schedule, 8, fixed_s), rel=1e-9)
