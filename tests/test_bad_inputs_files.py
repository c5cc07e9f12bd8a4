"""Every input file format, broken every way we could think of: exit 2, one line naming the file.

For a valid plan, graph and profile (built in code), each case writes one broken
copy under a distinctive name and runs the cheapest command that reads it
(`show`, `plan`, `profiles show`) through tests/bad_inputs.expect_user_error:
truncations, each field deleted, set to the wrong type, negative, NaN, huge or
deeply nested, plus the reported cases (a removed stage, a device the plan does
not have, a YAML alias bomb, memory written as a quoted string, ...).
"""

from __future__ import annotations

import json
import time

import pytest
import yaml

from bad_inputs import expect_user_error
from cli_fixtures import chain_graph, hand_plan
from pipeplan.hardware_profiles import load_profile, profile_to_dict

NAME = "broken-input"
PLAN_REQUIRED = ("schedule", "microbatches", "batch_size", "stages", "predicted", "graph")
GRAPH_REQUIRED = ("name", "batch_size", "layers", "edges")
WRONG_TYPES = {int: "7", str: 5, list: {"a": 1}, dict: [1, 2], float: "0.5", bool: "yes"}


def plan_doc() -> dict:
    doc = hand_plan(stages=4, microbatches=8).to_dict()
    doc["graph"]["layers"] = sum(len(s["layers"]) for s in doc["stages"])
    return doc


def graph_doc() -> dict:
    return chain_graph().to_dict()


def profile_doc() -> dict:
    return profile_to_dict(load_profile("a100-80gb-sxm"))


def show(tmp_path, doc, suffix=".json"):
    path = tmp_path / f"{NAME}{suffix}"
    path.write_text(doc if isinstance(doc, str) else json.dumps(doc))
    return expect_user_error(["show", path], names=[NAME])


def plan_graph(tmp_path, doc):
    path = tmp_path / f"{NAME}.json"
    path.write_text(doc if isinstance(doc, str) else json.dumps(doc))
    out = tmp_path / "out.json"
    return expect_user_error(["plan", path, "--profile", "a100-80gb-sxm", "--gpus", "4", "-o", out],
                             names=[NAME], outputs=[out])


def show_profile(tmp_path, text):
    path = tmp_path / f"{NAME}.yaml"
    path.write_text(text)
    return expect_user_error(["profiles", "show", path], names=[NAME])


def test_the_valid_documents_are_accepted(tmp_path):
    """The fuzz below breaks these; they must load as they are (else every case would pass for nothing)."""
    from pipeplan.costmodels.graph import Graph
    from pipeplan.hardware_profiles.loader import parse_profile
    from pipeplan.planner.plan import Plan

    Plan.from_dict(plan_doc())
    Graph.from_dict(graph_doc())
    parse_profile(profile_doc(), "x.yaml")


# ------------------------------------------------------------------ every format: truncation and nesting
@pytest.mark.parametrize("fraction", [0.0, 0.1, 0.5, 0.9, 0.999])
def test_truncated_files(tmp_path, fraction):
    for doc, run in ((plan_doc(), show), (graph_doc(), plan_graph)):
        text = json.dumps(doc)
        run(tmp_path, text[: int(len(text) * fraction)] or " ")
    text = yaml.safe_dump(profile_doc(), sort_keys=False)
    if fraction <= 0.5:  # the required fields come first; a later cut may leave a valid profile without its sources
        show_profile(tmp_path, text[: int(len(text) * fraction)] or "\n")


def test_deep_nesting(tmp_path):
    deep = "[" * 200 + "]" * 200
    show(tmp_path, json.dumps(plan_doc())[:-1] + f', "solver": {deep}}}')
    plan_graph(tmp_path, json.dumps(graph_doc())[:-1] + f', "source": {deep}}}')
    show_profile(tmp_path, yaml.safe_dump(profile_doc()) + "calibration: " + deep + "\n")


