"""The durable writer: one checkpoint file at a time, recorded in the manifest, then rotation.

No engine and no ranks: it takes a state dict, a path and an :class:`Entry`, on the one
process that writes (rank 0). With ``async_save`` the state is first copied to CPU memory
(into buffers kept from save to save, :class:`~unison.checkpoint.snapshot.Snapshot`) and
written by a background thread, which first runs the save's ``check`` on the copy; at most
one write is in flight. The tensors a caller says only an optimizer's step changes are copied
by that thread while training goes on, and :meth:`CheckpointWriter.fence` (called before the
step) waits for their copy.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Literal

import torch

from unison.checkpoint.disk_full import CheckpointDiskFull as CheckpointDiskFull  # its home before
from unison.checkpoint.disk_full import disk_full_error, is_disk_full
from unison.checkpoint.entry import Entry, file_in
from unison.checkpoint.io import atomic_save
from unison.checkpoint.manifest import Manifest
from unison.checkpoint.retention import retain
from unison.checkpoint.sharded_files import remove
from unison.checkpoint.snapshot import Pending, Snapshot
from unison.utils.logging import get_logger

_log = get_logger(__name__)


class CheckpointWriter:
    """Writes checkpoints into the folder of ``manifest``, records them, and rotates.

    Each file is written atomically (temp file, fsync, rename, fsync the folder), then
    added to the manifest, which is written durably before rotation deletes anything.

    Args:
        manifest: the folder's manifest (rank 0's view).
        keep_last: how many of the newest checkpoints to keep; None keeps all.
        keep_best: how many of the best by score to keep as well.
        mode: ``"max"`` or ``"min"``: which scores are best.
        async_save: write in a background thread.
    """

    def __init__(
        self,
        manifest: Manifest,
        *,
        keep_last: int | None,
        keep_best: int = 0,
        mode: Literal["max", "min"] = "max",
        async_save: bool = False,
    ) -> None:
        self.manifest = manifest
        self.keep_last = keep_last
        self.keep_best = keep_best
        self.mode = mode
        self.async_save = async_save
        self.saved: list[Path] = []
        """Files written, in order."""
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self.snapshot = Snapshot()
        """The CPU buffers an asynchronous write copies the state into, kept between saves."""
        self._reserving: threading.Thread | None = None
        self._removing: threading.Thread | None = None
        self.overlap = True
        """Whether an asynchronous save may copy the tensors its caller names (``later``) while
        training goes on; False once one of them changed before its copy was taken."""
        self._later: tuple[Pending, threading.Event, Path] | None = (
            None  # a copy left for later, set once taken
        )

    @property
    def folder(self) -> Path:
        return self.manifest.folder

    @property
    def in_flight(self) -> bool:
        """Whether an asynchronous write has started and not been waited for."""
        return self._thread is not None

    def write(
        self,
        state: dict[str, Any],
        path: Path,
        entry: Entry,
        *,
        check: Callable[[dict[str, Any]], str | None] | None = None,
        later: Callable[[torch.Tensor], bool] | None = None,
    ) -> bool:
        """Writes ``state`` to ``path`` and records ``entry``; in the background with ``async_save``.

        Waits first for a write still in flight (re-raising its error). ``check`` runs on what
        is written (the copy, with ``async_save``) in a thread of its own while the file is
        written: a message it returns is logged as a warning, and the file is removed before it
        takes its name, unrecorded.

        Returns:
            Whether the file was written and recorded: always True for an asynchronous write
            (its thread decides later).

        ``later`` (with ``async_save``): the tensors it holds for are copied by the writer's thread,
        after this returns, while training goes on. The caller promises that they do not change
        until it calls :meth:`fence`, which waits for that copy (the step of the optimizer they
        belong to). A tensor that changed in place all the same is found by its version counter:
        that checkpoint is not written (a warning names the tensor), and later saves copy every
        tensor before they return (:attr:`overlap`).
        """
        self.wait()
        if not self.async_save:
            return self._write(state, path, entry, check)
        # The previous write has finished (wait() above): its buffers are free to reuse.
        if self._reserving is not None:
            self._reserving.join()
        if later is not None and self.overlap:
            copy, pending = self.snapshot.take_later(state, later)
        else:
            copy, pending = self.snapshot.take(state), None
        if pending:
            copied = self.copy_later(pending, path)
            self._thread = threading.Thread(
                target=self._copy_then_write,
                args=(copy, pending, copied, path, entry, check),
                name="unison-ckpt",
                daemon=False,
            )
        else:
            self._thread = threading.Thread(
                target=self._write, args=(copy, path, entry, check), name="unison-ckpt", daemon=False
            )
        self._thread.start()
        return True

    def fence(self) -> float:
        """Waits until the copy an asynchronous save left for later is taken (call it before the
        tensors it copies may change: an optimizer's step); the seconds waited.

        A tensor found changed here, which the writer's thread did not see, changed after that
        thread's check: a warning says the file may hold part of the change, and later saves copy
        every tensor before they return.
        """
        if self._later is None:
            return 0.0
        (pending, copied, path), self._later = self._later, None
        start = time.perf_counter()
        copied.wait()
        waited = time.perf_counter() - start
        moved = pending.changed()
        if moved and self.overlap:  # the writer's own check, just after its copy, saw nothing
            self.overlap = False
            _log.warning(
                "Checkpoint %s: %s changed in place after the save began, before the optimizer's next step. The "
                "copy was checked unchanged when it was taken, but a change still running then may be partly in "
                "the file. Change these tensors only in the optimizer's step; later saves copy every tensor "
                "before training goes on.",
                path,
                listed(moved),
            )
        return waited

    def reserve(self, state: Any) -> None:
        """Allocates the copy's buffers for a state shaped like ``state`` in a background thread
        (only its shapes are read there), so that the first asynchronous save only copies
        (:meth:`Snapshot.reserve <unison.checkpoint.snapshot.Snapshot.reserve>`); once. The next
        asynchronous write waits for it. Nothing when writes are synchronous."""
        if not self.async_save or self._reserving is not None:
            return
        shapes = _shapes(state)

        def run() -> None:
            try:
                self.snapshot.reserve(shapes)
            except (RuntimeError, MemoryError) as err:  # the first save allocates its copy itself
                self.snapshot.release()
                _log.warning("Could not reserve the CPU copy of an asynchronous checkpoint: %s", err)

        self._reserving = threading.Thread(target=run, name="unison-ckpt", daemon=True)
        self._reserving.start()

    def wait(self) -> None:
        """Blocks until an asynchronous write and the deletions of rotation have finished; re-raises
        the write's error."""
        thread, self._thread = self._thread, None
        if thread is not None:
            thread.join()
        self._later = None  # taken: the thread has ended
        self._removed()
        if self._error is not None:
            err, self._error = self._error, None
            raise RuntimeError(f"Writing a checkpoint to {self.folder} failed: {err}") from err

    def in_background(self, work: Any) -> None:
        """Runs ``work()`` in the writer's thread (a sharded save's finish): :meth:`wait` joins it and
        re-raises its error. Waits first for a write still in flight."""
        self.wait()

        def run() -> None:
            try:
                work()
            except BaseException as err:
                self._error = err

        self._thread = threading.Thread(target=run, name="unison-ckpt", daemon=False)
        self._thread.start()

    def record(self, entry: Entry, path: Path) -> None:
        """Records a checkpoint written elsewhere (a sharded folder, durable already), then rotates."""
        if threading.current_thread() is not self._thread:
            self.wait()
        entry.saved_at = time.time()
        self._record(entry)
        self.saved.append(path)
        _log.info("Saved sharded checkpoint %s", path)

    def _write(
        self,
        state: dict[str, Any],
        path: Path,
        entry: Entry,
        check: Callable[[dict[str, Any]], str | None] | None = None,
    ) -> bool:
        """Writes and records one file, ``check`` running on ``state`` while it is written; whether
        the file was kept (False: ``check`` refused it, and nothing took its name)."""
        try:
            if check is None:
                self._save(state, path)
            else:
                with ThreadPoolExecutor(1, thread_name_prefix="unison-ckpt-check") as pool:
                    verdict = pool.submit(check, state)
                    self._save(state, path, keep=lambda: verdict.result() is None)
                refusal = verdict.result()
                if refusal is not None:
                    _log.warning(refusal)
                    return False
            entry.saved_at = time.time()
            entry.size = path.stat().st_size
            self._record(entry)
            self.saved.append(path)
            _log.info("Saved checkpoint %s", path)
            return True
        except BaseException as err:
            self._error = err
            if threading.current_thread() is threading.main_thread():
                self._error = None
                raise
            return False

    def _copy_then_write(
        self,
        copy: dict[str, Any],
        pending: Pending,
        copied: threading.Event,
        path: Path,
        entry: Entry,
        check: Callable[[dict[str, Any]], str | None] | None,
    ) -> None:
        """The writer's thread of a save that left copies for later: takes them, then writes."""
        try:
            moved = self.take(pending, copied)
        except BaseException as err:
            self._error = err
            return
        if moved:
            _log.warning(not_saved_message(path, listed(moved)))
            return
        self._write(copy, path, entry, check)

    def copy_later(self, pending: Pending, path: Path) -> threading.Event:
        """Registers a copy an asynchronous save of ``path`` left for later, which its own thread
        takes (:meth:`take`): :meth:`fence` waits for the event returned."""
        copied = threading.Event()
        self._later = (pending, copied, path)
        return copied

    def take(self, pending: Pending, copied: threading.Event) -> list[str]:
        """In the writer's thread: takes the copy left for later, then sets ``copied`` (the
        optimizer's step may go on); the key paths of the tensors found changed in place since
        the save (that checkpoint must not be kept, and later saves copy every tensor at once)."""
        try:
            moved = pending.fill()
            if moved:  # set before the step may go on: its own check then knows this change was seen
                self.overlap = False
            return moved
        finally:
            copied.set()

    def _save(self, state: Mapping[str, Any], path: Path, keep: Callable[[], bool] | None = None) -> None:
        try:
            # a background write goes around the page cache whatever its size (training competes for the CPU)
            atomic_save(state, path, direct=True if self.async_save else None, keep=keep)
        except (OSError, RuntimeError) as err:
            if not is_disk_full(err):
                raise
            raise disk_full_error(path, state, self.manifest) from err

    def _record(self, entry: Entry) -> None:
        """Adds a durable file to the manifest, then rotates: nothing is deleted before the manifest is."""
        self.manifest.add(entry)
        plan = retain(
            self.manifest.entries, keep_last=self.keep_last, keep_best=self.keep_best, mode=self.mode
        )
        self.manifest.remove(set(plan.delete))
        self.manifest.write()  # durable before anything is deleted
        doomed = [file_in(self.folder, name, source=str(self.manifest.path)) for name in plan.delete]
        self._removed()  # one deletion at a time
        if doomed:  # deleting a large file takes the file system tens of milliseconds: not the trainer's
            self._removing = threading.Thread(
                target=_remove_all, args=(doomed,), name="unison-ckpt-rotate", daemon=False
            )
            self._removing.start()

    def _removed(self) -> None:
        """Waits for the deletions of the last rotation (the next write may need their space)."""
        thread, self._removing = self._removing, None
        if thread is not None:
            thread.join()


def listed(names: list[str]) -> str:
    """Up to three key paths, and how many more."""
    shown = ", ".join(names[:3])
    return shown + (f" and {len(names) - 3} more tensor(s)" if len(names) > 3 else "")


def not_saved_message(path: Path, changed: str) -> str:
    """The warning of a checkpoint not written because the tensors ``changed`` names changed in
    place while an asynchronous save copied them."""
    return (
        f"Not saving checkpoint {path}: {changed} changed in place while the asynchronous save copied it, between "
        "the save and the optimizer's next step, so the copy may hold a mix of before and after. The newest "
        "checkpoint stays the previous one. Change these tensors only in the optimizer's step; later saves copy "
        "every tensor before training goes on."
    )


def _remove_all(paths: list[Path]) -> None:
    """Deletes rotated checkpoints (files or sharded folders); one that cannot be is logged and left
    (the manifest no longer lists it)."""
    for path in paths:
        try:
            remove(path)
        except OSError as err:
            _log.warning(
                "Could not delete the rotated checkpoint %s (%s); it can be deleted by hand.", path, err
            )


def _shapes(state: Any) -> Any:
    """``state`` with each tensor replaced by an empty one of its shape, dtype and device (meta
    device for a CPU one): what :meth:`CheckpointWriter.reserve` reads in its thread."""
    if isinstance(state, torch.Tensor):
        device = "meta" if state.device.type == "cpu" else state.device
        return torch.empty((), dtype=state.dtype, device=device).expand(state.shape)
    if isinstance(state, Mapping):
        return {k: _shapes(v) for k, v in state.items()}
    if isinstance(state, (list, tuple)):
        items = [_shapes(v) for v in state]
        return items if isinstance(state, list) else tuple(items)
    return state
