"""A Hugging Face config.json as a model: parameter counts against transformers' own, the loss against
transformers' own, a tiny end-to-end trace, the sequence length carried into the plan, and one clear
exit-2 line (nothing written) per kind of bad input."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from cli_invoke import invoke as run
from cli_invoke import one_error_line
from pipeplan.costmodels.model_file import load_model_file
from pipeplan.errors import UserError

transformers = pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
DATA = Path(__file__).resolve().parent / "data"
TINY = DATA / "tiny-llama.json"
TINY_MOE = DATA / "tiny-mixtral.json"

# Published sizes (model cards: 8.03B, 70.6B, 405.9B per the Llama 3 / 3.1 cards' safetensors counts; 46.7B in
# the Mixtral paper), to the digits published.
PUBLISHED = {
    "llama-3-8b.json": (8.03e9, 0.005e9),
    "llama-3-70b.json": (70.6e9, 0.05e9),
    "llama-3.1-405b.json": (405.9e9, 0.05e9),
    "mixtral-8x7b.json": (46.7e9, 0.05e9),
}


def transformers_count(path: Path) -> int:
    """transformers' own count: its config reader and its model class, on the meta device."""
    config = transformers.AutoConfig.from_pretrained(str(path))
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    return int(model.num_parameters())


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_shipped_config_parameter_count(name):
    path = EXAMPLES / name
    spec = load_model_file(str(path))
    with torch.device("meta"):
        model = spec.build()
    ours = sum(p.numel() for p in model.parameters())
    assert ours == transformers_count(path)
    published, tolerance = PUBLISHED[name]
    assert abs(ours - published) <= tolerance, (name, ours)
    assert all(p.dtype == torch.float32 for p in model.parameters())  # fp32 whatever the config's torch_dtype says
    assert spec.seq_len == min(json.loads(path.read_text())["max_position_embeddings"], 4096)


def test_tiny_config_count_inputs_and_loss_match_transformers():
    spec = load_model_file(str(TINY), seq_len=16)
    assert spec.seq_len == 16 and spec.entry == "build_model"
    torch.manual_seed(0)
    model = spec.build()
    assert sum(p.numel() for p in model.parameters()) == transformers_count(TINY)
    assert model.config.use_cache is False and model.config._attn_implementation == "sdpa"
    (ids,) = spec.example_inputs(3)
    target = spec.example_target(3)
    assert ids.shape == (3, 16) and ids.dtype == torch.long and int(ids.max()) < 512
    out = model(ids)
    # transformers' own causal-LM loss for labels=input_ids (it shifts the labels itself)
    expected = model(ids, labels=target).loss
    assert torch.allclose(spec.loss(out, target), expected, rtol=1e-5, atol=1e-6)


def test_an_architecture_without_sdpa_is_built_with_its_eager_attention():
    """transformers refuses attn_implementation="sdpa" for Bloom (no such path); it is built with its own
    attention, which computes and normalises the score matrix itself, and the trace says so."""
    from pipeplan.costmodels.hf_config import EAGER_NOTE
    from pipeplan.costmodels.trace import trace

    path = DATA / "tiny-bloom.json"
    with pytest.raises(ValueError, match="scaled_dot_product_attention"):
        transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(str(path)),
                                                      attn_implementation="sdpa")
    spec = load_model_file(str(path), seq_len=16)
    model = spec.build()
    assert model.config._attn_implementation == "eager" and spec.module.attention == "eager"
    assert sum(p.numel() for p in model.parameters()) == transformers_count(path)
    graph = trace(str(path), 2, seq_len=16, time_layers=False, fvcore_check=False)
    nodes = [n for layer in graph.layers for n in layer.nodes]
    assert not any("scaled_dot_product" in n for n in nodes) and any(n.startswith("softmax") for n in nodes)
    assert EAGER_NOTE in graph.notes and EAGER_NOTE not in trace(str(TINY), 2, seq_len=16, time_layers=False,
                                                                  fvcore_check=False).notes


