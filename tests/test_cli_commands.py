"""analyze / plan / compare / show through CliRunner, checking --json numbers against the planner's own functions.

The fixture graph is saved to disk, so no tracing happens except in the one
model.py test (the tiny MLP example, traced at batch 1).
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
from click.testing import CliRunner

import pipeplan.planner.predict as evaluate_mod
import pipeplan.planner.replay as replay_mod
import pipeplan.planner.search as search_mod
from cli_fixtures import chain_graph
from pipeplan.cli.main import cli
from pipeplan.hardware_profiles import load_profile
from pipeplan.planner.plan import Plan, load_plan
from pipeplan.planner.request import PlanRequest

ROOT = Path(__file__).resolve().parents[1]
DATA = Path(__file__).resolve().parent / "data"


def run(args):
    result = CliRunner().invoke(cli, [str(a) for a in args])
    assert result.exit_code == 0, (result.exit_code, result.stdout, result.stderr, result.exception)
    return result


def run_json(args):
    result = run(list(args) + ["--json"])
    return json.loads(result.stdout)  # one document and nothing else on stdout


def png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    return struct.unpack(">II", data[16:24])


@pytest.fixture(scope="module")
def graph():
    return chain_graph()


@pytest.fixture(scope="module")
def graph_file(tmp_path_factory, graph):
    path = tmp_path_factory.mktemp("g") / "graph.json"
    graph.save(path)
    return path


@pytest.fixture(scope="module")
def planned(graph_file, tmp_path_factory):
    """One `plan` run with every output, shared by the checks below."""
    out = tmp_path_factory.mktemp("out")
    doc = run_json(["plan", graph_file, "--profile", "a100-80gb-sxm", "--gpus", "4", "--batch-size", "32",
                    "-o", out / "plan.json", "--plot", out / "schedule.png", "--chrome-trace", out / "trace.json"])
    return doc, out


def test_plan_json_matches_search_called_directly(planned, graph):
    doc, out = planned
    profile = load_profile("a100-80gb-sxm")
    direct = search_mod.search(graph, profile, PlanRequest(devices=4, batch_size=32, dtype="bf16"))  # dtype auto = bf16 on a catalogue profile
    assert doc["plan"]["dtype"] == "bf16"
    assert doc["plan"]["predicted"] == direct.best.to_dict()["predicted"]
    assert [s["layers"] for s in doc["plan"]["stages"]] == [s.layers for s in direct.best.stages]
    assert doc["baseline"]["samples_per_s"] == direct.baseline.predicted.samples_per_s
    assert doc["baseline"]["speedup"] == pytest.approx(direct.best.predicted.samples_per_s / direct.baseline.predicted.samples_per_s)
    assert doc["graph"]["fingerprint"] == graph.fingerprint()
    assert doc["graph"]["parameters"] == graph.param_bytes // 4
    assert doc["profile"]["name"] == "a100-80gb-sxm" and doc["profile"]["usable_memory_bytes"] == profile.usable_memory_bytes
    # the plan file is the same plan, and loads back
    assert load_plan(out / "plan.json").to_dict() == doc["plan"]
    # the predictions are the evaluation of the plan's own partition
    assignment = [s.index for s in direct.best.stages for _ in s.layers]
    again = evaluate_mod.evaluate(graph, profile, assignment, data_parallel=direct.best.data_parallel,
                                  schedule=direct.best.schedule, microbatches=direct.best.microbatches, batch_size=32,
                                  dtype="bf16", optimizer="adam", recompute=direct.best.recompute, chunks=direct.best.chunks,
                                  layout=direct.best.solver.get("layout", "stage-major"))
    assert again.predicted.samples_per_s == pytest.approx(doc["plan"]["predicted"]["samples_per_s"], rel=1e-9)


def test_plan_outputs_png_and_chrome_trace(planned, graph):
    doc, out = planned
    w, h = png_size(out / "schedule.png")
    assert 900 <= w <= 2500 and 400 <= h <= 2500
    trace = json.loads((out / "trace.json").read_text())
    plan = Plan.from_dict(doc["plan"])
    sim = replay_mod.simulate_plan(plan, graph, load_profile("a100-80gb-sxm"))
    x = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    fwd = [e for e in x if e["args"]["kind"] == "fwd"]
    bwd = [e for e in x if e["args"]["kind"] == "bwd"]
    assert len(fwd) == len(bwd) == len([e for e in sim.events if e.kind == "fwd"])
    assert len(fwd) == len(plan.stages) * plan.microbatches or plan.schedule in ("pipedream", "interleaved")
    assert {e["name"] for e in fwd} >= {f"F{m}" for m in range(plan.microbatches)}
    end_us = max(e["ts"] + e["dur"] for e in x)
    assert end_us == pytest.approx(sim.iteration_s * 1e6, rel=1e-6)


@pytest.mark.parametrize(
    "flags, kwargs",
    [
        (["--stages", "2", "--microbatches", "4", "--schedule", "1f1b"], dict(stages=2, microbatches=4, schedule="1f1b")),
        (["--schedule", "gpipe", "--recompute", "on", "--optimizer", "sgd", "--dtype", "fp32"],
         dict(schedule="gpipe", recompute="on", optimizer="sgd", dtype="fp32")),
        (["--times", "measured", "--solver", "dp"], dict(times="measured", solver="dp")),
    ],
)
def test_option_families_reach_the_search(graph_file, graph, flags, kwargs):
    doc = run_json(["plan", graph_file, "--profile", "h100-sxm", "--gpus", "4", "--batch-size", "16"] + flags)
    kwargs = {"dtype": "bf16", **kwargs}
    direct = search_mod.search(graph, load_profile("h100-sxm"), PlanRequest(devices=4, batch_size=16, **kwargs))
    assert doc["plan"]["predicted"] == direct.best.to_dict()["predicted"]
    assert doc["plan"]["dtype"] == kwargs["dtype"]
    if "stages" in kwargs:
        assert len(doc["plan"]["stages"]) == kwargs["stages"] and doc["plan"]["microbatches"] == kwargs["microbatches"]
    if "schedule" in kwargs:
        assert doc["plan"]["schedule"] == kwargs["schedule"]
    if kwargs.get("recompute") == "on":
        assert doc["plan"]["recompute"] is True
    if "optimizer" in kwargs:
        assert doc["plan"]["optimizer"] == kwargs["optimizer"]


def test_infeasible_memory_is_a_user_error(tmp_path):
    huge = chain_graph(param_scale=20_000)  # ~1 TB of parameters
    path = tmp_path / "huge.json"
    huge.save(path)
    result = CliRunner().invoke(cli, ["plan", str(path), "--profile", "t4", "--gpus", "2", "-o", str(tmp_path / "p.json")])
    assert result.exit_code == 2, result.output
    line = [l for l in result.stderr.splitlines() if l.startswith("error:")]
    assert len(line) == 1 and "GiB" in line[0] and "Traceback" not in result.stderr
    assert not (tmp_path / "p.json").exists()


def test_human_report_on_stdout_progress_elsewhere(graph_file):
    result = run(["plan", graph_file, "--profile", "a100-80gb-sxm", "--gpus", "4", "--batch-size", "32"])
    out = result.stdout
    assert "per microbatch" in out and "samples/s" in out and "equal-layers split" in out
    from pipeplan.cli.fmt import fmt_bytes

    assert "layers.0" in out and f"% of {fmt_bytes(load_profile('a100-80gb-sxm').usable_memory_bytes)} usable" in out
    assert "plan: " not in out  # progress lines go to stderr


def test_show_reproduces_the_saved_plan(planned, graph_file, tmp_path):
    doc, out = planned
    shown = run_json(["show", out / "plan.json"])
    assert shown["plan"] == doc["plan"]
    assert shown["profile"]["name"] == "a100-80gb-sxm"
    # from the plan alone, the re-simulated timeline ends at the predicted iteration time
    run(["show", out / "plan.json", "--plot", tmp_path / "s.png", "--chrome-trace", tmp_path / "t.json"])
    x = [e for e in json.loads((tmp_path / "t.json").read_text())["traceEvents"] if e["ph"] == "X"]
    end_s = max(e["ts"] + e["dur"] for e in x) / 1e6
    assert end_s == pytest.approx(doc["plan"]["predicted"]["iteration_s"], rel=1e-6)
    assert png_size(tmp_path / "s.png")[0] > 900
    # with its graph, the model summary comes back
    with_graph = run_json(["show", out / "plan.json", "--graph", graph_file])
    assert with_graph["graph"]["parameters"] == doc["graph"]["parameters"]
    text = run(["show", out / "plan.json"]).stdout
    assert "tiny-chain" in text and "samples/s" in text


def test_compare_rows_match_search_per_profile(graph_file, graph, tmp_path):
    names = ["v100-32gb", "a100-80gb-sxm", "h100-sxm"]
    doc = run_json(["compare", graph_file, "--profiles", ",".join(names), "--gpus", "4", "--batch-size", "32",
                    "--plot", tmp_path / "bars.png"])
    assert [r["profile"] for r in doc["profiles"]] == [load_profile(n).name for n in names]
    # dtype auto: bf16 mixed precision, fp16 on a V100 (no bf16 there)
    assert [r["dtype"] for r in doc["profiles"]] == ["fp16", "bf16", "bf16"]
    for row in doc["profiles"]:
        best = search_mod.search(graph, load_profile(row["profile"]), PlanRequest(devices=4, batch_size=32, dtype=row["dtype"])).best
        assert row["samples_per_s"] == best.predicted.samples_per_s
        assert row["stages"] == len(best.stages) and row["microbatches"] == best.microbatches
        assert row["schedule"] == best.schedule
        assert row["memory_headroom_bytes"] == load_profile(row["profile"]).usable_memory_bytes - best.predicted.peak_memory_bytes
        for key in ("profile", "stages", "replicas", "microbatches", "schedule", "samples_per_s"):
            assert key in row
    w, h = png_size(tmp_path / "bars.png")
    assert w > 500 and h > 150


def test_compare_keeps_going_when_one_profile_cannot_fit(tmp_path):
    big = chain_graph(param_scale=1000)  # 2.2B parameters: 16 B each (mixed-precision Adam) = 35 GB, > T4, < H200
    path = tmp_path / "big.json"
    big.save(path)
    doc = run_json(["compare", path, "--profiles", "t4,h200", "--gpus", "1", "--batch-size", "4"])
    t4, h200 = doc["profiles"]
    assert t4["feasible"] is False and "GiB" in t4["error"] and t4["samples_per_s"] is None
    assert h200["feasible"] is True and h200["samples_per_s"] > 0


def test_analyze_traces_a_model_once_at_batch_1(tmp_path):
    doc = run_json(["analyze", ROOT / "examples" / "mlp.py", "--profile", "a100-80gb-sxm", "--gpus", "2",
                    "--batch-size", "16", "--repeats", "1", "--plot", tmp_path / "mlp.png"])
    assert doc["graph"]["trace_batch_size"] == 1
    assert doc["graph"]["source"]["model_file"] == str((ROOT / "examples" / "mlp.py").resolve())
    widths = [256, 2048, 512, 4096, 256, 1024, 128, 10]
    assert doc["graph"]["parameters"] == sum(a * b + b for a, b in zip(widths[:-1], widths[1:], strict=True))
    assert doc["plan"]["batch_size"] == 16 and doc["plan"]["graph"]["trace_batch_size"] == 1
    assert png_size(tmp_path / "mlp.png")[0] > 900


def test_plan_reads_a_pipedream_profile():
    path = DATA / "pipedream-profiles" / "vgg16.graph.txt"
    # 32 GB cards: on 16 GB ones nothing fits once torch's per-microbatch receive buffers are counted
    doc = run_json(["plan", path, "--profile", "v100-32gb-sxm2", "--gpus", "4", "--batch-size", "64", "--dtype", "fp32"])
    assert doc["plan"]["graph"]["model_file"] is None
    assert doc["plan"]["predicted"]["samples_per_s"] > 0


@pytest.mark.parametrize(
    "flags",
    [
        ["--schedule", "interleaved", "--stages", "2", "--microbatches", "4"],
        ["--schedule", "pipedream", "--gpus", "4"],
        ["--schedule", "1f1b", "--recompute", "on", "--stages", "2", "--gpus", "4"],  # recompute + 2 data-parallel replicas
    ],
)
def test_show_retraces_the_same_timeline_from_the_plan_alone(graph_file, graph, tmp_path, flags):
    args = ["plan", graph_file, "--profile", "a100-80gb-sxm", "--gpus", "2", "--batch-size", "16"] + flags
    doc = run_json(args + ["-o", tmp_path / "p.json", "--chrome-trace", tmp_path / "a.json"])
    plan = doc["plan"]
    if "interleaved" in flags:
        assert plan["schedule"] == "interleaved" and plan["chunks"] >= 2 and len(plan["stages"]) == 2 * plan["chunks"]
        direct = search_mod.search(graph, load_profile("a100-80gb-sxm"), PlanRequest(devices=2, batch_size=16, dtype="bf16", schedule="interleaved", stages=2, microbatches=4))
        assert plan["predicted"] == direct.best.to_dict()["predicted"]
    run(["show", tmp_path / "p.json", "--chrome-trace", tmp_path / "b.json"])
    a, b = ([e for e in json.loads((tmp_path / n).read_text())["traceEvents"] if e["ph"] == "X"] for n in ("a.json", "b.json"))
    if "interleaved" in flags:  # chunk-suffixed names ("F3.1") on both devices
        assert any(e["name"].endswith(".1") for e in a) and {e["pid"] for e in a} == {0, 1}
    if "on" in flags:
        assert any(e["cat"] == "recompute" for e in a)
    key = lambda e: (e["pid"], e["name"], e["cat"], round(e["ts"], 3), round(e["dur"], 3))  # noqa: E731
    assert sorted(map(key, a)) == sorted(map(key, b))


def test_analyze_accepts_a_saved_graph_like_plan(graph_file):
    args = [graph_file, "--profile", "h100-sxm", "--gpus", "2", "--batch-size", "8"]
    a, p = run_json(["analyze"] + args)["plan"], run_json(["plan"] + args)["plan"]
    a.pop("solver"), p.pop("solver")  # holds the solve's wall time
    assert a == p


def test_compare_row_for_a_precision_the_device_lacks(graph_file):
    doc = run_json(["compare", graph_file, "--profiles", "tpu-v5p,a100-80gb-sxm", "--gpus", "2", "--batch-size", "8", "--dtype", "fp32"])
    tpu, a100 = doc["profiles"]
    assert tpu["feasible"] is False and "fp32" in tpu["error"] and "--dtype bf16" in tpu["error"]
    assert a100["feasible"] is True and a100["dtype"] == "fp32"
    # with a single profile the same problem is the command's error (exit 2)
    result = CliRunner().invoke(cli, ["compare", str(graph_file), "--profiles", "tpu-v5p", "--gpus", "2", "--dtype", "fp32"])
    assert result.exit_code == 2 and "fp32" in result.stderr


def test_show_a_plan_whose_profile_file_moved(tmp_path):
    from cli_fixtures import hand_plan

    plan = hand_plan()
    plan.profile = str(tmp_path / "gone.yaml")
    plan.save(tmp_path / "p.json")
    doc = run_json(["show", tmp_path / "p.json"])
    assert doc["profile"] is None and "gone.yaml" in doc["notes"][0]
    result = run(["show", tmp_path / "p.json", "--plot", tmp_path / "p.png"])
    assert "memory capacity not shown" in result.stdout
    assert png_size(tmp_path / "p.png")[0] > 900



def _own_profile(path: Path) -> Path:
    """A user profile YAML (the H100 catalogue entry under another name), at `path`."""
    text = (ROOT / "hardware_profiles" / "catalog" / "h100-sxm.yaml").read_text()
    lines = [line for line in text.splitlines() if not line.startswith("aliases")]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join("name: my-box" if line.startswith("name:") else line for line in lines) + "\n")
    return path


def test_show_finds_the_profile_a_plan_was_made_with(graph_file, tmp_path, monkeypatch):
    """A plan made with `--profile profiles/local.yaml` used to say profile 'local' not found in `show`."""
    _own_profile(tmp_path / "profiles" / "local.yaml")
    monkeypatch.chdir(tmp_path)
    run(["plan", graph_file, "--profile", "profiles/local.yaml", "--gpus", "2", "-b", "8", "-o", "plan.json"])
    report = run(["show", "plan.json"]).stdout
    assert "profiles/local.yaml" in report and str(tmp_path) not in report and "not found" not in report
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")  # shown from another folder: the recorded path still leads to it
    doc = run_json(["show", "../plan.json"])
    assert doc["notes"] == [] and doc["profile"]["name"] == "my-box"


def test_show_finds_a_profile_copied_beside_its_plan(graph_file, tmp_path, monkeypatch):
    """A plan and its profile moved together (another folder, another machine): the YAML beside the plan."""
    own = _own_profile(tmp_path / "made" / "box.yaml")
    monkeypatch.chdir(tmp_path / "made")
    run(["plan", graph_file, "--profile", "box.yaml", "--gpus", "2", "-b", "8", "-o", "plan.json"])
    moved = tmp_path / "moved"
    moved.mkdir()
    for name in ("plan.json", "box.yaml"):
        (tmp_path / "made" / name).rename(moved / name)
    assert not own.exists()
    doc = run_json(["show", moved / "plan.json"])
    assert doc["notes"] == [] and doc["profile"]["name"] == "my-box"

def test_json_stdout_stays_clean_when_the_model_prints(tmp_path):
    model = tmp_path / "chatty.py"
    model.write_text(
        "import torch\n"
        "print('building the model!')\n"
        "class M(torch.nn.Module):\n"
        "    def __init__(self):\n"
        "        super().__init__()\n"
        "        self.a, self.b = torch.nn.Linear(8, 16), torch.nn.Linear(16, 4)\n"
        "    def forward(self, x):\n"
        "        print('forward!')\n"
        "        return self.b(torch.relu(self.a(x)))\n"
        "def build_model():\n"
        "    return M()\n"
        "def example_inputs(batch_size):\n"
        "    return (torch.randn(batch_size, 8),)\n"
    )
    result = CliRunner().invoke(cli, ["analyze", str(model), "--profile", "h100-sxm", "--gpus", "2", "--batch-size", "4",
                                      "--repeats", "1", "--json"])
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    assert doc["graph"]["parameters"] == 8 * 16 + 16 + 16 * 4 + 4
    assert "forward!" in result.stderr
