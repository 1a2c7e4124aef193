"""Training and evaluation steps, and the engines built around them."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal, cast

import torch
from ignite.engine import Engine as IgniteEngine
from ignite.engine import Events
from ignite.utils import convert_tensor
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.optim import Optimizer

from unison.distributed.batches import move_to_device
from unison.distributed.fsdp import global_value as _global
from unison.distributed.fsdp import is_sharded, no_gradient_sync
from unison.distributed.model import model_device
from unison.distributed.primitives import get_rank
from unison.engine.calls import resolve_model_call, whole_batch_with_y
from unison.engine.engine import DEFAULT_SYNC_EVERY, Engine
from unison.metrics.batch_loss import BatchLoss
from unison.metrics.epoch_average import EpochAverage
from unison.utils.seed import fork_rank_streams

AmpMode = Literal["bf16", "fp16"]
_AMP_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def prepare_batch(batch: Any, device: torch.device, non_blocking: bool = True) -> tuple[Any, Any]:
    """Splits a batch into ``(inputs, targets)`` and copies both to ``device``.

    Accepts a ``(x, y)`` pair (what a DataLoader over a ``TensorDataset`` yields) or a
    mapping with ``"x"``/``"y"`` or ``"input"``/``"target"`` keys. Nested lists, tuples and
    dicts of tensors are copied as well. Any other batch with a ``y`` field (a torch_geometric
    ``Batch``, a dataclass, a dict with a ``"y"`` key) is kept whole, as
    :class:`~unison.engine.WholeBatch` keeps it: the inputs are the whole batch on the device
    (pick the model's arguments with a :class:`~unison.engine.ModelCall`) and the target its
    ``y``. Copies are ``non_blocking``: with pinned memory a host-to-GPU copy overlaps with
    compute.
    """
    cls = batch.__class__
    if cls is tuple or cls is list:  # the common case first: no ABC check
        try:
            x, y = batch
        except ValueError:
            raise ValueError(
                f"prepare_batch got a {cls.__name__} of {len(batch)} items; expected an (inputs, targets) pair. "
                "Pass prepare_batch=your_function(batch, device, non_blocking) -> (x, y) for other layouts."
            ) from None
    elif isinstance(batch, Mapping):
        for xk, yk in (("x", "y"), ("input", "target"), ("inputs", "targets")):
            if xk in batch and yk in batch:
                x, y = batch[xk], batch[yk]
                break
        else:
            return whole_batch_with_y(batch, device, non_blocking)
    elif isinstance(batch, Sequence) and len(batch) == 2:
        x, y = batch
    elif isinstance(batch, (Sequence, torch.Tensor)):
        raise ValueError(
            f"prepare_batch got a {type(batch).__name__} batch; expected an (inputs, targets) pair. Pass "
            "prepare_batch=your_function(batch, device, non_blocking) -> (x, y) for other layouts."
        )
    else:
        return whole_batch_with_y(batch, device, non_blocking)
    # Plain tensors directly (one copy, or none when already there); anything else through
    # ignite's convert_tensor, which walks lists, tuples and dicts.
    if x.__class__ is torch.Tensor:
        if x.device != device:
            x = x.to(device, non_blocking=non_blocking)
    else:
        x = convert_tensor(x, device=device, non_blocking=non_blocking)
    if y.__class__ is torch.Tensor:
        if y.device != device:
            y = y.to(device, non_blocking=non_blocking)
    else:
        y = convert_tensor(y, device=device, non_blocking=non_blocking)
    return x, y


def check_device(model: nn.Module, device: torch.device | str | None, fn: str) -> torch.device:
    actual = model_device(model)
    if device is None:
        return actual
    wanted = torch.device(device)
    if wanted.type == "cuda" and wanted.index is None:
        wanted = torch.device("cuda", torch.cuda.current_device())
    if wanted != actual:
        raise ValueError(
            f"{fn}(device={str(device)!r}) but the model's parameters are on {actual}. Move the model first "
            "(unison.distributed.prepare_model(model) puts it on this rank's device), then build the "
            "optimizer and the engine; or leave device unset to use the model's device."
        )
    return wanted


def check_amp(amp: str | None, fn: str) -> torch.dtype | None:
    if amp is None or amp == "none":
        return None
    if amp not in _AMP_DTYPES:
        raise ValueError(f"{fn}(amp={amp!r}) is not a known mode; use 'bf16', 'fp16' or None.")
    return _AMP_DTYPES[amp]


def _position(engine: IgniteEngine) -> int:
    """The 1-based position of the current iteration in its epoch."""
    position = getattr(engine, "epoch_iteration", None)
    if position:
        return int(position)
    return (engine.state.iteration - 1) % (engine.state.epoch_length or 1) + 1  # a plain ignite Engine


class TrainStep:
    """One training iteration: forward, backward, and every ``accumulation_steps`` an update.

    Returned by :func:`create_trainer` as the engine's process function. It keeps the
    loss on the device: no ``.item()``, ``.cpu()`` or other host synchronisation happens
    in it (except inside ``GradScaler.step`` with fp16, which reads the overflow flag).

    Gradient accumulation splits an update over ``k`` consecutive iterations (micro-
    batches). DDP all-reduces gradients only on the last micro-batch of each window
    (``no_sync`` on the others). Windows restart at every epoch; when the epoch length
    is not a multiple of ``k``, the last, shorter window still ends with a synchronised
    update, and its loss is averaged over its own length.
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: Optimizer,
        loss_fn: Callable[[Any, Any], torch.Tensor],
        *,
        device: torch.device,
        amp_dtype: torch.dtype | None,
        scaler: torch.amp.GradScaler | None,
        accumulation_steps: int,
        clip_grad_norm: float | None,
        prepare_batch: Callable[[Any, torch.device, bool], tuple[Any, Any]],
        non_blocking: bool,
        model_call: Callable[[nn.Module, Any], Any] | None = None,
    ) -> None:
        self.model = model
        self.model_call = resolve_model_call(model_call, "TrainStep")
        """Calls the model on the inputs; None: ``model(x)``."""
        self._takes_batch = isinstance(loss_fn, BatchLoss)
        self._takes_trainer = self._takes_batch and cast(BatchLoss, loss_fn).with_trainer
        self._syncs_gradients = isinstance(model, DistributedDataParallel) or is_sharded(model)
        self.optimizer = optimizer
        self.loss_fn = loss_fn
        self.device = device
        self.amp_dtype = amp_dtype
        self.scaler = scaler
        self.accumulation_steps = accumulation_steps
        self.clip_grad_norm = clip_grad_norm
        self.prepare_batch = prepare_batch
        self.non_blocking = non_blocking
        self.grad_norm: torch.Tensor | None = None
        """Total gradient norm before clipping at the last update (a device tensor)."""
        self.loss_average: EpochAverage | None = None
        """Where each iteration's loss is added (``create_trainer(track_loss=True)``): in the step,
        not in a handler, which would cost a dozen Python calls per iteration."""
        self._engine: IgniteEngine | None = None
        self._on_update: Callable[[], None] | None = None

    def at_boundary(self, engine: IgniteEngine) -> bool:
        """Whether the last iteration closed an accumulation window (gradients are applied).

        Sync points and checkpoints inside an epoch wait for a boundary: between two, the
        accumulated gradients are per-rank state that a checkpoint would not hold.
        """
        if self.accumulation_steps == 1 or engine.state.iteration == 0:
            return True
        epoch_length = engine.state.epoch_length
        if epoch_length is None:
            return engine.state.iteration % self.accumulation_steps == 0
        position = _position(engine)  # 1-based, within the epoch
        return position % self.accumulation_steps == 0 or position == epoch_length

    def _forward_backward(self, x: Any, y: Any, window: int, engine: IgniteEngine) -> torch.Tensor:
        call = self.model_call
        extra = (engine,) if self._takes_trainer else ()  # BatchLoss(with_trainer=True): the trainer too
        if self.amp_dtype is not None:
            with torch.autocast(self.device.type, dtype=self.amp_dtype):
                loss = self.loss_fn(self.model(x) if call is None else call(self.model, x), y, *extra)
        else:
            loss = self.loss_fn(self.model(x) if call is None else call(self.model, x), y, *extra)
        scaled = loss / window if window > 1 else loss
        if self.scaler is not None:
            scaled = self.scaler.scale(scaled)
        scaled.backward()
        return loss

    def _window(self, engine: IgniteEngine) -> tuple[int, bool]:
        """(length of the current accumulation window, whether this iteration ends it)."""
        k = self.accumulation_steps
        if k == 1:
            return 1, True
        epoch_length = engine.state.epoch_length
        if epoch_length is None:
            raise ValueError(
                f"create_trainer(accumulation_steps={k}) needs a known epoch length to close the last "
                "window of an epoch; the data has no len(). Pass epoch_length to engine.run(...)."
            )
        position = _position(engine) - 1  # 0-based, within the epoch
        window_start = position - position % k
        length = min(k, epoch_length - window_start)
        return length, position - window_start == length - 1

    def _updated(self, engine: IgniteEngine) -> None:
        """Counts the update and fires ``UPDATE_COMPLETED`` (on engines that know the event)."""
        if engine is not self._engine:  # looked up once per engine, not per update
            self._engine = engine
            self._on_update = getattr(engine, "update_completed", None)
        if self._on_update is not None:
            self._on_update()

    def __call__(self, engine: IgniteEngine, batch: Any) -> torch.Tensor:
        window, is_last = (1, True) if self.accumulation_steps == 1 else self._window(engine)
        if self._takes_batch:  # the criterion reads the whole batch: it gets it on the device
            batch = move_to_device(batch, self.device, self.non_blocking)
            x, _ = self.prepare_batch(batch, self.device, self.non_blocking)
            y = batch
        else:
            x, y = self.prepare_batch(batch, self.device, self.non_blocking)
        if not is_last and self._syncs_gradients:
            with no_gradient_sync(self.model):  # DDP's no_sync, FSDP2's set_requires_gradient_sync
                loss = self._forward_backward(x, y, window, engine)
        else:
            loss = self._forward_backward(x, y, window, engine)
        if is_last:
            if self.clip_grad_norm is not None:
                if self.scaler is not None:
                    self.scaler.unscale_(self.optimizer)
                self.grad_norm = _global(
                    nn.utils.clip_grad_norm_(self.model.parameters(), self.clip_grad_norm).detach()
                )
            if self.scaler is not None:
                self.scaler.step(self.optimizer)
                self.scaler.update()
            else:
                self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
            self._updated(engine)
        loss = loss.detach()
        if self.loss_average is not None:
            self.loss_average.add(loss)
        return loss