def test_an_attention_free_architecture_has_no_attention_note_and_its_convolution_counts_its_groups():
    """Mamba (tests/data/tiny-mamba.json) has no SDPA path and no attention either: no note about score matrices.
    Its causal conv1d is depthwise (groups = its 128 inner channels), and every layer's backward counts twice its
    forward (input and weight gradients of its projections and convolution), where torch's own counter priced the
    convolution's weight gradient 128 times over."""
    from pipeplan.costmodels.hf_config import EAGER_NOTE
    from pipeplan.costmodels.trace import trace

    graph = trace(str(DATA / "tiny-mamba.json"), 2, seq_len=16, time_layers=False, fvcore_check=False)
    assert EAGER_NOTE not in graph.notes
    counted = [layer for layer in graph.layers if layer.fwd_flops > 0]
    assert counted and all(layer.bwd_flops == 2 * layer.fwd_flops for layer in counted), \
        [(layer.name, layer.fwd_flops, layer.bwd_flops) for layer in counted]


def test_default_seq_len_is_max_positions_capped():
    from pipeplan.cli.options import DEFAULT_MAX_SEQ_LEN
    from pipeplan.costmodels.hf_config import DEFAULT_MAX_SEQ_LEN as COSTMODELS_MAX

    assert DEFAULT_MAX_SEQ_LEN == COSTMODELS_MAX == 4096
    assert load_model_file(str(TINY)).seq_len == 256  # max_position_embeddings, under the cap
    assert load_model_file(str(EXAMPLES / "llama-3.1-405b.json")).seq_len == 4096  # 131072, capped


def test_tiny_trace_end_to_end_records_seq_len():
    from pipeplan.costmodels.trace import trace
    from pipeplan.planner.predict import graph_summary

    graph = trace(str(TINY), 2, seq_len=32, repeats=1, fvcore_check=False)
    assert graph.source["seq_len"] == 32 and graph.source["model_file"] == str(TINY)
    assert graph.name == "tiny-llama"
    n_params = transformers_count(TINY)
    assert sum(l.param_bytes for l in graph.layers) == 4 * n_params  # fp32, untied
    # the matmul FLOPs of one decoder layer, computed from the config: q, k, v, o, gate, up, down
    cfg = json.loads(TINY.read_text())
    h, i, heads, kv = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    tokens = 2 * 32
    head_dim = h // heads
    per_layer = 2 * tokens * (h * h + 2 * h * kv * head_dim + h * h + 3 * h * i)
    linear = sum(l.fwd_flops for l in graph.layers if l.name.startswith("model.layers.0.") and l.kind == "matmul")
    assert linear == per_layer
    assert graph_summary(graph)["seq_len"] == 32


def test_tiny_mixtral_traces_and_counts_expert_flops():
    from pipeplan.costmodels.trace import trace

    graph = trace(str(TINY_MOE), 2, seq_len=16, repeats=1, fvcore_check=False)
    cfg = json.loads(TINY_MOE.read_text())
    h, i, k, e = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_experts_per_tok"], cfg["num_local_experts"]
    tokens = 2 * 16
    # each token runs through k experts (gate+up: h -> 2i, down: i -> h) plus the router (h -> e)
    experts = 2 * tokens * k * (h * 2 * i + i * h) + 2 * tokens * h * e
    mlp = sum(l.fwd_flops for l in graph.layers if l.name.startswith("model.layers.0.mlp"))
    assert mlp == experts
    assert sum(l.param_bytes for l in graph.layers) == 4 * transformers_count(TINY_MOE)
    # the experts' two grouped GEMMs are matmul layers of their own, each holding its expert weights and pricing its
    # FLOPs as a matmul (they had been folded into the router's layer and the activation's, priced as elementwise)
    experts_layers = [l for l in graph.layers if l.name.startswith("model.layers.0.mlp.experts") and l.kind == "matmul"]
    assert [l.param_bytes for l in experts_layers] == [4 * e * h * 2 * i, 4 * e * i * h]
    assert [sum(p.fwd_flops for p in l.parts if p.kind == "matmul") for l in experts_layers] == [
        2 * tokens * k * h * 2 * i, 2 * tokens * k * i * h]
    router = graph.layer("model.layers.0.mlp.gate")
    assert router.param_bytes == 4 * h * e and router.fwd_flops == 2 * tokens * h * e


