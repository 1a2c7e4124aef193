"""Parts and rank functions of the CUDA tier (tests/cuda).

``run_distributed`` sends a function by name: spawned ranks import this small module, not
the test modules. Every function computes on ``unison.distributed.device()`` (this rank's
``cuda:LOCAL_RANK`` on a GPU machine) and returns plain data or CPU tensors for the test to
compare in the parent process. Batches depend only on (iteration, rank), and models on
their seed, so two runs that must agree see the same numbers.
"""

from __future__ import annotations

import contextlib
import io
import os
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

from unison.distributed import (
    all_reduce_sum,
    broadcast_object,
    device,
    get_local_rank,
    get_rank,
    get_world_size,
    model_device,
    prepare_loaders,
    prepare_model,
    sync_bool,
    unwrap_model,
)
from unison.distributed.fsdp import full_model_state, is_sharded, local_tensor
from unison.engine import Engine, Events, create_trainer

BACKEND = "nccl"
DEVICE_TYPE = "cuda"
IN, HIDDEN, OUT, BATCH = 8, 32, 4, 8


# --- parts ------------------------------------------------------------------------------------------


def make_mlp(seed: int = 0, dropout: float = 0.0) -> nn.Module:
    """Three Linear layers (FSDP's "auto" rule makes each a unit); weights from ``seed`` only.

    Only the CPU generator is seeded (and put back): ``torch.manual_seed`` would also reseed
    every GPU's generator, which ``fork_rng(devices=[])`` does not restore, so every run's
    dropout masks on the GPU would be the same whatever its own seed."""
    with torch.random.fork_rng(devices=[]):
        torch.default_generator.manual_seed(seed)
        layers: list[nn.Module] = [nn.Linear(IN, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, HIDDEN), nn.ReLU()]
        if dropout:
            layers.append(nn.Dropout(dropout))
        layers.append(nn.Linear(HIDDEN, OUT))
        return nn.Sequential(*layers)


