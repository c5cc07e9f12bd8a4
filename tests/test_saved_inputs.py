"""A stage whose first layer saves its input saves the tensor it received: counted once, not twice.

torch's stages run a microbatch on the buffer they received it into, so a first LayerNorm, Linear or GELU saves
that very storage, which the memory model already counts as a receive buffer (or, recomputed, as the input the
checkpoint keeps). The trace records what each layer saves of tensors earlier layers made
(`Layer.input_saved_bytes`, costmodels/transient.py `saved_inputs`); `stage_memory` and the partitioner's
`RangeMemory` count it once (costmodels/memory.py `saved_beyond_received`). References: the tensors' own sizes,
and `stage_memory` with the same stage's saves less that input.
"""

import itertools
import random
from pathlib import Path

import pytest

from pipeplan.costmodels.graph import Graph
from pipeplan.costmodels.memory import RangeMemory, saved_beyond_received, split_rerun_bytes, stage_memory
from pipeplan.costmodels.trace import trace

ROOT = Path(__file__).resolve().parents[1]
BATCH, SEQ, WIDTH = 4, 64, 64  # examples/gpt.py "tiny"
FP32 = 4


@pytest.fixture(scope="module")
def traced():
    return trace(str(ROOT / "examples/gpt.py"), BATCH, time_layers=False)


@pytest.fixture(scope="module")
def gpt(traced):
    return {layer.name: layer for layer in traced.layers}


def test_a_layernorm_and_a_linear_save_the_residual_stream_they_receive(gpt):
    """ln_1 reads the residual stream the block before made; c_fc reads ln_2's output: each saves it, a weight
    op's save (its own mean and rstd, or nothing else of the input, are no input)."""
    stream = BATCH * SEQ * WIDTH * FP32
    for name in ("h.1.ln_1", "h.1.mlp.c_fc"):
        assert gpt[name].input_saved_bytes == stream, name
        assert gpt[name].input_nonweight_saved_bytes == 0, name
        assert gpt[name].input_saved_bytes <= gpt[name].saved_bytes


def test_a_gelu_saves_the_linears_output_as_an_op_without_weights(gpt):
    wide = BATCH * SEQ * 4 * WIDTH * FP32
    gelu = gpt["h.1.mlp.gelu"]
    assert gelu.input_saved_bytes == gelu.input_nonweight_saved_bytes == gelu.saved_bytes == wide


def test_the_models_own_input_is_no_layers(gpt):
    """Token ids come from outside the model (and save nothing a stage received)."""
    assert next(iter(gpt.values())).input_saved_bytes == 0


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "interleaved", "zb-h1"])
@pytest.mark.parametrize("recompute", [False, True])
def test_stage_memory_counts_the_received_input_once(schedule, recompute):
    """Torch's schedules: the same device as one whose saves leave that input out. PipeDream's loops receive into
    tensors of their own: unchanged."""
    chunks = 2 if schedule == "interleaved" else 1
    kw = dict(param_bytes=4000, input_bytes_per_mb=300, output_bytes_per_mb=300, schedule=schedule, stages=3, stage=1,
              microbatches=6, optimizer="adam", dtype="fp32", recompute=recompute, chunks=chunks)
    once = stage_memory(saved_bytes_per_mb=2000, input_saved_bytes_per_mb=300, **kw)
    assert once.total_bytes == stage_memory(saved_bytes_per_mb=1700, **kw).total_bytes
    assert once.total_bytes < stage_memory(saved_bytes_per_mb=2000, **kw).total_bytes
    assert saved_beyond_received(2000, 300, "pipedream") == 2000
    assert saved_beyond_received(2000, 300, schedule) == 1700


@pytest.mark.parametrize("schedule,chunks,recompute", [("1f1b", 1, False), ("gpipe", 1, True), ("interleaved", 2, False),
                                                      ("zb-h1", 1, True), ("pipedream", 1, False)])