def test_non_json_numbers(tmp_path):
    text = json.dumps(plan_doc())
    for bad in ("NaN", "Infinity", "-Infinity", "1e999"):
        assert show(tmp_path, text.replace('"microbatches": 8', f'"microbatches": {bad}'))
    graph = json.dumps(graph_doc())
    assert '"fwd_s": ' in graph
    for bad in ("NaN", "1e999"):
        plan_graph(tmp_path, graph.replace('"fwd_s": ', f'"fwd_s": {bad}, "x": ', 1))


# ------------------------------------------------------------------ plan.json
def _mutations(doc: dict, required: tuple[str, ...]):
    for key, value in doc.items():
        if key == "format":
            continue
        if key in required:
            yield f"{key} deleted", key, {k: v for k, v in doc.items() if k != key}
        swap = WRONG_TYPES.get(type(value))
        if swap is not None and key not in ("alternatives", "notes", "solver", "source", "inputs", "shared_params"):
            yield f"{key} as {type(swap).__name__}", key, {**doc, key: swap}
        if isinstance(value, int | float) and not isinstance(value, bool):
            yield f"{key} negative", key, {**doc, key: -4}


PLAN_CASES = [c for c in _mutations(plan_doc(), PLAN_REQUIRED)
              if c[1] in PLAN_REQUIRED + ("data_parallel", "chunks", "devices")]


@pytest.mark.parametrize("label, field, doc", PLAN_CASES, ids=[c[0] for c in PLAN_CASES])
def test_plan_field_mutations(tmp_path, label, field, doc):
    line = show(tmp_path, doc)
    assert field in line or "batch_size" in line or "divisible" in line


def _plan_with(edit):
    doc = plan_doc()
    edit(doc)
    return doc


PLAN_SHAPES = {
    "stage removed": (lambda d: d["stages"].pop(2), ["stages", "a stage was removed"]),
    "layer in two stages": (lambda d: d["stages"][1]["layers"].append(d["stages"][0]["layers"][0]), ["stages[1].layers"]),
    "device the plan does not have": (lambda d: d["stages"][3]["devices"].__setitem__(0, 9), ["stages[3].devices[0]", "<= 3"]),
    "stage index out of order": (lambda d: d["stages"][2].__setitem__("index", 5), ["stages [0, 1, 5, 3]"]),
    "stage index not a number": (lambda d: d["stages"][2].__setitem__("index", "2"), ["stages[2].index"]),
    "empty stage": (lambda d: d["stages"][2].__setitem__("layers", []), ["stages[2].layers"]),
    "microbatches -4": (lambda d: d.__setitem__("microbatches", -4), ["microbatches", "-4"]),
    "huge microbatches": (lambda d: d.__setitem__("microbatches", 10**30), ["batch_size"]),
    "1f1b with fewer microbatches than stages": (
        lambda d: d.update(schedule="1f1b", microbatches=2), ["microbatches", "1f1b"]),
    "negative predicted time": (lambda d: d["predicted"].__setitem__("iteration_s", -1.0), ["predicted.iteration_s"]),
    "negative stage memory": (lambda d: d["stages"][0]["predicted"].__setitem__("memory_bytes", -5),
                              ["stages[0].predicted.memory_bytes"]),
    "layer name not a string": (lambda d: d["stages"][0]["layers"].__setitem__(0, 3), ["stages[0].layers[0]"]),
    "stages not a list": (lambda d: d.__setitem__("stages", {"0": 1}), ["stages"]),
    "bool for microbatches": (lambda d: d.__setitem__("microbatches", True), ["microbatches"]),
    "unknown schedule": (lambda d: d.__setitem__("schedule", "chimera"), ["schedule"]),
    "huge value string": (lambda d: d.__setitem__("schedule", "x" * 10**6), ["schedule"]),
}


@pytest.mark.parametrize("case", list(PLAN_SHAPES))
def test_plan_shape_cases(tmp_path, case):
    edit, names = PLAN_SHAPES[case]
    line = show(tmp_path, _plan_with(edit))
    for name in names:
        assert name in line, line


# ------------------------------------------------------------------ graph.json
def _graph_with(edit):
    doc = graph_doc()
    edit(doc)
    return doc


