"""Weight-free tracing (issue 15, point 1): no parameter memory, no timing, the real trace's numbers.

The oracle for every example is the real trace (real weights, timed), run here: the
weight-free trace must give exactly its FLOPs, bytes, structure and fingerprint, and
differ only in the measured times (zero) and in saying so in `source`. A model too big
to build here (Llama-2-7B-shaped, 27 GB of fp32 weights) is checked against
parameter and FLOP counts computed from its shapes, in a subprocess whose address
space is capped well below its weights, so a regression fails instead of swapping.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import resource
import subprocess
import sys
from pathlib import Path
from unittest import mock

import pytest

from cli_invoke import invoke as run
from pipeplan.costmodels import gpu_attention
from pipeplan.costmodels.graph import Graph, load_graph
from pipeplan.costmodels.model_file import OutOfMemory, load_model_file
from pipeplan.costmodels.trace import trace
from pipeplan.hardware_profiles import load_profile, save_profile

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
LLAMA = ROOT / "examples" / "llama2_7b.py"
HAS_HF = importlib.util.find_spec("transformers") is not None
needs_hf = pytest.mark.skipif(not HAS_HF, reason="transformers not installed")
CAP_BYTES = 8 << 30  # address-space cap of the subprocesses: far below 27 GB of Llama weights

# (example, entry, batch): every example that fits in memory here, GPT-2 small included
CASES = [
    pytest.param("mlp", "build_model", 2, id="mlp"),
    pytest.param("wide_mlp", "build_model", 2, id="wide_mlp"),
    pytest.param("resnet", "build_model", 2, id="resnet"),
    pytest.param("unet", "build_model", 2, id="unet"),
    pytest.param("gpt", "build_model", 2, id="gpt"),
    pytest.param("gpt", "build_gpt2_small", 1, id="gpt2_small", marks=pytest.mark.slow),
    pytest.param("hf_gpt2", "build_model", 2, id="hf_gpt2", marks=needs_hf),
]
_cache: dict[tuple[str, str, int, bool], Graph] = {}
# GPT-2 small at 128 tokens, not its 1,024: its 124M weights are what the weight-free trace leaves out, and the
# full context only made the timed trace several times longer (examples/gpt.py reads PIPEPLAN_GPT_SEQ).
SEQ_ENV = {"build_gpt2_small": {"PIPEPLAN_GPT_SEQ": "128"}}


def traced(name: str, entry: str, batch: int, *, time_layers: bool) -> Graph:
    """The example traced; a timed (real) trace counts attention as the weight-free one does, as a GPU runs it
    (Hugging Face GPT-2's attention dropout: costmodels/gpu_attention.py; test_gpu_attention.py holds the CPU's
    path apart), so the two differ only in what weights and timing change."""
    key = (name, entry, batch, time_layers)
    if key not in _cache:
        repeats = 1 if time_layers else None
        as_gpu = gpu_attention.counting_as_gpu
        with (mock.patch.dict(os.environ, SEQ_ENV.get(entry, {})),
              mock.patch.object(gpu_attention, "counting_as_gpu", lambda enabled=True: as_gpu(True))):
            _cache[key] = trace(str(EXAMPLES / f"{name}.py"), batch, entry=entry, repeats=repeats,
                                time_layers=time_layers)
    return _cache[key]


FVCORE_SKIPPED = "fvcore cross-check skipped"


def without_times(graph: Graph) -> dict:
    """The graph document less what only a timed trace has: times, the source that describes them, and the
    fvcore cross-check, which needs a real model where fvcore cannot trace on meta (convolutions)."""
    doc = graph.to_dict()
    doc.pop("source")
    fvcore_notes = [n for n in doc["notes"] if n.startswith("fvcore") or n.startswith("FLOPs disagree with fvcore")
                    or n.startswith("total matmul/conv forward FLOPs disagree")]
    doc["notes"] = [n for n in doc["notes"] if n not in fvcore_notes]
    assert all(FVCORE_SKIPPED not in n for n in fvcore_notes) or graph.source["weights"] == "meta"
    for layer in doc["layers"]:
        assert layer.pop("fwd_s") >= 0 and layer.pop("bwd_s") >= 0
        w = layer.pop("bwd_weight_s")  # timed traces only (the weight-free one is not timed: null)
        assert w is None or w >= 0
        saves, upto = layer.pop("saved_tensors"), layer.pop("last_save_s")  # likewise
        assert (saves is None) == (upto is None) and (upto is None or upto >= 0)
        adds = layer.pop("grad_accumulate_s")  # likewise
        assert adds is None or 0 <= adds
    doc["totals"] = {k: v for k, v in doc["totals"].items() if not k.endswith("_s")}
    return doc


@pytest.mark.parametrize("name, entry, batch", CASES)
def test_weight_free_trace_gives_exactly_the_real_trace(name, entry, batch):
    real = traced(name, entry, batch, time_layers=True)
    free = traced(name, entry, batch, time_layers=False)
    assert free.fingerprint() == real.fingerprint()  # the runtime re-exports the real model and compares this
    assert [l.name for l in free.layers] == [l.name for l in real.layers]
    for a, b in zip(free.layers, real.layers, strict=True):
        assert (a.fwd_flops, a.bwd_flops, a.saved_bytes, a.param_bytes, a.bytes_moved, a.output_bytes, a.kind) == \
               (b.fwd_flops, b.bwd_flops, b.saved_bytes, b.param_bytes, b.bytes_moved, b.output_bytes, b.kind), a.name
    assert without_times(free) == without_times(real)  # edges, shared parameters, notes, totals: all of it
    fv_free = [n for n in free.notes if n.startswith("fvcore")]
    fv_real = [n for n in real.notes if n.startswith("fvcore")]
    assert fv_free == fv_real or (len(fv_free) == 1 and "on the meta device" in fv_free[0])
    assert sum(l.fwd_flops for l in real.layers) > 0 and real.param_bytes > 0


@pytest.mark.parametrize("name, entry, batch", CASES)
def test_weight_free_trace_is_untimed_and_says_so(name, entry, batch):
    real = traced(name, entry, batch, time_layers=True)
    free = traced(name, entry, batch, time_layers=False)
    assert free.source["weights"] == "meta" and free.source["timed"] is False
    assert all(l.fwd_s == 0.0 and l.bwd_s == 0.0 for l in free.layers)
    assert free.source["repeats"] is None
    assert real.source["weights"] == "real" and real.source["timed"] is True and real.source["repeats"] == 1
    assert sum(l.fwd_s + l.bwd_s for l in real.layers) > 0
    round_trip = Graph.from_dict(json.loads(json.dumps(free.to_dict())))
    assert round_trip.source["timed"] is False and round_trip.fingerprint() == real.fingerprint()


def _cap_address_space() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (CAP_BYTES, CAP_BYTES))


def capped(args: list[str], **env: str) -> subprocess.CompletedProcess:
    """`python -m pipeplan ARGS` with its address space capped (a real build of the big models fails fast)."""
    return subprocess.run([sys.executable, "-m", "pipeplan", *args], preexec_fn=_cap_address_space,
                          capture_output=True, text=True, timeout=600, env={**os.environ, **env}, cwd=ROOT)


def llama_counts(seq: int) -> tuple[int, int]:
    """Parameters and forward FLOPs (batch 1) of the Llama-2-7B shape, from its dimensions alone."""
    vocab, hidden, inter, layers = 32000, 4096, 11008, 32
    per_layer = 4 * hidden * hidden + 3 * hidden * inter + 2 * hidden  # q,k,v,o; gate,up,down; two RMSNorms
    params = 2 * vocab * hidden + layers * per_layer + hidden  # embedding, untied LM head, final norm
    matmul = 2 * seq * (layers * (4 * hidden * hidden + 3 * hidden * inter) + vocab * hidden)
    attention = layers * 4 * seq * seq * hidden  # softmax(QK^T)V: 2 matmuls of 2*s*s*d per head
    # Not counted, by the real trace either: the rotary table's matmul, inv_freq (d/2 x 1) @ positions (1 x s),
    # 2*(d/2)*s FLOPs, runs under torch.no_grad, which export wraps in a higher-order op (wrap_with_set_grad_enabled)
    # that FlopCounterMode does not look into.
    return params, matmul + attention


@needs_hf
@pytest.mark.slow
def test_llama_7b_shape_traces_without_its_weights(tmp_path):
    out = tmp_path / "llama.json"
    r = capped(["trace", str(LLAMA), "--no-times", "-b", "1", "-o", str(out), "--no-fvcore-check"],
               PIPEPLAN_LLAMA_SEQ="64")
    assert r.returncode == 0, r.stderr[-2000:]
    g = load_graph(out)
    params, fwd_flops = llama_counts(64)
    assert g.param_bytes == 4 * params  # 27 GB of weights, in a process that cannot map 8 GiB
    assert sum(l.fwd_flops for l in g.layers) == fwd_flops
    assert g.source["weights"] == "meta" and g.source["timed"] is False


HUGE = """import torch
def build_model():  # 14.4 GB of fp32 weights
    return torch.nn.Sequential(torch.nn.Linear(60000, 60000), torch.nn.ReLU(), torch.nn.Linear(60000, 10))
