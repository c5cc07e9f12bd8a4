"""Tensors in flight (costmodels/transient.py): the memory a step holds beyond saved activations and model state.

The reference is torch's own memory estimator, torch.distributed._tools.mem_tracker.MemTracker, run on a real
training step (gradients and Adam state already there, as from the second step on): its peak must equal what
pipeplan predicts for the whole model on one device, from the trace's saved bytes, its tensors in flight and
the model state. Before the term existed the prediction missed GPT's peak by a quarter (the loss's gradients).
"""

import importlib.util
import random
from pathlib import Path

import pytest

from pipeplan.costmodels.graph import Graph
from pipeplan.costmodels.memory import RangeMemory, transient_over_saved
from pipeplan.costmodels.trace import trace

ROOT = Path(__file__).resolve().parents[1]


def _memory_bench():
    """benchmarks/memory_bench.py, loaded by path: putting benchmarks/ on sys.path would let its modules shadow
    tests/ ones of the same name (pipedream_reference)."""
    spec = importlib.util.spec_from_file_location("memory_bench", ROOT / "benchmarks" / "memory_bench.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_BENCH = _memory_bench()
measured_peak_bytes, predicted_peak_bytes = _BENCH.measured_peak_bytes, _BENCH.predicted_peak_bytes


@pytest.mark.parametrize("name,batch", [("examples/mlp.py", 64), ("examples/resnet.py", 32), ("examples/unet.py", 16),
                                        ("examples/gpt.py", 16)])
def test_predicted_peak_matches_torchs_memory_tracker(name, batch):
    graph = trace(str(ROOT / name), batch, time_layers=False)
    measured = measured_peak_bytes(str(ROOT / name), batch)
    # at most 2% under and 5% over: the gradient being accumulated is priced as the largest layer's (all of its
    # parameters, whenever its backward runs), which is where the prediction errs, on the safe side
    assert 0.98 * measured <= predicted_peak_bytes(graph) <= 1.05 * measured


def test_without_tensors_in_flight_the_language_model_peak_is_missed():
    """The term is what closes the gap: saved activations and state alone miss GPT's peak by the loss's tensors."""
    graph = trace(str(ROOT / "examples/gpt.py"), 16, time_layers=False)
    assert predicted_peak_bytes(graph, in_flight=False) < 0.9 * measured_peak_bytes(str(ROOT / "examples/gpt.py"), 16)


def test_the_loss_holds_two_logit_sized_gradients():
    """Cross-entropy's backward writes the gradient of the log-probabilities, then of the logits, while the saved
    log-probabilities are still held: 2 x batch x seq x vocab x 4 bytes beyond them, on the last layer (and the
    loss's scalars: a few bytes)."""
    graph = trace(str(ROOT / "examples/gpt.py"), 4, time_layers=False)
    seq, vocab = 64, 512  # examples/gpt.py "tiny"
    assert graph.layers[-1].name == "lm_head"
    assert graph.layers[-1].transient_bytes == pytest.approx(2 * 4 * seq * vocab * 4, abs=16)


def test_transient_over_saved_by_hand():
    # held after each layer: 10, 30, 35; with each layer's transient: 10+5, 30+2, 35+20 -> peak 55, 20 over 35
    assert transient_over_saved([10, 20, 5], [5, 2, 20]) == 20
    # a large early transient comes when little is held: 10+40 = 50 is over the 35 held at the end by 15
    assert transient_over_saved([10, 20, 5], [40, 0, 0]) == 15
    assert transient_over_saved([10, 20, 5], [0, 0, 0]) == 0


def test_the_loss_runs_outside_a_recomputed_stage():
    """Under recomputation the last layer's peak (its loss) comes before the re-run: beside its own saves only."""
    # layers: held 10, 30, 35 (the last saves 5 and peaks 20 over all); with the loss apart: max(10 + 5, 30 + 2,
    # 5 + 20) = 32, under the 35 held at the end: nothing beyond
    assert transient_over_saved([10, 20, 5], [5, 2, 20], loss_apart=True) == 0
    assert transient_over_saved([10, 20, 5], [5, 2, 60], loss_apart=True) == 5 + 60 - 35
    assert transient_over_saved([10, 20, 5], [40, 2, 0], loss_apart=True) == transient_over_saved([10, 20, 5],
                                                                                                [40, 2, 0])


def test_range_memory_charges_what_stage_memory_does():
    rng = random.Random(3)
    n = 9
    saved = [rng.randrange(1, 1000) for _ in range(n)]
    transient = [rng.randrange(0, 3000) for _ in range(n)]
    kw = dict(param_bytes=[rng.randrange(0, 500) for _ in range(n)], saved_bytes=saved, cut_bytes=[7] * (n - 1),
              input_bytes=5, schedule="1f1b", stages=3, microbatches=4, chunks=1, recompute=False,
              optimizer="adam", dtype="fp32")
    for recompute in (False, True):
        kw["recompute"] = recompute
        with_t, without = RangeMemory(**kw, transient_bytes=transient), RangeMemory(**kw)
        for a in range(n):
            for b in range(a + 1, n + 1):
                assert with_t(1, a, b) - without(1, a, b) == transient_over_saved(
                    saved[a:b], transient[a:b], loss_apart=recompute and b == n)


def test_graph_files_keep_the_field_and_older_ones_load_without_it():
    graph = trace(str(ROOT / "examples/gpt.py"), 2, time_layers=False)
    doc = graph.to_dict()
    assert Graph.from_dict(doc).layers[-1].transient_bytes == graph.layers[-1].transient_bytes > 0
    for layer in doc["layers"]:
        del layer["transient_bytes"]
    assert all(layer.transient_bytes == 0 for layer in Graph.from_dict(doc).layers)
