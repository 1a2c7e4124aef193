"""Rank functions of tests/distributed/test_compile.py: the same training with and without compile.

Batches depend only on (iteration, rank) or come through ``prepare_loaders`` with a fixed
seed, so a compiled run and an uncompiled one see the same data; their parameters must
agree to float tolerance (inductor's fused kernels sum in another order). A worker that
compiles several models of one architecture in one process pays for one compilation:
dynamo's cached graph serves every later instance.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from _ddp_workers import batch, make_mlp
from torch import nn
from torch.utils.data import TensorDataset

from unison.checkpoint.state import model_state
from unison.distributed import get_rank, prepare_loaders, prepare_model, unwrap_model
from unison.distributed.compile import is_compiled
from unison.distributed.fsdp import full_model_state
from unison.engine import Events, create_trainer
from unison.handlers import Checkpoint
from unison.utils import manual_seed

SAMPLES, BATCH, EPOCHS = 24, 4, 2
"""24 samples on 2 ranks in batches of 4: 3 iterations an epoch, 6 in all, every batch full
(one shape, so one compiled graph)."""


def graphs_compiled() -> int:
    """Graphs dynamo has captured in this process so far."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def flat(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1).clone() for p in unwrap_model(model).parameters()])


# --- the CI test: DDP, compile on and off, resumed across ---------------------------------------


def _dataset() -> TensorDataset:
    gen = torch.Generator().manual_seed(5)
    return TensorDataset(
        torch.randn(SAMPLES, 8, generator=gen), torch.randint(0, 3, (SAMPLES,), generator=gen)
    )


def _run(folder: Path, compile: bool, *, stop: int | None = None, resume: bool = False) -> nn.Module:
    """A fresh run (as a new job builds it) of the MLP, saving to ``folder`` at its end;
    ``stop`` terminates it after that iteration, ``resume`` starts from the folder's newest file."""
    manual_seed(11 + get_rank())
    model = prepare_model(make_mlp(), compile=compile)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.05)
    loader, _ = prepare_loaders(_dataset(), batch_size=BATCH, seed=0)
    trainer = create_trainer(model, optimizer, F.cross_entropy)
    checkpoint = Checkpoint(folder, {"model": model, "optimizer": optimizer}, trainer, keep_last=None)
    checkpoint.attach()
    if resume:
        assert checkpoint.resume("auto") is not None, f"nothing to resume in {folder}"
    if stop is not None:
        trainer.add_event_handler(Events.ITERATION_COMPLETED(once=stop), lambda engine: engine.terminate())
    trainer.run(loader, max_epochs=EPOCHS)
    return model


def compile_and_resume(folder: str, stop: int) -> dict[str, Any]:
    """Uncompiled and compiled runs; a compiled run resumed without compile, and the other way round.

    Returns each run's parameters, the keys a compiled run's checkpoint holds next to the
    plain model's, what compile cost, and the keys of a model the user compiled with
    ``torch.compile`` before ``prepare_model`` (DDP around an ``OptimizedModule``).
    """
    root = Path(folder)
    eager = _run(root / "eager", compile=False)
    start = time.perf_counter()
    compiled = _run(root / "compiled", compile=True)
    first_compiled_run_s = time.perf_counter() - start
    graphs = graphs_compiled()
    _run(root / "c2e", compile=True, stop=stop)
    compiled_to_eager = _run(root / "c2e", compile=False, resume=True)
    _run(root / "e2c", compile=False, stop=stop)
    eager_to_compiled = _run(root / "e2c", compile=True, resume=True)
    saved = torch.load(sorted((root / "compiled").glob("*.pt"))[-1], map_location="cpu", weights_only=True)
    user_compiled = prepare_model(torch.compile(make_mlp()))
    return {
        "eager": flat(eager),
        "compiled": flat(compiled),
        "compiled_to_eager": flat(compiled_to_eager),
        "eager_to_compiled": flat(eager_to_compiled),
        "is_compiled": is_compiled(compiled) and not is_compiled(eager),
        "graphs": graphs,
        "graphs_after_all_runs": graphs_compiled(),
        "first_compiled_run_s": first_compiled_run_s,
        "saved_keys": sorted(saved["objects"]["model"]),
        "plain_keys": sorted(make_mlp().state_dict()),
        "user_compiled_keys": sorted(model_state(user_compiled)),
    }