def write(tmp_path, name, text):
    p = tmp_path / name
    p.write_text(text)
    return p


BAD = {
    "not-json.json": ("{model_type: llama", "invalid JSON"),
    "array.json": ("[1, 2]", "not a Hugging Face config (the JSON is a list"),
    "no-type.json": ('{"hidden_size": 64}', 'not a Hugging Face config (no "model_type" field)'),
    "unknown.json": ('{"model_type": "no-such-arch"}', "unknown model_type 'no-such-arch'"),
    "t5.json": ('{"model_type": "t5"}', "AutoModelForCausalLM cannot build a T5Config"),
    "vit.json": ('{"model_type": "vit"}', "has no causal language model in transformers"),
    "heads.json": ('{"model_type": "llama", "hidden_size": 64, "num_attention_heads": 5}', "transformers rejects this llama config"),
    "types.json": ('{"model_type": "llama", "hidden_size": "wide"}', "transformers rejects this llama config"),
}


@pytest.mark.parametrize("name", sorted(BAD))
@pytest.mark.parametrize("command", ["analyze", "trace"])
def test_bad_config_exit_2_one_line_nothing_written(tmp_path, name, command):
    text, message = BAD[name]
    path = write(tmp_path, name, text)
    out = tmp_path / "out.json"
    args = [command, path, "-o", out] + (["--profile", "a100-80gb-sxm", "--gpus", "4"] if command == "analyze" else [])
    code, _, stderr = run(args)
    assert code == 2, stderr
    assert message in one_error_line(stderr)
    assert not out.exists()


@pytest.mark.parametrize(
    "args, message",
    [
        (["--seq-len", "257"], "--seq-len 257 is longer than the model's max_position_embeddings 256"),
        (["--entry", "build_small"], "--entry build_small only applies to a model.py"),
    ],
)
def test_bad_flags_with_a_config(tmp_path, args, message):
    out = tmp_path / "plan.json"
    code, _, stderr = run(["analyze", TINY, "--profile", "a100-80gb-sxm", "--gpus", "4", "-o", out, *args])
    assert code == 2 and message in one_error_line(stderr)
    assert not out.exists()


def test_seq_len_with_a_model_py_or_a_graph_is_refused(tmp_path):
    out = tmp_path / "plan.json"
    code, _, stderr = run(["analyze", ROOT / "examples" / "mlp.py", "--seq-len", "128", "--profile", "a100-80gb-sxm",
                           "--gpus", "2", "-o", out])
    assert code == 2 and "--seq-len only applies to a Hugging Face config" in one_error_line(stderr)
    assert not out.exists()
    from cli_fixtures import chain_graph

    graph = tmp_path / "graph.json"
    chain_graph().save(graph)
    code, _, stderr = run(["analyze", graph, "--seq-len", "128", "--profile", "a100-80gb-sxm", "--gpus", "2", "-o", out])
    assert code == 2 and "--seq-len only apply when tracing" in one_error_line(stderr)
    assert not out.exists()


def test_a_graph_json_is_still_a_graph_and_a_config_is_not_a_graph(tmp_path):
    from cli_fixtures import chain_graph
    from pipeplan.cli.workflow import is_model_file, json_kind

    graph = tmp_path / "graph.json"
    chain_graph().save(graph)
    assert json_kind(str(graph)) == "graph" and not is_model_file(str(graph))
    assert json_kind(str(TINY)) == "config" and is_model_file(str(TINY))
    code, _, stderr = run(["plan", TINY, "--profile", "a100-80gb-sxm", "--gpus", "2"])
    assert code == 2 and "is a model file" in one_error_line(stderr)
    with pytest.raises(UserError, match="is a pipeplan graph, not a model"):
        load_model_file(str(graph))


