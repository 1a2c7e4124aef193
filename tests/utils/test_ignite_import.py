"""``import unison`` imports ignite without ``torch.distributed.optim`` (FSDP, DTensor), and ignite's
``Checkpoint`` still recognises a ZeRO optimizer once there is one."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from unison.testing import run_distributed
from unison.utils.ignite_import import DeferredZero, _StandIn


def _python(code: str) -> str:
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def test_importing_unison_leaves_fsdp_and_dtensor_unimported() -> None:
    out = _python(
        "import sys, unison, ignite.handlers.checkpoint as c\n"
        "print(sorted(m for m in ('torch.distributed.optim', 'torch.distributed.fsdp', 'torch.distributed.tensor')"
        " if m in sys.modules), c.HAVE_ZERO)"
    )
    assert out == "[] True"


def test_a_zero_optimizer_is_recognised_once_its_module_is_imported_and_nothing_else_is() -> None:
    out = _python(
        "import sys, torch, unison, ignite.handlers.checkpoint as c\n"
        "sgd = torch.optim.SGD([torch.zeros(1, requires_grad=True)])\n"
        "before = isinstance(sgd, c.ZeroRedundancyOptimizer)\n"
        "from torch.distributed.optim import ZeroRedundancyOptimizer as Z\n"
        "print(before, isinstance(sgd, c.ZeroRedundancyOptimizer), isinstance(object.__new__(Z), c.ZeroRedundancyOptimizer),"
        " issubclass(Z, c.ZeroRedundancyOptimizer), type(sys.modules['torch.distributed.optim']).__name__)"
    )
    assert out == "False False True True module"


def test_another_name_asked_of_the_stand_in_is_the_real_modules() -> None:
    from torch.distributed.optim import DistributedOptimizer

    stand_in = _StandIn("torch.distributed.optim")
    assert stand_in.DistributedOptimizer is DistributedOptimizer
    with pytest.raises(AttributeError):
        stand_in.__path__  # noqa: B018  - the import system must not take it for a package
    assert not isinstance(torch.optim.SGD([torch.zeros(1, requires_grad=True)]), DeferredZero)


def _ignite_checkpoint_of_zero(folder: str) -> int:
    import ignite.distributed as idist
    from ignite.engine import Engine
    from ignite.handlers import Checkpoint, DiskSaver
    from torch.distributed.optim import ZeroRedundancyOptimizer

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
    optimizer = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.Adam, lr=0.1)
    model(torch.randn(3, 4)).sum().backward()
    optimizer.step()
    engine = Engine(lambda e, b: None)
    saver = Checkpoint({"optimizer": optimizer}, DiskSaver(folder, require_empty=False), n_saved=1)
    saver(engine)  # ignite consolidates a ZeRO optimizer's shards on rank 0 before saving
    idist.barrier()
    saved = torch.load(saver.last_checkpoint, weights_only=True)
    return len(saved["state"])  # one object: saved as its own state dict


@pytest.mark.distributed
@pytest.mark.timeout(180)
def test_ignites_checkpoint_still_saves_a_zero_optimizer_whole(tmp_path) -> None:
    # Each rank holds the state of its own parameters; the file holds all four.
    assert run_distributed(_ignite_checkpoint_of_zero, str(tmp_path), nproc=2) == [4, 4]