def create_trainer(
    model: nn.Module,
    optimizer: Optimizer,
    loss_fn: Callable[[Any, Any], torch.Tensor],
    *,
    device: torch.device | str | None = None,
    amp: AmpMode | None = None,
    scaler: torch.amp.GradScaler | None = None,
    accumulation_steps: int = 1,
    clip_grad_norm: float | None = None,
    prepare_batch: Callable[[Any, torch.device, bool], tuple[Any, Any]] = prepare_batch,
    non_blocking: bool = True,
    track_loss: bool = True,
    sync_every: int | None = DEFAULT_SYNC_EVERY,
    model_call: Callable[[nn.Module, Any], Any] | None = None,
) -> Engine:
    """Builds a training :class:`~unison.engine.Engine` around a :class:`TrainStep`.

    Each iteration returns the batch's loss as a detached device tensor. The model is put
    in training mode at every epoch start (not every iteration). With ``track_loss`` the
    epoch's mean loss over all ranks is in ``engine.state.metrics["loss"]`` after the
    epoch's sync point.

    Args:
        model: the model, already on its device (see
            :func:`~unison.distributed.prepare_model`), plain or wrapped in DDP.
        optimizer: the optimizer over the model's parameters.
        loss_fn: ``loss_fn(y_pred, y) -> scalar tensor``, a mean over the batch; wrapped in
            :class:`~unison.metrics.BatchLoss`, called ``loss_fn(y_pred, batch)`` with the
            whole batch on the device instead (and ``loss_fn(y_pred, batch, trainer)`` with
            ``BatchLoss(..., with_trainer=True)``).
        device: where batches go; default, the model's device. Given, it must match it.
        amp: ``"bf16"`` or ``"fp16"`` autocast; None for full precision. fp16 uses a
            ``GradScaler`` (one is made unless ``scaler`` is given).
        scaler: a ``torch.amp.GradScaler`` for fp16.
        accumulation_steps: micro-batches per optimizer update, >= 1.
        clip_grad_norm: clip the total gradient norm to this value (after unscaling).
        prepare_batch: ``fn(batch, device, non_blocking) -> (x, y)``; see
            :func:`prepare_batch` and :class:`~unison.engine.WholeBatch`.
        non_blocking: copy batches to the device asynchronously.
        track_loss: keep the epoch's mean loss (one sum on the device per iteration).
        sync_every: iterations between the trainer's sync points inside an epoch (see
            :class:`~unison.engine.Engine`).
        model_call: ``fn(model, x) -> y_pred``, how the model is called on the inputs
            (a :class:`~unison.engine.ModelCall` picks fields of a batch); default ``model(x)``.

    Returns:
        The trainer. Its process function is the :class:`TrainStep`
        (``trainer.process_function``), which holds model, optimizer and scaler.

    Example:
        >>> import torch
        >>> from unison.engine import create_trainer
        >>> model = torch.nn.Linear(2, 1)
        >>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
        >>> trainer = create_trainer(model, opt, torch.nn.functional.mse_loss)
        >>> data = [(torch.ones(4, 2), torch.zeros(4, 1))] * 3
        >>> state = trainer.run(data, max_epochs=2)
        >>> state.iteration, "loss" in state.metrics
        (6, True)

    Distributed:
        Build it on every rank. With a DDP model, gradients are averaged across ranks at
        each update; nothing else in the step is a collective.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"create_trainer(model=...) needs an nn.Module, got {type(model).__name__}.")
    if not isinstance(optimizer, Optimizer):
        raise TypeError(
            f"create_trainer(optimizer=...) needs a torch.optim.Optimizer, got {type(optimizer).__name__}."
        )
    if not callable(loss_fn):
        raise TypeError(f"create_trainer(loss_fn=...) must be callable, got {type(loss_fn).__name__}.")
    if (
        isinstance(accumulation_steps, bool)
        or not isinstance(accumulation_steps, int)
        or accumulation_steps < 1
    ):
        raise ValueError(
            f"create_trainer(accumulation_steps={accumulation_steps!r}) must be an int >= 1 "
            "(1 means an optimizer update every iteration)."
        )
    if clip_grad_norm is not None and (
        isinstance(clip_grad_norm, bool)
        or not isinstance(clip_grad_norm, (int, float))
        or not clip_grad_norm > 0
    ):
        raise ValueError(
            f"create_trainer(clip_grad_norm={clip_grad_norm!r}) must be a positive number or None."
        )
    resolved = check_device(model, device, "create_trainer")
    amp_dtype = check_amp(amp, "create_trainer")
    if scaler is not None and amp != "fp16":
        raise ValueError(
            f"create_trainer(scaler=...) was given with amp={amp!r}; a GradScaler is only for amp='fp16' "
            "(bf16 has the range of fp32 and needs no loss scaling)."
        )
    if amp == "fp16" and scaler is None:
        scaler = torch.amp.GradScaler(resolved.type)

    step = TrainStep(
        model,
        optimizer,
        loss_fn,
        device=resolved,
        amp_dtype=amp_dtype,
        scaler=scaler,
        accumulation_steps=accumulation_steps,
        clip_grad_norm=clip_grad_norm,
        prepare_batch=prepare_batch,
        non_blocking=non_blocking,
        model_call=resolve_model_call(model_call, "create_trainer"),
    )
    trainer = Engine(step, sync_every=sync_every, name="trainer")

    def _train_mode(_: Engine) -> None:
        model.train()

    def _start_clean(_: Engine) -> None:
        optimizer.zero_grad(set_to_none=True)

    def _check_epoch_length(engine: Engine) -> None:
        if accumulation_steps > 1 and engine.state.epoch_length is None:
            raise ValueError(
                f"create_trainer(accumulation_steps={accumulation_steps}) needs a known epoch length to close "
                "the last accumulation window of an epoch, and the data has no len(). Pass epoch_length to "
                "trainer.run(...)."
            )

    def _rank_streams(engine: Engine) -> None:
        if engine.state.iteration == 0:  # a fresh run; a resumed one gets its streams back from the checkpoint
            fork_rank_streams(get_rank())

    trainer.add_event_handler(Events.STARTED, _check_epoch_length)
    trainer.add_event_handler(Events.STARTED, _rank_streams)
    trainer.add_event_handler(Events.EPOCH_STARTED, _train_mode)
    trainer.add_event_handler(Events.STARTED, _start_clean)
    if track_loss:
        step.loss_average = EpochAverage(name="loss")
        step.loss_average.attach(trainer, per_iteration=False)  # the step adds each loss
    return trainer