def test_analyze_a_config_records_seq_len_in_the_plan(tmp_path):
    out = tmp_path / "plan.json"
    code, _, stderr = run(["analyze", TINY, "--seq-len", "32", "--trace-batch-size", "2", "--repeats", "1",
                           "--profile", "a100-80gb-sxm", "--gpus", "2", "-b", "8", "-o", out])
    assert code == 0, stderr
    doc = json.loads(out.read_text())
    assert doc["graph"]["seq_len"] == 32 and doc["graph"]["model_file"] == str(TINY)
    # what the runtime does with it: the same spec, the same structure
    from pipeplan.costmodels.trace import export_structure

    spec = load_model_file(doc["graph"]["model_file"], doc["graph"]["entry"], seq_len=doc["graph"]["seq_len"])
    assert spec.example_inputs(2)[0].shape == (2, 32)
    _, graph = export_structure(spec, 2, depth=doc["graph"]["depth"])
    assert graph.fingerprint() == doc["graph"]["fingerprint"]


def test_fingerprint_does_not_depend_on_the_batch_and_logits_are_transformers():
    """Position ids come in explicitly (no batch-1 `expand` to lose), so a graph traced at batch 1 matches
    the runtime's export at any microbatch; the ids are transformers' own default, so the logits are too."""
    from pipeplan.costmodels.trace import export_structure

    for path in (TINY, TINY_MOE):
        spec = load_model_file(str(path), seq_len=16)
        assert len({export_structure(spec, b)[1].fingerprint() for b in (1, 2, 3)}) == 1
        torch.manual_seed(0)
        ours = spec.build()
        torch.manual_seed(0)
        ref = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(str(path)),
                                                            dtype=torch.float32, attn_implementation="sdpa")
        (ids,) = spec.example_inputs(2)
        torch.testing.assert_close(ours(ids).logits, ref(ids).logits)


def test_pipeplan_run_rebuilds_the_config_at_the_plans_seq_len(tmp_path):
    """`pipeplan run` of a 2-stage plan of the tiny config at seq_len 16 (not the default 256) trains as one
    process would at seq_len 16."""
    from runtime_helpers import SEED, hand_plan, run_cli

    plan = hand_plan(str(TINY), stages=2, devices=2, schedule="1f1b", microbatches=2, batch_size=4)
    plan.graph["seq_len"] = 16  # the fingerprint is shape-free: the plan's seq_len is all that says 16
    plan.save(tmp_path / "plan.json")
    r = run_cli("run", str(tmp_path / "plan.json"), "--steps", "2", "--warmup", "0", "--optimizer", "sgd", "--lr", "0.01",
                "--json", timeout=180)
    assert r.returncode == 0, r.stderr[-2000:]
    losses = json.loads(r.stdout)["losses"]

    spec = load_model_file(str(TINY), seq_len=16)
    torch.manual_seed(SEED)
    model = spec.build()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    (x,), y = spec.example_inputs(4), spec.example_target(4)
    expected = []
    for _ in range(2):
        opt.zero_grad()
        total = 0.0
        for xi, yi in zip(x.tensor_split(2), y.tensor_split(2), strict=True):
            loss = spec.loss(model(xi), yi)
            (loss / 2).backward()
            total += float(loss.detach())
        opt.step()
        expected.append(total / 2)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected), rtol=1e-4, atol=1e-6)


def test_attention_memory_is_what_the_sdpa_kernel_saves_no_s_by_s_buffer():
    """Saved bytes come from the traced kernels: SDPA (a flash kernel on CPU) keeps q, k, v, its output and the
    softmax statistics, linear in the sequence length; an eager attention would keep heads x s x s fp32 scores
    (and probabilities). What grows with s^2 here is transformers' boolean causal mask (1 byte an element, shared
    by the heads), which the model really builds, so the plan counts it."""
    from pipeplan.costmodels.trace import trace

    def block_saved(s: int) -> int:
        graph = trace(str(TINY), 1, seq_len=s, fvcore_check=False, time_layers=False)
        return sum(layer.saved_bytes for layer in graph.layers if layer.name.startswith("model.layers.0."))

    small, large = block_saved(64), block_saved(256)
    heads = json.loads(TINY.read_text())["num_attention_heads"]
    quadratic = large - 4 * small  # the linear terms cancel: what s^2 adds from s = 64 to 256
    scores = heads * (256**2 - 4 * 64**2) * 4  # one fp32 score matrix per head
    assert 0 <= quadratic <= scores // 4  # at most 4 one-byte masks: no per-head fp32 buffer
