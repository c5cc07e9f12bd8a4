"""examples/hf_gpt2.py with 6 layers instead of 2 (enough identical blocks to trace once), for tests/test_blocks.py."""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "examples"))
import hf_gpt2  # noqa: E402
from hf_gpt2 import example_inputs, example_target, loss_fn  # noqa: E402,F401

hf_gpt2.CONFIG["n_layer"] = 6


def build_model():
    return hf_gpt2.build_model()
