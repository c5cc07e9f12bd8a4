"""Published GPU training throughput against pipeplan's prediction of the same configuration.

Usage (prints the table; --write-results rewrites this benchmark's section of benchmarks/RESULTS.md):

    python benchmarks/published_bench.py [--only SUBSTRING] [--no-cache] [--no-depth-check] [--write-results]

Each row of benchmarks/published/cases.yaml is a measured number from a paper or a vendor/framework page
(quoted there with its source): a model of known shape trained on named GPUs with a known parallel
configuration. For each row the model is traced weight-free (a Hugging Face config.json through
`pipeplan.trace(..., time_layers=False)`; Megatron-LM's and Zero Bubble's GPTs, whose attention was unfused,
from benchmarks/published/megatron_gpt_s*.py; ResNet-50 from the model defined below; torchgpipe's U-Net and
ResNet-101 from benchmarks/published/torchgpipe_*.py; cnn-benchmarks' VGGs and ResNets from
benchmarks/published/cnn_benchmarks.py), `pipeplan.search` is run with everything the source fixed
(stages, data-parallel replicas, microbatches, schedule, recomputation, dtype, ZeRO level, mixed-precision recipe)
on the catalogue profile of that GPU, or, where the source gives its split (`balance`), that split is evaluated;
the plan's samples/s is converted to the source's metric (tokens/s per GPU, samples/s, or the
source's own FLOP formula). Nothing is fitted to the rows but the Pascal profiles' memory efficiency, fitted to
the cnn-benchmarks rows by benchmarks/published_fit.py. Rows with tensor parallelism are listed but not
predicted (pipeplan does not model it) and are left out of the error statistics.

Traced graphs are cached under /tmp/pipeplan-published-bench (keyed by the model file, sequence length,
torch version and the tracer's sources); --no-cache retraces. The depth check retraces two models with one
layer per op (instead of one per transformer block) to show what the block-level roofline hides.
"""

from __future__ import annotations

import argparse
import bisect
import dataclasses
import hashlib
import itertools
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

SECTION = "## Published GPU training throughput (`benchmarks/published_bench.py`)"
HERE = Path(__file__).resolve().parent
DATA = HERE / "published"
ROOT = HERE.parent
CACHE = Path("/tmp/pipeplan-published-bench")
TARGET_MEDIAN, TARGET_WORST = 0.10, 0.25  # issue 16: median |error| <= 10%, worst <= 25%
# Models traced one layer per transformer block by default (blocks.coarse_depth), retraced one layer per op.
DEPTH_CHECK = (("mpt-7b", 4), ("zb-gpt-6.2b", 4), ("bert-large-128", 5))


