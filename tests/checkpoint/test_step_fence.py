"""Which tensors an asynchronous save copies beside the next iteration: the CPU parameters and state of
the optimizers it holds, and nothing else; each optimizer hooked once."""

from __future__ import annotations

import torch
from torch import nn

from unison.checkpoint.step_fence import StepFence, _cpu_storage


class _Writer:
    def __init__(self, waits: list[float]) -> None:
        self.waits = waits

    def fence(self) -> float:
        return self.waits.pop(0) if self.waits else 0.0


def test_only_the_optimizers_parameters_and_state_are_left_for_later():
    model = nn.Sequential(nn.Linear(3, 3), nn.BatchNorm1d(3), nn.Linear(3, 1))
    frozen = model[2].weight
    optimizer = torch.optim.Adam([p for p in model.parameters() if p is not frozen], lr=0.1)
    model(torch.randn(4, 3)).sum().backward()
    optimizer.step()
    later = StepFence(_Writer([]), []).later({"model": model, "optimizer": optimizer, "note": 3})
    state = model.state_dict()
    assert later(state["0.weight"]) and later(state["2.bias"])
    assert not later(state["2.weight"])  # not the optimizer's: another may change it
    assert not later(state["1.running_mean"])  # a buffer: the next forward changes it
    adam = optimizer.state_dict()["state"]
    assert all(later(v) for s in adam.values() for v in s.values())
    assert not later(torch.zeros(3))


def test_each_optimizer_is_hooked_once_and_its_steps_wait_is_added_to_the_last_stall():
    model = nn.Linear(2, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    stalls = [0.5]
    fence = StepFence(_Writer([0.25]), stalls)
    for _ in range(3):
        fence.later({"optimizer": optimizer})
    assert len(optimizer._optimizer_step_pre_hooks) == 1
    model(torch.ones(1, 2)).sum().backward()
    optimizer.step()
    optimizer.step()
    assert stalls == [0.75]


def test_no_optimizer_nothing_for_later_and_no_hook():
    model = nn.Linear(2, 1)
    assert StepFence(_Writer([]), []).later({"model": model}) is None


def test_only_a_plain_cpu_tensors_own_memory_counts():
    class Wrapped(torch.Tensor):
        pass

    plain = torch.ones(4)
    assert _cpu_storage(plain) == plain.untyped_storage().data_ptr()
    assert _cpu_storage(nn.Parameter(plain)) == plain.untyped_storage().data_ptr()
    assert _cpu_storage(plain.as_subclass(Wrapped)) is None
    assert _cpu_storage(torch.empty(0)) is None
    assert _cpu_storage(torch.empty(3, device="meta")) is None
