"""Published closed-form formulas: pipeline bubbles, transformer/conv FLOPs, activation memory.

These are not used to plan (the planner works from the traced graph and the
simulator); they are the independent oracles the cost models and the simulator
are checked against, and quick sanity numbers for docs and reports. Each
function is one formula from one paper, symbols as in that paper.
"""

from __future__ import annotations


def gpipe_bubble_fraction(stages: int, microbatches: int) -> float:
    """Idle fraction of a GPipe iteration: (K - 1) / (M + K - 1).

    Source: GPipe (Huang et al., NeurIPS 2019) §2.3, "O((K-1)/(M+K-1))", with
    uniform stages; equals t_pb / (t_id + t_pb) of Megatron-LM §2.2.1. Also the
    bubble of 1F1B / PipeDream-Flush, which reorders the same work.
    """
    _positive(stages=stages, microbatches=microbatches)
    return (stages - 1) / (microbatches + stages - 1)


def megatron_bubble_ratio(stages: int, microbatches: int, chunks: int = 1) -> float:
    """Bubble time relative to ideal compute time: (p - 1) / (v * m).

    Source: Megatron-LM PTD-P (Narayanan et al., SC'21) §2.2.1 ((p-1)/m) and
    §2.2.2 for the interleaved schedule with v model chunks per device.
    """
    _positive(stages=stages, microbatches=microbatches, chunks=chunks)
    return (stages - 1) / (chunks * microbatches)


def pipeline_iteration_s(stage_s: float, stages: int, microbatches: int, chunks: int = 1) -> float:
    """Iteration time of a uniform synchronous pipeline: (m + (p - 1)/v) * (t_f + t_b).

    Source: Megatron-LM §2.2.1-2.2.2: ideal time m(t_f + t_b) plus the bubble
    (p - 1)(t_f + t_b)/v, with `stage_s` = t_f + t_b of one microbatch on one device.
    """
    _positive(stages=stages, microbatches=microbatches, chunks=chunks)
    return (microbatches + (stages - 1) / chunks) * stage_s


def transformer_layer_fwd_flops(batch: int, seq: int, hidden: int) -> int:
    """Forward FLOPs of one transformer layer: 24 B s h^2 + 4 B s^2 h.

    Source: Narayanan et al. 2021 (Megatron-LM PTD-P), Appendix: QKV 6Bsh^2,
    scores 2Bs^2h, attention over values 2Bs^2h, output projection 2Bsh^2, MLP
    (h -> 4h -> h) 16Bsh^2. Multiply-add = 2 FLOPs; softmax/norms/biases ignored.
    """
    return 24 * batch * seq * hidden**2 + 4 * batch * seq**2 * hidden


def transformer_training_flops(batch: int, seq: int, layers: int, hidden: int, vocab: int,
                               recompute: bool = True) -> float:
    """FLOPs of one training iteration of a GPT model.

    Source: Narayanan et al. 2021 Eq. (3): 96 B s l h^2 (1 + s/(6h) + V/(16 l h))
    with full recomputation (4 passes of each layer); without it, 3 passes:
    72 B s l h^2 (1 + s/(6h) + V/(12 l h)) (Korthikanti et al. 2022 §6.3).
    """
    b, s, l, h, v = batch, seq, layers, hidden, vocab
    if recompute:
        return 96 * b * s * l * h**2 * (1 + s / (6 * h) + v / (16 * l * h))
    return 72 * b * s * l * h**2 * (1 + s / (6 * h) + v / (12 * l * h))


def transformer_params(layers: int, hidden: int, vocab: int, seq: int) -> float:
    """Parameter count of a GPT model: 12 l h^2 (1 + 13/(12h) + (V + s)/(12 l h)).

    Source: Narayanan et al. 2021 Eq. (2) (learned position embeddings, tied LM head).
    """
    l, h = layers, hidden
    return 12 * l * h**2 * (1 + 13 / (12 * h) + (vocab + seq) / (12 * l * h))


def conv2d_fwd_flops(batch: int, c_in: int, c_out: int, h_out: int, w_out: int, k_h: int, k_w: int,
                     groups: int = 1) -> int:
    """Forward FLOPs of a Conv2d: 2 N H_out W_out C_out (C_in/groups) K_h K_w.

    Source: PyTorch torch/utils/flop_counter.py `conv_flop_count` (bias ignored).
    """
    return 2 * batch * h_out * w_out * c_out * (c_in // groups) * k_h * k_w


def transformer_layer_activation_bytes(seq: int, batch: int, hidden: int, heads: int) -> float:
    """Activation bytes one transformer layer saves (16-bit, no parallelism): s b h (34 + 5 a s / h).

    Source: Korthikanti et al., "Reducing activation recomputation in large
    transformer models" (2022), Eq. (1) (includes 1-byte dropout masks).
    """
    return seq * batch * hidden * (34 + 5 * heads * seq / hidden)


def _positive(**values: int) -> None:
    for name, value in values.items():
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
