"""Messages between :mod:`unison.testing.pool`, its warm process and the warm process's ranks:
a pickle with its length in front, over a Unix socket, and file descriptors passed with it."""

from __future__ import annotations

import array
import pickle
import socket
import struct
from typing import Any

_HEADER = struct.Struct("!Q")


def send(sock: socket.socket, message: Any, fds: tuple[int, ...] = ()) -> None:
    """Sends ``message`` (a pickle) and, with it, duplicates of the file descriptors ``fds``."""
    data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    header = _HEADER.pack(len(data))
    if fds:
        sock.sendmsg([header], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))])
    else:
        sock.sendall(header)
    sock.sendall(data)


def receive(sock: socket.socket) -> tuple[Any, list[int]]:
    """The next message and the file descriptors that came with it; EOFError when the peer is gone."""
    header, fds = b"", []
    while len(header) < _HEADER.size:
        chunk, ancillary, _, _ = sock.recvmsg(_HEADER.size - len(header), socket.CMSG_SPACE(8 * 4))
        if not chunk:
            raise EOFError("the other end of the pool's socket closed")
        header += chunk
        for level, kind, passed in ancillary:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                fds += array.array("i", passed[: len(passed) - len(passed) % 4]).tolist()
    (size,) = _HEADER.unpack(header)
    data = bytearray(size)
    view, got = memoryview(data), 0
    while got < size:
        n = sock.recv_into(view[got:])
        if not n:
            raise EOFError("the other end of the pool's socket closed")
        got += n
    return pickle.loads(data), fds