def _layer(i, key, value):
    return lambda d: d["layers"][i].__setitem__(key, value)


GRAPH_CASES = {
    **{f"negative {key}": (_layer(3, key, -5), [f"layers[3] ('layers.3').{key}", "-5"])
       for key in ("fwd_flops", "bwd_flops", "param_bytes", "saved_bytes", "output_bytes", "bytes_moved")},
    **{f"negative {key}": (_layer(2, key, -0.5), [f"layers[2] ('layers.2').{key}"]) for key in ("fwd_s", "bwd_s")},
    **{f"{key} as text": (_layer(1, key, "12"), [f"layers[1] ('layers.1').{key}"]) for key in ("fwd_flops", "fwd_s")},
    "fractional FLOPs": (_layer(0, "fwd_flops", 1.5), ["fwd_flops"]),
    "bool for bytes": (_layer(0, "param_bytes", True), ["param_bytes"]),
    "unknown kind": (_layer(0, "kind", "quantum"), ["kind"]),
    "outputs not a map": (_layer(0, "outputs", [1]), ["outputs"]),
    "negative output tensor": (lambda d: d["layers"][0]["outputs"].update({"layers.0:out": -1}), ["outputs"]),
    "duplicate layer name": (lambda d: d["layers"][4].__setitem__("name", "layers.2"), ["layers[4].name", "unique"]),
    "layer without a name": (lambda d: d["layers"][4].pop("name"), ["layers[4].name is missing"]),
    "negative edge bytes": (lambda d: d["edges"][0].__setitem__("bytes", -1), ["edges[0].bytes"]),
    "edge to an unknown layer": (lambda d: d["edges"][0].__setitem__("dst", "nowhere"), ["nowhere"]),
    "batch size 0": (lambda d: d.__setitem__("batch_size", 0), ["batch_size"]),
    "no layers": (lambda d: d.__setitem__("layers", []), ["layers"]),
    "layers not a list": (lambda d: d.__setitem__("layers", "abc"), ["layers"]),
    "layer not an object": (lambda d: d["layers"].__setitem__(0, 5), ["layers"]),
    "negative input bytes": (lambda d: d.__setitem__("input_bytes", -8), ["input_bytes"]),
    "shared param negative": (lambda d: d.__setitem__("shared_params", [{"name": "w", "bytes": -1, "layers": ["a"]}]),
                              ["shared_params[0].bytes"]),
}


@pytest.mark.parametrize("case", list(GRAPH_CASES))
def test_graph_cases(tmp_path, case):
    edit, names = GRAPH_CASES[case]
    line = plan_graph(tmp_path, _graph_with(edit))
    for name in names:
        assert name in line, line


GRAPH_MUTATIONS = list(_mutations(graph_doc(), GRAPH_REQUIRED))


@pytest.mark.parametrize("label, field, doc", [c for c in GRAPH_MUTATIONS if c[1] in GRAPH_REQUIRED + ("input_bytes",)],
                         ids=[c[0] for c in GRAPH_MUTATIONS if c[1] in GRAPH_REQUIRED + ("input_bytes",)])
def test_graph_field_mutations(tmp_path, label, field, doc):
    assert field in plan_graph(tmp_path, doc)


# ------------------------------------------------------------------ profile YAML
BOMB = """\
a: &a ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]
b: &b [*a,*a,*a,*a,*a,*a,*a,*a,*a]
c: &c [*b,*b,*b,*b,*b,*b,*b,*b,*b]
d: &d [*c,*c,*c,*c,*c,*c,*c,*c,*c]
e: &e [*d,*d,*d,*d,*d,*d,*d,*d,*d]
f: &f [*e,*e,*e,*e,*e,*e,*e,*e,*e]
g: &g [*f,*f,*f,*f,*f,*f,*f,*f,*f]
"""


