"""Zero bubble's deferred gradients: what a split backward's input pass B keeps until its weight pass W.

torch.distributed.pipelining's zero-bubble schedules (ZB-H1, ZB-V, DualPipeV) run B as `stage_backward_input`
(torch _backward.py), which keeps the gradient flowing into every autograd node where the input's path meets a
parameter's until W. The memory model charges them (costmodels/transient.py `_DeferredGrads` per layer, memory.py
`held_with_deferred` / `walked_held_bytes` per device, schedules.py `weight_pass_points` for how many wait).
References: torch's own B on the real layers (the bytes it keeps), torch's own op orders (how many wait), and
the CPU runtime's memory meter against the same B and W without it (benchmarks/memory_bench.py runs the plans).
"""

import importlib.util
import itertools
import random
from pathlib import Path

import pytest
import torch

from pipeplan.costmodels.graph import Graph
from pipeplan.costmodels.memory import RangeMemory, held_with_deferred, stage_memory, walked_held_bytes
from pipeplan.costmodels.trace import trace
from pipeplan.costmodels.transient import StorageLog, _replay
from pipeplan.schedules import weight_pass_points
from pipeplan.v_orders import dualpipev_order, held_points, zbv_order

B = pytest.importorskip("torch.distributed.pipelining._backward")
S = pytest.importorskip("torch.distributed.pipelining.schedules")
ROOT = Path(__file__).resolve().parents[1]
BATCH, SEQ, WIDTH = 4, 64, 64  # examples/gpt.py "tiny"


def _gpt():
    spec = importlib.util.spec_from_file_location("example_gpt", ROOT / "examples" / "gpt.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    torch.manual_seed(0)
    return module.build_model()


def _kept_by_torchs_b(outputs, output_grads, x, params) -> int:
    """Bytes of the distinct gradients torch's B keeps for W (its param groups' "grads")."""
    _, groups = B.stage_backward_input(outputs, output_grads, [x], iter(params))
    kept = {t.untyped_storage()._cdata: t.untyped_storage().nbytes()
            for g in groups for grads in g.get("grads") or [] for t in grads if t is not None}
    return sum(kept.values())


@pytest.fixture(scope="module")
def traced():
    return trace(str(ROOT / "examples/gpt.py"), BATCH, time_layers=False)


def _layers_bytes(graph, prefix: str) -> int:
    return sum(layer.deferred_grad_bytes for layer in graph.layers if layer.name.startswith(prefix))


def test_a_blocks_deferred_gradients_are_what_torchs_input_pass_keeps(traced):
    model = _gpt()
    x = torch.randn(BATCH, SEQ, WIDTH, requires_grad=True)
    out = model.h[1](x)
    kept = _kept_by_torchs_b([out], [torch.randn_like(out)], x, model.h[1].parameters())
    assert kept > 0
    assert _layers_bytes(traced, "h.1.") == kept


def test_the_last_stages_deferred_gradients_include_the_logits(traced):
    """The loss's stage: torch's B from the loss keeps the final norm's output gradient and the logits'."""
    model = _gpt()
    x = torch.randn(BATCH, SEQ, WIDTH, requires_grad=True)
    logits = model.lm_head(model.ln_f(x))
    target = torch.randint(0, logits.shape[-1], (BATCH, SEQ))
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), target.flatten())
    params = [*model.ln_f.parameters(), model.lm_head.weight]
    kept = _kept_by_torchs_b([loss], None, x, params)
    assert kept == _layers_bytes(traced, "ln_f") + _layers_bytes(traced, "lm_head")
    assert _layers_bytes(traced, "lm_head") == logits.numel() * 4


def test_the_loss_saves_its_log_probabilities(traced):
    """Cross-entropy saves the log-probabilities (one logit-sized fp32 tensor) and its integer targets; torch's B
    on the loss's stage frees them (docs/cost-models.md §3.3b), so the trace records them on the last layer."""
    vocab = 512  # examples/gpt.py "tiny"
    assert [layer.name for layer in traced.layers if layer.loss_saved_bytes] == ["lm_head"]
    assert traced.layers[-1].loss_saved_bytes == pytest.approx(BATCH * SEQ * vocab * 4 + BATCH * SEQ * 8, abs=16)
    assert traced.layers[-1].loss_saved_bytes <= traced.layers[-1].saved_bytes


def test_an_embedding_lookup_keeps_nothing(traced):
    """Integer indices need no gradient: the token and position embeddings are no weight ops (torch skips the
    first stage's B anyway)."""
    assert traced.layers[0].name == "wte" and traced.layers[0].deferred_grad_bytes == 0