# Written from the run recorded in benchmarks/RESULTS.md (the predictions are deterministic: no timing is involved).
ANALYSIS = """
**What changed since the baseline (median 20%, worst 74%), and what still misses.** Every change but one is a
mechanism with a source outside this table (costmodels/part_costs.py, docs/cost-models.md); the one number
fitted to published rows is the memory efficiency of the Pascal profiles (9 below), fitted to one source and
checked against another.

1. *Per-op-kind pricing.* `trace` now records a layer's ops summed per kind (graph `parts`: matmul, attention,
   norm, elementwise, dropout, conv, conv3x3, other) and a layer costs the sum of its parts' rooflines, so a
   decoder block's norms, residual adds, GELU and dropout no longer hide under its GEMMs' FLOPs. The depth
   check below shows it: a model traced one layer per block now predicts what it predicts one layer per op
   (mpt-7b 1.00 against 0.99; before, 1.08 against 0.99).
2. *Training-mode traffic.* Norms read their input twice forward and five tensors backward (PyTorch's CUDA
   kernels), dropout writes a mask, an elementwise backward moves 3 tensors, and the loss over the model's
   output (a 50k-word vocabulary's logits) is charged to the layer that returns it. mpt-125m: 1.20 -> 1.14.
3. *Per-device, per-dtype efficiency.* `efficiency` takes `kind@dtype` keys; Hopper profiles carry
   FlashAttention-2's 35% (FlashAttention-3 paper) and GEMMs at 80.1/85.9 of A100's (ml-engineering's measured
   MAMF table). H100 rows: 1.32-1.74 -> 1.05-1.43.
4. *Winograd and per-kernel time.* FP32 3x3 convolutions run 2.25x fewer multiplies (Lavin & Gray); every
   kernel costs at least 3 µs and eager PyTorch 8 µs of host time per op (the floor for small microbatches).
   ResNet-50 fp32 on V100: 0.76 -> 0.89.
5. *The optimizer step.* Each device steps its stages' optimizer after the gradients are reduced, a
   memory-bound pass of 28 bytes per parameter for a fused Adam (costmodels/optimizer_step.py). Small on these
   rows (mpt-13b/h100x8: 1.43 -> 1.39), more where a device holds many parameters per sample. LLM Foundry's
   runs step with Composer's DecoupledAdamW (their yamls' `decoupled_adamw`), a Python loop of eight torch ops
   a tensor (composer/optim/decoupled_weight_decay.py): 80 bytes a parameter, not a fused kernel's 28; their
   rows say so (`optimizer_kernels: foreach`, the plan's `--optimizer-kernels`): mpt-13b/h100x8 1.31 -> 1.26,
   mpt-7b/h100x8 1.16 -> 1.15, the rest within 0.01. Their gradient clipping by norm (~12 bytes a parameter
   more) is not priced. Since, the step streams at the bandwidth the profile's memory-bound layers get (its
   memory efficiency, 0.80 unless it says; compute.streaming_bandwidth_bytes_per_s), not the datasheet's: on
   an H100 torch's fused Adam moved GPT-2's 28 bytes a parameter at 60% of it (RESULTS, GPU (g)).
   mpt-13b/h100x8 1.26 -> 1.24, the rest within 0.01.
6. *Channels-first convolutions on tensor cores.* cuDNN's tensor-core convolutions work in NHWC; a model left
   in PyTorch's default NCHW pays a transpose of every convolution's input and output there and back (MosaicML
   Composer's "Channels Last" card). `trace` now records which convolutions are channels-first (the part's
   `layout_bytes`) and NVIDIA profiles charge the transposes in fp16, bf16 and tf32. DeepLearningExamples run
   mixed precision with `--memory-format nhwc` and TF32 in NCHW (its configs.yml), so the AMP rows are traced
   channels-last (`build_resnet50_nhwc`) and the TF32 rows as they are: resnet50-tf32/a100x1 1.42 -> 1.13, the
   AMP rows unchanged. As a check against another source, the same model predicts channels-last 1.25x faster
   than NCHW in fp16 on A100 (1.24x on V100); the Composer card says "about 30%".
7. *Compute beside collectives.* ZeRO-3's all-gathers and reduce-scatters overlap compute, which then runs
   18.9% slower for as long as they overlap (Lee et al. 2025, arXiv 2507.03114: the average slowdown over GPT
   and LLaMA training on A100, H100, MI250 and MI210; planner/predict_inputs.op_times). mpt-13b/h100x8
   1.39 -> 1.31, mpt-3b/h100x16 1.17 -> 1.06, mpt-7b/h100x128 1.05 -> 1.00; rows with large microbatches move
   1-2%.

Two rows were added with 6 (the same table's 8-GPU TF32 and FP32 figures, quoted in the rows beside them):
resnet50-tf32/a100x8 1.16 and resnet50-fp32/v100x8 0.91.

Ten rows were added later from a sixth source, torchgpipe's speed benchmarks (Kim et al. 2020): pipeline
training of a U-Net with long skip connections and of ResNet-101 on 1 to 8 Tesla P40s, GPipe in fp32 with
checkpointing. The models are rebuilt item for item as torchgpipe builds them (benchmarks/published/
torchgpipe_*.py; the U-Net's parameter counts equal torchgpipe's own table at five sizes, ResNet-101's equals
torchvision's 44,549,160; tests/test_published_torchgpipe.py), on a catalogue profile `p40` (datasheet numbers),
and predicted with the split torchgpipe ran (its `balance`). They came in at median 13%, worst 40% (unet/p40-
pipeline8); the one-GPU pipeline rows read 1.04 and 1.00 only because two errors cancelled.

8. *torchgpipe's recomputation spares one microbatch.* Its default `checkpoint="except_last"` keeps the last
   microbatch whole, where pipeplan's runtime (and this table before) re-runs every one. The simulator now
   has that rule (`recompute_last=False`, planner/simulate.py; the rows' `checkpoint: except_last`). The one-GPU
   pipeline rows (2 microbatches, one re-run) are now predicted at 0.85x the plain model's throughput, as
   torchgpipe measured (0.858 U-Net, 0.853 ResNet-101; before: 0.74), which uncovered the error they had hidden:
   pipeline-1 1.04 -> 1.20 (U-Net), 1.00 -> 1.16 (ResNet-101), equal to the one-GPU baselines' 1.21 and 1.16.
9. *Pascal's memory-bound layers, calibrated on a seventh source.* cnn-benchmarks (Johnson 2017) times seven
   CNNs on a Titan X Pascal and a GTX 1080 Ti, the same GP102 chip as the P40 (Torch7 + cuDNN 5.1, fp32, batch
   16, forward + backward without the optimizer step: `step: false`; new profiles `titan-x-pascal`,
   `gtx-1080-ti`; models in benchmarks/published/cnn_benchmarks.py with torchvision's parameter counts). With
   the catalogue's memory efficiency (0.80) VGG-16 and -19, nearly all 3x3 convolutions, are predicted at
   0.99-1.10: the Winograd pricing holds against cuDNN's autotuned kernels. The ResNets, with a batch norm and
   an activation after every convolution, read 1.12-1.58. One number, the memory efficiency of the GP102
   profiles, minimises the median |log(predicted / published)| over these 14 rows at 0.58
   (`python benchmarks/published_fit.py` prints the grid: median error 4.7% at 0.58, 16.6% at 0.80). torchgpipe's
   P40 rows are not in the fit; with 8 and the fitted value they read median 5.5%, worst 23% (before both: 13%,
   40%; with 8 alone: 18%, 41%). That is the one number in this table fitted to published rows; the fit's table and its held-out
   column are in the script's output, and tests/test_published_cnn_benchmarks.py fails if a cost-model change
   moves the fit's minimum away from the profiles' value. After 10 and 12 the minimum is still 0.58 (median
   4.7%; 16.6% at 0.80; torchgpipe held out: 5.2%, worst 23%).

10. *Where a transfer is paid.* pipeplan's simulator started each transfer at the producer's end and let it hide
   behind the receiver's compute. Its runtime does not: torch.distributed.pipelining posts a receive when it
   comes to the op and waits on it, and ProcessGroupNCCL starts a receive only after the work queued before it
   on the compute stream, so every op of a receiving stage pays its transfer (planner/simulate.py,
   `receives_wait`, for the torch schedules on every profile without a measured per-op gap; docs/cost-models.md).
   Megatron's pipeline waits for its batched sends and receives likewise: the Zero Bubble rows move by 0-0.01
   (NVLink). torchgpipe copies on CUDA streams of its own beside compute (torchgpipe/copy.py), so its rows are
   predicted with copies hidden (`copies: overlapped`) and do not move. Where the rule matters is pipeplan's
   own plans over slow links: its 8-stage plan for the U-Net on P40s is predicted at 109 samples/s for its
   runtime, where torchgpipe's way of running the same split (copies hidden, one microbatch not re-run) gives
   127 (the table below, last two predicted columns).
11. *Attention as the framework ran it.* The GPT rows were traced through transformers' SDPA attention, a fused
   kernel that never writes the (batch x heads, seq, seq) score matrix. The Megatron-LM runs did: its legacy
   CoreAttention computes the scores with a baddbmm, normalises them with FusedScaleMaskSoftmax, drops out
   probabilities and multiplies by the values with a bmm, four passes over that matrix forward and their
   gradients backward; FlashAttention came only with `--use-flash-attn`, which Narayanan et al. 2021 predates
   and which the Zero Bubble repository's paper-time script (examples/pretrain_zero_bubble.sh at 7c89dd42)
   does not pass. These rows are now traced from benchmarks/published/megatron_gpt_s*.py, GPT-2 with that
   attention (tests/test_published_megatron.py: it computes what transformers' SDPA GPT-2 computes, and the
   score-matrix matmuls are 2 s^2 h FLOPs each). megatron-1.7b 1.23 -> 0.99; Zero Bubble 1.09-1.26 ->
   1.04-1.10 (1.5B, whose score matrices weigh most beside its GEMMs, moved most). LLM Foundry's MPT rows
   keep SDPA: the benchmark ran MPT with Triton/Flash attention (cases.yaml's source notes). BERT: see 13.
12. *Torch7's first-layer input gradient.* cnn_benchmark.lua's `model:backward(x, dout)` computes the first
   layer's gradInput where the module has one, which PyTorch skips for an input that needs no gradient.
   cnn_benchmarks.py's inputs need one, so the trace counts VGG's first input gradient (Caffe models,
   gradInput kept: tests/test_published_cnn_benchmarks.py, its backward twice its forward's FLOPs). The ResNets
   have none: fb.resnet.torch's createModel ends with `model:get(1).gradInput = nil` (models/resnet.lua),
   cudnn.torch's SpatialConvolution:updateGradInput returns without one, and cnn-benchmarks restores only
   gradWeight and gradBias of the models it loads (utils.lua); their stem now counts the weight gradient only
   (`StemWithoutGradInput`). An earlier version of this item charged it to the ResNets too (1.40 -> 1.37 on
   resnet18/1080ti); taken back, found by reading those sources: resnet18 1.32 and 1.40, resnet34 1.25 and 1.27.
13. *BERT as DeepLearningExamples trained it, and what its phase-2 "sequences" are.* These rows were traced from
   transformers' BertLMHeadModel with SDPA attention (MLM head on every token) and read 1.13-1.22 at 128 tokens,
   0.74-0.75 at 512. The code behind the quoted tables (DeepLearningExamples a9e2c1d5, where the 21.11 tables
   appear) runs the MLM head on the masked positions only (`dense_sequence_output`, on by default; LDDL masks
   round(0.15 x tokens) a sequence) and unfused attention (torch.bmm, F.softmax, no fmha or flash path): the
   rows are now traced from published/dle_bert_s*.py, which computes what transformers' BertForPreTraining
   computes at those positions with the same weights (tests/test_published_dle_bert.py). 128 tokens: 1.12-1.21
   (the head's saving and the unfused scores about cancel). Phase 2 was not a 512-token workload: the README's
   changelog has "Binned pretraining for phase2 with LDDL using a bin size of 64", the scripts read the phase-2
   data from `bin_size_64`, LDDL pads each batch to its longest sequence and draws each batch from one bin, and
   throughput counts sequences whatever their length (run_pretraining.py: batch x GPUs x steps / time). At 512
   tokens a sequence the model predicts 0.57; the lengths the binned run saw are not published, but LDDL
   publishes what binning did to this recipe's phase 2 (its README's "Sequence Binning Performance": 32 Selene
   nodes, 2565 s with one 512-token bin, 1483 s with bins of 64: 1.73x), so these two rows are the 512-token
   prediction x 1.73 (cases.yaml `binned_speedup`): 0.99 and 1.00 on A100s. That factor is another source's
   measurement of the same recipe end to end on 256 GPUs, not a mechanism of pipeplan's; the rows are right
   only as far as it carries to 1 and 8 GPUs. A check that it carries: the DGX-1 V100 table (the same 21.11
   container and scripts) has 512-token rows too, added with it: 1.14 and 1.17, beside its 128-token rows'
   1.18 and 1.21, so per token the published 512/128 ratio (1.34) and the predicted one (1.29) agree there.

14. *No Winograd gain on small images.* DeepBench's per-kernel times (RESULTS, "Per kernel") show cuDNN's 3x3
   stride-1 convolutions on 7x7 outputs (ResNet's last stage, 256-512 channels) running at the implicit GEMM's
   rate whatever algorithm cudnnFind picked, forward and input gradient at 0.38-0.88 of the FP32 peak in direct
   FLOPs on both Pascal cards and the V100 (cuDNN 5, 6 and 7.6), where the same channels on 14x14 and 28x28
   outputs reach 1.04-2.35: too
   few output tiles per image to spread Winograd's transforms over. `trace` now records a 3x3 convolution with
   an output side under 8 as `conv` (direct FLOPs; costmodels/export.py `WINOGRAD_MIN_OUTPUT_SIDE`). The rows
   that have such layers move: resnet18 1.32 and 1.40 -> 1.18 and 1.26, resnet34 1.25 and 1.27 -> 1.12 and
   1.14, resnet50 1.14 -> 1.11-1.12, the U-Net (its 6x6 bottleneck) pipeline-8 1.23 -> 1.17 and baseline
   1.06 -> 0.99, ResNet-50 in fp32 on V100s 0.89 and 0.90 -> 0.86 and 0.88; the fp16 and tf32 rows do not
   move (no Winograd there). The Pascal fit's minimum stays at 0.58
   (median 4.4%; 15.0% at 0.80; torchgpipe held out: 4.1%, worst 17%; 5.0%, 17% since its timeline benchmark's row
   joined them), and the split torchgpipe tuned for 8
   P40s now prices more evenly (stage compute 51-134 ms a microbatch, 45-134 before: its 6x6 stage was the
   one priced at half the others).
15. *Batch norms with few channels.* An NCHW batch norm reduces each channel in one thread block (torch cunn's
   BatchNormalization.cu launches `blocks(input.getSize(1))`, as PyTorch's Normalization.cuh does for its
   statistics), so a layer of 64 channels keeps only a few blocks on each multiprocessor and leaves bandwidth
   idle. cunn's kernel, timed forward and backward at batch 64 on a Maxwell Titan X (soumith/cudnn.torch#100),
   took 1.45x as long per element at 64 channels as at 128-512, and 1.89x at 16. `trace` now records a
   channels-first batch norm's channels (the norm part's `channels`; 0 for channels-last, layer, group and
   instance norms), and the three GP102 profiles carry those times as `channel_factors.norm` on the memory
   efficiency (0.53 at 16 channels, 0.69 at 64, 1 from 128). cnn-benchmarks runs cuDNN's batch norm
   (cudnn.convert), whose kernels are not public; the factors are cunn's, taken as they are (judgement). Every
   ResNet's stem and first stage are 64 channels, a larger share of the small ones: resnet18 1.18 and 1.26 ->
   1.12 and 1.20, resnet34 1.12 and 1.14 -> 1.08 and 1.10, resnet50 1.11-1.12 -> 1.09-1.10, the deeper ones
   within 0.01; VGG has no batch norm and the U-Net instance norms (one block per sample and channel), so they do
   not move; torchgpipe's ResNet-101 rows move 0.00-0.07 down (pipeline-8 1.01 -> 0.94). The Pascal fit's
   minimum stays at 0.58 (median |log ratio| 0.045 with and without; its worst row 26% -> 20%; torchgpipe held
   out: 5.2%, worst 17%). Profiles other than GP102 have no such factors: pipeplan has not measured a batch norm
   by channel count on the kernels the V100 and A100 rows ran (cuDNN 7-8, PyTorch's channels-last kernels).

Still missing (the rows above 1.15 or below 0.85):
- *Small ResNets on Pascal.* ResNet-18 reads 1.12-1.20, ResNet-34 and -50 1.08-1.10, the deeper ones
  0.98-1.01. cnn-benchmarks times forward and backward apart (the "Forward and backward apart" table above):
  the miss is in the backward, a roughly fixed 3.4-4.7 ms in ResNet-18 and -34 and 8 ms in ResNet-50 (at most
  1.1 ms in their forwards), against -4 to +5 ms for VGG and the deeper ResNets (before 15: 4.2-5.6 and 9 ms).
  A fixed cost in what the three share fits the stem: its
  7x7 convolution over 3 input channels is a GEMM with a reduction of only 147 (forward, weight gradient), but
  Torch7 + cuDNN's per-layer times of a 3-channel first layer (soumith/convnet-benchmarks,
  torch7/layerwise_benchmarks/output.log, 11x11 over 3 channels on a Maxwell Titan X) put its forward near 60%
  of peak and its weight gradient at 1.07x its forward, as priced: under 0.2 ms here. Differences between rows
  place the miss: ResNet-34 minus ResNet-18 (its extra basic blocks at every resolution) is predicted within
  0.4 ms of the published backward difference (12.3-13.2 ms), so most of it is in what every ResNet shares (the stem's batch
  norm, ReLU and pooling over 64x112x112, the stage transitions, the head), not a per-block cost of small 3x3
  convolutions (14 has priced those at the implicit GEMM's rate since). 15 prices the 64-channel batch norms
  at cunn's rate; cuDNN's, which Torch7 ran, may be slower still at 64 channels (cuDNN 4's took 2.4x cunn's
  there in the same issue; cuDNN 5.1's are not published). DeepBench's per-kernel times on these GPUs (RESULTS,
  "Per kernel: DeepBench's convolutions") show the convolutions' backward priced too fast (their backward
  kernels run below the forward's FLOP rate: 1x1 ones at 0.66-0.72 on every GPU, 3x3 ones at 0.75-1.10 by cuDNN
  version), which the 0.58 partly stands in for; priced at those rates, the fit moves to 0.82 and the ResNets'
  memory-bound layers carry the miss (resnet18/1080ti 1.46, before 14). The deeper ResNets show that one
  memory efficiency cannot be right for every layer either:
  ResNet-101 minus ResNet-50 (17 more 14x14 blocks of 1024 channels) is predicted at 61.3 ms per batch against
  53.0 published (+16%, Titan X), ResNet-152 minus ResNet-101 at +8%. Telling which needs per-layer CUDA times.
- *torchgpipe's U-Net at 8 stages* (1.17, the worst of its rows): with
  torchgpipe's split the predicted stages are unequal (51 to 134 ms per microbatch); either the split
  torchgpipe tuned on P40s is as unequal as predicted, or per-layer costs at the extremes (the encoder's and
  the decoder's 192x192 blocks against the rest) are off relative to each other,
  as the ResNets above suggest. Its skip tensors (up to 300 MB a microbatch) cross PCIe beside compute, priced
  at 16 GB/s on every link (copies hidden, as torchgpipe runs them); a server whose 8 GPUs hang off two CPU
  sockets would move them slower, and pipeplan prices a skip on every cut it crosses where torchgpipe's portals
  copy it straight to the stage that pops it. torchgpipe's timeline benchmark (the same U-Net on 4 of the P40s,
  its own split, 8 microbatches of 16: row unet/p40-timeline4) narrows it. On its split the predicted stages
  are unequal too (161-234 ms) and the row reads 0.91; the split that balances the predicted stages (the
  "balanced split" columns: the search's, memory unbounded) predicts 58.3 samples/s against 58.5 published,
  and does as well on the 4-GPU speed rows (U-Net 67.3 against 67.0, ResNet-101 260 against 266; on 2 GPUs
  1.13 and 0.95). So on 4 GPUs torchgpipe's splits behave as if balanced on the P40s (its `balance_by_time`
  times every layer) and the predicted per-layer costs sum right; on 8 GPUs the same balanced prediction
  overshoots both models (U-Net 119 against 88.5, ResNet-101 484 against 412): something the 8-GPU runs pay
  that no split of the predicted costs shows, U-Net more with its larger copies. Needs the U-Net's per-layer
  CUDA times (`trace --device cuda`) and the server's GPU-to-GPU bandwidth across its sockets.
- *H100 at small microbatches* (mpt-13b/h100x8, mb 2: 1.24, the worst of its source; the other H100 rows
  1.00-1.15). The overlap slowdown above is a published average, not this run's; the H100 rows' remaining gap
  is H100-wide (mpt-1b 1.15, mpt-7b 1.14 on 8 GPUs), which points at the H100 profile's GEMM and attention
  efficiencies (from MAMF and FlashAttention-3's paper, not from these runs). Needs H100 training measured with
  the frameworks' kernels.
- *BERT on V100s* (1.14-1.21 at both lengths, see 13; A100s 0.99-1.13) loses time pipeplan does not see. It
  is not the encoder's ops as traced: DLE fuses bias + GELU and the like with TorchScript/NVFuser, which
  would make it faster still. Needs DLE's own per-iteration times on a V100.
- *ResNet-50 on 8 GPUs* loses 14-20% against 1 GPU in the published mixed-precision runs (1.26 on A100) while
  its all-reduce is under 1% of the iteration, and 3-4% in the TF32/FP32 runs: most likely the input pipeline
  (DALI decoding at 16.6k img/s), which pipeplan does not model.
- *Memory (not scored):* the rows with recomputation are now priced a block at a time, as LLM Foundry (each
  MPTBlock checkpointed) and Megatron-LM (`--checkpoint-num-layers 1`) ran them (`recompute_granularity: block`;
  docs/cost-models.md §3.3): both now fit, mpt-30b at 74.0 GiB and Megatron 1.7B at 50.5 (132.9 and 314 with one
  checkpoint per stage, the whole model re-run at once; Megatron 1.7B read 108 with a checkpoint per traced
  layer, its 245 modules, before the blocks were the frameworks' 24 transformer layers). Since the memory model
  counts the tensors in flight and the outputs torch's stages keep (benchmarks/RESULTS.md, "Peak memory"),
  mpt-350m and mpt-760m on A100s read out of memory, though they trained
  (80.0 and 79.4 GiB predicted, 79 usable; 61.6 and 65.6 before): their 32 and 24 sequences of 2,048 tokens
  make logits of 6.6 and 5.0 GB in bf16, and the traced loss is transformers' (an fp32 log-softmax saved, two
  logit-sized gradients, the logits kept), where LLM Foundry's MPT defaults to flash-attn's fused
  cross-entropy (llmfoundry/models/mpt/modeling_mpt.py: `loss_fn` 'fused_crossentropy'), one kernel that makes
  neither the fp32 log-softmax nor a second gradient. Pricing the framework's loss, like its attention, would
  take its kernels' memory (not done). torchgpipe's U-Net and ResNet-101 pipelines on P40s read out of memory
  until GPipe ran pipeplan's own loop (pipeplan/lean_gpipe.py): torch's GPipe allocated a receive buffer per
  microbatch each way for a step (the U-Net's skip tensors cross its cuts at up to 300 MB a microbatch), kept
  each input gradient until the step ended and every sent output until the last forward: on ResNet-101's stage 1
  (torchgpipe's 4-GPU split) 185 MiB a microbatch where torchgpipe keeps its 76 MiB input. That memory made
  pipeplan's own split of these rows unequal (ResNet-101 on 4 and 8 GPUs: 0.59 and 0.58 on its runtime). The
  loop now makes each buffer when its microbatch needs it and frees each sent output and input gradient once
  sent (as torchgpipe hands tensors over and Megatron-LM's `deallocate_output_tensor` frees them), the memory
  model prices that (docs/cost-models.md §3.5; on the CPU runtime -7% to +16% a stage but one of 2.3 MiB, RESULTS'
  "Peak memory"), and every torchgpipe row fits: pipeplan's own split reads 0.95 and 0.98 on 2 and 4 GPUs for ResNet-101, and on
  pipeplan's runtime 0.88-1.18 of all seven pipeline rows (the source-split table).

Rows and assumptions: LLM Foundry's rows quote the benchmark README at commit c90b9b31 (MPT configs from the
same repository; the traced parameter counts equal the table's NumParams exactly); Megatron 1.7B's microbatch
size and the Zero Bubble models' vocabulary (32000, which reproduces the named sizes) and fp16 are not in the
sources and are assumptions, recorded per row in cases.yaml; BERT is built as DeepLearningExamples'
BertForPreTraining runs it (published/dle_bert.py: the MLM head on the masked positions, attention unfused, the
NSP head; item 13).
"""


