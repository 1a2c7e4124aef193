"""Whole-program test processes forked from a warm interpreter, instead of new ones.

A test that runs ``python -m unison run ...``, ``unison tune ...``, ``python -m
torch.distributed.run ...`` or a script tests a user's process: its exit code, its signals, its
files, its output. Before it does anything, each such interpreter spent 2.5-3.5 CPU-seconds
importing torch, ``torch._dynamo``, ignite and unison; the suite started about 130 of them.

Here a server, started once per pytest process as a new interpreter, imports those modules and
nothing else (no torch operation, no thread), and forks one child per program. The child becomes
the program as a new interpreter would: the caller's standard streams, working folder,
environment, session or process group, umask, ``sys.argv`` and ``sys.path`` (``PYTHONPATH``
included); signal handlers and mask as Python sets them at start; ``random`` and numpy reseeded;
then the module (``-m``), the script (a console script such as ``unison`` too) or the ``-c`` code
runs as ``__main__``, and the interpreter ends as usual (threads joined, ``atexit``, exit status).

:class:`WarmPopen` replaces :class:`subprocess.Popen` in the test process only
(``conftest.py``). A program's own children (torchrun's ranks, a launcher's fork server) start as
they always do, as its children: a test that ends a process tree, as a lost node would, still
ends them all. It starts a new interpreter as before whenever the warm one could not honour the call: a command
that is not Python, Python options beyond ``-u``, ``-B``, ``-s`` and ``-X faulthandler``,
``preexec_fn``, ``close_fds=False``, another user or group, or an environment
that differs in a variable read at import (:data:`READ_AT_START`). A test marked
``cold_process`` (whose subject is the interpreter's own start: what it imports, how long it
takes) gets new interpreters throughout.

The caller waits through the server: it reaps its children and sends each one's wait status on
the connection that asked for it. ``pid``, signals, ``killpg`` and ``/proc`` behave as for any
process; only the parent differs (the server, not the caller), and ``/proc/PID/cmdline`` shows
the server's command line. With ``UNISON_WARM_TRACE=<folder>`` set, each pytest process writes
there one line per program it starts: warm, or why not.
"""

from __future__ import annotations

import contextlib
import os
import select
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
from typing import Any

PRELOAD = (
    "torch",
    "torch._dynamo",
    "ignite.engine",
    "ignite.distributed",
    "unison",
    "unison.cli",
    "unison.recipe",
)
"""What the server imports before it forks: what each of the suite's programs imports first."""

READ_AT_START = (
    "PYTHON",
    "TORCH_LOGS",
    "TORCHDYNAMO",
    "TORCHINDUCTOR",
    "TORCH_COMPILE",
    "TORCH_CPP",
    "TORCH_SHOW",
    "PYTORCH",
    "OMP_",
    "MKL_",
    "KMP_",
    "GOMP_",
    "LD_",
    "MALLOC_",
)
"""Prefixes of variables a program reads as it starts or imports (Python's own, torch's logging
and compiler settings, the OpenMP and allocator libraries'): a call whose value of one differs
from the server's gets a new interpreter. CUDA's variables are not among them: the server never
initialises CUDA, and CUDA reads them as it does. ``PYTHONPATH``, ``PYTHONUNBUFFERED``,
``PYTHONFAULTHANDLER`` and ``PYTHONDONTWRITEBYTECODE`` are applied in the child instead."""

_APPLIED = ("PYTHONPATH", "PYTHONUNBUFFERED", "PYTHONFAULTHANDLER", "PYTHONDONTWRITEBYTECODE")
_READ_WHEN_USED = ("TORCHINDUCTOR_CACHE_DIR",)
"""Under a prefix of :data:`READ_AT_START`, but read from ``os.environ`` each time a compile
needs it, never at import: the child's environment (the caller's) is what it sees. torch sets
``TORCHINDUCTOR_CACHE_DIR`` in a process's environment the first time it asks for the cache
folder (importing torch_geometric does), so without this the next program would start cold."""
_THREADS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")
"""Read by OpenMP and MKL as torch loads them; a child given one (the server being given none)
sets torch's thread count to it, as a new interpreter's torch would start with it."""
_STATUS = struct.Struct("!i")
_ORIGINAL_POPEN = subprocess.Popen


