"""``scripts/run api``: uvicorn's command line, each API process on a listening socket of its own.

With ``--workers N`` uvicorn binds one socket in its supervisor and every process accepts from it: the first to wake
takes every connection waiting, so a few keep-alive clients that connect at once often all land on one process while
the others idle (2 cores, 4 clients: 64-68 req/s in such rounds against 94-104 when they spread; BENCHMARKS.md).
Here, on Linux, each process binds its own socket to the address with ``SO_REUSEPORT`` and the kernel spreads new
connections over the processes that listen. A process listens only once its app has started (its bundle loaded), and
a process the supervisor restarts binds its own again. The supervisor binds the address first, without listening:
a port in use fails at once, as with uvicorn's own socket, and port 0 is resolved once for every process. An API
process ends with its supervisor (SIGTERM on the supervisor's death): none outlives a killed API to answer beside
the next one.

Everything else is uvicorn's command line and supervisor as they are (``uvicorn.main.main``).
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import sys

import uvicorn.config
import uvicorn.main
from uvicorn.config import STARTUP_FAILURE

log = logging.getLogger("uvicorn.error")

_reserved: list[socket.socket] = []
"""The supervisor's own socket on the address: bound, never listening (so the kernel sends it no connection)."""


def reuse_port_socket(family: int, address: tuple) -> socket.socket:
    """A TCP socket bound to ``address`` with ``SO_REUSEPORT`` (and ``SO_REUSEADDR``), not yet listening."""
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind(address)
    return sock


def _die_with(supervisor: int) -> None:
    """In an API process: be sent SIGTERM when the supervisor ``supervisor`` dies (Linux's parent-death signal), and
    exit now if it already has. Processes that outlived a killed supervisor would otherwise go on answering on the
    port beside a new API's (their sockets, like its, allow the port to be shared)."""
    import ctypes

    pr_set_pdeathsig = 1
    ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGTERM, 0, 0, 0)
    if os.getppid() != supervisor:
        raise SystemExit("the API's supervisor is gone")


def process_socket(family: int, address: tuple, supervisor: int) -> socket.socket:
    """In an API process: its own socket on the address (``reuse_port_socket``), the process tied to its
    supervisor's life (``_die_with``)."""
    _die_with(supervisor)
    return reuse_port_socket(family, address)


class OwnSocket:
    """What uvicorn's supervisor hands each API process it starts: pickled into the process (``spawn``), it is
    unpickled there as a socket of its own on the address (``process_socket``), which uvicorn's server starts
    listening on once the app has started."""

    def __init__(self, family: int, address: tuple) -> None:
        self.family, self.address, self.supervisor = family, address, os.getpid()

    def __reduce__(self) -> tuple:
        return process_socket, (self.family, self.address, self.supervisor)


_uvicorn_bind_socket = uvicorn.config.Config.bind_socket


def bind_own_sockets(config: uvicorn.config.Config) -> socket.socket:
    """``Config.bind_socket`` for a TCP host and port: the address reserved here, an ``OwnSocket`` for the
    processes (uvicorn passes it to each as it would its one socket); a Unix socket or ``--fd``: uvicorn's own."""
    if config.uds is not None or config.fd is not None:
        return _uvicorn_bind_socket(config)
    family = socket.AF_INET6 if config.host and ":" in config.host else socket.AF_INET
    try:
        reserved = reuse_port_socket(family, (config.host, config.port))
    except OSError as exc:
        log.error(exc)
        sys.exit(STARTUP_FAILURE)
    _reserved.append(reserved)
    host, port = reserved.getsockname()[:2]
    log.info("Uvicorn running on %s://%s:%d, one listening socket per process (Press CTRL+C to quit)",
             "https" if config.is_ssl else "http", config.host, port)
    return OwnSocket(family, (host, port))  # type: ignore[return-value]


def main() -> None:
    if sys.platform.startswith("linux") and hasattr(socket, "SO_REUSEPORT"):
        uvicorn.config.Config.bind_socket = bind_own_sockets  # type: ignore[method-assign]
    uvicorn.main.main()


if __name__ == "__main__":
    main()