# --- behind the compile marker ------------------------------------------------------------------


class Block(nn.Module):
    """A user-defined block: FSDP2 shards each one as a unit, dynamo captures its forward."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.linear = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.linear(x)) + x


class Net(nn.Module):
    def __init__(self, width: int = 16, blocks: int = 2) -> None:
        super().__init__()
        self.stem = nn.Linear(8, width)
        self.blocks = nn.ModuleList(Block(width) for _ in range(blocks))
        self.head = nn.Linear(width, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def make_net(seed: int = 0) -> nn.Module:
    saved = torch.random.get_rng_state()
    torch.manual_seed(seed)
    net = Net()
    torch.random.set_rng_state(saved)
    return net


def _train(model: nn.Module, iterations: int, sizes: tuple[int, ...] = (4,)) -> None:
    """``iterations`` steps of this rank's batches; batch sizes cycle through ``sizes``."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05)
    trainer = create_trainer(model, optimizer, F.cross_entropy)
    data = []
    for i in range(iterations):
        x, y = batch(i, get_rank())
        n = sizes[i % len(sizes)]
        data.append((x[:n].clone(), y[:n].clone()))  # fresh tensors, as a loader gives, not views
    trainer.run(data, max_epochs=1)


def fsdp_compiled(iterations: int) -> dict[str, Any]:
    """The whole weights of the user-defined net trained under FSDP2, without and with compile."""
    out: dict[str, Any] = {}
    for compile in (False, True):
        model = prepare_model(make_net(), strategy="fsdp", compile=compile)
        _train(model, iterations)
        out[compile] = {k: v.detach().clone() for k, v in full_model_state(model).items()}
    out["graphs"] = graphs_compiled()
    return out


def ddp_options(iterations: int) -> dict[str, Any]:
    """The MLP under DDP: eager, ``fullgraph=True``, and ``dynamic=True`` on batches of 4 and 3 rows."""
    out: dict[str, Any] = {}
    for name, compile, sizes in (
        ("eager", False, (4,)),
        ("fullgraph", {"fullgraph": True}, (4,)),
        ("eager_uneven", False, (4, 3)),
        ("dynamic", {"dynamic": True}, (4, 3)),
    ):
        before = graphs_compiled()
        model = prepare_model(make_mlp(), compile=compile)
        _train(model, iterations, sizes)
        out[name] = flat(model)
        out[f"{name}_graphs"] = graphs_compiled() - before
    try:
        wrapped = torch.compile(prepare_model(make_mlp()), fullgraph=True)
        _train(wrapped, 1)
        out["torch_compile_of_ddp_fullgraph"] = "ran"
    except Exception as exc:  # dynamo's Unsupported: DDP's forward cannot be traced whole
        out["torch_compile_of_ddp_fullgraph"] = type(exc).__name__
    return out