def example_inputs(batch_size):
    return (torch.randn(batch_size, 60000),)
"""


@pytest.mark.slow
def test_out_of_memory_says_too_big_not_fix_the_file(tmp_path):
    model = tmp_path / "huge.py"
    model.write_text(HUGE)
    r = capped(["trace", str(model), "-b", "1", "-o", str(tmp_path / "g.json"), "--no-fvcore-check"])
    assert r.returncode == 2, r.stderr[-2000:]
    assert "Traceback" not in r.stderr
    # refused before the build where its weights and gradients exceed the free RAM (tests/test_trace_ram.py), else
    # the capped build runs out: either way the same advice
    assert "out of memory" in r.stderr and "too big for this machine's RAM" in r.stderr
    assert "--no-times" in r.stderr and "catalogue profile" in r.stderr
    assert "fix build_model" not in r.stderr
    r = capped(["trace", str(model), "--no-times", "-b", "1", "-o", str(tmp_path / "g.json"), "--no-fvcore-check"])
    assert r.returncode == 0, r.stderr[-2000:]
    assert load_graph(tmp_path / "g.json").param_bytes == 4 * (60000 * 60000 + 60000 + 60000 * 10 + 10)


ALLOCATOR = ("[enforce fail at alloc_cpu.cpp:117] data. DefaultCPUAllocator: can't allocate memory: "
             "you tried to allocate 1073741824 bytes. Error code 12 (Cannot allocate memory)")


@pytest.mark.parametrize("raise_it", [f"raise RuntimeError({ALLOCATOR!r})", "raise MemoryError()"])
def test_an_allocation_failure_in_build_model_is_not_blamed_on_the_file(tmp_path, raise_it):
    model = tmp_path / "m.py"
    model.write_text(f"def build_model():\n    {raise_it}\ndef example_inputs(b):\n    return ()\n")
    with pytest.raises(OutOfMemory) as err:
        load_model_file(str(model)).build()
    assert "too big for this machine's RAM" in str(err.value) and "fix build_model" not in str(err.value)
    if "RuntimeError" in raise_it:
        assert "could not allocate 1,024 MiB more" in err.value.message


def test_any_other_error_in_build_model_is_still_the_files(tmp_path):
    model = tmp_path / "m.py"
    model.write_text("def build_model():\n    raise RuntimeError('shape mismatch')\ndef example_inputs(b):\n    return ()\n")
    with pytest.raises(Exception) as err:
        load_model_file(str(model)).build()
    assert not isinstance(err.value, OutOfMemory) and "fix build_model" in str(err.value)


NOT_ON_META = """import torch
class M(torch.nn.Module):
    def __init__(self):
        super().__init__()
        width = int(torch.tensor(16).item())  # a value, not a shape: the meta device has none
        self.a, self.b = torch.nn.Linear(8, width), torch.nn.Linear(width, 4)
    def forward(self, x):
        return self.b(torch.relu(self.a(x)))