# ---- ResNet-50 v1.5 (torchvision's layout; stride 2 in the 3x3 convolution), traced as a model file ----

class Bottleneck(nn.Module):
    def __init__(self, cin: int, width: int, stride: int):
        super().__init__()
        cout = width * 4
        self.conv1 = nn.Conv2d(cin, width, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = nn.Conv2d(width, width, 3, stride=stride, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(width)
        self.conv3 = nn.Conv2d(width, cout, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(cout)
        self.downsample = None
        if stride != 1 or cin != cout:
            self.downsample = nn.Sequential(nn.Conv2d(cin, cout, 1, stride=stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x):
        y = F.relu(self.bn1(self.conv1(x)))
        y = F.relu(self.bn2(self.conv2(y)))
        y = self.bn3(self.conv3(y))
        return F.relu(y + (x if self.downsample is None else self.downsample(x)))


class ResNet50(nn.Module):
    def __init__(self, classes: int = 1000):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 64, 7, stride=2, padding=3, bias=False), nn.BatchNorm2d(64), nn.ReLU(),
                                  nn.MaxPool2d(3, stride=2, padding=1))
        blocks, cin = [], 64
        for i, (width, n) in enumerate(zip((64, 128, 256, 512), (3, 4, 6, 3), strict=True)):
            for j in range(n):
                blocks.append(Bottleneck(cin, width, 2 if (j == 0 and i > 0) else 1))
                cin = width * 4
        self.blocks = nn.Sequential(*blocks)
        self.fc = nn.Linear(cin, classes)

    def forward(self, x):
        x = self.blocks(self.stem(x))
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))