class _Client:
    """How this process reaches its server: started on the first warm call, ended with this process."""

    def __init__(self, env: dict[str, str]) -> None:
        self.env = env
        self.address: str | None = None
        self.server: subprocess.Popen | None = None
        self.cold = False

    def connect(self) -> socket.socket | None:
        if self.address is None:
            self._start()
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.connect(self.address)  # type: ignore[arg-type]
        except OSError:
            sock.close()
            return None
        return sock

    def _start(self) -> None:
        folder = tempfile.mkdtemp(prefix="unison-warm-")
        self.address = os.path.join(folder, "s")
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(self.address)
        listener.listen(64)
        # stdin is a pipe this process holds: the server exits when this process has.
        self.server = _ORIGINAL_POPEN(
            [sys.executable, __file__, str(listener.fileno())],
            env=self.env,
            stdin=subprocess.PIPE,
            pass_fds=(listener.fileno(),),
            start_new_session=True,
        )
        listener.close()
        _cleanup_at_exit(self, folder)


def _cleanup_at_exit(client: _Client, folder: str) -> None:
    import atexit

    def end() -> None:
        if client.server is not None and client.server.poll() is None:
            client.server.stdin.close()  # type: ignore[union-attr]
            try:
                client.server.wait(timeout=10)
            except subprocess.TimeoutExpired:
                client.server.kill()
        shutil.rmtree(folder, ignore_errors=True)

    atexit.register(end)


_client: _Client | None = None


def install(env: dict[str, str]) -> None:
    """Makes :class:`WarmPopen` this process's ``subprocess.Popen``; ``env`` is the server's environment."""
    global _client
    _client = _Client(dict(env))
    subprocess.Popen = WarmPopen  # type: ignore[misc]


def set_cold(cold: bool) -> None:
    """With ``True``, every call starts a new interpreter (a ``cold_process`` test)."""
    if _client is not None:
        _client.cold = cold


def _python_command(args: list[str], env: dict[str, str]) -> dict[str, Any] | None:
    """What to run for ``args`` in a warm child, or None when only a new interpreter can run it."""
    exe = args[0] if args else ""
    if not os.path.isabs(exe):
        exe = shutil.which(exe, path=env.get("PATH")) or exe
    request: dict[str, Any] = {"unbuffered": False, "faulthandler": False}
    if _same_file(exe, sys.executable):
        rest = list(args[1:])
        while rest and rest[0].startswith("-") and rest[0] not in ("-m", "-c", "-"):
            option = rest.pop(0)
            if option == "-u":
                request["unbuffered"] = True
            elif option in ("-B", "-s"):
                pass
            elif option == "-X" and rest and rest[0] == "faulthandler":
                rest.pop(0)
                request["faulthandler"] = True
            else:
                return None
        if not rest or rest[0] == "-":
            return None
        if rest[0] in ("-m", "-c"):
            if len(rest) < 2:
                return None
            kind = "module" if rest[0] == "-m" else "code"
            request.update(kind=kind, target=rest[1], argv=[rest[0], *rest[2:]])
        else:
            if not os.path.isfile(rest[0]):
                return None
            request.update(kind="path", target=rest[0], argv=list(rest))
        request["command"] = [exe, *args[1:]]
        return request
    if os.path.isfile(exe):
        try:
            with open(exe, "rb") as script:
                first = script.readline().strip()
        except OSError:
            return None
        if first.startswith(b"#!") and _same_file(first[2:].decode(errors="replace").strip(), sys.executable):
            request.update(kind="path", target=exe, argv=[args[0], *args[1:]], command=[exe, *args[1:]])
            return request
    return None


def _same_file(a: str, b: str) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False


def _env_misfit(env: dict[str, str], server_env: dict[str, str]) -> str | None:
    """The first variable of ``env`` a warm child could not honour, if any."""
    for key in sorted(set(env) | set(server_env)):
        if key in _APPLIED or key in _READ_WHEN_USED or env.get(key) == server_env.get(key):
            continue
        if key in _THREADS and key not in server_env and env[key].isdigit() and int(env[key]) > 0:
            continue
        if key.startswith("KMP_") and not _INTEL_OPENMP:
            continue  # read by Intel's and LLVM's OpenMP as they load; torch's wheel has GNU's
        if key.startswith(READ_AT_START):
            return key
    return None


