"""examples/hf_gpt2.py with dropout off: the runtime equivalence test compares a pipelined step with a
single-process one, and dropout masks drawn by different processes can never match."""

import importlib.util
from pathlib import Path

_spec = importlib.util.spec_from_file_location("_pipeplan_example_hf_gpt2", Path(__file__).parents[1] / "examples" / "hf_gpt2.py")
_example = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_example)

example_inputs = _example.example_inputs
example_target = _example.example_target
loss_fn = _example.loss_fn


def build_model():
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(**_example.CONFIG, use_cache=False, attn_implementation="sdpa",
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return GPT2LMHeadModel(config)
