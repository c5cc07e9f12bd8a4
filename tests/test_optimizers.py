"""pipeplan/optimizers.py: which kernels the runtime's optimizer steps with, and that it takes any iterable.

On CUDA the runtime steps with torch's fused kernels, what the catalogue's GPU profiles price (28 bytes a
parameter for Adam); elsewhere with torch's defaults, what a CPU calibration times. The CUDA side runs in
tests/test_gpu_cuda.py (skipped without a GPU)."""

from types import SimpleNamespace

import pytest
import torch

from pipeplan.errors import UserError
from pipeplan.optimizers import DEFAULT_LR, fused_for, make_optimizer
from runtime_helpers import train_alike


def _stand_in(device_type: str, floating: bool = True) -> SimpleNamespace:
    """What `fused_for` reads of a tensor, for devices this machine has not got."""
    return SimpleNamespace(device=SimpleNamespace(type=device_type), is_floating_point=lambda: floating)


def test_fused_only_where_every_parameter_is_a_floating_point_tensor_on_cuda():
    assert fused_for([_stand_in("cuda"), _stand_in("cuda")])
    assert not fused_for([_stand_in("cuda"), _stand_in("cpu")])
    assert not fused_for([_stand_in("cuda", floating=False)])
    assert not fused_for([])
    assert not fused_for([torch.zeros(2), torch.zeros(2, device="meta")])


@pytest.mark.parametrize("name", sorted(DEFAULT_LR))
def test_on_a_cpu_the_step_is_torchs_default_and_takes_a_generator(name):
    """A generator of parameters (model.parameters()) must reach the optimizer whole: the kernel choice reads the
    parameters first, which would exhaust it. The step must equal torch's default optimizer's (built here from the
    same hyperparameters, independently of make_optimizer)."""
    torch.manual_seed(0)
    a, b = torch.nn.Linear(4, 3), torch.nn.Linear(4, 3)
    b.load_state_dict(a.state_dict())
    opt = make_optimizer(name, a.parameters(), DEFAULT_LR[name])
    assert not opt.defaults.get("fused")
    assert sum(len(g["params"]) for g in opt.param_groups) == 2
    ref = {"sgd": lambda p: torch.optim.SGD(p, lr=0.01), "momentum": lambda p: torch.optim.SGD(p, lr=0.01, momentum=0.9),
           "adam": lambda p: torch.optim.Adam(p, lr=1e-3), "adamw": lambda p: torch.optim.AdamW(p, lr=1e-3)}[name](
        b.parameters())
    x = torch.randn(5, 4)
    train_alike(((a, opt), (b, ref)), x, 2)
    for pa, pb in zip(a.parameters(), b.parameters(), strict=True):
        assert torch.equal(pa, pb)


def test_an_unknown_name_is_a_user_error():
    with pytest.raises(UserError, match="unknown optimizer"):
        make_optimizer("lamb", [torch.nn.Parameter(torch.zeros(1))], 0.1)


def test_the_plans_kernels_choose_the_step_on_a_cpu():
    """"fused" takes torch's fused kernels, which it has for a CPU too, and updates as the default loop does (to
    float rounding); "foreach" on a CPU is torch's default (the same passes one tensor at a time); anything else
    is refused."""
    torch.manual_seed(0)
    a, b = torch.nn.Linear(8, 4), torch.nn.Linear(8, 4)
    b.load_state_dict(a.state_dict())
    fused = make_optimizer("adamw", a.parameters(), 1e-2, "fused")
    plain = make_optimizer("adamw", b.parameters(), 1e-2, "foreach")
    assert fused.defaults["fused"] is True and not plain.defaults.get("fused") and not plain.defaults.get("foreach")
    x = torch.randn(6, 8)
    train_alike(((a, fused), (b, plain)), x, 3)
    for pa, pb in zip(a.parameters(), b.parameters(), strict=True):
        torch.testing.assert_close(pa, pb, rtol=1e-5, atol=1e-6)
    with pytest.raises(UserError, match="optimizer kernels"):
        make_optimizer("adam", [torch.nn.Parameter(torch.zeros(1))], 0.1, "apex")


def test_the_runtime_steps_as_its_plan_says():
    """runtime/worker.optimizer_factory builds each stage's optimizer with the plan's optimizer_kernels."""
    from pipeplan.runtime.worker import optimizer_factory

    plan = SimpleNamespace(optimizer="sgd", optimizer_kernels="fused")
    opts = SimpleNamespace(optimizer=None, lr=None)  # no --optimizer, no --lr: the plan's
    opt = optimizer_factory(opts, plan)([torch.nn.Parameter(torch.zeros(2))])
    assert isinstance(opt, torch.optim.SGD) and opt.defaults["fused"] is True