def _maps_intel_openmp() -> bool:
    try:
        with open("/proc/self/maps") as maps:
            text = maps.read()
    except OSError:
        return True
    return "libiomp" in text or "/libomp" in text


_INTEL_OPENMP = _maps_intel_openmp()


def _trace(how: str, argv: list[str]) -> None:
    folder = os.environ.get("UNISON_WARM_TRACE")
    if folder:
        with open(os.path.join(folder, f"{os.getpid()}.txt"), "a") as out:
            out.write(f"{how} {' '.join(argv[:6])[:300]}\n")


class WarmPopen(subprocess.Popen):
    """``subprocess.Popen`` that runs a Python program as a fork of the warm server where it can."""

    _warm: socket.socket | None = None

    def _execute_child(  # type: ignore[override]
        self, args, executable, preexec_fn, close_fds, pass_fds, cwd, env, startupinfo, creationflags, shell,
        p2cread, p2cwrite, c2pread, c2pwrite, errread, errwrite, restore_signals, gid, gids, uid, umask,
        start_new_session, *more,
    ):  # fmt: skip
        everything = (args, executable, preexec_fn, close_fds, pass_fds, cwd, env, startupinfo, creationflags,
                      shell, p2cread, p2cwrite, c2pread, c2pwrite, errread, errwrite, restore_signals, gid, gids,
                      uid, umask, start_new_session, *more)  # fmt: skip
        process_group = more[0] if more else None
        call_env = {k: v for k, v in (os.environ if env is None else env).items()}
        call_env = {os.fsdecode(k): os.fsdecode(v) for k, v in call_env.items()}
        argv = [os.fsdecode(a) for a in ([args] if isinstance(args, (str, bytes, os.PathLike)) else args)]
        request, client = None, _client
        if client is None or client.cold:
            why = "cold_process"
        elif shell or preexec_fn is not None or not close_fds or gid is not None or gids or uid is not None:
            why = "Popen arguments"
        elif executable is not None and not _same_file(os.fsdecode(executable), argv[0]):
            why = "executable"
        else:
            why = _env_misfit(call_env, client.env) or ""
            request = None if why else _python_command(argv, call_env)
            why = why or ("" if request is not None else "not a Python program")
        sock = client.connect() if request is not None and client is not None else None
        _trace("warm" if sock is not None else f"cold ({why or 'no server'})", argv)
        if sock is None:
            return super()._execute_child(*everything)
        fds = [
            p2cread if p2cread != -1 else 0,
            c2pwrite if c2pwrite != -1 else 1,
            errwrite if errwrite != -1 else 2,
            *pass_fds,
        ]
        request.update(
            env=call_env,
            cwd=os.fsdecode(cwd) if cwd is not None else os.getcwd(),
            new_session=bool(start_new_session),
            process_group=process_group,
            umask=umask,
            pgid=os.getpgid(0),
            pass_fds=list(pass_fds),
        )
        from unison.testing.wire import receive, send

        try:
            send(sock, request, tuple(fds))
            (pid, error), _ = receive(sock)
        finally:
            self._close_pipe_fds(p2cread, p2cwrite, c2pread, c2pwrite, errread, errwrite)  # and DEVNULL's
        if error is not None:
            sock.close()
            raise error
        self.pid = pid
        self._child_created = True
        self._warm = sock

    def _try_wait(self, wait_flags):
        if self._warm is None:
            return super()._try_wait(wait_flags)
        self._warm.setblocking(not wait_flags & os.WNOHANG)
        data = b""
        try:
            while len(data) < _STATUS.size:
                chunk = self._warm.recv(_STATUS.size - len(data))
                if not chunk:
                    return (self.pid, 9)  # the server is gone: as if the child were killed
                data += chunk
                self._warm.setblocking(True)
        except BlockingIOError:
            return (0, 0)
        self._warm.close()
        return (self.pid, _STATUS.unpack(data)[0])

    def _internal_poll(self, _deadstate=None, *args, **kwargs):
        if self._warm is None:
            return super()._internal_poll(_deadstate, *args, **kwargs)
        if self.returncode is None:
            if not self._waitpid_lock.acquire(False):
                return None
            try:
                if self.returncode is None:
                    pid, sts = self._try_wait(os.WNOHANG)
                    if pid == self.pid:
                        self._handle_exitstatus(sts)
            except OSError:
                if _deadstate is not None:
                    self.returncode = _deadstate
            finally:
                self._waitpid_lock.release()
        return self.returncode