def build_resnet50():
    return ResNet50()


class ChannelsLast(nn.Module):
    """A model run channels-last (NHWC), as DeepLearningExamples runs its mixed-precision ResNet-50
    (--memory-format nhwc): weights converted, the input converted on entry (DALI hands it over NHWC)."""

    def __init__(self, net: nn.Module):
        super().__init__()
        self.net = net.to(memory_format=torch.channels_last)

    def forward(self, x):
        return self.net(x.contiguous(memory_format=torch.channels_last))


def build_resnet50_nhwc():
    return ChannelsLast(ResNet50())


def example_inputs(batch_size):
    return (torch.randn(batch_size, 3, 224, 224),)


def example_target(batch_size):
    return torch.randint(0, 1000, (batch_size,))


def loss_fn(output, target):
    return F.cross_entropy(output, target)


# ---- cases, graphs, predictions ------------------------------------------------------------------------

def load_cases() -> dict[str, Any]:
    import yaml

    with open(DATA / "cases.yaml", encoding="utf-8") as f:
        doc = yaml.safe_load(f)
    for c in doc["cases"]:
        assert c["tp"] * c["pp"] * c["dp"] == c["gpus"], c["id"]
        assert c["micro_batch"] * c["microbatches"] * c["dp"] == c["global_batch"], c["id"]
        assert c["source"] in doc["sources"] and c["model"] in doc["models"], c["id"]
    return doc