def test_range_memory_counts_a_ranges_first_layer_as_stage_memory_does(schedule, chunks, recompute):
    rng = random.Random(11)
    n, K, M = 7, 3, 6
    saved = [rng.randrange(100, 1000) for _ in range(n)]
    nonweight = [rng.randrange(0, s) for s in saved]
    received = [0] + [rng.randrange(0, s) for s in saved[1:]]
    received_nonweight = [min(r, w) for r, w in zip(received, nonweight, strict=True)]
    passes = [rng.randrange(0, 3) for _ in range(n)]
    kw = dict(param_bytes=[rng.randrange(0, 500) for _ in range(n)], saved_bytes=saved, cut_bytes=[7] * (n - 1),
              input_bytes=5, schedule=schedule, stages=K, microbatches=M, chunks=chunks, recompute=recompute,
              optimizer="adam", dtype="fp32")
    rm = RangeMemory(**kw, nonweight_saved_bytes=nonweight, weight_passes=passes, input_saved_bytes=received,
                     input_nonweight_saved_bytes=received_nonweight)
    torch_stage = schedule != "pipedream"
    splits = schedule == "zb-h1"
    for s, (a, b) in itertools.product(range(K * chunks), itertools.combinations(range(n + 1), 2)):
        first = received[a] if torch_stage else 0
        w_rerun = split_rerun_bytes(sum(saved[a:b]) - first, 0, sum(nonweight[a:b]) - received_nonweight[a],
                                    sum(passes[a:b]), first=s == 0) if splits and recompute else 0
        want = stage_memory(param_bytes=sum(kw["param_bytes"][a:b]) * chunks,
                            saved_bytes_per_mb=sum(saved[a:b]) * chunks, input_saved_bytes_per_mb=received[a] * chunks,
                            input_bytes_per_mb=7 if a else 5, output_bytes_per_mb=7 if b < n else 0,
                            schedule=schedule, stages=K, stage=s % K, microbatches=M, optimizer="adam", dtype="fp32",
                            recompute=recompute, chunks=chunks, largest_layer_param_bytes=max(kw["param_bytes"][a:b]),
                            w_rerun_bytes=w_rerun)
        assert rm(s, a, b) == want.total_bytes, (s, a, b)


def test_graph_files_from_before_the_fields_load_with_zeros(traced, gpt):
    """A graph file traced before these counts (the layer's and its autocast objects' keys absent) loads, as 0."""
    doc = traced.to_dict()
    assert Graph.from_dict(doc).layers[2].input_saved_bytes == traced.layers[2].input_saved_bytes > 0
    for layer in doc["layers"]:
        for counts in [layer, *layer.get("autocast", {}).values()]:
            counts.pop("input_saved_bytes", None)
            counts.pop("input_nonweight_saved_bytes", None)
    loaded = Graph.from_dict(doc).layers
    assert all(x.input_saved_bytes == x.input_nonweight_saved_bytes == 0 for x in loaded)
    assert all(x.autocast.get("cpu", {}).get("input_saved_bytes", 0) == 0 for x in loaded)


def test_a_recomputed_v_device_is_walked_with_each_chunks_own_bytes():
    """Recomputed, a V device's peak walked op by op: held microbatches keep their own stage's input, a forward or
    backward re-runs its own stage, a W holds its own stage's re-runs (and the loss's saves on the last stage).
    By hand on a four-op order of stages 1 and 2 (the middle device of a 2-device ZB-V)."""
    from pipeplan.costmodels.memory import walked_recomputed_bytes

    order = [("F", 1, 0), ("F", 2, 0), ("B", 2, 0), ("W", 2, 0), ("B", 1, 0), ("W", 1, 0)]
    kept, rerun, w_rerun = [0, 40, 20, 0], [0, 500, 600, 0], [0, 2000, 3000, 0]
    loss, deferred, transient = [0, 0, 0, 0], [0, 7, 9, 0], [0, 30, 50, 0]
    # F1: 40 + 500 (+30); F2: 60 + 600 (+50); B2: 60 + 600 (+50); W2: 60 + 3000, 9 pending; B1: 40 + 500 (+30);
    # W1: 40 + 2000, 7 pending
    assert walked_recomputed_bytes(order, kept, rerun, w_rerun, loss, deferred, transient) == (3060, 9, 0)
    w_rerun[1] = w_rerun[2] = 100  # now stage 2's forward and backward peak: inputs, its re-run, tensors in flight
    assert walked_recomputed_bytes(order, kept, rerun, w_rerun, loss, deferred, transient) == (660, 0, 50)
