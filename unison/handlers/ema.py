"""An exponential moving average (EMA) of a model's weights, updated once per optimizer update.

Why not ``ignite.handlers.EMAHandler`` (ignite 0.5.5, ``ignite/handlers/ema_handler.py``),
read before writing this:

- it has no ``state_dict()``/``load_state_dict()``: a checkpoint does not carry it unless
  the user lists ``ema_handler.ema_model`` in ``to_save``, and nothing of its own position
  (its warmup runs off the engine's event counter) is saved with it;
- its default buffer mode ``"copy"`` assigns ``ema_b.data = model_b.data``: the EMA model's
  buffers become the online model's tensors (shared storage), not a copy or an average;
  ``"update"`` averages integer buffers with ``mul_``/``add_`` and falls back to sharing
  the tensor on the error;
- its "warmup" ramps the momentum, where ``warmup`` here holds the average equal to the
  weights for the first updates (the common recipe: do not average the random start);
- it attaches to ``ITERATION_COMPLETED`` by default: once per micro-batch under gradient
  accumulation (attaching it to ``UPDATE_COMPLETED`` fixes only that).

So the average here is ``torch.optim.swa_utils.AveragedModel`` with ``use_buffers=True``
and the EMA update of ``get_ema_multi_avg_fn`` (one fused ``lerp`` per dtype group) for
floating-point tensors, while integer buffers (BatchNorm's ``num_batches_tracked``) are
copied, not averaged. Its state (the averaged weights, ``n_averaged`` and the update
counter) is saved by a :class:`~unison.handlers.Checkpoint` as ``handler:EMA``, so a
resumed run's average equals the uninterrupted run's bit for bit.

Under DDP the average is of the module inside the wrapper. After each optimizer update
every rank holds the same parameters (DDP averaged the gradients, every rank stepped the
same optimizer), so every rank's average of the parameters is the same with no
collective. Buffers are the exception DDP makes: BatchNorm's running statistics follow
each rank's own batch between DDP's broadcasts, so each rank's average of them may differ,
as the model's own do. The evaluator and ``predict`` broadcast rank 0's buffers first and
checkpoints hold rank 0's, so what is evaluated, saved and resumed is rank 0's average.

Under FSDP the same holds (:mod:`unison.distributed.replicated`): each rank averages its
own buffers with no collective; the average's buffers take rank 0's values when it is
swapped in for an evaluation or a prediction, and before every sharded save, so
validation, the checkpoint, the test phase and ``unison export --ema`` hold one average.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
from ignite.engine import Engine
from torch import nn
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

from unison.distributed.fsdp import is_dtensor, is_sharded
from unison.distributed.model import unwrap_model
from unison.distributed.primitives import broadcast_tensors
from unison.engine.events import UpdateEvents

_Tensors = tuple[torch.Tensor, ...] | list[torch.Tensor]


def _ema_update(decay: float) -> Callable[[_Tensors, _Tensors], None]:
    """One EMA step: a fused ``lerp`` per device and floating dtype (``get_ema_multi_avg_fn``'s),
    a copy for the rest (integer buffers such as counters follow the model)."""
    lerp = get_ema_multi_avg_fn(decay)

    @torch.no_grad()
    def update(averaged: _Tensors, current: _Tensors) -> None:
        groups: dict[tuple[torch.device, torch.dtype], tuple[list[torch.Tensor], list[torch.Tensor]]] = {}
        for a, c in zip(averaged, current, strict=True):
            if a.is_floating_point() or a.is_complex():
                group = groups.setdefault((a.device, a.dtype), ([], []))
                group[0].append(a)
                group[1].append(c)
            else:
                a.copy_(c)
        for group_averaged, group_current in groups.values():
            lerp(group_averaged, group_current, 0)  # the step count is unused by the EMA

    return update


class EMA:
    """Keeps an exponential moving average of a model's parameters and buffers.

    At every ``every``-th optimizer update (``UpdateEvents.UPDATE_COMPLETED``: once per
    gradient-accumulation window, never per micro-batch) the average moves towards the
    weights: ``avg = decay * avg + (1 - decay) * weights``. The first of these steps, and
    every one during the first ``warmup`` updates, sets the average to the weights instead
    (``AveragedModel``'s start). Before the first update it is a copy of the weights given.

    Evaluate, checkpoint and predict with :attr:`module`, the averaged model (a copy of the
    model's class, in eval mode): ``create_evaluator(ema.module, metrics)``,
    ``predict(ema.module, dataset)``. Attached to the trainer, its state is saved and
    resumed by a :class:`~unison.handlers.Checkpoint` without being listed in ``to_save``
    (as ``handler:EMA``); ``state_dict()["weights"]`` is a plain ``state_dict`` of the
    model's class, loadable with ``model.load_state_dict``.

    Args:
        model: the model being trained (plain or DDP: the module inside is averaged).
        decay: the weight of the old average at each step, in (0, 1): 0.999 averages over
            roughly the last 1000 steps.
        every: average every this many optimizer updates.
        warmup: updates during which the average is a copy of the weights.

    Example:
        >>> import torch
        >>> from unison.engine import create_trainer
        >>> from unison.handlers import EMA
        >>> model = torch.nn.Linear(2, 1)
        >>> trainer = create_trainer(model, torch.optim.SGD(model.parameters(), lr=0.1),
        ...                          torch.nn.functional.mse_loss, accumulation_steps=2)
        >>> ema = EMA(model, decay=0.9)
        >>> ema.attach(trainer)
        >>> _ = trainer.run([(torch.ones(4, 2), torch.zeros(4, 1))] * 4)
        >>> ema.updates  # 4 micro-batches, 2 updates
        2

    Distributed:
        Build and attach it on every rank; its updates issue no collective. Under FSDP,
        evaluating :attr:`module` agrees the average's buffers first (rank 0's), as the
        evaluator and ``predict`` do on every rank together.
    """

    def __init__(self, model: nn.Module, decay: float = 0.999, *, every: int = 1, warmup: int = 0) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(f"EMA(model=...) needs an nn.Module, got {type(model).__name__}.")
        if isinstance(decay, bool) or not isinstance(decay, (int, float)) or not 0.0 < decay < 1.0:
            raise ValueError(f"EMA(decay={decay!r}): expected a number in (0, 1), such as 0.999.")
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise ValueError(
                f"EMA(every={every!r}): expected an int >= 1 (optimizer updates between averages)."
            )
        if isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < 0:
            raise ValueError(f"EMA(warmup={warmup!r}): expected an int >= 0 (updates that copy the weights).")
        self.model = unwrap_model(model)
        self.decay = float(decay)
        self.every = every
        self.warmup = warmup
        self._update = _ema_update(self.decay)
        self.shards: ShardedAverage | None = ShardedAverage(self.model) if is_sharded(self.model) else None
        """Under FSDP: the average of this rank's shards (a sharded model cannot be copied whole)."""
        self._view: AveragedView | None = None
        self.averaged: ShardedAverage | AveragedModel = (
            self.shards if self.shards is not None else AveragedModel(self.model, use_buffers=True)
        )
        if isinstance(self.averaged, AveragedModel):
            for p in self.averaged.parameters():
                p.requires_grad_(False)
            self.averaged.eval()
        self.updates = 0
        """Optimizer updates seen (saved and resumed)."""

    @property
    def module(self) -> nn.Module:
        """The averaged model: the model's class, with the averaged weights, in eval mode.

        Under FSDP, where the average is kept as shards (:class:`ShardedAverage`), an
        :class:`AveragedView`: the sharded model itself, with the average swapped into its
        shards while an evaluator or ``predict`` runs it.
        """
        if self.shards is not None:
            if self._view is None:
                self._view = AveragedView(self.model, self.shards)
            return self._view
        assert isinstance(self.averaged, AveragedModel)
        return self.averaged.module

    def __call__(self, engine: Engine | None = None) -> None:
        """Counts one optimizer update; averages (or copies, during warmup) on every ``every``-th."""
        self.updates += 1
        if self.updates % self.every:
            return
        if self.updates <= self.warmup:
            self.averaged.n_averaged.zero_()  # a copy, as when nothing is averaged yet
        self._step()

    @torch.no_grad()
    def _step(self) -> None:
        """What ``AveragedModel.update_parameters`` does, without copying its (CPU) counter to the
        model's device at every update: from pageable memory that copy waits for the GPU."""
        if self.shards is not None:
            averaged, current = self.shards.tensors, self.shards.current()
        else:
            averaged = list(itertools.chain(self.module.parameters(), self.module.buffers()))
            current = [t.detach() for t in itertools.chain(self.model.parameters(), self.model.buffers())]
        if int(self.averaged.n_averaged) == 0:  # the counter lives on the CPU: no device sync
            torch._foreach_copy_(averaged, current)
        else:
            self._update(averaged, current)
        self.averaged.n_averaged += 1

    def attach(self, engine: Engine, event: Any = UpdateEvents.UPDATE_COMPLETED) -> None:
        """Updates at ``event``: by default every optimizer update of a trainer from
        :func:`~unison.engine.create_trainer`. Attaching twice registers once.

        Raises:
            ValueError: ``engine`` does not fire ``UPDATE_COMPLETED`` (not a unison Engine).
        """
        if event == UpdateEvents.UPDATE_COMPLETED and UpdateEvents.UPDATE_COMPLETED not in getattr(
            engine, "_allowed_events", []
        ):
            raise ValueError(
                "EMA.attach(engine): this engine never fires UpdateEvents.UPDATE_COMPLETED; attach it to a "
                "trainer from unison.engine.create_trainer (or pass event=... explicitly)."
            )
        if not engine.has_event_handler(self, event):
            engine.add_event_handler(event, self)

    def state_dict(self) -> dict[str, Any]:
        """The averaged weights (the model's own keys), how many updates they average, the counter."""
        return {
            "weights": self.shards.state() if self.shards is not None else self.module.state_dict(),
            "n_averaged": int(self.averaged.n_averaged),
            "updates": self.updates,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restores what :meth:`state_dict` saved (onto the average's device).

        Raises:
            KeyError: ``state`` is not an EMA's state.
        """
        missing = {"weights", "n_averaged", "updates"} - set(state)
        if missing:
            raise KeyError(f"EMA.load_state_dict: the state has no {sorted(missing)}; is it an EMA's state?")
        if self.shards is not None:
            self.shards.load(state["weights"])
        else:
            self.module.load_state_dict(state["weights"])
        self.averaged.n_averaged.fill_(int(state["n_averaged"]))
        self.updates = int(state["updates"])


class ShardedAverage:
    """The average of a sharded (FSDP) model: a copy of this rank's shard of each parameter and of
    each buffer, updated with no collective. Saved as DTensors of the parameters' layout, so a
    checkpoint holds it sharded and resumes it at any world size."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.names = [n for n, _ in itertools.chain(model.named_parameters(), model.named_buffers())]
        self.tensors = [t.detach().clone() for t in self.current()]
        self.n_averaged = torch.zeros((), dtype=torch.long)

    def current(self) -> list[torch.Tensor]:
        """This rank's shards of the model's parameters, and its buffers."""
        return [_local(t).detach() for t in itertools.chain(self.model.parameters(), self.model.buffers())]

    def _live(self) -> list[torch.Tensor]:
        return list(itertools.chain(self.model.parameters(), self.model.buffers()))

    def state(self) -> dict[str, torch.Tensor]:
        """The averaged weights under the model's own keys, as DTensors where the model has them."""
        from torch.distributed.tensor import DTensor

        out: dict[str, torch.Tensor] = {}
        for name, live, mine in zip(self.names, self._live(), self.tensors, strict=True):
            if is_dtensor(live):
                out[name] = DTensor.from_local(
                    mine,
                    live.device_mesh,  # type: ignore[attr-defined]  # a DTensor (checked above)
                    live.placements,  # type: ignore[attr-defined]
                    shape=live.shape,
                    stride=live.stride(),
                )
            else:
                out[name] = mine
        return out

    def replicated(self) -> list[torch.Tensor]:
        """The average's tensors that every rank holds whole (its buffers), not shards."""
        return [mine for live, mine in zip(self._live(), self.tensors, strict=True) if not is_dtensor(live)]

    @contextlib.contextmanager
    def swapped(self) -> Iterator[None]:
        """Inside, the model's own shards hold the average; its trained weights come back on exit.

        Collective: enter on every rank together. The average's buffers (each rank's
        average of its own statistics) first take rank 0's values, which checkpoints also
        hold; then each rank swaps its own shards in.
        """
        broadcast_tensors(self.replicated())
        live = [_local(t) for t in self._live()]
        with torch.no_grad():
            trained = [t.clone() for t in live]
            torch._foreach_copy_(live, self.tensors)
        try:
            yield
        finally:
            with torch.no_grad():
                torch._foreach_copy_(live, trained)

    @torch.no_grad()
    def load(self, weights: Mapping[str, torch.Tensor]) -> None:
        """Loads averaged weights: sharded (DTensors, any world size) or whole (cut into this
        rank's shards; a collective then, as every rank loads together)."""
        from torch.distributed.tensor import distribute_tensor

        missing = sorted(set(self.names) - set(weights))
        if missing:
            raise KeyError(f"EMA.load_state_dict: the averaged weights lack {missing[:5]}")
        for name, live, mine in zip(self.names, self._live(), self.tensors, strict=True):
            value = weights[name]
            if is_dtensor(live) and not is_dtensor(value):
                value = distribute_tensor(value.to(live.device), live.device_mesh, live.placements)  # type: ignore[attr-defined]
            mine.copy_(_local(value))


class AveragedView(nn.Module):
    """A sharded model seen with its averaged weights: what :attr:`EMA.module` is under FSDP.

    Its forward is the model's; the evaluator and ``predict`` enter :meth:`swapped` (every
    rank together, before they gather the parameters), so the average is what they run.
    """

    def __init__(self, model: nn.Module, average: ShardedAverage) -> None:
        super().__init__()
        self.model = model
        self._average = average

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.model(*args, **kwargs)

    def swapped(self) -> contextlib.AbstractContextManager[None]:
        """The average in the model's shards while inside (see :meth:`ShardedAverage.swapped`)."""
        return self._average.swapped()


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if is_dtensor(tensor) else tensor  # type: ignore[attr-defined]
