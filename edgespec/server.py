"""`edgespec serve`: an OpenAI-compatible HTTP API over one engine, and a chat page.

FastAPI on uvicorn. The engine is synchronous and holds one KV cache, so requests are
served one at a time (an asyncio lock); each generation runs in a worker thread and
streams its records back through a queue. A client that disconnects cancels its
generation, or its place in the queue. Tokenizing runs in a thread too (a 1 MB prompt
takes about a second), so the event loop keeps answering meanwhile. Errors use OpenAI's
shape, {"error": {"message", "type", "param", "code"}}. Host, key and body checks are
edgespec.http_guard's; the request schema is edgespec.openai_schema's.

The KV cache is kept from one request to the next only when the new prompt begins with
the whole previous prompt (a chat's next turn): then neither `reused_tokens` nor the
prefill time can tell a client how much of someone else's prompt its own matches, only
whether it repeats that prompt entirely.
"""

from __future__ import annotations

import asyncio
import dataclasses
import errno
import json
import logging
import socket
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable
from importlib.resources import files
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse, JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.staticfiles import StaticFiles

from edgespec.engine import MODES, Engine, GenerationConfig
from edgespec.errors import EdgespecError
from edgespec.http_guard import MAX_BODY, Guard
from edgespec.openai_schema import (
    ChatRequest,
    CompletionRequest,
    NotUnicode,
    Sampling,
    UnsupportedError,
)
from edgespec.spec.logprobs import TokenLogprob
from edgespec.tokenizer import NO_TEMPLATE

log = logging.getLogger("edgespec.server")
WEB = Path(str(files("edgespec") / "web"))
PAGE_HEADERS = {  # the page loads nothing from anywhere else, and runs no inline script
    "Content-Security-Policy": "default-src 'self'; img-src 'self' data:; "
                               "frame-ancestors 'none'; base-uri 'none'; form-action 'none'",
    "X-Content-Type-Options": "nosniff", "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-store"}


# what a field of several types takes, for its 422 (pydantic names the types it tried)
ACCEPTED = {"prompt": "a string, a list of one string, or token ids (a list of ints)",
            "stop": "a string or a list of strings",
            "content": "a string or a list of text parts"}


def field_path(loc: tuple) -> tuple[str | None, bool]:
    """A validation error's place as the API spells it (`messages[0].content`), and whether
    pydantic tried a union there: its loc then goes on with the type it tried (`str`,
    `list[int]`), no field of the request."""
    path = ""
    for part in loc:
        if isinstance(part, int):
            path += f"[{part}]"
        elif part in ("str", "int", "float", "bool", "list", "dict") or "[" in str(part):
            return path or None, True
        else:
            path += f".{part}" if path else str(part)
    return path or None, False


class ApiError(Exception):
    def __init__(self, status: int, message: str, kind: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.kind, self.param, self.code = (
            status, message, kind, param, code)


COMPLETION_DEFAULT_TOKENS = 16  # /v1/completions without max_tokens, as OpenAI's
# a generation the engine's close() (serve's shutdown) cut short or never began
SHUTTING_DOWN = "the server is shutting down, so this answer was cut short; send it again later."


class _Gone(Exception):
    """The client left before its generation could start."""


def error_response(status: int, message: str, kind: str = "invalid_request_error",
                   param: str | None = None, code: str | None = None) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind, "param": param,
                                   "code": code}}, status_code=status)


class Turns:
    """One generation at a time, in arrival order; a request whose client leaves while
    it waits gives up its place instead of running for nobody."""

    def __init__(self):
        self.lock = asyncio.Lock()

    async def acquire(self, request: Request) -> None:
        waiter = asyncio.ensure_future(self.lock.acquire())
        try:
            while True:
                done, _ = await asyncio.wait({waiter}, timeout=0.25)
                if done:
                    return
                if await request.is_disconnected():
                    raise _Gone()
        except BaseException:  # gone, or cancelled (a stream's response task is)
            if not waiter.done():
                waiter.cancel()  # asyncio.Lock hands a turn granted meanwhile on
            elif not waiter.cancelled() and waiter.exception() is None:
                self.lock.release()  # it was granted just as we gave up
            raise

    def release(self) -> None:
        self.lock.release()


