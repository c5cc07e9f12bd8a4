"""The two foreign formats pipeplan reads, broken every way: a PipeDream graph.txt (`pipeplan import`,
`pipeplan plan`) and a Hugging Face config.json (`pipeplan analyze`). Each case is one exit-2 line naming the
file and the field (and, for graph.txt, the line), with any quoted value cut short, and no output file.

Every check runs before anything is built, so the whole file takes seconds; the valid documents the cases
break are run once for real, so a case cannot pass because everything fails.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from bad_inputs import expect_user_error
from pipeplan.cli.main import cli

NAME = "broken-import"
PROFILE = ["--profile", "a100-80gb-sxm"]
TINY = Path(__file__).resolve().parent / "data" / "tiny-llama.json"
LONG = "x" * 600

# ------------------------------------------------------------------ PipeDream graph.txt
FIELDS = ("forward_compute_time", "backward_compute_time", "activation_size", "parameter_size")
VALUES = {"forward_compute_time": "1.5", "backward_compute_time": "2.5", "activation_size": "4096.0",
          "parameter_size": "1024.0"}


def node_line(node: str = "node1", desc: str = "Conv2d(3, 64, kernel_size=(3, 3))", **values: str) -> str:
    v = {**VALUES, **values}
    return f"{node} -- {desc} -- " + ", ".join(f"{f}={v[f]}" for f in FIELDS)


def graph_txt(line2: str | None = None, edges: str = "\tnode0 -- node1\n\tnode1 -- node2\n") -> str:
    """Input0, node1 (line 2, the one the cases break), node2, then the edges (lines 4 and 5)."""
    return "\n".join([
        node_line("node0", "Input0", activation_size="100.0", parameter_size="0.0"),
        node_line() if line2 is None else line2,
        node_line("node2", "ReLU(inplace)", parameter_size="0.0"),
    ]) + "\n" + edges


def write_graph(tmp_path: Path, text: str) -> Path:
    path = tmp_path / f"{NAME}.graph.txt"
    path.write_text(text)
    return path


def import_and_plan(tmp_path: Path, text: str, names: list[str], *, plan: bool = True) -> str:
    """`pipeplan import` (and `pipeplan plan`) of the text: one error line naming `names`, nothing written."""
    path = write_graph(tmp_path, text)
    out = tmp_path / "out.json"
    line = expect_user_error(["import", path, "-o", out], [NAME, *names], [out])
    if plan:
        expect_user_error(["plan", path, *PROFILE, "--gpus", "4", "-o", out], [NAME, *names], [out])
    return line


def test_the_valid_graph_txt_imports_and_plans(tmp_path):
    path = write_graph(tmp_path, graph_txt())
    out = tmp_path / "out.json"
    r = CliRunner().invoke(cli, ["import", str(path), "-o", str(out)])
    assert r.exit_code == 0, r.output
    assert out.exists()
    r = CliRunner().invoke(cli, ["plan", str(path), *PROFILE, "--gpus", "4", "-o", str(tmp_path / "plan.json")])
    assert r.exit_code == 0, r.output


BAD_NUMBERS = ["inf", "-inf", "Infinity", "nan", "NaN", "1e400", "-1", "-0.5", "abc", "1.0.0", "0x10", LONG,
               "1e20"]


@pytest.mark.parametrize("field", FIELDS)
@pytest.mark.parametrize("value", BAD_NUMBERS, ids=lambda v: v if len(v) < 20 else "long-garbage")
def test_every_field_must_be_finite_non_negative_and_plausible(tmp_path, field, value):
    line = import_and_plan(tmp_path, graph_txt(node_line(**{field: value})), [":2:", field],
                           plan=value in ("inf", "1e400", "nan", LONG))
    assert LONG not in line and "x" * 70 not in line  # the value is quoted short


@pytest.mark.parametrize("field, value", [
    ("forward_compute_time", "10000001"),  # over 1e7 ms (2.8 hours) for one layer
    ("backward_compute_time", "1e9"),
    ("parameter_size", "2e15"),  # over a petabyte
    ("activation_size", "1e16"),
])
def test_implausibly_large_values(tmp_path, field, value):
    import_and_plan(tmp_path, graph_txt(node_line(**{field: value})), [":2:", field, value])


@pytest.mark.parametrize("value, names", [
    ("[1.0; inf]", ["inf"]),
    ("[nan; 2.0]", ["nan"]),
    ("[1.0; -3]", ["-3"]),
    ("[1.0; abc]", ["abc"]),
    ("[1e400]", ["1e400"]),
    ("[6e14; 6e14]", ["sum"]),  # each item plausible, the sum not
])
def test_activation_lists(tmp_path, value, names):
    import_and_plan(tmp_path, graph_txt(node_line(activation_size=value)), [":2:", "activation_size", *names])


def test_an_unclosed_activation_list(tmp_path):
    text = graph_txt("node1 -- Conv2d -- forward_compute_time=1, backward_compute_time=1, activation_size=[1; 2")
    import_and_plan(tmp_path, text, [":2:"])


@pytest.mark.parametrize("field", FIELDS)
def test_a_missing_field_is_named(tmp_path, field):
    line = node_line()
    start = line.index(f"{field}=")
    end = line.find(", ", start)
    broken = line[:start] + line[end + 2:] if end != -1 else line[:start].rstrip(", ")
    import_and_plan(tmp_path, graph_txt(broken), [":2:", field, "missing"])


@pytest.mark.parametrize("field", FIELDS)
def test_an_empty_value_is_named(tmp_path, field):
    line = node_line(**{field: ""})
    import_and_plan(tmp_path, graph_txt(line), [":2:", field])


@pytest.mark.parametrize("cut", [3, 5, 9, 30, 60, 100, -1])
def test_truncated_node_lines(tmp_path, cut):
    line = node_line()
    if cut == -1:  # everything but the last value
        cut = line.index("parameter_size=") + len("parameter_size=")
    import_and_plan(tmp_path, graph_txt(line[:cut]), [":2:"], plan=cut in (9, 60))


def test_a_truncated_file(tmp_path):
    """Cut mid-way through the last node line (line 3), as a copy interrupted by a full disk leaves it."""
    text = graph_txt()
    cut = text.index("node2") + 40
    import_and_plan(tmp_path, text[:cut], [":3:"])


@pytest.mark.parametrize("text, names", [
    ("hello world\n", [":1:", "not a PipeDream node line"]),
    (LONG + "\n", [":1:", "not a PipeDream node line"]),
    ("node1 -- " + LONG + "\n", [":1:", "forward_compute_time", "missing"]),
    (graph_txt(edges="\tnode0 -- node1 -- node2\n"), [":4:", "edge line"]),
    (graph_txt(edges="\tnode0\n"), [":4:", "edge line"]),
    (graph_txt(edges="\tnode0 -- node1\n\tnode1 -- " + LONG + "\n"), [":5:", "unknown node"]),
    (graph_txt(edges="\tnode0 -- node1\n\tnode1 -- node9\n"), [":5:", "unknown node", "node9"]),
    (graph_txt(node_line("node0", "Conv")), [":2:", "defined twice", "node0"]),
    (graph_txt() + "\tnode2 -- node1\n", ["cycle"]),
    ("\n\n", ["no nodes"]),
])
def test_malformed_files(tmp_path, text, names):
    # `plan` takes a file for a PipeDream profile by its field names; without them it is "neither ... nor"
    line = import_and_plan(tmp_path, text, names, plan="forward_compute_time" in text)
    assert "x" * 70 not in line


def test_the_whole_file_is_garbage(tmp_path):
    import_and_plan(tmp_path, "\x00\x01 garbage -- \x7f\n" * 50, [":1:"], plan=False)


# ------------------------------------------------------------------ Hugging Face config.json
def tiny() -> dict:
    return json.loads(TINY.read_text())


def analyze(tmp_path: Path, doc: dict | str, names: list[str]) -> str:
    """`pipeplan analyze` of the config: one error line naming the file and `names`, no plan written."""
    path = tmp_path / f"{NAME}.json"
    path.write_text(doc if isinstance(doc, str) else json.dumps(doc))
    out = tmp_path / "plan.json"
    return expect_user_error(["analyze", path, *PROFILE, "--gpus", "8", "-o", out], [NAME, *names], [out])


def test_the_valid_configs_are_accepted(tmp_path):
    """The cases below break tiny-llama.json; as it is (at a short sequence) it must analyze, and the
    shipped configs must pass the same checks."""
    from pipeplan.costmodels.hf_config import load_hf_config

    out = tmp_path / "plan.json"
    r = CliRunner().invoke(cli, ["analyze", str(TINY), *PROFILE, "--gpus", "8", "--seq-len", "16", "-o", str(out)])
    assert r.exit_code == 0, r.output
    assert out.exists()
    root = TINY.parents[2]
    for path in [TINY, TINY.with_name("tiny-mixtral.json"), *sorted((root / "examples").glob("*.json"))]:
        load_hf_config(str(path))


SIZES = ["hidden_size", "vocab_size", "intermediate_size", "max_position_embeddings"]
COUNTS = ["num_hidden_layers", "num_attention_heads", "num_key_value_heads"]


@pytest.mark.parametrize("field", SIZES + COUNTS)
@pytest.mark.parametrize("value", [-1, -64, 0, 10**30, 2**63], ids=["minus1", "minus64", "zero", "1e30", "2**63"])
def test_sizes_and_counts_must_be_positive_and_sane(tmp_path, field, value):
    line = analyze(tmp_path, {**tiny(), field: value}, [field, str(value)[:20]])
    assert "build_model" not in line and "torch" not in line


@pytest.mark.parametrize("field, value", [
    ("hidden_size", 10**7 + 1), ("vocab_size", 10**8), ("intermediate_size", 10**12),
    ("num_hidden_layers", 10**5 + 1), ("num_attention_heads", 10**6), ("max_position_embeddings", 10**9),
    ("num_local_experts", 10**5), ("head_dim", 10**9),
])
def test_huge_values(tmp_path, field, value):
    analyze(tmp_path, {**tiny(), field: value}, [field, str(value)])


@pytest.mark.parametrize("field, value", [
    ("rms_norm_eps", -1), ("rms_norm_eps", -1.0), ("rms_norm_eps", 0), ("rms_norm_eps", 0.0), ("rms_norm_eps", 2.5),
    ("attention_dropout", -0.1), ("attention_dropout", 1.5), ("initializer_range", -0.02),
    ("rope_theta", -10000.0), ("rope_theta", 0),
])
def test_eps_dropout_and_float_ranges(tmp_path, field, value):
    analyze(tmp_path, {**tiny(), field: value}, [field, repr(value)])


@pytest.mark.parametrize("field", ["hidden_size", "num_hidden_layers", "vocab_size", "rms_norm_eps", "rope_theta"])
@pytest.mark.parametrize("token", ["NaN", "Infinity", "-Infinity", "1e400", "-1e400"])
def test_non_finite_numbers_name_the_field(tmp_path, field, token):
    text = json.dumps({**tiny(), field: "@@"}).replace('"@@"', token)
    analyze(tmp_path, text, [field, token])


@pytest.mark.parametrize("field", ["hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size",
                                   "rms_norm_eps", "max_position_embeddings"])
@pytest.mark.parametrize("value", ["64", True, False, [64], {"a": 1}, None, LONG],
                         ids=["string", "true", "false", "list", "object", "null", "long-string"])
def test_wrong_types(tmp_path, field, value):
    line = analyze(tmp_path, {**tiny(), field: value}, [field])
    assert "x" * 70 not in line


@pytest.mark.parametrize("field", ["hidden_size", "num_hidden_layers", "vocab_size", "intermediate_size"])
def test_a_float_for_an_integer(tmp_path, field):
    analyze(tmp_path, {**tiny(), field: 64.5}, [field, "64.5"])


@pytest.mark.parametrize("changes, names", [
    ({"num_attention_heads": 5}, ["num_attention_heads", "hidden_size"]),  # 64 is not split in 5 heads
    ({"num_attention_heads": 6}, ["num_attention_heads", "hidden_size"]),
    ({"num_key_value_heads": 3}, ["num_key_value_heads", "num_attention_heads"]),  # 4 heads, 3 KV heads
    ({"num_key_value_heads": 8}, ["num_key_value_heads", "num_attention_heads"]),
    ({"pad_token_id": 512}, ["pad_token_id", "vocab_size"]),
    ({"pad_token_id": 10**6}, ["pad_token_id", "vocab_size"]),
])
def test_fields_that_must_fit_together(tmp_path, changes, names):
    analyze(tmp_path, {**tiny(), **changes}, names)


@pytest.mark.parametrize("changes, names", [
    ({"num_experts_per_tok": 5}, ["num_experts_per_tok", "num_local_experts"]),  # 4 experts, top-5
    ({"num_experts_per_tok": 0}, ["num_experts_per_tok"]),
    ({"num_local_experts": 0}, ["num_local_experts"]),
    ({"num_local_experts": -4}, ["num_local_experts"]),
])
def test_mixture_of_experts_fields(tmp_path, changes, names):
    doc = {**json.loads(TINY.with_name("tiny-mixtral.json").read_text()), **changes}
    analyze(tmp_path, doc, names)


@pytest.mark.parametrize("doc, names", [
    ({"model_type": "gpt2", "n_embd": 64, "n_head": 5, "n_layer": 2}, ["n_head", "n_embd"]),
    ({"model_type": "gpt2", "n_layer": 0}, ["n_layer"]),
    ({"model_type": "gpt2", "n_positions": -1}, ["n_positions"]),
    ({"model_type": "gpt2", "layer_norm_epsilon": -1e-5}, ["layer_norm_epsilon"]),
    ({"model_type": "gpt2", "resid_pdrop": 2.0}, ["resid_pdrop"]),
    ({"model_type": "qwen2", "hidden_size": 64, "num_attention_heads": 5, "num_key_value_heads": 5},
     ["num_attention_heads", "hidden_size"]),
])
def test_other_architectures_and_their_field_names(tmp_path, doc, names):
    analyze(tmp_path, doc, names)


@pytest.mark.parametrize("doc, names", [
    ({"hidden_size": 64}, ["model_type"]),  # a missing model_type
    ({"model_type": 7}, ["model_type"]),
    ({"model_type": LONG}, ["model_type"]),
    ("[1, 2]", ["not a Hugging Face config"]),
    (json.dumps({"model_type": "llama", "hidden_size": 64})[:25], ["invalid JSON"]),  # truncated
])
def test_missing_and_malformed(tmp_path, doc, names):
    line = analyze(tmp_path, doc, names)
    assert "x" * 70 not in line
