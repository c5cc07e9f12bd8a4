"""Hardware profiles: the catalogue against the reference sheet, lookup, fallbacks, JSON/YAML round trips."""

import dataclasses
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

from pipeplan.cli.main import cli
from pipeplan.errors import UserError
from pipeplan.hardware_profiles import list_profiles, load_profile, profile_to_dict, save_profile
from pipeplan.hardware_profiles.loader import CATALOG_DIR, EFFICIENCY_KINDS, GIB, parse_profile, read_profile_file

REFERENCE = Path(__file__).resolve().parent / "data" / "reference" / "accelerators-and-formulas.md"

# ids the interface promises (interfaces.md, "Hardware profiles")
REQUIRED = """v100-16gb-sxm2 v100-32gb-sxm2 a100-40gb-sxm a100-80gb-sxm a100-80gb-pcie h100-sxm h100-pcie h200 b200
l4 t4 a10g rtx-4090 mi250x mi300x tpu-v3 tpu-v4 tpu-v5e tpu-v5p tpu-v6e""".split()

# catalogue name -> (reference id, factor): mi250x is described per GCD (half a package)
REF_IDS = {
    "v100-16gb-sxm2": ("v100-sxm2-16gb", 1), "v100-32gb-sxm2": ("v100-sxm2-32gb", 1),
    "a100-40gb-sxm": ("a100-sxm4-40gb", 1), "a100-80gb-sxm": ("a100-sxm4-80gb", 1),
    "a100-80gb-pcie": ("a100-pcie-80gb", 1), "h100-sxm": ("h100-sxm5-80gb", 1), "h100-pcie": ("h100-pcie-80gb", 1),
    "h200": ("h200-sxm-141gb", 1), "b200": ("b200", 1), "l4": ("l4", 1), "t4": ("t4", 1), "a10g": ("a10g", 1),
    "rtx-4090": ("rtx-4090", 1), "mi250x": ("mi250x", 0.5), "mi300x": ("mi300x", 1), "tpu-v3": ("tpu-v3", 1),
    "tpu-v4": ("tpu-v4", 1), "tpu-v5e": ("tpu-v5e", 1), "tpu-v5p": ("tpu-v5p", 1), "tpu-v6e": ("tpu-v6e-trillium", 1),
}


def reference_entries() -> dict[str, dict]:
    block = re.search(r"```yaml\n(.*?)```", REFERENCE.read_text(encoding="utf-8"), re.S).group(1)
    entries = {a["id"]: a for a in yaml.safe_load(block)["accelerators"]}

    def resolve(entry: dict) -> dict:
        if "inherits" not in entry:
            return dict(entry)
        return {**resolve(entries[entry["inherits"]]), **{k: v for k, v in entry.items() if k != "inherits"}}

    return {key: resolve(entry) for key, entry in entries.items()}


def test_every_promised_profile_loads_by_name():
    names = {p.name for p in list_profiles()}
    assert set(REQUIRED) <= names
    for name in REQUIRED:
        assert load_profile(name).name == name


def test_catalogue_numbers_match_the_reference_sheet():
    ref = reference_entries()
    for prof in list_profiles():
        if prof.name not in REF_IDS:
            continue
        ref_id, f = REF_IDS[prof.name]
        r = ref[ref_id]
        assert prof.memory_bytes == round(r["memory_gib"] * f * GIB), prof.name
        assert prof.mem_bw_bytes_per_s == pytest.approx(r["mem_bw_gbps"] * f * 1e9, rel=1e-3), prof.name
        for dtype in ("tf32", "fp16", "bf16"):
            want = r.get(f"{dtype}_tflops")
            got = prof.peak_flops[dtype]
            assert (got is None) == (want is None), (prof.name, dtype)
            if want is not None:
                assert got == pytest.approx(want * f * 1e12, rel=1e-3), (prof.name, dtype)
        # fp32: non-tensor rate, except MI250X whose fp32 GEMMs run on matrix cores
        want32 = r.get("fp32_matrix_tflops") or r.get("fp32_tflops")
        got32 = prof.peak_flops["fp32"]
        assert (got32 is None) == (want32 is None), prof.name
        if want32:
            assert got32 == pytest.approx(want32 * f * 1e12, rel=1e-3), prof.name