def build_model():
    return M()
def example_inputs(batch_size):
    return (torch.randn(batch_size, 8),)
"""


def test_a_model_that_cannot_be_built_on_meta_falls_back_to_real_weights(tmp_path):
    model = tmp_path / "not_on_meta.py"
    model.write_text(NOT_ON_META)
    free = trace(str(model), 4, time_layers=False, fvcore_check=False)
    real = trace(str(model), 4, repeats=1, fvcore_check=False)
    assert free.source["weights"] == "real" and free.source["timed"] is False
    assert all(l.fwd_s == 0.0 and l.bwd_s == 0.0 for l in free.layers)
    assert free.notes[0].startswith("built with real weights: tracing without them failed")
    assert "item" in free.notes[0]
    assert free.fingerprint() == real.fingerprint()
    assert [(l.fwd_flops, l.bwd_flops, l.saved_bytes) for l in free.layers] == \
           [(l.fwd_flops, l.bwd_flops, l.saved_bytes) for l in real.layers]
    assert sum(l.fwd_flops for l in free.layers) == 2 * 4 * (8 * 16 + 16 * 4)


# ---- the CLI: time layers only when the times are used ----------------------------------------------


@pytest.fixture(scope="module")
def local_profile(tmp_path_factory):
    """A catalogue profile marked local (this machine's calibration), written as a YAML file."""
    p = dataclasses.replace(load_profile("a100-80gb-sxm"), name="test-local", local=True)
    path = tmp_path_factory.mktemp("profiles") / "test-local.yaml"
    save_profile(p, path)
    return path


MLP = EXAMPLES / "mlp.py"


@pytest.mark.parametrize("extra, timed", [
    (["--profile", "a100-80gb-sxm"], False),
    (["--profile", "a100-80gb-sxm", "--times", "measured"], True),
    (["--profile", "LOCAL"], True),
    (["--profile", "LOCAL", "--dtype", "bf16"], True),  # re-timed in bf16 like a device (cli/device_like.py)
    (["--profile", "LOCAL", "--dtype", "bf16", "--times", "roofline"], False),
])
def test_analyze_times_layers_only_when_the_plan_uses_them(local_profile, extra, timed, no_side_by_side):
    extra = [str(local_profile) if a == "LOCAL" else a for a in extra]
    code, out, err = run(["analyze", MLP, "--gpus", "2", "--batch-size", "16", "--repeats", "1", "--json", *extra])
    assert code == 0, err
    source = json.loads(out)["graph"]["source"]
    assert source["timed"] is timed
    assert source["weights"] == ("real" if timed else "meta")


def test_compare_times_layers_when_any_profile_uses_them(local_profile):
    code, out, err = run(["compare", MLP, "--profiles", f"a100-80gb-sxm,{local_profile}", "--gpus", "2",
                          "--batch-size", "16", "--repeats", "1", "--json"])
    assert code == 0, err
    assert json.loads(out)["graph"]["source"]["timed"] is True
    code, out, err = run(["compare", MLP, "--profiles", "a100-80gb-sxm,h100-sxm", "--gpus", "2",
                          "--batch-size", "16", "--json"])
    assert code == 0, err
    assert json.loads(out)["graph"]["source"]["weights"] == "meta"


@pytest.fixture(scope="module")
def untimed_graph(tmp_path_factory):
    path = tmp_path_factory.mktemp("untimed") / "graph.json"
    code, out, err = run(["trace", MLP, "--no-times", "-b", "4", "-o", path, "--no-fvcore-check"])
    assert code == 0, err
    assert "not timed" in out and "heaviest" in out
    return path


def test_trace_no_times_writes_an_untimed_graph_that_plans_on_a_catalogue_profile(untimed_graph):
    g = load_graph(untimed_graph)
    assert g.source["timed"] is False and g.source["weights"] == "meta"
    assert all(l.fwd_s == 0.0 for l in g.layers) and sum(l.fwd_flops for l in g.layers) > 0
    code, out, err = run(["plan", untimed_graph, "--profile", "a100-80gb-sxm", "--gpus", "2", "--json"])
    assert code == 0, err


@pytest.mark.parametrize("extra, why", [
    (["--profile", "a100-80gb-sxm", "--times", "measured"], "--times measured"),
    (["--profile", "LOCAL"], "the local profile test-local"),
])
def test_planning_an_untimed_graph_with_measured_times_is_a_user_error(untimed_graph, local_profile, extra, why):
    extra = [str(local_profile) if a == "LOCAL" else a for a in extra]
    code, out, err = run(["plan", untimed_graph, "--gpus", "2", *extra])
    assert code == 2, (out, err)
    line = [l for l in err.splitlines() if l.startswith("error:")]
    assert len(line) == 1 and "Traceback" not in err
    assert "traced without layer times" in line[0] and why in line[0]
    assert "on a catalogue profile with --times model" in line[0]  # advice that works: the test above


def test_no_times_and_repeats_contradict(tmp_path):
    code, out, err = run(["trace", MLP, "--no-times", "--repeats", "2", "-o", tmp_path / "g.json"])
    assert code == 2 and "--no-times" in err and not (tmp_path / "g.json").exists()
