"""A PipeDream graph.txt's times are per profiled minibatch; --profiled-batch-size says how big that was."""

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from cli_fixtures import chain_graph
from pipeplan.cli.main import cli

SHARED = Path(__file__).resolve().parent / "data" / "pipedream-profiles"
VGG = SHARED / "vgg16.graph.txt"


def samples_per_s(batch, *extra):
    args = ["plan", str(VGG), "--profile", "v100-32gb", "--gpus", "1", "--batch-size", str(batch), "--stages", "1",
            "--microbatches", "1", "--recompute", "off", "--times", "measured", "--json", *extra]
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)["plan"]["predicted"]["samples_per_s"]


def test_profiled_batch_size_scales_measured_times_per_sample():
    # One device, one stage, one microbatch: no communication. Without the flag one "sample" is a whole
    # profiled minibatch; with it, 64 samples are that same minibatch, so 64x the samples per second.
    assert samples_per_s(64, "--profiled-batch-size", "64") == pytest.approx(64 * samples_per_s(1), rel=1e-9)


def test_profiled_batch_size_is_refused_for_a_pipeplan_graph(tmp_path):
    path = tmp_path / "graph.json"
    chain_graph().save(path)
    result = CliRunner().invoke(cli, ["plan", str(path), "--profile", "v100-32gb", "--gpus", "2",
                                      "--profiled-batch-size", "8"])
    assert result.exit_code == 2
    assert "--profiled-batch-size only applies to a PipeDream graph.txt" in result.output
