"""`pipeplan run` of a plan priced on a GPU's catalogue profile, on this machine's CPU cores: a note says the
prediction is for that device (the table reads +100,000% and nothing said why)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from cli_fixtures import hand_plan
from pipeplan.cli.run_cmd import _planned_for_another_machine
from pipeplan.hardware_profiles import load_profile
from pipeplan.hardware_profiles.loader import save_profile


def test_a_catalogue_plan_run_on_cpu_says_whose_prediction_it_is(tmp_path, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    plan = hand_plan()  # on a100-80gb-sxm
    note = _planned_for_another_machine(plan, str(tmp_path / "plan.json"))
    assert note is not None and "a100-80gb-sxm (NVIDIA A100 SXM4 80GB)" in note and "profiles calibrate" in note


def test_no_note_for_a_local_profile_a_gpu_run_or_a_profile_gone(tmp_path, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    local = dataclasses.replace(load_profile("a100-80gb-sxm"), name="here", local=True)
    save_profile(local, tmp_path / "local.yaml")
    assert load_profile(str(tmp_path / "local.yaml")).local  # the file round-trips the flag the check reads
    plan = dataclasses.replace(hand_plan(), profile=str(tmp_path / "local.yaml"))
    assert _planned_for_another_machine(plan, str(tmp_path / "plan.json")) is None
    gone = dataclasses.replace(hand_plan(), profile=str(tmp_path / "moved.yaml"))
    assert _planned_for_another_machine(gone, str(tmp_path / "plan.json")) is None
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert _planned_for_another_machine(hand_plan(), str(tmp_path / "plan.json")) is None


@pytest.mark.parametrize("catalogue", ["h100-sxm", "tpu-v5p"])
def test_the_note_names_the_plans_own_profile(tmp_path, monkeypatch, catalogue):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    plan = dataclasses.replace(hand_plan(), profile=catalogue)
    note = _planned_for_another_machine(plan, str(tmp_path / "plan.json"))
    assert f"predicted for {catalogue} ({load_profile(catalogue).device})" in note