@pytest.mark.parametrize("where", ["calibration", "aliases"])
def test_yaml_alias_bomb_is_refused_fast(tmp_path, where):
    doc = profile_doc()
    doc.pop(where, None)
    bomb = BOMB.replace("\n", "\n  ").rstrip() + "\n"
    text = yaml.safe_dump(doc, sort_keys=False) + f"{where}:\n  " + bomb + "  h: [*g,*g,*g,*g,*g,*g,*g,*g,*g]\n"
    t0 = time.monotonic()
    line = show_profile(tmp_path, text)
    assert time.monotonic() - t0 < 5
    assert "aliases" in line and len(line) < 200
    path = tmp_path / f"{NAME}.yaml"
    out = tmp_path / "out.json"
    expect_user_error(["plan", graph_file(tmp_path), "--profile", path, "--gpus", "2", "-o", out], names=[NAME],
                      outputs=[out])


def graph_file(tmp_path):
    path = tmp_path / "ok-graph.json"
    chain_graph().save(path)
    return path


PROFILE_CASES = {
    "memory as quoted text": ("memory_gib", '"9"', ["memory_gib", "without quotes"]),
    "exponent without a dot": ("memory_gib", "8e1", ["memory_gib", "exponents"]),
    "NaN memory": ("memory_gib", ".nan", ["memory_gib"]),
    "infinite bandwidth": ("memory_bandwidth_gbps", ".inf", ["memory_bandwidth_gbps"]),
    "negative memory": ("memory_gib", "-80", ["memory_gib"]),
    "zero memory": ("memory_gib", "0", ["memory_gib"]),
    "huge memory": ("memory_gib", "1.0e+30", ["memory_gib", "implausible"]),
    "bool memory": ("memory_gib", "true", ["memory_gib"]),
    "list for a number": ("memory_gib", "[1, 2]", ["memory_gib"]),
    "huge name": ("name", "x" * 100000, ["name"]),
    "map for aliases": ("aliases", "{a: 1}", ["aliases"]),
}


@pytest.mark.parametrize("case", list(PROFILE_CASES))
def test_profile_cases(tmp_path, case):
    field, value, names = PROFILE_CASES[case]
    doc = profile_doc()
    assert field in doc
    doc[field] = "VALUE-HERE"
    text = yaml.safe_dump(doc, sort_keys=False, width=10**6).replace("VALUE-HERE", value)
    line = show_profile(tmp_path, text)
    for name in names:
        assert name in line, line


@pytest.mark.parametrize("field", ["format", "name", "device", "memory_gib", "memory_bandwidth_gbps", "peak_tflops"])
def test_profile_required_field_deleted(tmp_path, field):
    doc = profile_doc()
    doc.pop(field)
    assert field in show_profile(tmp_path, yaml.safe_dump(doc)) or field == "format"


def test_a_profile_that_is_not_a_mapping(tmp_path):
    for text in ("- a\n- b\n", "just text\n", "42\n", "{{{\n"):
        show_profile(tmp_path, text)


def test_stages_beyond_a_leaf_graph_do_not_suggest_depth(tmp_path):
    out = tmp_path / "out.json"
    line = expect_user_error(["plan", graph_file(tmp_path), "--profile", "a100-80gb-sxm", "--gpus", "100", "-k", "100",
                              "-o", out], names=["--stages 100", "12 layers", "--stages 12 or fewer"], outputs=[out])
    assert "--depth" not in line


def test_real_plans_with_rounding_noise_load(tmp_path):
    """A search can predict a bubble of -2.2e-16 (float rounding): such a plan is whole, not broken."""
    from pipeplan.planner.plan import Plan

    doc = plan_doc()
    doc["predicted"]["bubble_fraction"] = -2.220446049250313e-16
    Plan.from_dict(doc)


@pytest.mark.parametrize("field, value", [("alternatives", {"a": 1}), ("notes", "text"), ("solver", [1]),
                                          ("profile", 7), ("recompute", "yes")])
def test_plan_descriptive_fields(tmp_path, field, value):
    assert field in show(tmp_path, {**plan_doc(), field: value})


def test_deeply_nested_yaml_does_not_crash_the_parser(tmp_path):
    line = show_profile(tmp_path, "format: pipeplan.profile/v1\ncalibration: " + "[" * 100000 + "]" * 100000 + "\n")
    assert "nested deeper" in line