def _tracer_hash() -> str:
    h = hashlib.sha1(torch.__version__.encode())
    for p in [*sorted((ROOT / "costmodels").glob("*.py")), *sorted(DATA.glob("*.py"))]:  # model files import siblings
        h.update(p.read_bytes())
    return h.hexdigest()[:12]


def model_path(model: dict[str, Any]) -> Path:
    """The file traced: the model file where there is one (it may build its config.json in a way of its own)."""
    return (DATA / (model.get("model_file") or model["config"])).resolve()


def trace_model(model: dict[str, Any], *, use_cache: bool, depth: int | None = None):
    """The model's layer graph at batch 1 (weight-free, untimed), from the cache when it is there."""
    import pipeplan
    from pipeplan.costmodels.graph import load_graph

    path = model_path(model)
    seq = model.get("seq_len")
    depth = model.get("depth") if depth is None else depth
    salt = f"|{seq}|{model.get('entry')}|{depth}|{_tracer_hash()}".encode()
    key = hashlib.sha1(path.read_bytes() + salt).hexdigest()[:16]
    cached = CACHE / f"{path.stem}-{seq}-{depth}-{key}.json"
    if use_cache and cached.exists():
        return load_graph(cached), 0.0
    t0 = time.perf_counter()
    kwargs: dict[str, Any] = {"time_layers": False, "fvcore_check": False, "depth": depth}
    if not model.get("model_file"):
        kwargs["seq_len"] = seq
    else:
        kwargs["entry"] = model["entry"]
    graph = pipeplan.trace(str(path), 1, **kwargs)
    took = time.perf_counter() - t0
    CACHE.mkdir(parents=True, exist_ok=True)
    graph.save(cached)
    return graph, took


def megatron_flops(cfg: dict[str, Any], seq: int, batch: int) -> float:
    """Narayanan et al. 2021 eq. 3 (with recomputation): 96 B s l h^2 (1 + s/(6h) + V/(16 l h))."""
    l, h, V = cfg["n_layer"], cfg["n_embd"], cfg["vocab_size"]
    return 96.0 * batch * seq * l * h * h * (1 + seq / (6 * h) + V / (16 * l * h))


def to_metric(case: dict[str, Any], model: dict[str, Any], samples_per_s: float) -> float:
    metric, gpus = case["metric"], case["gpus"]
    if metric == "samples_per_s":
        return samples_per_s
    if metric == "samples_per_s_per_gpu":
        return samples_per_s / gpus
    if metric == "tokens_per_s_per_gpu":
        return samples_per_s * model["seq_len"] / gpus
    if metric == "megatron_tflops_per_gpu":
        cfg = json.loads((DATA / model["config"]).read_text())
        per_sample = megatron_flops(cfg, model["seq_len"], 1)
        return per_sample * samples_per_s / gpus / 1e12
    raise ValueError(f"unknown metric {metric}")


def predict_case(case: dict[str, Any], graph, profile=None) -> dict[str, Any]:
    """pipeplan's prediction of the published configuration (on `profile`, default the case's catalogue GPU); a
    source that times forward and backward only (`step: false`, one GPU) is predicted without the optimizer step
    that follows them."""
    summary = _predict(case, graph, profile)
    spare, overlap = case.get("checkpoint") == "except_last", case.get("copies") == "overlapped"
    if spare or overlap:
        summary["samples_per_s"] = case["global_batch"] / _framework_s(summary["plan"], spare=spare, overlap=overlap)
    if case.get("binned_speedup"):  # the source's sequences are binned by length: see the case's `assumed`
        summary["samples_per_s"] *= float(case["binned_speedup"])
    if case.get("step", True) is False:
        assert case["gpus"] == 1, case["id"]
        plan = summary["plan"]
        it = plan.predicted.iteration_s - max(s.predicted.optimizer_s for s in plan.stages)
        summary["samples_per_s"] = case["global_batch"] / it
    return summary


def _framework_s(plan, *, spare: bool, overlap: bool) -> float:
    """The plan's iteration as torchgpipe runs it. `spare`: its default checkpoint="except_last" re-runs no forward
    for one microbatch per stage (planner/simulate.py, recompute_last), where pipeplan's runtime re-runs every one.
    `overlap`: it copies each microbatch between GPUs on CUDA streams of its own, so a copy runs beside the
    receiving GPU's compute (torchgpipe/copy.py: "used to overlap copy and computation"), where pipeplan's runtime
    posts the receive when it reaches the op and waits for it (simulate's receives_wait)."""
    from pipeplan.planner.replay import simulate_from_plan

    replayed = simulate_from_plan(plan).iteration_s
    if abs(replayed - plan.predicted.iteration_s) > 1e-9 * plan.predicted.iteration_s:
        raise AssertionError(f"the replay ({replayed}) is not the plan's prediction ({plan.predicted.iteration_s})")
    return simulate_from_plan(plan, recompute_last=not spare, receives_wait=False if overlap else None).iteration_s