# ---- the server -----------------------------------------------------------------------------


def _serve(listener_fd: int, control_fd: int = 0) -> tuple[dict[str, Any], list[int]] | None:
    """Forks one child per request; returns, in a child, what it is to run (None: time to exit,
    which is when ``control_fd`` reads the end of its pipe)."""
    from unison.testing.wire import receive, send

    listener = socket.socket(fileno=listener_fd)
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_r, False)
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    waiting: dict[int, socket.socket] = {}
    while True:
        ready, _, _ = select.select([control_fd, listener, wake_r], [], [])
        if control_fd in ready and not os.read(control_fd, 4096):
            return None
        if wake_r in ready:
            while True:
                try:
                    if not os.read(wake_r, 4096):
                        break
                except BlockingIOError:
                    break
            while True:
                try:
                    pid, status = os.waitpid(-1, os.WNOHANG)
                except ChildProcessError:
                    break
                if pid == 0:
                    break
                conn = waiting.pop(pid, None)
                if conn is not None:
                    try:
                        conn.sendall(_STATUS.pack(status))
                    except OSError:
                        pass
                    conn.close()
        if listener in ready:
            conn, _ = listener.accept()
            try:
                request, fds = receive(conn)
            except (EOFError, OSError):
                conn.close()
                continue
            sys.stdout.flush()
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:
                signal.set_wakeup_fd(-1)
                signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                for held in (listener, *waiting.values()):
                    os.close(held.detach())
                os.close(wake_r)
                os.close(wake_w)
                if control_fd > 2:
                    os.close(control_fd)
                try:
                    _become(request, fds)
                except BaseException as error:  # noqa: BLE001 - reported to the caller, as exec's errors are
                    send(conn, (None, error))
                    os._exit(127)
                send(conn, (os.getpid(), None))
                os.close(conn.detach())
                return request, fds
            for fd in fds:
                os.close(fd)
            waiting[pid] = conn  # the child reports its start; this process, its end


def _become(request: dict[str, Any], fds: list[int]) -> None:
    """Turns this fork into the start of the program ``request`` names (before it runs)."""
    # The standard streams, then ``pass_fds`` at their numbers in the caller; out of the way first,
    # since a number received may be one of those wanted.
    import fcntl

    high = [fcntl.fcntl(fd, fcntl.F_DUPFD, 1024) for fd in fds]
    for fd in fds:
        os.close(fd)
    for target, fd in zip([0, 1, 2, *request["pass_fds"]], high, strict=True):
        os.dup2(fd, target)
    for fd in high:
        os.close(fd)
    if request["new_session"]:
        os.setsid()
    elif request["process_group"] is not None and request["process_group"] >= 0:
        os.setpgid(0, request["process_group"])
    else:
        with contextlib.suppress(OSError):  # the caller's group, where it is in this session
            os.setpgid(0, request["pgid"])
    if request["umask"] >= 0:
        os.umask(request["umask"])
    os.chdir(request["cwd"])
    env = request["env"]
    os.environ.clear()
    os.environ.update(env)
    for signum in signal.valid_signals():
        if signum in (signal.SIGKILL, signal.SIGSTOP):
            continue
        try:
            signal.signal(signum, signal.SIG_DFL)
        except (OSError, ValueError):
            pass
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGPIPE, signal.SIG_IGN)
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_SETMASK, [])


