"""Run by tests/test_export_torchtitan.py with a Python that has torchtitan 0.3 installed (not pipeplan's venv:
torchtitan pins huggingface_hub and fsspec versions that pipeplan's transformers does not accept).

argv: MODULE_DIR MODULE CONFIG [tyro overrides...]. Loads the config through torchtitan's own ConfigManager
(the exported config_registry function plus the exported command-line flags), builds the model on the meta
device, cuts it with torchtitan's own `_split_module` per model part, and prints JSON: the parallelism settings
torchtitan parsed, the number of decoder layers, and the top-level modules each part keeps.
"""

import json
import sys

import torch

sys.path.insert(0, sys.argv[1])
from torchtitan.config.manager import ConfigManager  # noqa: E402
from torchtitan.distributed.pipeline_parallel import _generate_llm_fqn_per_model_part, _split_module  # noqa: E402

config = ConfigManager().parse_args(["--module", sys.argv[2], "--config", sys.argv[3], *sys.argv[4:]])
p = config.parallelism
with torch.device("meta"):
    model = config.model_spec.model.build()
kept = []
for part in p.module_fqns_per_model_part:
    sub = _split_module(model, part)
    names = []
    for name, child in sub.named_children():
        if child is None:
            continue
        if isinstance(child, (torch.nn.ModuleList, torch.nn.ModuleDict)) or type(child).__name__ in ("ModuleList", "ModuleDict"):
            keys = child.keys() if hasattr(child, "keys") else range(len(child))
            names += [f"{name}.{k}" for k in keys]
        else:
            names.append(name)
    kept.append(names)
n_layers = len(config.model_spec.model.layers)
print(json.dumps({
    "pipeline_parallel_degree": p.pipeline_parallel_degree,
    "pipeline_parallel_schedule": p.pipeline_parallel_schedule,
    "pipeline_parallel_microbatch_size": p.pipeline_parallel_microbatch_size,
    "local_batch_size": config.training.local_batch_size,
    "mixed_precision_param": config.training.mixed_precision_param,
    "activation_checkpoint": type(config.activation_checkpoint).__qualname__ if config.activation_checkpoint else None,
    "data_parallel_replicate_degree": p.data_parallel_replicate_degree,
    "data_parallel_shard_degree": p.data_parallel_shard_degree,
    "module_fqns_per_model_part": p.module_fqns_per_model_part,
    "n_layers": n_layers,
    "kept": kept,
    "default_parts": {f"{k},{i},{o}": _generate_llm_fqn_per_model_part(k, n_layers, i, o)
                      for k in (2, 3, 4) for i in (1, 2) for o in (1, 2)
                      if k <= n_layers + i + o and (n_layers + i + o) // k >= max(i, o)},
}))
