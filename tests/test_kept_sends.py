"""What a device's ops leave live under torch's multi-stage schedules (costmodels/memory.py `Sends`, `left_live`).

torch 2.13's `_PipelineScheduleRuntime` (interleaved 1F1B, ZB-V, DualPipeV) keeps every send's work object until the
step's end, so a forward's output sent to another device and a backward's input gradient sent to another device stay
live until then; the model's output stays from the last stage's forward to its backward; a W or a whole backward adds
a weight gradient into `.grad`. Counted by hand on torch's orders (pipeplan/v_orders.py, planner/simulate.py), and
what stage_memory adds to a walk.
"""

from __future__ import annotations

from pipeplan.costmodels.memory import Sends, left_live, stage_memory, walked_held_bytes, walked_recomputed_bytes
from pipeplan.v_orders import dualpipev_order, zbv_order

# rank 0 of 2 holds stages 0 and 3: stage 0 sends its output (5) to rank 1, stage 3 its input gradient (7) to rank 1
RANK0 = Sends(out=[5, 0, 0, 0], grad=[0, 0, 0, 7], model_out=100, last=3, accumulating=1)


def test_zbv_rank0_keeps_each_send_to_the_steps_end_and_the_logits_from_forward_to_backward():
    order = list(zbv_order(0, 2, 2))
    assert order == [("F", 0, 0), ("F", 0, 1), ("F", 3, 0), ("B", 3, 0), ("W", 3, 0), ("F", 3, 1), ("B", 3, 1),
                     ("W", 3, 1), ("B", 0, 0), ("W", 0, 0), ("B", 0, 1), ("W", 0, 1)]
    # F0,0 5; F0,1 10; F3,0 +100 logits; B3,0 +7 sent (the logits go after it); W3,0 +1 being added in; F3,1 +100;
    # B3,1 +7; W3,1; stage 0's B sends nothing (torch skips it), its W adds a gradient in
    assert left_live(order, RANK0) == [5, 10, 110, 117, 18, 117, 124, 25, 24, 25, 24, 25]


def test_dualpipev_whole_backwards_send_and_add_in_like_a_b_and_a_w():
    order = list(dualpipev_order(0, 2, 4))
    assert order == [("F", 0, 0), ("F", 0, 1), ("F", 0, 2), ("F", 3, 0), ("B", 3, 0), ("W", 3, 0), ("F", 3, 1),
                     ("F", 0, 3), ("BW", 3, 1), ("F", 3, 2), ("BW", 0, 0), ("BW", 3, 2), ("F", 3, 3), ("BW", 0, 1),
                     ("BW", 3, 3), ("B", 0, 2), ("W", 0, 2), ("B", 0, 3), ("W", 0, 3)]
    assert left_live(order, RANK0) == [5, 10, 15, 115, 122, 23, 122, 127, 135, 134, 135, 142, 141, 142, 149,
                                       48, 49, 48, 49]


def test_the_walk_adds_them_at_the_op_where_the_device_peaks():
    """The middle device of a 2-device ZB-V (stages 1 and 2; the 1 -> 2 cut stays on it): without sends the peak is
    stage 2's W (60 held + 3000 re-run); stage 1's output to stage 2 is a local hand-over (0), stage 2's output
    (11) and stage 1's input gradient (13) go to rank 0, a weight gradient of 2 is added in at each W."""
    order = [("F", 1, 0), ("F", 2, 0), ("B", 2, 0), ("W", 2, 0), ("B", 1, 0), ("W", 1, 0)]
    kept, rerun, w_rerun = [0, 40, 20, 0], [0, 500, 600, 0], [0, 2000, 3000, 0]
    loss, deferred, transient = [0, 0, 0, 0], [0, 7, 9, 0], [0, 30, 50, 0]
    sends = Sends(out=[0, 0, 11, 0], grad=[0, 13, 0, 0], model_out=0, last=3, accumulating=2)
    assert left_live(order, sends) == [0, 11, 11, 13, 24, 26]
    # W2: 60 held + 3000 + 13 live, 9 pending
    assert walked_recomputed_bytes(order, kept, rerun, w_rerun, loss, deferred, transient, sends) == (3073, 9, 0)
    # not recomputed, saving 40 and 20 a microbatch: F2 (and B2) peak, 60 held + 11 live, 50 in flight; B1 has
    # 40 + 24 + 30, W2 60 + 13 + 9 pending
    saved = [0, 40, 20, 0]
    assert walked_held_bytes(order, saved, deferred, transient, sends) == (71, 0, 50)


def test_with_a_walk_only_the_receive_buffers_are_added():
    """A walked device's held bytes already hold its kept and sent outputs, the model's output and the weight
    gradient being added in: stage_memory adds the receive buffers and model state, nothing counted twice."""
    kw = dict(param_bytes=4000, saved_bytes_per_mb=300, input_bytes_per_mb=10, output_bytes_per_mb=20,
              schedule="zb-v", stages=2, stage=0, microbatches=4, optimizer="sgd", dtype="fp32", recompute=False,
              model_output_bytes_per_mb=500, largest_layer_param_bytes=1000, receive_bytes=77)
    walked = stage_memory(**kw, held_bytes=(600, 50, 40))
    counted = stage_memory(**kw)
    assert walked.buffer_bytes == 77 and walked.transient_bytes == 40
    assert walked.total_bytes == walked.weights_bytes + walked.optimizer_bytes + 77 + 600 + 50 + 40
    assert counted.buffer_bytes > 77 + 500  # the counts add the kept outputs and one model output
    assert counted.transient_bytes > 0  # and the weight gradient being added in


def test_interleaved_whole_backwards_on_the_device_holding_the_loss():
    """Interleaved 1F1B, 2 devices x 2 chunks, M = 2, device 1 (stages 1 and 3): its whole backwards (torch's
    FULL_BACKWARD, "BW" to the walk) send the input gradients of stages 1 and 3 (5 and 7) to device 0 and add a
    weight gradient in (1); stage 1's output (6) goes to device 0 too; the logits (100) live from F3 to its BW."""
    from pipeplan.planner.configs import Config
    from pipeplan.planner.walks import walk_orders

    order = walk_orders(Config(schedule="interleaved", stages=2, data_parallel=1, microbatches=2, chunks=2), 2)[1]
    assert order == [("F", 1, 0), ("F", 1, 1), ("F", 3, 0), ("BW", 3, 0), ("F", 3, 1), ("BW", 3, 1), ("BW", 1, 0),
                     ("BW", 1, 1)]
    sends = Sends(out=[0, 6, 0, 0], grad=[0, 5, 0, 7], model_out=100, last=3, accumulating=1)
    assert left_live(order, sends) == [6, 12, 112, 120, 119, 127, 32, 37]