def test_cluster_shapes_follow_the_named_systems():
    a100 = load_profile("a100-80gb-sxm")
    assert a100.devices_per_node == 8
    assert a100.intra_node.kind == "nvlink" and a100.intra_node.bandwidth_bytes_per_s == 300e9
    assert a100.inter_node.bandwidth_bytes_per_s == 200e9 / 8  # 200 Gb/s HDR per GPU
    h100 = load_profile("h100-sxm")
    assert h100.intra_node.bandwidth_bytes_per_s == 450e9 and h100.inter_node.bandwidth_bytes_per_s == 50e9
    assert load_profile("b200").intra_node.bandwidth_bytes_per_s == 900e9
    # link_between: ranks 0-7 share a node, 8 is on the next one
    assert a100.link_between(0, 7) is a100.intra_node
    assert a100.link_between(7, 8) is a100.inter_node
    assert a100.link_between(9, 15) is a100.intra_node


def test_every_profile_is_consistent_and_sourced():
    for p in list_profiles():
        assert 0 < p.usable_memory_bytes <= p.memory_bytes, p.name
        assert p.sources, p.name
        assert p.confidence and set(p.confidence.values()) <= {"V", "S", "M"}, p.name
        assert p.intra_node.bandwidth_bytes_per_s >= p.inter_node.bandwidth_bytes_per_s, p.name
        assert 0 < p.intra_node.latency_s <= p.inter_node.latency_s < 1e-3, p.name
        assert p.flops_for("bf16") > 0


def test_names_and_aliases_are_unique_and_case_insensitive():
    seen = {}
    for p in list_profiles():
        for n in (p.name, *p.aliases):
            assert n not in seen, f"{n} used by {seen.get(n)} and {p.name}"
            seen[n] = p.name
    assert load_profile("H100").name == "h100-sxm"
    assert load_profile("v100-32gb").name == "v100-32gb-sxm2"
    assert load_profile("a100-80gb").name == "a100-80gb-sxm"


def test_unknown_name_suggests_close_matches():
    with pytest.raises(UserError) as e:
        load_profile("a100-80gb-sx")
    assert "a100-80gb-sxm" in str(e.value) and "profiles list" in str(e.value)


def test_flops_fallbacks():
    a100, v100, tpu = load_profile("a100-80gb-sxm"), load_profile("v100-16gb-sxm2"), load_profile("tpu-v4")
    assert a100.flops_for("fp32") == 19.5e12  # fp32 never silently becomes tf32
    assert a100.flops_for("tf32") == 156e12
    assert v100.flops_for("tf32") == 15.7e12  # no TF32 on Volta: CUDA-core fp32
    assert v100.flops_for("fp16") == 125e12
    assert v100.flops_for("bf16") == 15.7e12  # no bf16 fast path: fp32 rate, not the fp16 tensor rate
    assert tpu.flops_for("bf16") == 275e12
    for dtype in ("fp32", "tf32", "fp16"):
        with pytest.raises(UserError) as e:
            tpu.flops_for(dtype)
        assert "--dtype bf16" in str(e.value) and "tpu-v4" in str(e.value)
    with pytest.raises(UserError, match="unknown dtype 'int8'"):
        a100.flops_for("int8")


def test_efficiency_kinds_match_the_graph_layer_kinds():
    from pipeplan.costmodels.graph import PART_KINDS

    assert EFFICIENCY_KINDS == (*PART_KINDS, "memory")


def test_save_then_load_round_trips_every_catalogue_profile(tmp_path):
    for p in list_profiles():
        out = tmp_path / f"{p.name}.yaml"
        save_profile(p, out)
        q = read_profile_file(out)
        assert abs(q.memory_bytes - p.memory_bytes) <= 64 and abs(q.usable_memory_bytes - p.usable_memory_bytes) <= 64
        same = dataclasses.replace(q, path=p.path, memory_bytes=p.memory_bytes, usable_memory_bytes=p.usable_memory_bytes)
        assert same == p, p.name
    assert not list(tmp_path.glob(".*.tmp"))  # atomic writes leave no temp files


def test_profile_to_dict_is_the_file_format():
    p = load_profile("h100-sxm")
    doc = profile_to_dict(p)
    assert doc["format"] == "pipeplan.profile/v1"
    assert doc["peak_tflops"] == {"fp32": 66.9, "tf32": 494.7, "fp16": 989.4, "bf16": 989.4}
    assert doc["intra_node"] == {"kind": "nvlink", "bandwidth_gbps": 450, "latency_us": 3}
    assert dataclasses.replace(parse_profile(doc, "x.yaml"), path=p.path) == p


