"""unison/distributed/activation_ckpt.py: blocks recompute their activations in backward, and
training is the same as without (dropout included), under one process, DDP and FSDP2.

The rank functions and the model (a residual MLP whose blocks count their forward calls) are
in ``_activation_ckpt_workers.py``.
"""

from __future__ import annotations

import copy
import re
from pathlib import Path

import pytest
import torch
from _activation_ckpt_workers import Net, QuietBlock, batch, make_net, run, scenarios
from torch import nn

from unison.distributed import prepare_model
from unison.distributed.activation_ckpt import (
    ac_spec,
    checkpoint_blocks,
    checkpointed_blocks,
    is_checkpointed,
)
from unison.distributed.fsdp import FSDPOptions
from unison.testing import run_distributed

ITERATIONS, STOP = 4, 2


def _close(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert list(a) == list(b)
    for key in a:
        torch.testing.assert_close(a[key], b[key], msg=key)


def test_a_checkpointed_block_runs_its_forward_twice_per_training_step_and_once_in_evaluation():
    plain, ac = make_net(), prepare_model(make_net(), activation_checkpointing="auto")
    x, y = batch(0, 0)
    for model in (plain, ac):
        nn.functional.cross_entropy(model(x), y).backward()
    assert [b.calls for b in plain.blocks] == [1, 1, 1]
    assert [b.calls for b in ac.blocks] == [2, 2, 2]  # the forward, then its recomputation in backward
    with torch.no_grad():
        ac(x)
    assert [b.calls for b in ac.blocks] == [3, 3, 3]  # nothing kept, nothing recomputed
    assert not is_checkpointed(ac.stem) and not is_checkpointed(ac)


def test_one_process_trains_the_same_with_dropout_and_keeps_the_plain_keys():
    plain, ac = run("ddp", False, ITERATIONS), run("ddp", ["Block"], ITERATIONS)
    assert plain["losses"] == pytest.approx(ac["losses"], rel=1e-6)
    _close(plain["weights"], ac["weights"])  # keys in the same order: no wrapper prefix
    assert ac["calls"] == [2 * ITERATIONS] * 3 and plain["calls"] == [ITERATIONS] * 3


def test_a_deep_copy_recomputes_its_own_blocks():
    """An EMA averages a deep copy: the copy's blocks must run the copy's weights."""
    model = prepare_model(make_net(), activation_checkpointing="auto")
    twin = copy.deepcopy(model)
    with torch.no_grad():
        for p in twin.parameters():
            p.zero_()
    x, _ = batch(0, 0)
    assert is_checkpointed(twin.blocks[0])
    twin(x).sum().backward()
    assert [b.calls for b in twin.blocks] == [2, 2, 2] and [b.calls for b in model.blocks] == [0, 0, 0]
    assert torch.equal(twin(x), torch.zeros(4, 3))


def test_a_container_without_a_forward_is_never_a_block_to_recompute():
    """``nn.Transformer``'s layers sit in two ``ModuleList``s, whose own forward never runs: the auto
    rule chose the lists (wrapped, they recomputed nothing); it chooses the layers now, and naming a
    list fails, naming the layers."""
    model = nn.Transformer(d_model=8, nhead=2, num_encoder_layers=2, num_decoder_layers=2, dim_feedforward=16)
    blocks = checkpointed_blocks(model, "auto")
    assert blocks == [*model.encoder.layers, *model.decoder.layers]
    with pytest.raises(
        ValueError,
        match=r"activation_checkpointing names \['ModuleList'\], which only hold modules.*DecoderLayer",
    ):
        checkpoint_blocks(model, ["ModuleList"])
    assert not any(is_checkpointed(m) for m in model.modules())


def test_the_rules_choose_the_blocks_and_name_what_the_model_has():
    net = make_net()
    assert checkpointed_blocks(net, "auto") == list(net.blocks)
    assert checkpointed_blocks(net, "auto", FSDPOptions()) == list(net.blocks)  # FSDP's units made of layers
    assert checkpointed_blocks(net, ["Linear"]) == [net.stem, *(b.linear for b in net.blocks), net.head]
    with pytest.raises(
        ValueError, match=r"no repeated blocks to recompute"
    ):  # FSDP units that are lone layers
        checkpointed_blocks(net, "auto", FSDPOptions(shard=("Linear",)))
    assert ac_spec(False) is None and ac_spec(True) == "auto" and ac_spec("Block") == ("Block",)
    with pytest.raises(
        ValueError, match=r"names \['Bogus'\].*could be meant.*\['Block', 'Linear', 'Sequential'\]"
    ):
        checkpoint_blocks(net, ["Bogus"])
    with pytest.raises(ValueError, match=r"'auto': the model \(Sequential\) has no repeated blocks"):
        checkpoint_blocks(nn.Sequential(nn.Linear(2, 2), nn.Tanh(), nn.Linear(2, 1)), "auto")
    with pytest.raises(ValueError, match=r"no instance of these classes holds parameters"):
        checkpoint_blocks(net, ["Dropout"])
    with pytest.raises(
        ValueError, match=r"prepare_model\(activation_checkpointing=\.\.\.\)=3: expected false, 'auto'"
    ):
        prepare_model(make_net(), activation_checkpointing=3)  # type: ignore[arg-type]
    assert not any(is_checkpointed(m) for m in net.modules())  # a refused rule changed nothing


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.timeout(120)
def test_ddp_and_fsdp2_train_the_same_with_checkpointed_blocks_and_resume_bitwise():
    results = run_distributed(scenarios, ITERATIONS, STOP, nproc=2, timeout=100)
    for rank, out in enumerate(results):
        for strategy in ("ddp", "fsdp"):
            plain, ac = out[strategy]["plain"], out[strategy]["ac"]
            assert plain["losses"] == pytest.approx(ac["losses"], rel=1e-6), (rank, strategy)
            _close(plain["weights"], ac["weights"])
            assert ac["calls"] == [2 * ITERATIONS] * 3, (rank, strategy)
            assert plain["calls"] == [ITERATIONS] * 3, (rank, strategy)
        _close(out["fsdp"]["ac"]["weights"], out["ddp"]["ac"]["weights"])
        resumed, uninterrupted = out["resumed"], out["ddp"]["ac"]["weights"]
        assert list(resumed) == list(uninterrupted)
        assert all(torch.equal(resumed[k], uninterrupted[k]) for k in resumed), rank


NET = """\
import torch
from torch import nn
from torch.utils.data import TensorDataset


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm, self.act, self.body = nn.LayerNorm(4), nn.Tanh(), nn.Linear(4, 2)

    def forward(self, x):
        return self.body(self.act(self.norm(x)))


class Pair(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x):
        return self.b(torch.tanh(self.a(x)))


class Deep(nn.Module):
    def __init__(self):
        super().__init__()
        self.pairs, self.head = nn.Sequential(Pair(), Pair()), nn.Linear(4, 2)

    def forward(self, x):
        return self.head(self.pairs(x))


def build(seed):
    x = torch.randn(8, 4, generator=torch.Generator().manual_seed(seed))
    return TensorDataset(x, (x[:, 0] > 0).long()), TensorDataset(x, (x[:, 0] > 0).long())
"""

BODY = """\
name: ac
parallel:
  activation_checkpointing: {rule}
model:
  type: !pyobject acnet.Net
data:
  build: !pyobject acnet.build
training:
  max_epochs: 1
  batch_size: 4
validation:
  metrics:
    loss: !pyobject unison.metrics.Loss
"""


@pytest.mark.parametrize(
    ("rule", "says"),
    [
        ("[Bogus]", r"names \['Bogus'\].*could be meant.*\['LayerNorm', 'Linear'\]"),
        ("[Tanh]", r"\['Tanh'\]: no instance of these classes holds parameters.*\['LayerNorm', 'Linear'\]"),
        ("auto", r"'auto': the model \(Net\) has no repeated blocks.*\['LayerNorm', 'Linear'\]"),
        ("3", r"expected .*got int: 3"),
    ],
)
def test_a_rule_that_chooses_no_block_fails_before_spawning_at_its_line(tmp_path: Path, rule: str, says: str):
    from unison.config import ConfigError, load_config
    from unison.recipe import plan
    from unison.recipe.build.preflight import preflight

    (tmp_path / "acnet.py").write_text(NET)
    config = tmp_path / "config.yaml"
    config.write_text(BODY.format(rule=rule))
    with pytest.raises(ConfigError) as err:
        preflight(plan(load_config(config)))
    message = str(err.value)
    assert message.startswith(f"{config}:3: parallel.activation_checkpointing:"), message
    assert re.search(says, message), message


def test_the_config_key_reaches_the_built_model(tmp_path: Path):
    from unison.config import load_config
    from unison.recipe import plan
    from unison.recipe.build.assemble import build_model
    from unison.recipe.build.preflight import preflight

    (tmp_path / "acnet.py").write_text(NET)
    config = tmp_path / "config.yaml"
    config.write_text(BODY.format(rule="auto").replace("acnet.Net", "acnet.Deep"))
    planned = plan(load_config(config))
    preflight(planned)
    model = build_model(planned)
    assert [name for name, m in model.named_modules() if is_checkpointed(m)] == ["pairs.0", "pairs.1"]
    assert list(model.state_dict()) == list(type(model)().state_dict())


@pytest.mark.compile
@pytest.mark.timeout(300)
def test_compiled_checkpointed_blocks_train_as_compiled_plain_ones():
    results = []
    for ac in (False, "auto"):
        torch.manual_seed(100)
        model = prepare_model(make_net(block=QuietBlock), activation_checkpointing=ac, compile=True)
        optimizer = torch.optim.AdamW(model.parameters(), lr=0.05)
        for it in range(3):
            x, y = batch(it, 0)
            optimizer.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            optimizer.step()
        results.append({k: v.detach().clone() for k, v in model.state_dict().items()})
    _close(*results)
    assert isinstance(model, Net) and isinstance(model.blocks[0], QuietBlock)