def _predict(case: dict[str, Any], graph, profile=None) -> dict[str, Any]:
    """pipeplan's best plan for exactly the published configuration (search with everything fixed)."""
    import pipeplan
    from pipeplan.errors import InfeasibleError
    from pipeplan.planner.baselines import equal_layers

    profile = profile or pipeplan.load_profile(case["gpu"])
    if case.get("balance"):
        return _summarise(_evaluate(case, graph, profile, balance_assignment(graph, case["balance"])), profile, True)
    request = pipeplan.PlanRequest(
        devices=case["gpus"], batch_size=case["global_batch"], schedule=case["schedule"], stages=case["pp"],
        data_parallel=case["dp"], microbatches=case["microbatches"], chunks=1,
        recompute="on" if case["recompute"] else "off", dtype=case["precision"], optimizer=case["optimizer"],
        recompute_granularity=case.get("recompute_granularity", "stage"),
        optimizer_kernels=case.get("optimizer_kernels", "auto"), mixed_precision=case["mixed_precision"],
        sharding=case["sharding"], top=1)
    fits = True
    try:
        plan = pipeplan.search(graph, profile, request).best
    except InfeasibleError:  # pipeplan's memory model says it does not fit; predict the equal split anyway
        fits = False
        plan = _evaluate(case, graph, profile, equal_layers(len(graph.layers), case["pp"]))
    return _summarise(plan, profile, fits)


def balance_assignment(graph, balance: list[int]) -> list[int]:
    """Each traced layer's stage under torchgpipe's `balance` (items per partition of its flattened sequence).

    The torchgpipe models (published/torchgpipe_seq.py) name item i `layers.<i>`; items without ops (the skip
    stashes) leave no layer, so the map goes by index, not by position.
    """
    bounds = list(itertools.accumulate(balance))
    indices = [int(layer.name.split(".")[1]) for layer in graph.layers]
    out = [bisect.bisect_right(bounds, i) for i in indices]
    if bounds[-1] != max(indices) + 1 or out[-1] != len(balance) - 1:
        raise ValueError(f"balance {balance} does not cover the traced sequence")
    return out


def _evaluate(case: dict[str, Any], graph, profile, assignment: list[int]):
    import pipeplan

    return pipeplan.evaluate(graph, profile, assignment, schedule=case["schedule"],
                             microbatches=case["microbatches"], batch_size=case["global_batch"],
                             data_parallel=case["dp"], recompute=case["recompute"], dtype=case["precision"],
                             recompute_granularity=case.get("recompute_granularity", "stage"),
                             optimizer=case["optimizer"], sharding=case["sharding"],
                             mixed_precision=case["mixed_precision"],
                             optimizer_kernels=case.get("optimizer_kernels", "auto"))


def _summarise(plan, profile, fits: bool) -> dict[str, Any]:
    """The row's prediction and where its iteration goes (`fits`: False where the memory model says it does not)."""
    fits = fits and plan.predicted.peak_memory_bytes <= profile.usable_memory_bytes
    st = [s.predicted for s in plan.stages]
    M, it = plan.microbatches, plan.predicted.iteration_s
    busiest = max(s.compute_s for s in st) * M
    comm = max(max(s.fwd_comm_s - s.fwd_s, 0.0) + max(s.bwd_comm_s - s.bwd_s, 0.0) for s in st) * M \
        + max(s.allreduce_s for s in st)
    return {"plan": plan, "profile": profile, "fits": fits, "samples_per_s": plan.predicted.samples_per_s,
            "mfu": plan.predicted.achieved_flops_fraction, "bubble": plan.predicted.bubble_fraction,
            "compute_share": busiest / it if it > 0 else 0.0, "exposed_comm_share": comm / it if it > 0 else 0.0,
            "peak_gib": plan.predicted.peak_memory_bytes / 2**30}


def kind_shares(graph, profile, dtype: str, samples: int) -> dict[str, Any]:
    """Predicted fwd+bwd time per op kind (the layers' cost parts) at `samples` per microbatch, the share of it
    in memory-bound parts, and the share that is per-kernel time (costmodels/part_costs.py)."""
    from pipeplan.costmodels.compute import PART_BASE_KIND, efficiency_for, peak_flops_for_kind
    from pipeplan.costmodels.memory import activation_bytes_scale
    from pipeplan.costmodels.part_costs import (
        BACKWARD_KERNELS_FACTOR,
        effective_flops,
        kernel_overheads_s,
        part_bytes,
    )

    ratio = samples / graph.batch_size
    scale = activation_bytes_scale(dtype)
    kernel_s, _ = kernel_overheads_s(profile)
    by_kind: dict[str, float] = {}
    total = mem_bound = kernels = 0.0
    for part in (p for layer in graph.layers for p in layer.parts):
        ce, me = efficiency_for(profile, part.kind, dtype)
        peak = peak_flops_for_kind(profile, PART_BASE_KIND.get(part.kind, part.kind), dtype)
        flops, nbytes = effective_flops(part, profile, dtype), part_bytes(part, ratio)
        for f, b in zip(flops, nbytes, strict=True):
            c, m = f * ratio / (peak * ce), b * scale / (profile.mem_bw_bytes_per_s * me)
            total += max(c, m)
            by_kind[part.kind] = by_kind.get(part.kind, 0.0) + max(c, m)
            mem_bound += max(c, m) if m > c else 0.0
        kernels += part.ops * (1 + BACKWARD_KERNELS_FACTOR) * kernel_s
    total += kernels
    return {"by_kind": {k: v / total for k, v in sorted(by_kind.items(), key=lambda kv: -kv[1])},
            "memory_bound": mem_bound / total, "kernels": kernels / total}


# ---- report ---------------------------------------------------------------------------------------------

def published_mfu(case: dict[str, Any]) -> str:
    """The source's own utilisation figure, where its row has one (LLM Foundry MFU; Megatron % of peak)."""
    cells = [c.strip() for c in case["quote"].split("|")]
    if case["source"] == "llm-foundry":
        return f"{float(cells[4]):.0f}%"
    if case["source"] == "megatron-ptdp":
        return cells[9]
    return "—"


def fmt_num(x: float) -> str:
    if x >= 1000:
        return f"{x:,.0f}"
    if x >= 100:
        return f"{x:.0f}"
    if x >= 10:
        return f"{x:.1f}"
    return f"{x:.2f}"


UNITS = {"tokens_per_s_per_gpu": "tok/s/GPU", "samples_per_s": "samples/s", "samples_per_s_per_gpu": "samples/s/GPU",
         "megatron_tflops_per_gpu": "TFLOP/s/GPU"}


def config_text(c: dict[str, Any]) -> str:
    par = []
    if c["tp"] > 1:
        par.append(f"TP{c['tp']}")
    if c["pp"] > 1:
        par.append(f"PP{c['pp']} {c['schedule']}")
    if c["dp"] > 1:
        par.append(f"DP{c['dp']}" + (f" {c['sharding']}" if c["sharding"] != "none" else ""))
    par.append(f"mb {c['micro_batch']} x {c['microbatches']}")
    par.append(c["precision"])
    if c["recompute"]:
        par.append("recompute")
    return ", ".join(par)


def summary(rows: list[dict[str, Any]]) -> tuple[float, float, str]:
    errs = [(abs(r["ratio"] - 1), r["id"]) for r in rows if r.get("ratio") is not None]
    med = statistics.median(e for e, _ in errs)
    worst, worst_id = max(errs)
    return med, worst, worst_id