# ---------------------------------------------------------------- user folder
def write_profile(folder: Path, name: str, **changes) -> Path:
    doc = profile_to_dict(load_profile("a100-80gb-sxm"))
    doc.pop("aliases")
    doc.update(name=name, device="My A100 box", devices_per_node=4, **changes)
    path = folder / f"{name}.yaml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


def test_user_folder_profiles_are_listed_and_loadable(tmp_path, monkeypatch):
    monkeypatch.setenv("PIPEPLAN_PROFILE_DIR", str(tmp_path))
    write_profile(tmp_path, "lab-a100")
    assert load_profile("lab-a100").devices_per_node == 4
    r = CliRunner().invoke(cli, ["profiles", "list", "--json"])
    assert r.exit_code == 0, r.output
    items = json.loads(r.stdout)
    mine = [d for d in items if d["name"] == "lab-a100"]
    assert len(mine) == 1 and mine[0]["origin"] == "user" and mine[0]["devices_per_node"] == 4
    assert len(items) == len(list(CATALOG_DIR.glob("*.yaml"))) + 1
    r = CliRunner().invoke(cli, ["profiles", "list"])
    assert r.exit_code == 0 and "lab-a100" in r.stdout and "tpu-v6e" in r.stdout


def test_user_profile_shadows_catalogue_name(tmp_path, monkeypatch):
    monkeypatch.setenv("PIPEPLAN_PROFILE_DIR", str(tmp_path))
    write_profile(tmp_path, "h100-sxm")
    assert load_profile("h100-sxm").device == "My A100 box"
    assert [p.device for p in list_profiles() if p.name == "h100-sxm"] == ["My A100 box"]


def test_broken_user_profile_is_an_error_naming_it(tmp_path, monkeypatch):
    monkeypatch.setenv("PIPEPLAN_PROFILE_DIR", str(tmp_path))
    write_profile(tmp_path, "broken", memory_gib=-1)
    r = CliRunner().invoke(cli, ["profiles", "list"])
    assert r.exit_code == 2
    assert "broken.yaml" in r.stderr and "memory_gib" in r.stderr


def test_duplicate_user_profile_names_are_an_error(tmp_path, monkeypatch):
    monkeypatch.setenv("PIPEPLAN_PROFILE_DIR", str(tmp_path))
    write_profile(tmp_path, "twin")
    (tmp_path / "twin2.yaml").write_text((tmp_path / "twin.yaml").read_text())
    with pytest.raises(UserError, match="'twin' is also used by"):
        list_profiles()


# ---------------------------------------------------------------- CLI
def test_show_json_and_table():
    r = CliRunner().invoke(cli, ["profiles", "show", "tpu-v5e", "--json"])
    assert r.exit_code == 0
    doc = json.loads(r.stdout)
    assert doc["name"] == "tpu-v5e" and doc["peak_tflops"]["bf16"] == 197 and doc["peak_tflops"]["fp32"] is None
    assert doc["origin"] == "catalog"
    r = CliRunner().invoke(cli, ["profiles", "show", "h100"])
    assert r.exit_code == 0 and "h100-sxm" in r.stdout and "989.4 TFLOP/s" in r.stdout and "sources" in r.stdout


def test_show_accepts_a_path(tmp_path):
    path = write_profile(tmp_path, "from-path")
    r = CliRunner().invoke(cli, ["profiles", "show", str(path), "--json"])
    assert r.exit_code == 0 and json.loads(r.stdout)["name"] == "from-path"


def test_list_json_is_one_document_of_valid_profiles():
    r = CliRunner().invoke(cli, ["profiles", "list", "--json"])
    assert r.exit_code == 0
    items = json.loads(r.stdout)
    assert {d["name"] for d in items} >= set(REQUIRED)
    for d in items:
        d = {k: v for k, v in d.items() if k not in ("origin", "path")}
        assert parse_profile(d, "json").name == d["name"]


def test_profiles_list_does_not_import_torch():
    code = (
        "import sys; from click.testing import CliRunner; from pipeplan.cli.main import cli\n"
        "r = CliRunner().invoke(cli, ['profiles', 'list', '--json']); assert r.exit_code == 0\n"
        "print('torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "False", out.stderr


def test_callers_get_independent_copies():
    a = load_profile("a100-80gb-sxm")
    a.peak_flops["bf16"] = 1.0
    a.efficiency["matmul"] = 0.1
    fresh = load_profile("a100-80gb-sxm")
    assert fresh.peak_flops["bf16"] == 312e12 and "matmul" not in fresh.efficiency
    assert [p.peak_flops["bf16"] for p in list_profiles() if p.name == "a100-80gb-sxm"] == [312e12]