class WideMLP(nn.Module):
    """A user-defined MLP over 1 MiB: DDP's 1 MiB first bucket splits it in three."""

    def __init__(self) -> None:
        super().__init__()
        layers: list[nn.Module] = [nn.Linear(8, 512), nn.Tanh()]
        for _ in range(2):
            layers += [nn.Linear(512, 512), nn.Tanh()]
        self.net = nn.Sequential(*layers, nn.Linear(512, 3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def ddp_graph_splits(cases: list[tuple[str, str]]) -> dict[str, dict[str, Any]]:
    """:func:`ddp_graph_split` of each ``(kind, how)``, keyed ``"kind/how"``."""
    return {f"{kind}/{how}": ddp_graph_split(kind, how) for kind, how in cases}


def ddp_graph_split(kind: str, how: str) -> dict[str, Any]:
    """Graphs and DDP-optimizer buckets of one forward and backward of ``kind`` ("user": WideMLP,
    "torch": its ``nn.Sequential``) compiled by ``how`` ("unison": ``prepare_model(compile=True)``,
    "torch": ``torch.compile`` of the DDP wrapper), and the frames dynamo tried to compile."""
    import torch._dynamo
    from torch._dynamo.backends.distributed import DDPOptimizer
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    buckets: list[int] = []
    original = DDPOptimizer.compile_fn

    def spy(self: DDPOptimizer, gm: Any, example_inputs: Any) -> Any:
        compiled = original(self, gm, example_inputs)
        buckets.append(len(self.buckets))
        return compiled

    DDPOptimizer.compile_fn = spy  # type: ignore[method-assign]
    try:
        torch.manual_seed(0)
        plain = WideMLP() if kind == "user" else WideMLP().net
        if how == "unison":
            model = prepare_model(plain, compile=True, bucket_cap_mb=1)
        else:
            model = torch.compile(prepare_model(plain, bucket_cap_mb=1))
        x, y = batch(0, get_rank())
        F.cross_entropy(model(x), y).backward()
    finally:
        DDPOptimizer.compile_fn = original  # type: ignore[method-assign]
    return {
        "graphs": int(counters["stats"]["unique_graphs"]),
        "buckets_per_graph": buckets,
        "frames_tried": int(counters["frames"]["total"]),
    }


class ConvPoolNet(nn.Module):
    """The digits recipe's network: two convolutions, a max-pool, two linear layers."""

    def __init__(self, channels: int = 16) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Conv2d(1, channels, 3, padding=1),
            nn.ReLU(),
            nn.Conv2d(channels, 2 * channels, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Flatten(),
            nn.Linear(2 * channels * 16, 64),
            nn.ReLU(),
            nn.Linear(64, 10),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def conv_pool_gradient_gaps() -> dict[str, float]:
    """Max |compiled - eager| over the first step's gradients of :class:`ConvPoolNet`, for
    ``compile_model`` ("unison") and a plain ``torch.compile`` ("torch"), relative to the
    largest eager gradient."""
    import torch._dynamo

    from unison.distributed.compile import compile_model

    gen = torch.Generator().manual_seed(3)
    x, y = torch.rand(32, 1, 8, 8, generator=gen), torch.randint(0, 10, (32,), generator=gen)

    def gradients(model: nn.Module, call: Any) -> list[torch.Tensor]:
        F.cross_entropy(call(x), y).backward()
        return [p.grad.detach().clone() for p in model.parameters()]

    torch.manual_seed(0)
    truth = gradients(eager := ConvPoolNet(), eager)
    scale = max(float(g.abs().max()) for g in truth)
    gaps = {}
    for how in ("unison", "torch"):
        torch._dynamo.reset()
        torch.manual_seed(0)
        model = ConvPoolNet()
        call = compile_model(model) if how == "unison" else torch.compile(model)
        got = gradients(model, call)
        gaps[how] = max(float((g - t).abs().max()) for g, t in zip(got, truth, strict=True)) / scale
    torch._dynamo.reset()
    return gaps


def torch_class_compiles() -> dict[str, int]:
    """Graphs captured by one forward of an ``nn.Sequential`` compiled with ``Module.compile``
    and with ``compile_model``."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    from unison.distributed.compile import compile_model

    out = {}
    for how in ("module.compile", "compile_model"):
        torch._dynamo.reset()
        counters.clear()
        model = make_mlp()
        if how == "module.compile":
            model.compile()
        else:
            compile_model(model)
        model(batch(0, 0)[0])
        out[how] = graphs_compiled()
    torch._dynamo.reset()
    return out