def run(args) -> str:

    doc = load_cases()
    models, sources = doc["models"], doc["sources"]
    cases = [c for c in doc["cases"] if not args.only or args.only in c["id"]]
    graphs: dict[str, Any] = {}
    trace_s: dict[str, float] = {}
    t_start = time.perf_counter()
    load_at_start = os.getloadavg()[0]
    param_checks = []
    for c in cases:
        m = models[c["model"]]
        if c["tp"] > 1 or c["model"] in graphs:
            continue
        graphs[c["model"]], trace_s[c["model"]] = trace_model(m, use_cache=not args.no_cache)
        if m.get("params"):
            traced = sum(layer.param_bytes for layer in graphs[c["model"]].layers) // 4
            param_checks.append((c["model"], traced, m["params"]))
        print(f"traced {c['model']}: {len(graphs[c['model']].layers)} layers"
              + (f" in {trace_s[c['model']]:.1f} s" if trace_s[c["model"]] else " (cached)"), flush=True)
    rows = []
    for c in cases:
        m = models[c["model"]]
        row = {"id": c["id"], "case": c, "model": m, "published": float(c["published"]), "ratio": None}
        if c["tp"] == 1:
            p = predict_case(c, graphs[c["model"]])
            row.update(p)
            row["predicted"] = to_metric(c, m, p["samples_per_s"])
            row["ratio"] = row["predicted"] / row["published"]
        rows.append(row)
        print(f"{c['id']:28s} published {c['published']:>10} predicted "
              + (f"{row['predicted']:10.1f}  ratio {row['ratio']:.2f}" if row["ratio"] else "(tensor parallel)"),
              flush=True)
    elapsed = time.perf_counter() - t_start

    # --- the table
    lines = ["| row | model | GPUs | config | published | predicted | ratio | source |",
             "|---|---|---|---|---:|---:|---:|---|"]
    for r in rows:
        c = r["case"]
        unit = UNITS[c["metric"]]
        pred = ("n/a (TP not modelled)" if r["ratio"] is None
                else fmt_num(r["predicted"]) + ("" if r["fits"] else " (OOM predicted)")
                + (f" ({r['model']['seq_len']} tokens x {c['binned_speedup']} binned)" if c.get("binned_speedup") else ""))
        ratio = "—" if r["ratio"] is None else f"{r['ratio']:.2f}"
        src = f"{c['source']}: {c['table']}"
        lines.append(f"| {c['id']} | {r['model']['shape']} | {c['gpus']}x {c['gpu']} | {config_text(c)} | "
                     f"{fmt_num(r['published'])} {unit} | {pred} | {ratio} | {src} |")
    predicted = [r for r in rows if r["ratio"] is not None]
    med, worst, worst_id = summary(predicted)
    n_src = len({r["case"]["source"] for r in predicted})
    n_pp = sum(r["case"]["pp"] > 1 for r in predicted)
    per_source = []
    for s in sources:
        rs = [r for r in predicted if r["case"]["source"] == s]
        if rs:
            ratios = [r["ratio"] for r in rs]
            per_source.append(f"{s}: {len(rs)} rows, median ratio {statistics.median(ratios):.2f} "
                              f"(range {min(ratios):.2f}-{max(ratios):.2f})")

    # --- diagnostics: where the predicted time goes
    diag = ["| row | published MFU | pred MFU | compute share | exposed comm share | bubble | pred peak GiB | "
            "time by kind (memory-bound share) |",
            "|---|---:|---:|---:|---:|---:|---:|---|"]
    shares_seen = {}
    for r in predicted:
        c = r["case"]
        key = (c["model"], c["gpu"], c["precision"], c["micro_batch"])
        if key not in shares_seen:
            shares_seen[key] = kind_shares(graphs[c["model"]], r["profile"], c["precision"], c["micro_batch"])
        ks = shares_seen[key]
        kinds = ", ".join(f"{k} {v:.0%}" for k, v in ks["by_kind"].items() if v >= 0.005)
        diag.append(f"| {r['id']} | {published_mfu(c)} | {r['mfu']:.0%} | {r['compute_share']:.0%} | "
                    f"{r['exposed_comm_share']:.0%} | "
                    f"{max(r['bubble'], 0.0):.0%} | {r['peak_gib']:.1f} | {kinds} ({ks['memory_bound']:.0%}; "
                    f"per-kernel time {ks['kernels']:.0%}) |")

    # --- the same model and configuration on A100 and H100 (LLM Foundry runs both)
    speedups = []
    index = {(r["case"]["model"], r["case"]["gpus"], r["case"]["gpu"]): r for r in predicted}
    for (mk, n, gpu), ra in index.items():
        rh = index.get((mk, n, "h100-sxm"))
        if gpu == "a100-80gb-sxm" and rh is not None:
            speedups.append(f"{mk} on {n} GPUs: published {rh['published'] / ra['published']:.2f}x, "
                            f"predicted {rh['predicted'] / ra['predicted']:.2f}x")
    oom = [f"{r['id']} {r['peak_gib']:.0f} GiB" for r in predicted if not r["fits"]]

    # --- depth check: the same rows with one layer per op
    depth_lines = []
    if not args.no_depth_check:
        for model_key, depth in DEPTH_CHECK:
            rs = [r for r in predicted if r["case"]["model"] == model_key]
            if not rs:
                continue
            g, took = trace_model(models[model_key], use_cache=not args.no_cache, depth=depth)
            kinds = sorted({layer.kind for layer in g.layers})
            for r in rs:
                p = predict_case(r["case"], g)
                fine = to_metric(r["case"], r["model"], p["samples_per_s"])
                ks = kind_shares(g, p["profile"], r["case"]["precision"], r["case"]["micro_batch"])
                depth_lines.append(
                    f"| {r['id']} | {len(graphs[model_key].layers)} -> {len(g.layers)} ({', '.join(kinds)}) | "
                    f"{r['ratio']:.2f} | {fine / r['published']:.2f} | "
                    + ", ".join(f"{k} {v:.0%}" for k, v in ks["by_kind"].items() if v >= 0.005)
                    + f" (memory-bound {ks['memory_bound']:.0%}) |")
            print(f"depth check {model_key}: {len(g.layers)} layers" + (f", traced in {took:.1f} s" if took else ""))

    checks = "; ".join(f"{k} {t:,} (published {p:,}{', exact' if t == p else f', {t / p - 1:+.2%}'})"
                       for k, t, p in param_checks)
    body = [
        "Command: `python benchmarks/published_bench.py --write-results`  ",
        f"Machine: {os.cpu_count()} cores, no GPU, torch {torch.__version__}; "
        f"load average at start {load_at_start:.1f}. "
        f"Wall time {elapsed:.0f} s (traces {sum(trace_s.values()):.0f} s; cached graphs are reused from /tmp).  ",
        f"Cases: benchmarks/published/cases.yaml ({len(rows)} rows from "
        f"{len({r['case']['source'] for r in rows})} sources, each with the "
        "quoted row and what the source leaves open); model configs in benchmarks/published/. Every prediction "
        "is `pipeplan.search` with the published stages, data-parallel size, microbatches, schedule, recomputation, "
        "dtype, ZeRO level and mixed-precision recipe fixed, on the catalogue profile of the GPU; where the source "
        "gives its split (torchgpipe's `balance`), the prediction is `pipeplan.evaluate` of that split instead. "
        "Nothing is fitted. ratio = predicted / published.  ",
        f"Parameter counts of the traced models against the source: {checks}.",
        "",
        *lines,
        "",
        f"**{len(predicted)} predicted rows from {n_src} sources (none with tensor parallelism; "
        f"{n_pp} pipeline-parallel, "
        f"{len(predicted) - n_pp} data-parallel or single-GPU): median |error| {med:.0%} (target <= "
        f"{TARGET_MEDIAN:.0%}: {'met' if med <= TARGET_MEDIAN else 'not met'}), worst {worst:.0%} ({worst_id}; "
        f"target <= {TARGET_WORST:.0%}: {'met' if worst <= TARGET_WORST else 'not met'}).** "
        f"Tensor-parallel rows ({len(rows) - len(predicted)}) are listed for the record and not counted. "
        f"{sum(r['ratio'] > 1 for r in predicted)} of {len(predicted)} rows are over-predicted; median ratio "
        f"{statistics.median(r['ratio'] for r in predicted):.2f}.  ",
        "Per source: " + "; ".join(per_source) + ".",
        "",
        "Where the predicted iteration goes (pred MFU: model FLOPs over the iteration at the dtype's dense peak, "
        "as the sources compute MFU; compute share: the busiest device's forward + backward (+ recompute) "
        "over the iteration; exposed comm: ZeRO collectives longer than the op they overlap, plus the "
        "end-of-iteration all-reduce; time by kind: share of the summed layer rooflines, with the share of it "
        "in memory-bound layers, and the layers' memory time that the max() of the roofline hides under their "
        "FLOPs):",
        "",
        *diag,
        "",
        "H100 over A100, same model and parallel configuration: " + "; ".join(speedups)
        + f" (the catalogue's dense bf16 peaks differ {989.4 / 312:.2f}x).  ",
        "Rows the published run trained but pipeplan's memory model predicts out of memory (its prediction is "
        "still shown): " + ("; ".join(oom) if oom else "none") + ".",
    ]
    split_lines = source_split_lines(predicted, graphs)
    if split_lines:
        body += [
            "",
            "The source's split against pipeplan's own (rows with a published `balance`; same configuration, "
            "split by `pipeplan.search`, which plans for pipeplan's runtime; both splits predicted as the row's "
            "framework runs them, e.g. torchgpipe's `checkpoint` and `copies`; the last column is the plan's own "
            "prediction, for pipeplan's runtime: every microbatch re-run, each receive waited for): per-stage "
            "compute is one microbatch's forward + backward + recompute on each stage, as predicted. The last three "
            "columns split by the search with memory unbounded (`memory_unbounded`): the split that balances the "
            "predicted stage times, predicted as the row's framework runs it, its stages, and on pipeplan's runtime.",
            "",
            "| row | published | predicted, source's split | stage compute ms, source's split | "
            "predicted, pipeplan's split | stage compute ms, pipeplan's split | pipeplan's split on pipeplan's "
            "runtime | predicted, balanced split | stage compute ms, balanced split | balanced split on pipeplan's "
            "runtime |",
            "|---|---:|---:|---|---:|---|---:|---:|---|---:|",
            *split_lines,
        ]
    pass_lines = pass_split_lines(predicted)
    if pass_lines:
        body += [
            "",
            "Forward and backward apart (rows whose source times them apart, per batch; published minus "
            "predicted in ms):",
            "",
            "| row | forward ms, published | predicted | missing | backward ms, published | predicted | missing |",
            "|---|---:|---:|---:|---:|---:|---:|",
            *pass_lines,
        ]
    if depth_lines:
        body += [
            "",
            "Depth check: rows of models that `trace` groups one layer per transformer block by default "
            "(more than `MAX_LEAF_LAYERS` leaf modules), retraced with one layer per op "
            f"({', '.join(f'{m}: depth={d}' for m, d in DEPTH_CHECK)}), everything else equal:",
            "",
            "| row | layers (kinds) | ratio, per block | ratio, per op | time by kind, per op |",
            "|---|---|---:|---:|---|",
            *depth_lines,
        ]
    return "\n".join(body)