def batch(iteration: int, rank: int, scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's batch of ``iteration``, on the CPU: a function of both, not of any RNG state."""
    gen = torch.Generator().manual_seed(1000 * iteration + rank)
    return torch.randn(BATCH, IN, generator=gen) * scale, torch.randint(0, OUT, (BATCH,), generator=gen)


def batches(n: int, rank: int, pinned: bool = False) -> list[tuple[torch.Tensor, torch.Tensor]]:
    out = [batch(i, rank) for i in range(n)]
    if pinned and torch.cuda.is_available():
        out = [(x.pin_memory(), y.pin_memory()) for x, y in out]
    return out


def dataset(size: int, seed: int = 0) -> TensorDataset:
    gen = torch.Generator().manual_seed(seed)
    return TensorDataset(torch.randn(size, IN, generator=gen), torch.randint(0, OUT, (size,), generator=gen))


def cpu_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The whole weights (gathered when sharded: a collective), as CPU copies."""
    return {k: v.detach().to("cpu", copy=True) for k, v in full_model_state(model).items()}


def flat(state: dict[str, torch.Tensor]) -> torch.Tensor:
    return torch.cat([v.reshape(-1).float() for v in state.values()])


def largest_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys(), (sorted(a), sorted(b))
    return max(float((a[k].float() - b[k].float()).abs().max()) for k in a)


def parameter_device(model: nn.Module) -> str:
    """Where this rank's share of the first parameter lives (a DTensor's local shard when sharded)."""
    return str(local_tensor(next(model.parameters()).detach()).device)


# --- 1. the process group ----------------------------------------------------------------------------


def group_facts() -> dict[str, Any]:
    """This rank's group, device and collectives, through torch and through unison's primitives."""
    import torch.distributed as dist

    here = device()
    direct = torch.full((3,), float(get_rank() + 1), device=here)
    dist.all_reduce(direct)  # NCCL needs the tensor on this rank's GPU
    sums = all_reduce_sum([torch.tensor([float(get_rank() + 1)], device=here), torch.ones(2, device=here)])
    placed = prepare_model(nn.Linear(2, 2))
    return {
        "backend": dist.get_backend(),
        "rank": get_rank(),
        "world_size": get_world_size(),
        "local_rank": get_local_rank(),
        "env_local_rank": int(os.environ["LOCAL_RANK"]),
        "device": str(here),
        "current_device": torch.cuda.current_device() if here.type == "cuda" else None,
        "direct_all_reduce": direct.cpu().tolist(),
        "direct_device": str(direct.device),
        "all_reduce_sum": [s.tolist() for s in sums],
        "any": sync_bool(get_rank() == 0, "any"),
        "all": sync_bool(get_rank() == 0, "all"),
        "broadcast": broadcast_object(get_rank() + 10),
        "model_device": str(model_device(placed)),
    }


# --- 2. automatic mixed precision ------------------------------------------------------------------

_AMP_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def _count_steps(optimizer: torch.optim.Optimizer, position: Any) -> list[int]:
    """The 1-based iterations at which ``optimizer.step()`` really ran (GradScaler skips some)."""
    steps: list[int] = []
    optimizer.register_step_post_hook(lambda *_: steps.append(position()))
    return steps


def amp_runs(amp: str, iterations: int, inf_at: int | None = None) -> dict[str, Any]:
    """unison's trainer with ``amp``, a plain loop with ``torch.autocast`` (and, for fp16, its own
    ``torch.amp.GradScaler``), and the plain loop in full precision, on the same batches.

    ``inf_at``: the 0-based iteration whose inputs are scaled by 1e6, beyond fp16's range, so
    its gradients are not finite and a GradScaler must skip that update.
    """
    here = device()
    data = [batch(i, 0, scale=1e6 if i == inf_at else 1.0) for i in range(iterations)]

    model = make_mlp().to(here)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    trainer = create_trainer(model, optimizer, F.cross_entropy, amp=amp)  # type: ignore[arg-type]
    unison_steps = _count_steps(optimizer, lambda: trainer.state.iteration)
    trainer.run(data, max_epochs=1)
    scaler = trainer.process_function.scaler  # type: ignore[attr-defined]

    def plain(dtype: torch.dtype | None) -> tuple[dict[str, torch.Tensor], list[int], Any]:
        model = make_mlp().to(here)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        own = torch.amp.GradScaler(here.type) if dtype is torch.float16 else None
        position = [0]
        steps = _count_steps(optimizer, lambda: position[0])
        model.train()
        for x, y in data:
            position[0] += 1
            x, y = x.to(here), y.to(here)
            optimizer.zero_grad(set_to_none=True)
            context = (
                torch.autocast(here.type, dtype=dtype) if dtype is not None else contextlib.nullcontext()
            )
            with context:
                loss = F.cross_entropy(model(x), y)
            if own is not None:
                own.scale(loss).backward()
                own.step(optimizer)
                own.update()
            else:
                loss.backward()
                optimizer.step()
        return cpu_state(model), steps, own

    plain_state, plain_steps, plain_scaler = plain(_AMP_DTYPES[amp])
    full_state, _, _ = plain(None)
    return {
        "unison": cpu_state(model),
        "plain": plain_state,
        "full_precision": full_state,
        "unison_steps": unison_steps,
        "plain_steps": plain_steps,
        "scaler": None if scaler is None else type(scaler).__name__,
        "scaler_enabled": None if scaler is None else scaler.is_enabled(),
        "unison_scale": None if scaler is None else scaler.get_scale(),
        "plain_scale": None if plain_scaler is None else plain_scaler.get_scale(),
        "initial_scale": torch.amp.GradScaler(here.type).get_scale(),
        "parameter_device": parameter_device(model),
        "loss": trainer.state.metrics["loss"],
    }


# --- 3. DDP and FSDP2 ------------------------------------------------------------------------------


def train_strategy(
    strategy: str, iterations: int, fsdp: dict[str, Any] | None = None, **trainer_kwargs: Any
) -> dict[str, Any]:
    """Trains the MLP on this rank's batches under ``strategy``; the whole weights after (every rank)."""
    model = prepare_model(make_mlp(), strategy=strategy, fsdp=fsdp)  # type: ignore[arg-type]
    placed = parameter_device(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05)
    trainer = create_trainer(model, optimizer, F.cross_entropy, **trainer_kwargs)
    trainer.run(batches(iterations, get_rank()), max_epochs=1)
    return {
        "state": cpu_state(model),
        "parameter_device": placed,
        "sharded": is_sharded(model),
        "wrapped": type(model).__name__,
        "loss": trainer.state.metrics["loss"],
    }


# --- 4. checkpoints ---------------------------------------------------------------------------------


