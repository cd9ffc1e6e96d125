"""What every request to `edgespec serve` passes before a route sees it.

A plain ASGI middleware, not Starlette's BaseHTTPMiddleware: that one wraps `receive`
so a route never learns that its client went away (a non-streaming request then ran to
the end for nobody). In order, it checks:

- the Host header, against DNS rebinding: a web page on some other site whose name the
  attacker points at 127.0.0.1 reaches this server with its own name as the Host, so
  only IP literals, `localhost` and the names given with --allowed-host are answered;
- the API key, for everything but the chat page, its assets and /health (bytes compared
  in constant time, as the client sent them);
- the body size, counted on the bytes that actually arrive (a chunked body has no
  Content-Length to believe), before any of it is parsed.
"""

from __future__ import annotations

import ipaddress
import json
import secrets
from collections.abc import Awaitable, Callable, Iterable
from typing import Any

from edgespec.errors import EdgespecError

MAX_BODY = 1 << 20  # bytes; a small model's context holds far less text than this
PUBLIC = ("/", "/health", "/favicon.ico")
PUBLIC_PREFIXES = ("/static/",)

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]


def check_api_key(key: str | None) -> None:
    """A key that could never match, or matches nothing, is refused at start-up."""
    if key is None:
        return
    if not key:
        raise EdgespecError("the API key is empty (an unset variable?); give a key, or "
                            "leave --api-key out to serve without one.")
    if not all(0x21 <= ord(c) <= 0x7E for c in key):
        raise EdgespecError("the API key must be printable ASCII without spaces (HTTP "
                            "headers carry nothing else reliably); choose another key.")


def host_allowed(host: str | None, allowed: Iterable[str]) -> bool:
    """IP literals and localhost always; other names only when listed ("*": any)."""
    if host is None:  # HTTP/1.0 without a Host: not something a browser sends
        return True
    name = host.rsplit(":", 1)[0] if not host.endswith("]") else host
    name = name.strip("[]").lower().rstrip(".")
    allowed = {a.lower().rstrip(".") for a in allowed}
    if "*" in allowed or name in allowed or name == "localhost" or name.endswith(".localhost"):
        return True
    try:
        ipaddress.ip_address(name)
    except ValueError:
        return False
    return True


async def send_error(send: Send, status: int, message: str, kind: str,
                     code: str | None = None) -> None:
    body = json.dumps({"error": {"message": message, "type": kind, "param": None,
                                 "code": code}}).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


class Guard:
    """ASGI middleware: Host check, API key, body limit (see the module docstring)."""

    def __init__(self, app: Callable, api_key: str | None = None,
                 allowed_hosts: Iterable[str] = (), max_body: int = MAX_BODY):
        check_api_key(api_key)
        self.app = app
        self.expected = api_key.encode() if api_key else None
        self.allowed_hosts = tuple(allowed_hosts)
        self.max_body = max_body

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers: dict[bytes, bytes] = {}
        for name, value in scope["headers"]:
            headers.setdefault(name.lower(), value)
        host = headers.get(b"host")
        if not host_allowed(host.decode("latin-1") if host is not None else None,
                            self.allowed_hosts):
            return await send_error(send, 403, "this server does not answer to that Host "
                                    "name (a defence against DNS rebinding); start it with "
                                    "--allowed-host NAME to allow it.", "invalid_request_error",
                                    "host_not_allowed")
        path = scope["path"]
        if self.expected is not None and not (path in PUBLIC or path.startswith(PUBLIC_PREFIXES)):
            # "Bearer KEY": the scheme's name in any case (RFC 9110 11.1), then blanks
            scheme, given = (headers.get(b"authorization", b"").split(None, 1) + [b"", b""])[:2]
            if scheme.lower() != b"bearer" or \
                    not secrets.compare_digest(given.strip(), self.expected):
                return await send_error(send, 401, "invalid or missing API key (use an "
                                        "'Authorization: Bearer KEY' header).",
                                        "authentication_error", "invalid_api_key")
        length = headers.get(b"content-length", b"")
        too_big = (f"request body over {self.max_body} bytes; send a shorter prompt.",
                   "invalid_request_error", "body_too_large")
        if length.isdigit() and int(length) > self.max_body:
            return await send_error(send, 413, *too_big)
        if scope["method"] in ("GET", "HEAD", "OPTIONS"):
            return await self.app(scope, receive, send)
        body = bytearray()
        while True:  # read it all here, so that nothing parses a body that is too big
            message = await receive()
            if message["type"] == "http.disconnect":
                return None
            body += message.get("body", b"")
            if len(body) > self.max_body:
                return await send_error(send, 413, *too_big)
            if not message.get("more_body", False):
                break
        replayed = False

        async def replay() -> dict[str, Any]:
            """The body once, then the real channel (so disconnects are still seen)."""
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": bytes(body), "more_body": False}
            return await receive()

        return await self.app(scope, replay, send)