def _run(request: dict[str, Any]) -> None:
    """Runs the program as ``__main__``, as a new interpreter would."""
    import random
    import runpy
    import types

    if _launches_python(request):
        rank = _start_nest()
        if rank is not None:
            return _run(rank[0])
    env = request["env"]
    random.seed()
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed()
    tempfile.tempdir = None
    if request["unbuffered"] or env.get("PYTHONUNBUFFERED"):
        sys.stdout.reconfigure(write_through=True)  # type: ignore[union-attr]
        sys.stderr.reconfigure(write_through=True)  # type: ignore[union-attr]
    threads = [int(env[key]) for key in _THREADS if key in env and key not in _SERVER_ENV]
    if threads:
        import torch

        torch.set_num_threads(threads[0])
    if request["faulthandler"] or env.get("PYTHONFAULTHANDLER"):
        import faulthandler

        faulthandler.enable()
    sys.dont_write_bytecode = bool(env.get("PYTHONDONTWRITEBYTECODE"))
    served_path = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    base = [p for p in sys.path[1:] if p not in _SERVER_PYTHONPATH]
    kind, target = request["kind"], request["target"]
    first = {"module": os.getcwd(), "code": "", "path": os.path.dirname(os.path.realpath(target))}[kind]
    if _shadows_a_loaded_module([first, *served_path]):
        # The program would import its own copy of a module the server has loaded (a copy of the
        # package under test, say): only a new interpreter can run it as it is.
        os.execv(request["command"][0], request["command"])
    sys.path[:] = [first, *served_path, *base]
    sys.argv[:] = request["argv"]
    if kind == "module":
        runpy.run_module(target, run_name="__main__", alter_sys=True)
    elif kind == "path":
        runpy.run_path(target, run_name="__main__")
    else:
        if sys.version_info >= (3, 13):  # its tracebacks show the lines of -c code, as Python's own does
            import linecache

            linecache.cache["<string>"] = (len(target), None, target.splitlines(True), "<string>")
        main = types.ModuleType("__main__")
        main.__dict__["__builtins__"] = __builtins__
        sys.modules["__main__"] = main
        exec(compile(target, "<string>", "exec"), main.__dict__)


LAUNCHERS = ("torch.distributed.run", "torchrun")
"""Programs that start Python programs of their own with ``subprocess.Popen`` (torchrun's ranks)."""


def _launches_python(request: dict[str, Any]) -> bool:
    target = request["target"] if request["kind"] == "module" else os.path.basename(request["target"])
    # The launcher's server listens on an abstract socket: Linux's.
    return sys.platform.startswith("linux") and request["kind"] != "code" and target in LAUNCHERS


def _start_nest() -> tuple[dict[str, Any], list[int]] | None:
    """Forks, for a launcher, a server of its own in this pre-program state: its Python children
    fork from it, so they are its descendants (ends of its process tree, one parent per
    launcher) and start warm. Returns None in the launcher, and a child's request in the child."""
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    address = f"\0unison-warm-{os.getpid()}-{os.urandom(6).hex()}"
    listener.bind(address)
    listener.listen(64)
    control_r, control_w = os.pipe()
    if os.fork() == 0:
        os.close(control_w)
        os.setpgid(0, 0)  # the launcher's group signals are for it and its children, not for this
        for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2):
            signal.signal(signum, signal.SIG_IGN)
        child = _serve(listener.detach(), control_r)
        if child is None:
            os._exit(0)
        return child
    os.close(control_r)
    listener.close()
    _NEST_CONTROL.append(control_w)  # held open as long as the launcher runs
    global _client
    _client = _Client(_SERVER_ENV)
    _client.address = address
    subprocess.Popen = WarmPopen  # type: ignore[misc]
    handler = sys.modules.get(
        "torch.distributed.elastic.multiprocessing.subprocess_handler.subprocess_handler"
    )
    if handler is not None:
        handler.Popen = WarmPopen  # type: ignore[attr-defined]
    return None


_NEST_CONTROL: list[int] = []


def _shadows_a_loaded_module(entries: list[str]) -> bool:
    """Whether a folder of ``entries`` holds a top-level module other than the one loaded by that name."""
    for entry in entries:
        try:
            names = os.listdir(entry or ".")
        except OSError:
            continue
        for name in names:
            module = sys.modules.get(name.split(".")[0] if name.endswith((".py", ".so")) else name)
            where = getattr(module, "__file__", None)
            if module is None or where is None:
                continue
            loaded = os.path.dirname(where) if os.path.basename(where).startswith("__init__.") else where
            if os.path.realpath(os.path.join(entry or ".", name)) != os.path.realpath(loaded):
                return True
    return False


if __name__ == "__main__":
    import gc
    import importlib

    _SERVER_ENV = dict(os.environ)
    _SERVER_PYTHONPATH = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    for _name in PRELOAD:
        importlib.import_module(_name)
    gc.collect()  # nothing frozen: a new interpreter's collector sees every object, and so does a child's
    _child = _serve(int(sys.argv[1]))
    if _child is not None:
        _request, _fds = _child
        del _child, _fds, _name
        _run(_request)