@pytest.mark.parametrize("field", ["deferred_grad_bytes", "loss_saved_bytes"])
def test_graph_files_keep_the_fields_and_older_ones_load_without_them(traced, field):
    doc = traced.to_dict()
    assert getattr(Graph.from_dict(doc).layers[-1], field) == getattr(traced.layers[-1], field) > 0
    for layer in doc["layers"]:
        del layer[field]
    assert all(getattr(layer, field) == 0 for layer in Graph.from_dict(doc).layers)


def _torch_zb_h1_order(K: int, M: int, rank: int) -> list[tuple[str, int, int]]:
    """torch's ScheduleInterleavedZeroBubble order with one stage per rank (ZB-H1), in v_orders' op names."""
    sched = S.ScheduleInterleavedZeroBubble.__new__(S.ScheduleInterleavedZeroBubble)  # no process group needed
    sched.pp_group_size, sched._n_microbatches, sched.n_local_stages = K, M, 1
    sched.number_of_rounds = max(1, M // K)
    sched.microbatches_per_round = M // sched.number_of_rounds
    sched.num_stages = sched._num_stages = K
    name = {"F": "F", "I": "B", "W": "W", "B": "BW"}
    return [(name[a.computation_type.value], a.stage_index, a.microbatch_index)
            for a in sched._calculate_single_rank_operations(rank) if a is not None]


@pytest.mark.parametrize("K", range(1, 7))
def test_zb_h1_points_are_torchs(K):
    for M in range(1, 14):
        if M % max(1, M // K):
            continue  # torch refuses it (schedules._zero_bubble_microbatches)
        for rank in range(K):
            got = weight_pass_points("zb-h1", K, rank, M, 1, 0)
            assert set(got) == set(held_points(_torch_zb_h1_order(K, M, rank))), (K, M, rank)


def _states(order):
    """Every op's (held, pending, busy) by the definition in held_points' docstring, unreduced."""
    held = pending = 0
    for kind, stage, _ in order:
        held += kind == "F"
        yield held, pending, kind != "W"
        if stage != 0:
            pending += 1 if kind == "B" else -1 if kind == "W" else 0
        held -= kind in ("W", "BW")


@pytest.mark.parametrize("order_of", [zbv_order, dualpipev_order])
def test_the_points_keep_every_peak(order_of):
    """Whatever a pair, a pending W and the tensors in flight weigh, the peak over the reduced points is the peak
    over every op."""
    rng = random.Random(5)
    for K, M in itertools.product(range(1, 5), range(1, 12)):
        if order_of is dualpipev_order and M < 2 * K:
            continue
        for rank in range(K):
            order = order_of(rank, K, M)
            points = held_points(order)
            for _ in range(5):
                w = rng.randrange(1, 100), rng.randrange(0, 100), rng.randrange(0, 300)
                assert (max(sum(x * y for x, y in zip(w, p, strict=True)) for p in points)
                        == max(sum(x * y for x, y in zip(w, p, strict=True)) for p in _states(order)))


def test_walking_equal_chunks_gives_the_counts_estimate():
    """`walked_held_bytes` (each chunk its own bytes) equals `held_with_deferred` (chunks averaged) when a rank's
    two chunks weigh the same: ranks other than the first under ZB-V, whose chunks both defer."""
    saved, deferred, transient = 1000, 300, 700
    for K, M in itertools.product(range(2, 5), range(1, 10)):
        for rank in range(1, K):
            order = zbv_order(rank, K, M)
            by_stage = [saved] * (2 * K), [deferred] * (2 * K), [transient] * (2 * K)
            counted = held_with_deferred(2 * saved, 0, weight_pass_points("zb-v", K, rank, M, 2, 0), False, 2,
                                         deferred, transient)
            assert sum(walked_held_bytes(order, *by_stage)) == sum(counted), (K, M, rank)


def test_range_memory_prices_deferred_gradients_as_stage_memory():
    rng = random.Random(7)
    n, K, M = 8, 3, 6
    deferred = [rng.randrange(0, 800) for _ in range(n)]
    kw = dict(param_bytes=[rng.randrange(0, 500) for _ in range(n)], saved_bytes=[rng.randrange(1, 1000) for _ in range(n)],
              cut_bytes=[7] * (n - 1), input_bytes=5, schedule="zb-h1", stages=K, microbatches=M, chunks=1,
              recompute=False, optimizer="adam", dtype="fp32")
    rm = RangeMemory(**kw, deferred_grad_bytes=deferred)
    for s, (a, b) in itertools.product(range(K), itertools.combinations(range(n + 1), 2)):
        want = stage_memory(param_bytes=sum(kw["param_bytes"][a:b]), saved_bytes_per_mb=sum(kw["saved_bytes"][a:b]),
                            input_bytes_per_mb=7 if a else 5, output_bytes_per_mb=7 if b < n else 0,
                            schedule="zb-h1", stages=K, stage=s, microbatches=M, optimizer="adam", dtype="fp32",
                            recompute=False, largest_layer_param_bytes=max(kw["param_bytes"][a:b]),
                            deferred_grad_bytes_per_mb=sum(deferred[a:b]) if s else 0)
        assert rm(s, a, b) == want.total_bytes, (s, a, b)
    # the pending W's are what the term adds: a stage whose B runs s microbatches ahead of its W
    assert rm(2, 1, 4) > RangeMemory(**kw)(2, 1, 4)


def _live_after_each_w(meter_hooks) -> list[int]:
    """A stage of 4 Linear + Tanh (tanh saves its output), 3 microbatches: forwards (under `meter_hooks`), then
    each B, then each W; live bytes after each W, logged as the runtime's meter logs a step."""
    torch.manual_seed(0)
    stage = torch.nn.Sequential(*[m for _ in range(4) for m in (torch.nn.Linear(256, 256), torch.nn.Tanh())])
    log = StorageLog(lambda: 0, {p.untyped_storage()._cdata for p in stage.parameters()})
    after = []
    with log:
        xs = [torch.randn(64, 256, requires_grad=True) for _ in range(3)]
        with meter_hooks:
            outs = [stage(x) for x in xs]
        groups = []
        for x, out in zip(xs, outs, strict=True):
            groups.append(B.stage_backward_input([out], [torch.ones_like(out)], [x], stage.parameters())[1])
        del outs
        for g in groups:
            B.stage_backward_weight(stage.parameters(), g)
            after.append(list(_replay(log.events, set()))[-1][2])
    return after


def test_the_runtimes_meter_does_not_keep_a_split_backward_alive():
    """The CPU runtime meters a step's saved tensors through saved-tensor hooks. A box holding the tensor itself
    made a cycle with every saved output (box -> tensor -> its grad_fn -> the box), which a split backward never
    breaks: B keeps the graph (retain_graph) and W runs only the weight nodes, so everything B alone needed stayed
    alive until Python's cycle collector ran; ZB-V's middle rank read 531 MiB where it peaks at 411. The box
    holds a detached view (no grad_fn), so W frees what it frees without the meter."""
    import contextlib
    import gc

    from pipeplan.runtime.measure import SavedTensorMeter

    meter = SavedTensorMeter(set())
    gc.disable()  # a cycle lives until the collector runs: keep it from running mid-test
    try:
        assert _live_after_each_w(meter.hooks()) == _live_after_each_w(contextlib.nullcontext())
    finally:
        gc.enable()


def test_only_weight_ops_saves_are_left_out_of_the_nonweight_bytes(traced):
    """A GPT block's saves by ops other than weight ops are attention's (queries, keys, values, output) and the
    GELU's input; the Linears and LayerNorms save as weight ops."""
    for layer in traced.layers:
        if layer.name.startswith("h.1."):
            kind = layer.name.rsplit(".", 1)[1]
            assert layer.nonweight_saved_bytes == (layer.saved_bytes if kind in ("attn", "gelu") else 0), layer.name


def test_a_recomputed_split_backwards_w_holds_a_rerun_per_parameter_group(traced):
    """torch's W calls autograd once per parameter group; under non-reentrant checkpoint each call re-runs the
    stage and what the re-run recomputed for ops W never reads stays until the W ends. Two GPT blocks
    (12 groups) recomputed as the runtime recomputes them: W's peak above what was live before it, against
    `split_rerun_bytes` from the trace (one re-run would be a seventh of it)."""
    import gc

    from pipeplan.costmodels.memory import split_rerun_bytes
    from pipeplan.costmodels.recompute import weight_grad_passes
    from pipeplan.runtime.recompute import recompute

    model = _gpt()
    blocks = recompute(torch.nn.Sequential(*model.h))
    layers = [layer for layer in traced.layers if layer.name.startswith("h.")]
    log = StorageLog(lambda: 0, {p.untyped_storage()._cdata for p in blocks.parameters()})
    with log:
        x = torch.randn(BATCH, SEQ, WIDTH, requires_grad=True)
        out = blocks(x).clone()
        groups = B.stage_backward_input([out], [torch.ones_like(out)], [x], blocks.parameters())[1]
        out.detach_()
        start = len(log.events)
        B.stage_backward_weight(blocks.parameters(), groups)
    live = [now for _, _, now in _replay(log.events, set())]
    w_peak = max(live[start:]) - live[start - 1]
    gc.collect()
    want = split_rerun_bytes(sum(x.saved_bytes for x in layers), 0, sum(x.nonweight_saved_bytes for x in layers),
                             weight_grad_passes(layers), first=False)
    assert weight_grad_passes(layers) == len(groups) == 12
    assert 0.85 * w_peak <= want <= 1.15 * w_peak, (w_peak, want)
