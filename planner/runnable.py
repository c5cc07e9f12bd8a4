"""What torch cannot run whatever the memory: partitions the search refuses rather than let `pipeplan run` fail.

torch.distributed.pipelining's split backward (the zero-bubble schedules) computes a stage's weight gradients one
parameter group at a time (`stage_backward_weight`, torch 2.13 pipelining/_backward.py), one autograd call each,
freeing the graph as it goes. When a stage uses one module twice with another module's parameters between the two
uses, the shared parameter's call walks back through the other group's nodes, whose saved tensors that group's
call has already freed: "Trying to backward through the graph a second time" (tests/test_runnable.py runs torch's
own functions on `a(relu(b(a(x))))`). The first stage is exempt: torch runs its whole backward as one autograd call
(`PipelineStage.backward_weight_one_chunk`). Refused here: a split-backward stage other than the first that holds
two users of one shared parameter, which also covers the harmless cases with nothing between the uses.
"""

from __future__ import annotations

from collections.abc import Sequence


def split_backward_conflict(shared_users: Sequence[Sequence[int]], assignment: Sequence[int]) -> int | None:
    """The first stage past stage 0 holding two users (layer indices) of one shared parameter, or None."""
    for users in shared_users:
        seen: set[int] = set()
        for i in users:
            s = assignment[i]
            if s > 0 and s in seen:
                return s
            seen.add(s)
    return None
