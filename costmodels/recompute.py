"""What recomputation's re-run of a checkpointed region costs: its forward up to the last tensor it saves.

The runtime recomputes a stage with torch's non-reentrant checkpoint (runtime/recompute.py). Its re-run stops
as soon as every tensor the original forward saved for backward has been saved again: "early stop", on by
default (`torch.utils.checkpoint.set_checkpoint_early_stop`, torch docs; `_checkpoint_hook` counts the
recomputed saves and raises `_StopRecomputationError` at the last). Whatever the forward does after its last
save is skipped. Autograd saves an op's inputs before the op runs and its outputs after, so a stage that ends in
a Linear (which saves its input and weight) re-runs everything but the final matmul: on examples/mlp.py's first
stage, 14.6 ms of re-run against a 30 ms forward, measured in `pipeplan run`. Frameworks that recompute with
their own reentrant function (Megatron-LM's CheckpointFunction, torchgpipe's Recompute) re-run the whole forward;
priced here is pipeplan's own runtime. On this machine's CPU a re-run also reads the inputs it runs on from DRAM,
where the traced forward found them in cache (`cold_read_s`).
"""

from __future__ import annotations

from collections.abc import Sequence

from pipeplan.costmodels.graph import Layer, trainable_params
from pipeplan.hardware_profiles.profile import HardwareProfile


def rerun_shares(layers: Sequence[Layer]) -> list[float]:
    """Of each layer of a region (in execution order), the share of its forward one re-run runs.

    Walking back from the region's end: a layer that saves nothing is skipped whole (0), the last layer that saves
    runs up to its last save (its traced share `last_save_s / fwd_s`), and every layer before it runs whole (1). A
    layer whose saves were not timed (`saved_tensors` None: graphs from before, analytic or imported ones) ends the
    walk as a whole forward, the price before this was known.
    """
    shares = [0.0] * len(layers)
    for i in range(len(layers) - 1, -1, -1):
        layer = layers[i]
        if layer.saved_tensors is None or layer.last_save_s is None:
            return [1.0] * (i + 1) + shares[i + 1:]
        if layer.saved_tensors == 0:
            continue
        shares[:i] = [1.0] * i
        shares[i] = min(1.0, layer.last_save_s / layer.fwd_s) if layer.fwd_s > 0 else 1.0
        return shares
    return shares


def rerun_forward_s(layers: Sequence[Layer], fwd_s: Sequence[float]) -> float:
    """One re-run of a region made of `layers` (in execution order) whose forwards take `fwd_s` on the device: each
    layer's forward times the share of it the re-run runs (`rerun_shares`)."""
    return sum(share * f for share, f in zip(rerun_shares(layers), fwd_s, strict=True))


def cold_read_s(nbytes: float, profile: HardwareProfile) -> float:
    """What a re-run pays beyond its traced forward to read `nbytes` of region inputs from DRAM, on this machine's CPU.

    Why: a local profile's layer times are measured in a forward where each layer's input was just made by the
    layer before it, in cache; a re-run in the backward reads inputs made long before. Measured here (one core,
    the runtime's allocator setting): a ReLU over 4 MiB took 108 µs with its input in cache and 306 µs with it
    evicted; 21 checkpoints of one such ReLU each cost 179-268 µs a region beyond the traced re-run, whatever
    checkpoint's variant (benchmarks/RESULTS.md, "Runtime, every schedule on the smaller examples"). The re-run
    reads its input from DRAM and writes its result into a buffer nothing touched since it was freed: priced as a
    copy of the bytes at the profile's copy rate (`mem_bw_bytes_per_s`, read + write bytes: calibrate's copy), 2n
    over it: 161-186 µs for those 4 MiB at 45-52 GB/s. (Zero bubble's W reads gradients back without writing
    their like: costmodels/split_backward.py prices n over it.) On a GPU (a catalogue profile's roofline, or CUDA-event
    times of layers whose tensors outgrow its L2) every input already comes from memory: nothing to add.
    """
    if not profile.local_cpu() or nbytes <= 0:
        return 0.0
    return 2.0 * nbytes / profile.mem_bw_bytes_per_s


def block_runs(block_of: Sequence[object]) -> list[tuple[int, int]]:
    """[start, stop) of each run of equal block ids in `block_of` (layers in execution order): the regions a stage
    recomputed per block checkpoints apart (a block the stage boundary cuts is its part inside; the runtime passes
    (stage, block) pairs for the whole model)."""
    runs: list[tuple[int, int]] = []
    for i, b in enumerate(block_of):
        if runs and block_of[runs[-1][0]] == b:
            runs[-1] = (runs[-1][0], i + 1)
        else:
            runs.append((i, i + 1))
    return runs


def weight_grad_passes(layers: Sequence[Layer]) -> int:
    """How often a zero-bubble W re-runs a recomputed stage made of `layers`: once per parameter group.

    torch.distributed.pipelining's split backward (torch 2.13 `_backward.py`): `stage_backward_input` groups the
    stage's parameters by the autograd nodes where their gradients leave the input-gradient path
    (`get_param_groups`; a Linear's weight and bias meet at its addmm, so in practice one group per module that
    owns parameters), and `stage_backward_weight` calls `torch.autograd.grad` once per group. Each call is a
    graph task of its own, and non-reentrant checkpoint re-runs the region once for every graph task that
    unpacks a saved tensor. Measured with torch's functions on a transformer block (two LayerNorms, three
    Linears): B re-ran its forward once and W five times (tests/test_recompute_cost.py).

    Counted: the distinct modules owning the parameters the layers use (a parameter's name less its last
    part), so a module used twice counts once, as torch merges its groups; a layer with parameter bytes but no
    parameter names (analytic or imported graphs) counts as one module.
    """
    owners: set[str] = set()
    unnamed = 0
    for layer in layers:
        if layer.params:
            owners.update(name.rsplit(".", 1)[0] for name in trainable_params(layer))
        elif layer.param_bytes > layer.frozen_param_bytes:
            unnamed += 1
    return len(owners) + unnamed


def weight_passes_added(layers: Sequence[Layer]) -> list[int]:
    """Per layer of the model, the parameter groups it adds to `weight_grad_passes`: the modules it uses that no
    layer before it used. A range's sum is `weight_grad_passes` of its layers unless a module used by the range is
    also used before it (counted there instead): the partitioner's per-range count in O(1)."""
    seen: set[str] = set()
    added = []
    for layer in layers:
        owners = {name.rsplit(".", 1)[0] for name in trainable_params(layer)}
        added.append(len(owners - seen) + int(not layer.params and layer.param_bytes > layer.frozen_param_bytes))
        seen |= owners
    return added


def checkpoint_overhead_s(layers: Sequence[Layer], per_region_s: float, per_tensor_s: float) -> float:
    """The host time of torch's checkpoint around one recomputed region of `layers`, beyond re-running them.

    Per region (RNG state, the re-run's frame, stopping it) and per tensor the region's forward saves (a pack
    hook in the forward and in the re-run, an unpack in the backward): hardware_profiles/recompute_overhead.py
    measures both. Layers whose saves were not counted count none.
    """
    if not layers:
        return 0.0
    return per_region_s + per_tensor_s * sum(layer.saved_tensors or 0 for layer in layers)
