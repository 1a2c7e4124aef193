"""torch's optimizer-state initialisation is taken once for an optimizer that keeps no state
(``unison.checkpoint.optim_init``): counted in optimizer steps, against torch's own."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.distributed.checkpoint import state_dict as torch_state_dict
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

from unison.checkpoint.optim_init import init_once


def _counted(optimizer: torch.optim.Optimizer) -> list[int]:
    """A list whose one item counts ``optimizer``'s steps."""
    steps = [0]
    optimizer.register_step_pre_hook(lambda *_: steps.__setitem__(0, steps[0] + 1))
    return steps


def _sgd(**kwargs: float) -> tuple[nn.Module, torch.optim.Optimizer, list[int]]:
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, **kwargs)
    return model, optimizer, _counted(optimizer)


def test_torch_initialises_a_stateless_optimizer_at_every_call() -> None:
    """The truth the next tests improve on: torch steps a stateless SGD at every call."""
    model, optimizer, steps = _sgd()
    for _ in range(3):
        get_optimizer_state_dict(model, optimizer)
    assert steps[0] == 3
    assert not optimizer.state


def test_a_stateless_optimizer_is_initialised_once_and_gives_torchs_state() -> None:
    model, optimizer, steps = _sgd(weight_decay=0.01)
    truth = get_optimizer_state_dict(model, optimizer)
    weights = [p.detach().clone() for p in model.parameters()]
    with init_once():
        first = get_optimizer_state_dict(model, optimizer)  # torch's own, once more: not yet seen
        again = [get_optimizer_state_dict(model, optimizer) for _ in range(3)]
        set_optimizer_state_dict(model, optimizer, again[-1])
    assert steps[0] == 2  # the call before init_once, and its first call
    assert first == truth and all(state == truth for state in again)
    assert all(p.grad is None for p in model.parameters())
    assert all(torch.equal(p, w) for p, w in zip(model.parameters(), weights, strict=True))


def test_a_new_setting_initialises_again() -> None:
    model, optimizer, steps = _sgd()
    with init_once():
        get_optimizer_state_dict(model, optimizer)
        optimizer.param_groups[0]["lr"] = 0.05  # a schedule's change: still stateless
        get_optimizer_state_dict(model, optimizer)
        assert steps[0] == 1
        optimizer.param_groups[0]["momentum"] = 0.9  # now its step keeps a buffer
        state = get_optimizer_state_dict(model, optimizer)
    assert steps[0] == 2
    assert set(state["state"]) == {"0.weight", "0.bias", "2.weight", "2.bias"}


def test_a_stateful_optimizer_is_initialised_as_torch_does() -> None:
    def adam() -> tuple[nn.Module, torch.optim.Optimizer, list[int]]:
        torch.manual_seed(0)
        model = nn.Linear(4, 3)
        optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
        return model, optimizer, _counted(optimizer)

    model, optimizer, steps = adam()
    truth_model, truth_optimizer, _ = adam()
    truth = get_optimizer_state_dict(truth_model, truth_optimizer)
    with init_once():
        state = get_optimizer_state_dict(model, optimizer)
        get_optimizer_state_dict(model, optimizer)  # it has its state now: torch returns at once
    assert steps[0] == 1
    assert set(state["state"]) == set(truth["state"]) == {"weight", "bias"}
    for key, value in truth["state"]["weight"].items():
        assert torch.equal(state["state"]["weight"][key], value)


def test_a_call_with_gradients_present_teaches_nothing() -> None:
    """torch steps nothing while a gradient is there (a save inside an accumulation window): an
    Adam that has not stepped yet is not taken for a stateless optimizer."""
    model = nn.Linear(4, 3)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    steps = _counted(optimizer)
    model(torch.ones(2, 4)).sum().backward()
    with init_once():
        assert get_optimizer_state_dict(model, optimizer)["state"] == {}  # as torch: no step
        assert steps[0] == 0
        optimizer.zero_grad(set_to_none=True)
        state = get_optimizer_state_dict(model, optimizer)  # now torch initialises it
    assert steps[0] == 1 and set(state["state"]) == {"weight", "bias"}


def test_torchs_own_function_is_back_outside() -> None:
    original = torch_state_dict._init_optim_state
    with init_once():
        inside = torch_state_dict._init_optim_state
        with init_once():  # nested: the outer one's is kept
            assert torch_state_dict._init_optim_state is inside
        assert torch_state_dict._init_optim_state is inside
    assert inside is not original
    assert torch_state_dict._init_optim_state is original


def test_an_error_inside_puts_torchs_function_back() -> None:
    original = torch_state_dict._init_optim_state
    with pytest.raises(RuntimeError, match="inside"), init_once():
        raise RuntimeError("inside")
    assert torch_state_dict._init_optim_state is original


def test_a_sharded_checkpoints_states_initialise_a_stateless_optimizer_once() -> None:
    """What a sharded save takes from its objects (``dcp_states``), save after save."""
    from unison.checkpoint.sharded import dcp_states

    model, optimizer, steps = _sgd()
    for _ in range(3):
        states = dcp_states({"model": model, "optimizer": optimizer}, ["model", "optimizer"])
    assert steps[0] == 1
    assert states["optimizer"] == get_optimizer_state_dict(model, optimizer)
    assert steps[0] == 2  # torch's own, outside
