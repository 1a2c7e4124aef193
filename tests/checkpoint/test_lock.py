"""unison/checkpoint/lock.py: one process per folder, refused with the holder named, never stale.

The holders here are other processes (a folder is held once per process), started by the
test and ended by their PID.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from _lock_workers import claim

from unison.checkpoint.lock import LOCK_FILE, FolderInUseError, FolderLock, hold_folder
from unison.testing import run_distributed

TIMEOUT_S = 60

HOLD = """\
import sys
from unison.checkpoint.lock import FolderLock
lock = FolderLock(sys.argv[1])
print("held", flush=True)
sys.stdin.readline()
"""

TRY = """\
import sys
from unison.checkpoint.lock import FolderInUseError, FolderLock
try:
    FolderLock(sys.argv[1]).release()
except FolderInUseError as err:
    print(err)
else:
    print("taken")
"""


def _try_elsewhere(folder: Path) -> str:
    """What another process is told when it claims ``folder``."""
    done = subprocess.run(
        [sys.executable, "-c", TRY, str(folder)], capture_output=True, text=True, timeout=TIMEOUT_S
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


@pytest.fixture
def holder(tmp_path: Path):
    """Another process that holds ``tmp_path/run`` until it is killed."""
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(tmp_path / "run")],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "held"
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=TIMEOUT_S)


@pytest.mark.timeout(TIMEOUT_S)
def test_a_second_process_is_refused_naming_the_holder(tmp_path: Path, holder: subprocess.Popen) -> None:
    folder = tmp_path / "run"
    with pytest.raises(FolderInUseError) as info:
        FolderLock(folder)
    message = str(info.value)
    assert f"PID {holder.pid} on host {socket.gethostname()}" in message
    assert str(folder) in message and f"kill {holder.pid}" in message
    assert json.loads((folder / LOCK_FILE).read_text())["pid"] == holder.pid


@pytest.mark.timeout(TIMEOUT_S)
def test_a_killed_holder_leaves_no_stale_lock(tmp_path: Path, holder: subprocess.Popen) -> None:
    folder = tmp_path / "run"
    with pytest.raises(FolderInUseError):
        FolderLock(folder)
    holder.kill()  # SIGKILL: no handler of its own runs
    holder.wait(timeout=TIMEOUT_S)
    with FolderLock(folder) as lock:
        assert lock.held
        assert json.loads((folder / LOCK_FILE).read_text())["pid"] == os.getpid()


@pytest.mark.timeout(2 * TIMEOUT_S)  # two processes, each under TIMEOUT_S
def test_claims_in_one_process_share_the_lock_until_the_last_ends(tmp_path: Path) -> None:
    first, second = FolderLock(tmp_path), FolderLock(tmp_path)
    first.release()
    assert f"PID {os.getpid()}" in _try_elsewhere(tmp_path)
    second.release()
    assert (tmp_path / LOCK_FILE).read_text() == ""  # nobody named while nobody holds it
    assert _try_elsewhere(tmp_path) == "taken"


@pytest.mark.timeout(TIMEOUT_S)
def test_a_claim_released_by_an_exception_frees_the_folder(tmp_path: Path) -> None:
    with pytest.raises(KeyError), FolderLock(tmp_path):
        raise KeyError("boom")
    assert _try_elsewhere(tmp_path) == "taken"


@pytest.mark.timeout(120)
def test_every_rank_is_refused_together(tmp_path: Path) -> None:
    with FolderLock(tmp_path):  # this process holds it: the job's rank 0 is another process
        told = run_distributed(claim, str(tmp_path), nproc=2, timeout=90)
    assert all(t.startswith("refused: ") and f"PID {os.getpid()}" in t for t in told), told
    assert run_distributed(claim, str(tmp_path), nproc=2, timeout=90) == ["held=True", "held=False"]


def test_one_process_alone_holds_on_rank_0(tmp_path: Path) -> None:
    claim_ = hold_folder(tmp_path / "made")
    assert claim_.held and (tmp_path / "made" / LOCK_FILE).is_file()
    claim_.release()


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_checkpoint_frees_its_folder_when_each_run_ends(tmp_path: Path) -> None:
    """The folder is held while a trainer runs and free after each run, the trainer kept alive; the
    claim made at construction serves the first run (no collective at STARTED, where a handler
    attached on one rank only must be named by the lockstep check, not hang)."""
    import torch
    from ignite.engine import Events
    from torch import nn

    from unison.engine import create_trainer
    from unison.handlers import Checkpoint

    model = nn.Linear(2, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    trainer = create_trainer(model, optimizer, nn.MSELoss())
    Checkpoint(tmp_path / "ckpt", {"model": model, "optimizer": optimizer}, trainer).attach()
    seen = []
    trainer.add_event_handler(Events.EPOCH_STARTED, lambda _: seen.append(_try_elsewhere(tmp_path / "ckpt")))
    data = [(torch.randn(4, 2), torch.randn(4, 1))] * 2
    for epochs in (1, 2):  # the second run continues the first: the folder is claimed again
        trainer.run(data, max_epochs=epochs)
        assert _try_elsewhere(tmp_path / "ckpt") == "taken", f"run to epoch {epochs}"
    assert len(seen) == 2 and all(f"PID {os.getpid()}" in told for told in seen), seen


def test_a_lock_file_linking_elsewhere_is_refused_and_its_target_not_truncated(tmp_path: Path) -> None:
    folder, victim = tmp_path / "run", tmp_path / "bashrc"
    folder.mkdir()
    victim.write_text("export PATH=/usr/bin\n")
    (folder / LOCK_FILE).symlink_to(victim)
    with pytest.raises(OSError, match="is a symbolic link"):
        FolderLock(folder)
    assert victim.read_text() == "export PATH=/usr/bin\n"
    (folder / LOCK_FILE).unlink()
    (folder / LOCK_FILE).symlink_to(tmp_path / "planted")  # dangling: nothing is made where it points
    with pytest.raises(OSError, match="is a symbolic link"):
        FolderLock(folder)
    assert not (tmp_path / "planted").exists()


@pytest.mark.parametrize("kind", ["other data", "hard link"])
def test_a_lock_file_unison_did_not_write_is_not_truncated(tmp_path: Path, kind: str) -> None:
    folder, victim = tmp_path / "run", tmp_path / "notes.txt"
    folder.mkdir()
    if kind == "hard link":
        victim.write_text(json.dumps({"pid": 1}))
        os.link(victim, folder / LOCK_FILE)
    else:
        victim = folder / LOCK_FILE
        victim.write_text("my notes, not a lock\n")
    before = victim.read_text()
    with pytest.raises(OSError, match="not a lock file unison wrote"):
        FolderLock(folder)
    assert victim.read_text() == before


def test_a_lock_file_unison_wrote_is_taken_again(tmp_path: Path) -> None:
    folder = tmp_path / "run"
    FolderLock(folder).release()  # leaves an empty lock file
    (folder / LOCK_FILE).write_text(json.dumps({"host": "h", "pid": 12, "started": 0.0}))  # a killed holder's
    with FolderLock(folder) as lock:
        assert lock.held and json.loads((folder / LOCK_FILE).read_text())["pid"] == os.getpid()


def _claim_while_the_collector_ends_another(tmp_path: Path, same: bool) -> tuple[bool, bool]:
    """Takes a claim while the garbage collector runs the finalizer of an unreleased claim in a cycle
    (on another folder, or on the same one); returns (the new claim holds, the folder is free after it)."""
    import gc

    from unison.checkpoint import lock

    first = tmp_path / "a"
    second = first if same else tmp_path / "b"
    left = FolderLock(first)
    left.cycle = left  # type: ignore[attr-defined]  # only the collector ends it
    del left
    taken = lock._take

    def take_while_collecting(folder: Path) -> int | None:
        gc.collect()  # as an allocation inside the claim may: the abandoned claim's finalizer runs here
        return taken(folder)

    lock._take = take_while_collecting  # type: ignore[assignment]
    gc.disable()
    try:
        claim = FolderLock(second)
    finally:
        gc.enable()
        lock._take = taken  # type: ignore[assignment]
    held = claim.held
    claim.release()
    gc.collect()
    return held, not lock._held


@pytest.mark.parametrize("same", [False, True], ids=["another folder", "the same folder"])
def test_a_claim_ended_by_the_collector_while_another_is_taken_does_not_hang(
    tmp_path: Path, same: bool
) -> None:
    import threading

    result: list[tuple[bool, bool]] = []
    worker = threading.Thread(
        target=lambda: result.append(_claim_while_the_collector_ends_another(tmp_path, same)), daemon=True
    )
    worker.start()
    worker.join(20)
    assert not worker.is_alive(), "taking a claim hung: the collector ended another claim inside it"
    assert result == [(True, True)]
