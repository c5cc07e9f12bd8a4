"""Every bad profile is exit 2 with one line naming the file, the field and what is expected.

Each case starts from a valid profile, breaks one thing, and runs
`pipeplan profiles show FILE` through the real CLI entry point.
"""

import copy

import pytest
import yaml
from click.testing import CliRunner

from pipeplan.cli.main import cli
from pipeplan.hardware_profiles import load_profile, profile_to_dict


def good_doc() -> dict:
    doc = profile_to_dict(load_profile("a100-80gb-sxm"))
    doc.pop("aliases")
    doc["name"] = "test-profile"
    return doc


def run_show(path) -> tuple[int, str]:
    r = CliRunner().invoke(cli, ["profiles", "show", str(path)])
    return r.exit_code, r.stderr


def set_path(doc: dict, dotted: str, value) -> None:
    *parents, last = dotted.split(".")
    for p in parents:
        doc = doc[p]
    if value is DELETE:
        del doc[last]
    else:
        doc[last] = value


DELETE = object()

# (id, field to change, new value, substrings the message must contain)
CASES = [
    ("missing-top", "memory_bandwidth_gbps", DELETE, ["'memory_bandwidth_gbps'", "is missing"]),
    ("missing-link-field", "intra_node.latency_us", DELETE, ["'intra_node.latency_us'", "is missing"]),
    ("missing-format", "format", DELETE, ['"format"', "pipeplan.profile/v1"]),
    ("negative-memory", "memory_gib", -80, ["'memory_gib'", "positive number in GiB", "-80"]),
    ("zero-bandwidth", "memory_bandwidth_gbps", 0, ["'memory_bandwidth_gbps'", "positive number in GB/s"]),
    ("negative-latency", "inter_node.latency_us", -5, ["'inter_node.latency_us'", "non-negative number in µs"]),
    ("negative-flops", "peak_tflops.bf16", -312, ["'peak_tflops.bf16'", "positive number in TFLOP/s"]),
    ("unit-string-memory", "memory_gib", "80 GB", ["'memory_gib'", "plain number in GiB", "'80 GB'"]),
    ("unit-string-bw", "intra_node.bandwidth_gbps", "600 GB/s", ["'intra_node.bandwidth_gbps'", "plain number in GB/s"]),
    ("exponent-as-text", "memory_bandwidth_gbps", "2e3", ["'memory_bandwidth_gbps'", "is the text '2e3'", "1.0e3"]),
    ("bytes-not-gib", "memory_gib", 85899345920, ["'memory_gib'", "implausible in GiB"]),
    ("flops-not-tflops", "peak_tflops.fp32", 19.5e12, ["'peak_tflops.fp32'", "implausible in TFLOP/s"]),
    ("wrong-type", "devices_per_node", "eight", ["'devices_per_node'", "whole number >= 1", "'eight'"]),
    ("float-devices", "devices_per_node", 2.5, ["'devices_per_node'", "whole number >= 1"]),
    ("zero-devices", "devices_per_node", 0, ["'devices_per_node'", "whole number >= 1"]),
    ("bool-number", "memory_gib", True, ["'memory_gib'", "must be a number in GiB"]),
    ("unknown-top", "memory_gb", 80, ["unknown field 'memory_gb'", "did you mean 'memory_gib'"]),
    ("unknown-link-key", "intra_node.bandwith_gbps", 10, ["unknown field 'intra_node.bandwith_gbps'", "intra_node.bandwidth_gbps"]),
    ("unknown-dtype", "peak_tflops.int8", 624, ["unknown field 'peak_tflops.int8'", "fp32, tf32, fp16, bf16"]),
    ("unknown-efficiency", "efficiency", {"gemm": 0.7}, ["unknown field 'efficiency.gemm'", "matmul"]),
    ("efficiency-range", "efficiency", {"matmul": 70}, ["'efficiency.matmul'", "(0, 2]"]),
    ("usable-over-total", "usable_memory_gib", 90, ["'usable_memory_gib'", "must not exceed memory_gib"]),
    ("no-dtypes", "peak_tflops", {"fp32": None, "bf16": None}, ["'peak_tflops'", "at least one"]),
    ("link-not-mapping", "inter_node", "infiniband", ["'inter_node'", "must be a mapping"]),
    ("bad-name", "name", "My Profile", ["'name'", "lower-case"]),
    ("sources-not-list", "sources", "datasheet", ["'sources'", "list of strings"]),
    ("bad-confidence", "confidence", {"memory": "high"}, ["'confidence.memory'", "V, S or M"]),
    ("wrong-format-kind", "format", "pipeplan.plan/v1", ["format is 'pipeplan.plan/v1'", "pipeplan.profile/v1"]),
    ("wrong-format-version", "format", "pipeplan.profile/v9", ["format version 'v9' is not supported"]),
    ("local-not-bool", "local", "yes please", ["'local'", "true or false"]),
]


@pytest.mark.parametrize("case_id,field,value,expect", CASES, ids=[c[0] for c in CASES])
def test_bad_field_exits_2_naming_file_and_field(tmp_path, case_id, field, value, expect):
    doc = copy.deepcopy(good_doc())
    set_path(doc, field, value)
    path = tmp_path / f"{case_id}.yaml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    code, err = run_show(path)
    assert code == 2, err
    assert str(path) in err
    for text in expect:
        assert text in err, f"{text!r} not in {err!r}"
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_the_good_document_itself_is_accepted(tmp_path):
    path = tmp_path / "good.yaml"
    path.write_text(yaml.safe_dump(good_doc(), sort_keys=False))
    assert run_show(path)[0] == 0


@pytest.mark.parametrize(
    "text,expect",
    [
        ("format: pipeplan.profile/v1\nname: [unclosed\n", ["invalid YAML at line 3 column 1"]),
        ("", ["empty file"]),
        ("- just\n- a list\n", ["not a pipeplan file"]),
        ("format: pipeplan.profile/v1\n\tname: tab\n", ["invalid YAML"]),
    ],
    ids=["syntax", "empty", "list", "tab"],
)
def test_unreadable_yaml_exits_2(tmp_path, text, expect):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    code, err = run_show(path)
    assert code == 2 and str(path) in err
    for t in expect:
        assert t in err, err


def test_missing_and_binary_files_exit_2(tmp_path):
    code, err = run_show(tmp_path / "nope.yaml")
    assert code == 2 and "no such profile file" in err
    binary = tmp_path / "bin.yaml"
    binary.write_bytes(b"\xff\xfe\x00\x81" * 10)
    code, err = run_show(binary)
    assert code == 2 and "not a text file" in err


def test_unknown_profile_name_exits_2():
    r = CliRunner().invoke(cli, ["profiles", "show", "a100-80gb-sx"])
    assert r.exit_code == 2 and "unknown hardware profile 'a100-80gb-sx'" in r.stderr and "a100-80gb-sxm" in r.stderr


def test_debug_shows_the_traceback(tmp_path):
    path = tmp_path / "neg.yaml"
    doc = good_doc()
    doc["memory_gib"] = -1
    path.write_text(yaml.safe_dump(doc))
    r = CliRunner().invoke(cli, ["--debug", "profiles", "show", str(path)])
    assert r.exit_code != 0 and r.exception is not None and "memory_gib" in str(r.exception)