def _token_text(engine: Engine, token: int) -> tuple[str, list[int]]:
    raw = engine.tokenizer.token_bytes(token)
    return raw.decode("utf-8", errors="replace"), list(raw)


def chat_logprobs(engine: Engine, entries: list[TokenLogprob]) -> list[dict[str, Any]]:
    """OpenAI's chat format: token, logprob, bytes, and the top alternatives."""
    def one(token: int, logprob: float) -> dict[str, Any]:
        text, raw = _token_text(engine, token)
        return {"token": text, "logprob": logprob, "bytes": raw}

    return [{**one(e.token, e.logprob), "top_logprobs": [one(t, lp) for t, lp in e.top]}
            for e in entries]


def completion_logprobs(engine: Engine, entries: list[TokenLogprob],
                        offset: int) -> dict[str, Any]:
    """The legacy completions format: parallel lists, top alternatives as dicts."""
    tokens = [_token_text(engine, e.token)[0] for e in entries]
    offsets = []
    for t in tokens:
        offsets.append(offset)
        offset += len(t)
    return {"tokens": tokens, "token_logprobs": [e.logprob for e in entries],
            "top_logprobs": [{_token_text(engine, t)[0]: lp for t, lp in e.top}
                             for e in entries],
            "text_offset": offsets}