def source_split_lines(predicted: list[dict[str, Any]], graphs: dict[str, Any]) -> list[str]:
    """Table rows: each row with a published split, predicted with it and with pipeplan's best split."""
    out = []
    for r in predicted:
        c = r["case"]
        if not c.get("balance") or c["pp"] == 1:
            continue
        unsplit = {k: v for k, v in c.items() if k != "balance"}
        own = predict_case(unsplit, graphs[c["model"]])
        own_metric = to_metric(c, r["model"], own["samples_per_s"])
        free = predict_case(unsplit, graphs[c["model"]], memory_unbounded(c["gpu"]))
        free_metric = to_metric(c, r["model"], free["samples_per_s"])

        def ms(plan) -> str:
            return ", ".join(f"{s.predicted.compute_s * 1e3:.0f}" for s in plan.stages)

        runtime = to_metric(c, r["model"], own["plan"].predicted.samples_per_s)
        free_runtime = to_metric(c, r["model"], free["plan"].predicted.samples_per_s)
        out.append(f"| {r['id']} | {fmt_num(r['published'])} | {fmt_num(r['predicted'])} ({r['ratio']:.2f}) | "
                   f"{ms(r['plan'])} | {fmt_num(own_metric)} ({own_metric / r['published']:.2f}) | {ms(own['plan'])} "
                   f"| {fmt_num(runtime)} | {fmt_num(free_metric)} ({free_metric / r['published']:.2f}) | "
                   f"{ms(free['plan'])} | {fmt_num(free_runtime)} ({free_runtime / r['published']:.2f}) |")
    return out


def memory_unbounded(gpu: str):
    """The catalogue profile of `gpu` with memory no plan fills: the search's split then balances the predicted
    stage times alone, as a split tuned by timing the layers on the GPU (torchgpipe's `balance_by_time`) would."""
    import pipeplan

    return dataclasses.replace(pipeplan.load_profile(gpu), memory_bytes=2**60, usable_memory_bytes=2**60)


def pass_split_lines(predicted: list[dict[str, Any]]) -> list[str]:
    """Table rows: forward and backward of one-GPU rows whose source's columns time them apart, against the plan's."""
    out = []
    for r in predicted:
        c = r["case"]
        if c["source"] != "cnn-benchmarks":  # columns: GPU | cuDNN | Forward (ms) | Backward (ms) | Total (ms)
            continue
        cells = [x.strip() for x in c["quote"].split("|")]
        fwd_ms, bwd_ms = float(cells[2]), float(cells[3])
        stage = r["plan"].stages[0].predicted
        p_fwd, p_bwd = stage.fwd_s * c["microbatches"] * 1e3, stage.bwd_s * c["microbatches"] * 1e3
        out.append(f"| {r['id']} | {fwd_ms:.1f} | {p_fwd:.1f} | {fwd_ms - p_fwd:+.1f} | {bwd_ms:.1f} | {p_bwd:.1f} "
                   f"| {bwd_ms - p_bwd:+.1f} |")
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", help="only the cases whose id contains this")
    ap.add_argument("--no-cache", action="store_true",
                    help="retrace every model (cache: /tmp/pipeplan-published-bench)")
    ap.add_argument("--no-depth-check", action="store_true", help="skip retracing two models with one layer per op")
    ap.add_argument("--write-results", action="store_true", help="rewrite this section of benchmarks/RESULTS.md")
    args = ap.parse_args()
    sys.path.insert(0, str(ROOT))  # a source checkout works without installing
    torch.set_num_threads(1)
    body = run(args) + "\n\n" + ANALYSIS.strip()
    print("\n" + body)
    if args.write_results:
        sys.path.insert(0, str(HERE))
        from results import write_section

        write_section(SECTION, body)
    return 0


if __name__ == "__main__":
    sys.exit(main())
