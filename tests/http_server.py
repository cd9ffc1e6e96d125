"""Running an ASGI app on a real socket for a test (uvicorn in a thread)."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import uvicorn


def slowed(engine, seconds: float = 0.01):
    """`engine` with each target pass made `seconds` longer: the demo writes its whole
    context in a third of a second, a bigger model's pace leaves time to walk away."""
    forward = engine.target.forward

    def slow(*args, **kwargs):
        time.sleep(seconds)
        return forward(*args, **kwargs)

    engine.target.forward = slow
    return engine


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def running(app) -> Iterator[str]:
    """Serve `app` on 127.0.0.1 until the block ends; yields its base URL."""
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port,
                                           log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)
