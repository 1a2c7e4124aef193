"""A program forked from the warm interpreter (tests/_warm_exec.py) starts as a new interpreter would.

The truth is the same program run as a new interpreter: each test runs it both ways and compares
what the program saw (arguments, folder, environment, ``sys.path``, signals, session, umask,
streams) and how it ended (exit status, output).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import _warm_exec
import pytest

PROBE = textwrap.dedent(
    """
    import gc, json, os, signal, sys
    ignored = [int(s) for s in signal.valid_signals()
               if s not in (signal.SIGKILL, signal.SIGSTOP) and signal.getsignal(s) == signal.SIG_IGN]
    mask = os.umask(0)
    print(json.dumps({
        "warm": "torch" in sys.modules,
        "argv": sys.argv,
        "name": __name__,
        "cwd": os.getcwd(),
        "path0": sys.path[0],
        "extra_on_path": [p for p in sys.path if p.endswith("extra")],
        "var": os.environ.get("PROBE_VAR"),
        "sigint_raises": signal.getsignal(signal.SIGINT) is signal.default_int_handler,
        "ignored": ignored,
        "blocked": sorted(int(s) for s in signal.pthread_sigmask(signal.SIG_BLOCK, [])),
        "session_leader": os.getsid(0) == os.getpid(),
        "umask": mask,
        "stdin": sys.stdin.read(),
        "threads": len(os.listdir("/proc/self/task")),
        "random": __import__("random").random(),
        "frozen": gc.get_freeze_count(),
    }))
    print("to stderr", file=sys.stderr)
    sys.exit(int(sys.argv[-1]))
    """
)


def _run(cmd: list[str], *, cold: bool, **kwargs) -> subprocess.CompletedProcess:
    _warm_exec.set_cold(cold)
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=120, **kwargs)
    finally:
        _warm_exec.set_cold(False)


def _both(cmd: list[str], **kwargs) -> tuple[subprocess.CompletedProcess, subprocess.CompletedProcess]:
    return _run(cmd, cold=True, **kwargs), _run(cmd, cold=False, **kwargs)


@pytest.mark.parametrize("form", ["script", "module", "code"])
def test_a_warm_program_sees_what_a_new_interpreter_sees(tmp_path: Path, form: str) -> None:
    (tmp_path / "extra").mkdir()
    (tmp_path / "extra" / "probe_mod.py").write_text(PROBE)
    script = tmp_path / "probe.py"
    script.write_text(PROBE)
    work = tmp_path / "work"
    work.mkdir()
    head = {
        "script": [sys.executable, "-u", str(script)],
        "module": [sys.executable, "-m", "probe_mod"],
        "code": [sys.executable, "-c", PROBE],
    }[form]
    env = {**os.environ, "PROBE_VAR": "given", "PYTHONPATH": str(tmp_path / "extra"), "OMP_NUM_THREADS": "1"}
    cold, warm = _both(
        [*head, "an arg", "3"], env=env, cwd=work, input="from stdin", start_new_session=True, umask=0o027
    )
    assert cold.returncode == warm.returncode == 3, (cold.stderr, warm.stderr)
    assert cold.stderr == warm.stderr == "to stderr\n"
    seen_cold, seen_warm = json.loads(cold.stdout), json.loads(warm.stdout)
    assert (seen_cold.pop("warm"), seen_warm.pop("warm")) == (False, True), "the warm run was not a fork"
    assert seen_cold.pop("random") != seen_warm.pop("random")
    assert seen_warm == seen_cold
    assert seen_warm["umask"] == 0o027 and seen_warm["session_leader"] and seen_warm["threads"] == 1


def test_warm_programs_draw_their_own_random_numbers() -> None:
    code = "import random; print(random.random())"
    draws = {_run([sys.executable, "-c", code], cold=False).stdout for _ in range(3)}
    assert len(draws) == 3


@pytest.mark.parametrize(
    ("code", "status"),
    [
        ("raise KeyboardInterrupt", -signal.SIGINT),
        ("import sys; sys.exit('a message')", 1),
        ("def f():\n    raise ValueError('bad value')\nf()", 1),
        ("import os, signal; os.kill(os.getpid(), signal.SIGTERM)", -signal.SIGTERM),
        (
            "import threading, time\nt = threading.Thread(target=lambda: (time.sleep(0.2), print('joined')))\nt.start()",
            0,
        ),
        ("import atexit; atexit.register(print, 'at exit')", 0),
    ],
)
def test_a_warm_program_ends_as_a_new_interpreter_does(code: str, status: int) -> None:
    cold, warm = _both([sys.executable, "-c", code])
    assert cold.returncode == warm.returncode == status
    assert warm.stdout == cold.stdout
    # A traceback has the same last lines (the warm one has the server's frame above the program's).
    assert warm.stderr.splitlines()[-2:] == cold.stderr.splitlines()[-2:]


def test_a_console_script_runs_warm(tmp_path: Path) -> None:
    unison = Path(sys.executable).with_name("unison")
    cold, warm = _both([str(unison), "--help"], cwd=tmp_path)
    assert cold.returncode == warm.returncode == 0
    assert warm.stdout == cold.stdout and "usage: unison" in warm.stdout


def test_a_compile_cache_folder_torch_set_in_the_callers_environment_keeps_programs_warm(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # torch writes TORCHINDUCTOR_CACHE_DIR into os.environ the first time it asks for its cache
    # folder (importing torch_geometric does); a compile reads it then, never at import.
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    code = (
        "import sys; from torch._inductor.runtime.cache_dir_utils import cache_dir; "
        "print('torch' in sys.modules and 'unison' in sys.modules, cache_dir())"
    )
    cold, warm = _both([sys.executable, "-c", code])
    assert cold.stdout.split() == ["False", str(tmp_path / "inductor")], cold.stderr
    assert warm.stdout.split() == ["True", str(tmp_path / "inductor")], warm.stderr


def test_a_program_with_its_own_copy_of_a_loaded_package_gets_a_new_interpreter(tmp_path: Path) -> None:
    # A copy of the package under test (as tests/test_layers.py makes) must be the one imported.
    (tmp_path / "unison").mkdir()
    (tmp_path / "unison" / "__init__.py").write_text("WHICH = 'the copy'\n")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    code = "import sys, unison; print(unison.WHICH, 'torch' in sys.modules)"
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    result = _run([sys.executable, "-c", code], cold=False, env=env, cwd=elsewhere)
    assert result.stdout.split() == ["the", "copy", "False"], result.stderr


def test_a_warm_program_past_its_deadline_is_killed_and_reaped() -> None:
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    assert proc._warm is not None  # type: ignore[attr-defined]
    with pytest.raises(subprocess.TimeoutExpired):
        proc.wait(timeout=0.5)
    proc.kill()
    assert proc.wait(timeout=30) == -signal.SIGKILL
    assert not Path(f"/proc/{proc.pid}").exists()


def test_polling_a_warm_program_sees_it_run_then_end(tmp_path: Path) -> None:
    flag = tmp_path / "go"
    proc = subprocess.Popen(
        [sys.executable, "-c", f"import os, time\nwhile not os.path.exists({str(flag)!r}): time.sleep(0.01)"]
    )
    try:
        assert proc.poll() is None
        assert Path(f"/proc/{proc.pid}").exists()
        flag.touch()
        assert proc.wait(timeout=60) == 0
        assert proc.poll() == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


RANK_PROBE = textwrap.dedent(
    """
    import json, os, sys

    def ancestors():
        pid, chain = os.getpid(), []
        while pid > 1:
            with open(f"/proc/{pid}/stat") as stat:
                pid = int(stat.read().rsplit(")", 1)[1].split()[1])
            chain.append(pid)
        return chain

    out = sys.argv[1]
    with open(os.path.join(out, os.environ["RANK"] + ".json"), "w") as f:
        json.dump({
            "warm": "torch" in sys.modules,
            "ancestors": ancestors(),
            "env": {k: os.environ[k] for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "GROUP_RANK")},
            "session_leader": os.getsid(0) == os.getpid(),
        }, f)
    """
)


@pytest.mark.slow
def test_torchrun_s_ranks_start_warm_as_descendants_of_their_agent(tmp_path: Path) -> None:
    script = tmp_path / "rank.py"
    script.write_text(RANK_PROBE)
    seen = {}
    for cold in (True, False):
        out = tmp_path / ("cold" if cold else "warm")
        out.mkdir()
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
        _warm_exec.set_cold(cold)
        try:
            agent = subprocess.Popen([*cmd, str(script), str(out)], start_new_session=True)
            assert agent.wait(timeout=120) == 0
        finally:
            _warm_exec.set_cold(False)
        ranks = [json.loads((out / f"{rank}.json").read_text()) for rank in range(2)]
        for rank in ranks:
            assert agent.pid in rank["ancestors"], "a rank outside its agent's process tree"
            assert rank["session_leader"]  # torchrun starts each rank in a session of its own
        seen[cold] = ranks
    assert [r["warm"] for r in seen[True]] == [False, False]
    assert [r["warm"] for r in seen[False]] == [True, True]
    assert [r["env"] for r in seen[True]] == [r["env"] for r in seen[False]]
    # One parent per agent: what tests/multinode/test_two_node_torchrun.py tells agents apart by.
    assert seen[False][0]["ancestors"][0] == seen[False][1]["ancestors"][0]


def test_pass_fds_reach_a_warm_program_at_their_numbers() -> None:
    code = "import os, sys; fd = int(sys.argv[1]); os.write(fd, b'through %d' % fd); print(sorted(os.listdir('/proc/self/fd')))"
    outputs = []
    for cold in (True, False):
        read, write = os.pipe()
        try:
            result = _run([sys.executable, "-c", code, str(write)], cold=cold, pass_fds=(write,))
        finally:
            os.close(write)
        with os.fdopen(read, "rb") as pipe:
            outputs.append((pipe.read(), result.returncode))
        assert result.returncode == 0, result.stderr
    assert outputs[0] == outputs[1] and outputs[0][0].startswith(b"through ")


def test_devnull_streams_of_a_warm_program_are_closed_once(tmp_path: Path) -> None:
    for _ in range(2):  # a descriptor closed twice would fail the second start, or another file
        result = subprocess.run(
            [sys.executable, "-c", "import sys; print('out'); sys.exit(sys.stdin.read() == '')"],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            timeout=60,
        )
        assert result.returncode == 1