def tensors_in(obj: Any) -> Iterator[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for value in obj.values():
            yield from tensors_in(value)
    elif isinstance(obj, (list, tuple)):
        for value in obj:
            yield from tensors_in(value)


CKPT_SIZE, CKPT_BATCH = 20, 4
"""The checkpoint runs' dataset size and per-rank batch: 5 batches an epoch at one rank, 3 at two."""


def _checkpointed_run(
    folder: str, rng_seed: int
) -> tuple[Engine, nn.Module, torch.optim.Optimizer, Any, Any]:
    from unison.handlers import Checkpoint
    from unison.utils import manual_seed

    manual_seed(rng_seed)
    model = prepare_model(make_mlp(dropout=0.3))
    optimizer = torch.optim.Adam(model.parameters(), lr=0.05)
    loader, _ = prepare_loaders(dataset(CKPT_SIZE), batch_size=CKPT_BATCH, seed=0)
    trainer = create_trainer(model, optimizer, F.cross_entropy, sync_every=1)
    checkpoint = Checkpoint(folder, {"model": model, "optimizer": optimizer}, trainer, keep_last=None)
    checkpoint.attach()
    return trainer, model, optimizer, loader, checkpoint


def checkpoint_roundtrip(folder: str, stop: int, max_epochs: int = 2) -> dict[str, Any]:
    """Run A uninterrupted; run B stopped after iteration ``stop`` (saving as it stops); run B'
    built afresh resuming B's folder; a control run with other dropout masks. Rank 0 also reads
    A's last file back: with ``torch.load(weights_only=True, map_location="cpu")``, with
    ``load_checkpoint``, and into a CPU copy of the model."""
    from unison.checkpoint import load_checkpoint

    a_trainer, a_model, _, a_loader, a_ckpt = _checkpointed_run(f"{folder}/a", rng_seed=1 + get_rank())
    a_trainer.run(a_loader, max_epochs=max_epochs)

    trainer, _, _, loader, _ = _checkpointed_run(f"{folder}/b", rng_seed=1 + get_rank())
    trainer.add_event_handler(Events.ITERATION_COMPLETED(once=stop), lambda e: e.terminate())
    trainer.run(loader, max_epochs=max_epochs)
    stopped = trainer.state.iteration

    b_trainer, b_model, b_optimizer, b_loader, b_ckpt = _checkpointed_run(
        f"{folder}/b", rng_seed=1 + get_rank()
    )
    resumed = b_ckpt.resume("auto")
    after_resume = {
        "parameters": parameter_device(b_model),
        "optimizer_state": sorted(
            {str(t.device) for state in b_optimizer.state.values() for t in tensors_in(state) if t.dim() > 0}
        ),
    }
    b_trainer.run(b_loader, max_epochs=max_epochs)

    c_trainer, c_model, _, c_loader, _ = _checkpointed_run(f"{folder}/c", rng_seed=99_991 + get_rank())
    c_trainer.run(c_loader, max_epochs=max_epochs)

    out: dict[str, Any] = {
        "a": cpu_state(a_model),
        "b": cpu_state(b_model),
        "control": cpu_state(c_model),
        "stopped": stopped,
        "resumed": None if resumed is None else Path(resumed).name,
        "after_resume": after_resume,
        "iterations": (a_trainer.state.iteration, b_trainer.state.iteration),
    }
    if get_rank() == 0:
        path = a_ckpt.saved[-1]
        raw = torch.load(path, weights_only=True, map_location="cpu")
        loaded = load_checkpoint(path)
        on_cpu = make_mlp(dropout=0.3)
        on_cpu.load_state_dict(loaded["objects"]["model"])
        x, _ = batch(0, 0)
        unwrap_model(a_model).eval()
        on_cpu.eval()
        with torch.no_grad():
            gpu_out = unwrap_model(a_model)(x.to(device())).cpu()
            cpu_out = on_cpu(x)
        out["file"] = {
            "devices_with_map_location": sorted({str(t.device) for t in tensors_in(raw)}),
            "model": {k: v.clone() for k, v in loaded["objects"]["model"].items()},
            "cpu_model_state": {k: v.detach().clone() for k, v in on_cpu.state_dict().items()},
            "forward_difference": float((gpu_out - cpu_out).abs().max()),
        }
    return out


# --- 5. pinned-memory loaders ------------------------------------------------------------------------


def pinned_loaders(num_workers: int) -> dict[str, Any]:
    """The same data through pinned and unpinned loaders: what each yields, what non-blocking copies
    hold, and what a trainer learns from each."""
    here = device()
    train, val = dataset(40), dataset(13, seed=1)
    kwargs = {"batch_size": 8, "seed": 0, "num_workers": num_workers}
    pinned_train, pinned_val = prepare_loaders(train, val, pin_memory=True, **kwargs)
    plain_train, plain_val = prepare_loaders(train, val, pin_memory=False, **kwargs)
    assert (
        pinned_train is not None
        and pinned_val is not None
        and plain_train is not None
        and plain_val is not None
    )

    pinned_flags, same_batches, copies_equal, copied_to = [], [], [], set()
    for pinned, plain in [
        *zip(pinned_train, plain_train, strict=True),
        *zip(pinned_val, plain_val, strict=True),
    ]:
        pinned_flags.append(all(t.is_pinned() for t in pinned))
        same_batches.append(all(torch.equal(p, q) for p, q in zip(pinned, plain, strict=True)))
        fast = [t.to(here, non_blocking=True) for t in pinned]
        slow = [t.to(here) for t in plain]
        if here.type == "cuda":
            torch.cuda.current_stream().synchronize()
        copies_equal.append(all(torch.equal(f, s) for f, s in zip(fast, slow, strict=True)))
        copied_to.update(str(t.device) for t in fast)

    def trained(loader: Any, non_blocking: bool) -> dict[str, torch.Tensor]:
        model = make_mlp().to(here)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        trainer = create_trainer(model, optimizer, F.cross_entropy, non_blocking=non_blocking)
        trainer.run(loader, max_epochs=2)
        return cpu_state(model)

    return {
        "pinned": pinned_flags,
        "same_batches": same_batches,
        "copies_equal": copies_equal,
        "copied_to": sorted(copied_to),
        "trained_pinned": trained(pinned_train, non_blocking=True),
        "trained_plain": trained(plain_train, non_blocking=False),
    }


# --- 6. no host synchronisation between sync points -------------------------------------------------

SYNC_MESSAGE = "synchronizing CUDA operation"
"""What torch says when ``torch.cuda.set_sync_debug_mode`` catches a host-device synchronisation."""


def set_sync_debug(mode: str) -> None:
    torch.cuda.set_sync_debug_mode(mode)


class SyncDebugInIterations:
    """Turns ``torch.cuda.set_sync_debug_mode("error")`` on at ``ITERATION_STARTED`` and back to
    ``"warn"`` after the ``ITERATION_COMPLETED`` handlers attached before it: any host-device
    synchronisation inside an iteration raises, while the sync points (at the tail of
    ``ITERATION_COMPLETED`` and at ``EPOCH_COMPLETED``) run in ``"warn"`` mode, where each
    synchronisation is a warning. Attach it after every other handler."""

    def __init__(self) -> None:
        self.iterations = 0

    def attach(self, engine: Engine) -> SyncDebugInIterations:
        engine.add_event_handler(Events.ITERATION_STARTED, self._enter)
        engine.add_event_handler(Events.ITERATION_COMPLETED, self._leave)
        return self

    def _enter(self, _: Engine) -> None:
        self.iterations += 1
        set_sync_debug("error")

    def _leave(self, _: Engine) -> None:
        set_sync_debug("warn")


def hot_path_run(
    epochs: int, epoch_length: int, sync_every: int, read_in_iteration: bool = False, **trainer_kwargs: Any
) -> dict[str, Any]:
    """A trainer (model, non-finite guard, progress bar, epoch loss) whose iterations run under
    sync debug mode ``"error"`` and whose sync points run under ``"warn"``; returns what ran and
    how many synchronisations were warned of outside the iterations.

    ``read_in_iteration``: a handler reads the loss with ``.item()`` in every iteration (the
    positive control: the run must fail).
    """
    from unison.handlers import NonFiniteGuard, ProgressBar

    model = prepare_model(make_mlp())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    trainer = create_trainer(model, optimizer, F.cross_entropy, sync_every=sync_every, **trainer_kwargs)
    NonFiniteGuard().attach(trainer)  # joins every sync point: they happen inside epochs at one rank too
    ProgressBar(file=io.StringIO()).attach(trainer)
    if read_in_iteration:
        trainer.add_event_handler(Events.ITERATION_COMPLETED, lambda e: e.state.output.item())
    probe = SyncDebugInIterations().attach(trainer)
    data = batches(epoch_length, get_rank(), pinned=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        set_sync_debug("warn")
        try:
            trainer.run(data, max_epochs=epochs)
        finally:
            set_sync_debug("default")
    return {
        "iterations": probe.iterations,
        "sync_points": trainer.sync_point.count,
        "synchronisations_outside_iterations": sum(SYNC_MESSAGE in str(w.message) for w in caught),
        "loss": trainer.state.metrics["loss"],
    }


# --- 7. torch.compile ----------------------------------------------------------------------------------


def compiled_training(iterations: int) -> dict[str, Any]:
    """The MLP trained eagerly and compiled (``prepare_model(compile=True)``) on the same batches."""
    import torch._dynamo

    from unison.distributed.compile import is_compiled

    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()

    def run(compile: bool) -> nn.Module:
        model = prepare_model(make_mlp(), compile=compile)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        trainer = create_trainer(model, optimizer, F.cross_entropy)
        trainer.run(batches(iterations, get_rank()), max_epochs=1)
        return model

    eager, compiled = run(False), run(True)
    return {
        "eager": cpu_state(eager),
        "compiled": cpu_state(compiled),
        "plain_keys": list(make_mlp().state_dict()),
        "compiled_keys": list(unwrap_model(compiled).state_dict()),
        "wrapped_keys": list(compiled.state_dict()),
        "is_compiled": is_compiled(compiled),
        "unwrapped_type": type(unwrap_model(compiled)).__name__,
        "graphs": int(torch._dynamo.utils.counters["stats"]["unique_graphs"]),
        "parameter_device": parameter_device(compiled),
    }