def create_app(engine: Engine, model_id: str, api_key: str | None = None,
               default_mode: str | None = None, allowed_hosts: tuple[str, ...] = (),
               max_body: int = MAX_BODY) -> Guard:
    """The ASGI app serving `engine` under the model name `model_id` (behind the Guard)."""
    app = FastAPI(title="edgespec", version="1", docs_url=None, redoc_url=None)
    turns = Turns()
    created = int(time.time())
    counts = {"served": 0, "cancelled": 0}
    previous_prompt: list[int] = []
    default_mode = default_mode or engine.default_mode
    if default_mode not in MODES:
        raise EdgespecError(f"unknown mode '{default_mode}'.")

    @app.exception_handler(ApiError)
    async def api_error(_: Request, e: ApiError) -> JSONResponse:
        return error_response(e.status, e.message, e.kind, e.param, e.code)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, e: RequestValidationError) -> JSONResponse:
        first = e.errors()[0]
        loc = tuple(first.get("loc", ()))
        where, union = field_path(loc[1:])
        if first.get("type") == "json_invalid":
            return error_response(400, "the request body is not valid JSON.")
        kind = request.headers.get("content-type", "").split(";")[0].strip().lower()
        json_kind = kind == "application/json" or kind.endswith("+json")
        if loc == ("body",) and not json_kind:  # FastAPI read no JSON at all
            return error_response(400, "the request body is read as JSON only with the "
                                  "header Content-Type: application/json; send it.")
        if loc == ("body",) and first.get("type") != "value_error":
            return error_response(400, "the request body must be a JSON object.")
        message = str(first.get("msg")).removeprefix("Value error, ")
        cause = (first.get("ctx") or {}).get("error")
        if isinstance(cause, NotUnicode):  # raised over the whole body, of one field
            return error_response(422, f"{cause}.", param=cause.where or None)
        if union:  # pydantic's message is the first alternative's: "a valid string"
            name = where.rsplit(".", 1)[-1].split("[")[0]
            message = f"must be {ACCEPTED.get(name, 'of another type')}."
        return error_response(422, f"{where}: {message}" if where else message, param=where)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, e: StarletteHTTPException) -> JSONResponse:
        return error_response(e.status_code, str(e.detail))

    @app.exception_handler(Exception)
    async def internal(_: Request, e: Exception) -> JSONResponse:
        log.exception("request failed")
        return error_response(500, f"internal error ({type(e).__name__}); see the server's "
                              "log.", kind="server_error")

    @app.api_route("/", methods=["GET", "HEAD"], include_in_schema=False)  # curl -I too
    async def page() -> FileResponse:
        return FileResponse(WEB / "index.html", headers=PAGE_HEADERS)

    app.mount("/static", StaticFiles(directory=WEB), name="static")

    @app.get("/health")
    async def health() -> dict[str, Any]:
        return {"status": "ok", "model": model_id, "device": engine.devices,
                "busy": turns.lock.locked(), "draft": engine.draft is not None,
                "default_mode": default_mode, "auth": api_key is not None,
                "chat": bool(engine.tokenizer.chat_template), **counts}

    card = {"id": model_id, "object": "model", "created": created, "owned_by": "edgespec"}

    def not_served(name: str) -> ApiError:
        return ApiError(404, f"model '{name}' is not served here; this server serves "
                        f"'{model_id}'.", param="model", code="model_not_found")

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [card]}

    @app.get("/v1/models/{name:path}")  # OpenAI's retrieve; an id may hold a slash
    async def model(name: str) -> dict[str, Any]:
        if name != model_id:
            raise not_served(name)
        return card

    def config_for(req: Sampling, prompt_tokens: int, param: str,
                   logprobs: int | None) -> GenerationConfig:
        room = engine.context_length - prompt_tokens
        if room < 1:
            raise ApiError(400, f"the prompt is {prompt_tokens} tokens and the model's "
                           f"context holds {engine.context_length}, which leaves no room for "
                           f"an answer; send at most {engine.context_length - 1}.",
                           param=param, code="context_length_exceeded")
        # OpenAI's legacy completions (and vLLM's) stop at 16 tokens unless told; a chat
        # answer runs to its end, or the context's
        default = room if isinstance(req, ChatRequest) else COMPLETION_DEFAULT_TOKENS
        wanted = req.max_completion_tokens or req.max_tokens or default
        config = GenerationConfig(
            max_new_tokens=min(wanted, room),
            temperature=1.0 if req.temperature is None else req.temperature,
            top_p=1.0 if req.top_p is None else req.top_p, top_k=max(req.top_k or 0, 0),
            seed=req.seed, stop=req.stops(),
            mode=req.mode or default_mode, logprobs=logprobs)
        try:
            config = engine.settings(config)
        except EdgespecError as e:
            raise ApiError(400, str(e), param="mode" if req.mode else None) from None
        return config

    async def tokenize(work: Callable[[], list[int]], param: str) -> list[int]:
        try:
            ids = await asyncio.to_thread(work)
        except EdgespecError as e:
            raise ApiError(400, str(e), param=param) from None
        if not ids:
            raise ApiError(400, "the prompt is empty after tokenization; give some text.",
                           param=param)
        return ids

    async def run(prompt_ids: list[int], config: GenerationConfig,
                  request: Request) -> AsyncIterator[Any]:
        """Records of one generation, produced in a worker thread, one at a time."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        done = object()

        def work() -> None:
            try:
                for record in engine.records(prompt_ids, config):
                    loop.call_soon_threadsafe(queue.put_nowait, record)
                    if record.finish_reason:
                        counts["served"] += 1
                        counts["cancelled"] += record.finish_reason == "cancelled"
            except BaseException as e:  # handed to the event loop, raised there
                loop.call_soon_threadsafe(queue.put_nowait, e)
            loop.call_soon_threadsafe(queue.put_nowait, done)

        try:
            await turns.acquire(request)
        except (_Gone, asyncio.CancelledError):
            counts["cancelled"] += 1
            raise
        try:
            if prompt_ids[:len(previous_prompt)] != previous_prompt:
                engine.reset()  # see the module docstring: no partial reuse across clients
            previous_prompt[:] = prompt_ids
            thread = threading.Thread(target=work, daemon=True)
            thread.start()
            checked = time.monotonic()
            try:
                while True:
                    try:
                        item = await asyncio.wait_for(queue.get(), timeout=0.25)
                    except asyncio.TimeoutError:
                        item = None
                    if time.monotonic() - checked > 0.25:
                        checked = time.monotonic()
                        if await request.is_disconnected():
                            engine.cancel()
                    if item is None:
                        continue
                    if item is done:
                        return
                    cut = not isinstance(item, BaseException) and \
                        item.finish_reason == "cancelled" and engine.closed
                    if cut:  # its text still goes out, then the stream is said to be cut
                        yield dataclasses.replace(item, finish_reason=None)
                    if cut or engine.closed and isinstance(item, EdgespecError):
                        raise ApiError(503, SHUTTING_DOWN, kind="server_error")
                    if isinstance(item, EdgespecError):
                        raise ApiError(400, str(item))
                    if isinstance(item, BaseException):
                        raise item
                    yield item
            finally:
                engine.cancel()  # no-op when finished; stops a stream whose client left
                await asyncio.to_thread(thread.join)
        finally:
            turns.release()

    async def respond(request: Request, req: ChatRequest | CompletionRequest,
                      prompt_ids: list[int], chat: bool):
        if chat:
            top = (req.top_logprobs or 0) if req.logprobs else None
        else:
            top = req.logprobs
        config = config_for(req, len(prompt_ids), "messages" if chat else "prompt", top)
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}"
        kind = "chat.completion" if chat else "text_completion"
        offset = [0]  # completions' text_offset runs on across chunks

        def usage(stats) -> dict[str, Any]:
            return {"prompt_tokens": len(prompt_ids), "completion_tokens": stats.new_tokens,
                    "total_tokens": len(prompt_ids) + stats.new_tokens}

        def logprobs_of(entries: list[TokenLogprob] | None, text: str) -> Any:
            if entries is None:
                return None
            if chat:
                return {"content": chat_logprobs(engine, entries), "refusal": None}
            out = completion_logprobs(engine, entries, offset[0])
            offset[0] += len(text)
            return out

        def choice(text: str | None, finish: str | None, delta: bool,
                   entries: list[TokenLogprob] | None = None) -> dict[str, Any]:
            finish = {"cancelled": "stop"}.get(finish, finish)
            lp = logprobs_of(entries, text or "")
            if not chat:
                return {"index": 0, "text": text or "", "logprobs": lp, "finish_reason": finish}
            body = {"role": "assistant", "content": text, "refusal": None} if not delta else (
                {"content": text} if text is not None else {})
            return {"index": 0, "delta" if delta else "message": body, "logprobs": lp,
                    "finish_reason": finish}

        if not req.stream:
            text, entries, record = [], [], None
            try:
                async for record in run(prompt_ids, config, request):
                    text.append(record.text)
                    entries += record.logprobs or []
            except _Gone:
                return Response(status_code=499)
            return {"id": rid, "object": kind, "created": int(time.time()), "model": model_id,
                    "choices": [choice("".join(text), record.finish_reason, False,
                                       entries if top is not None else None)],
                    "usage": usage(record.stats), "edgespec": record.stats.to_dict()}

        include_usage = bool(req.stream_options and req.stream_options.include_usage)

        async def events() -> AsyncIterator[str]:
            head = {"id": rid, "object": f"{kind}.chunk" if chat else kind,
                    "created": int(time.time()), "model": model_id}
            if include_usage:
                head["usage"] = None  # as OpenAI: null on every chunk but the last

            def chunk(payload: dict[str, Any]) -> str:
                return f"data: {json.dumps({**head, **payload})}\n\n"

            if chat:
                yield chunk({"choices": [{"index": 0, "delta": {"role": "assistant",
                                                                "content": ""},
                                          "logprobs": None, "finish_reason": None}]})
            try:
                async for record in run(prompt_ids, config, request):
                    if record.text or record.logprobs:
                        yield chunk({"choices": [choice(record.text, None, True,
                                                        record.logprobs)]})
                    if record.finish_reason:
                        yield chunk({"choices": [choice(None, record.finish_reason, True)],
                                     "edgespec": record.stats.to_dict()})
                        if include_usage:
                            yield chunk({"choices": [], "usage": usage(record.stats)})
            except _Gone:
                return
            except ApiError as e:
                yield f"data: {json.dumps({'error': {'message': e.message, 'type': e.kind}})}\n\n"
            except Exception as e:  # the stream has begun: report it in-band, then end it
                log.exception("generation failed")
                error = {"message": f"internal error ({type(e).__name__}); see the server's "
                                    "log.", "type": "server_error"}
                yield f"data: {json.dumps({'error': error})}\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-store"})

    def checked(req: ChatRequest | CompletionRequest) -> None:
        """The model asked for first (a 404 before anything about the request's content),
        then what this server cannot do."""
        if req.model != model_id:
            raise not_served(req.model)
        try:
            req.unsupported()
        except UnsupportedError as e:
            raise ApiError(400, str(e), param=e.param, code="unsupported") from None

    @app.post("/v1/chat/completions")
    async def chat_completions(req: ChatRequest, request: Request):
        checked(req)
        if not engine.tokenizer.chat_template:
            raise ApiError(400, f"{NO_TEMPLATE}; send it a plain prompt to continue at "
                           "/v1/completions instead.", param="messages")
        conversation = req.conversation()
        ids = await tokenize(lambda: engine.tokenizer.encode_chat(
            conversation, continue_final=req.continue_final_message), "messages")
        return await respond(request, req, ids, chat=True)

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, request: Request):
        checked(req)
        prompt = req.single_prompt()
        ids = await tokenize(lambda: engine.encode_ids(prompt), "prompt")
        return await respond(request, req, ids, chat=False)

    return Guard(app, api_key, allowed_hosts, max_body)


def listen(host: str, port: int) -> socket.socket:
    """The server's socket, bound before the model loads: a port in use or a host that is
    not this machine's is the user's error, said in one sentence before any work."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
    except socket.gaierror:
        raise EdgespecError(f"cannot listen on '{host}': it is no address or known host name; "
                            "use 127.0.0.1 (this machine only) or 0.0.0.0 (every "
                            "interface).") from None
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
    except OSError as e:
        sock.close()
        if e.errno == errno.EADDRINUSE:
            raise EdgespecError(f"port {port} on {host} is in use; choose another --port.") \
                from None
        raise EdgespecError(f"cannot listen on {host}:{port} ({e.strerror}); use an address "
                            "of this machine and a port above 1023.") from None
    return sock


def serve(engine: Engine, model_id: str, sock: socket.socket, api_key: str | None = None,
          allowed_hosts: tuple[str, ...] = ()) -> None:
    """Serve on `sock` (listen()) until interrupted."""
    import uvicorn

    app = create_app(engine, model_id, api_key, allowed_hosts=allowed_hosts)
    closing_server(engine, uvicorn.Config(app, log_level="info", server_header=False)).run(
        sockets=[sock])


def closing_server(engine: Engine, config: Any) -> Any:
    """A uvicorn server (for this `uvicorn.Config`) that closes `engine` when told to stop
    (Ctrl-C, SIGTERM): uvicorn waits for open connections to close, and a generation keeps
    its client's open to its end, minutes at a long max_tokens. Closed, the engine ends
    the running one after its current pass and refuses the queued ones."""
    import uvicorn

    class Server(uvicorn.Server):
        def handle_exit(self, sig: int, frame: Any) -> None:
            engine.close()
            super().handle_exit(sig, frame)

    return Server(config)
