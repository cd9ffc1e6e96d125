"""`edgespec serve`: an OpenAI-compatible HTTP API over one engine.

FastAPI on uvicorn. The engine is synchronous and holds one KV cache, so requests are
served one at a time (an asyncio lock); each generation runs in a worker thread and
streams its records back through a queue. A client that disconnects cancels its
generation. Errors use OpenAI's shape, {"error": {"message", "type", "param", "code"}}.
"""

from __future__ import annotations

import asyncio
import json
import secrets
import threading
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any, Literal

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field
from starlette.exceptions import HTTPException as StarletteHTTPException

from edgespec.engine import MODES, Engine, GenerationConfig
from edgespec.errors import EdgespecError

MAX_BODY = 1 << 20  # bytes; prompts longer than this do not fit a small model's context


class ApiError(Exception):
    def __init__(self, status: int, message: str, kind: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.kind, self.param, self.code = (
            status, message, kind, param, code)


def error_response(status: int, message: str, kind: str = "invalid_request_error",
                   param: str | None = None, code: str | None = None) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind, "param": param,
                                   "code": code}}, status_code=status)


class Message(BaseModel):
    role: Literal["system", "user", "assistant"]
    content: str


class Sampling(BaseModel):
    model_config = ConfigDict(extra="ignore")  # OpenAI clients send fields we do not use

    model: str
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    stop: str | list[str] | None = None
    seed: int | None = None
    n: int = 1
    stream: bool = False
    mode: Literal["ar", "spec", "lookup"] | None = None  # extension: the decoding mode


class ChatRequest(Sampling):
    messages: list[Message] = Field(min_length=1)


class CompletionRequest(Sampling):
    prompt: str


def create_app(engine: Engine, model_id: str, api_key: str | None = None,
               default_mode: str = "spec") -> FastAPI:
    """The ASGI app serving `engine` under the model name `model_id`."""
    app = FastAPI(title="edgespec", version="1")
    lock = asyncio.Lock()
    created = int(time.time())
    counts = {"served": 0, "cancelled": 0}
    if default_mode == "spec" and engine.draft is None:
        default_mode = "ar"
    if default_mode not in MODES:
        raise EdgespecError(f"unknown mode '{default_mode}'.")

    @app.middleware("http")
    async def guard(request: Request, call_next):
        length = request.headers.get("content-length")
        if length and length.isdigit() and int(length) > MAX_BODY:
            return error_response(413, f"request body over {MAX_BODY} bytes.",
                                  code="body_too_large")
        if api_key and request.url.path.startswith("/v1/"):
            given = request.headers.get("authorization", "")
            if not secrets.compare_digest(given.encode(), f"Bearer {api_key}".encode()):
                return error_response(401, "invalid or missing API key (use an "
                                      "'Authorization: Bearer KEY' header).",
                                      kind="authentication_error", code="invalid_api_key")
        return await call_next(request)

    @app.exception_handler(ApiError)
    async def api_error(_: Request, e: ApiError) -> JSONResponse:
        return error_response(e.status, e.message, e.kind, e.param, e.code)

    @app.exception_handler(RequestValidationError)
    async def invalid(_: Request, e: RequestValidationError) -> JSONResponse:
        first = e.errors()[0]
        where = ".".join(str(x) for x in first.get("loc", ())[1:]) or None
        if first.get("type") == "json_invalid":
            return error_response(400, "the request body is not valid JSON.")
        if tuple(first.get("loc", ())) == ("body",):
            return error_response(400, "the request body must be a JSON object.")
        return error_response(422, f"{where or 'body'}: {first.get('msg')}", param=where)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, e: StarletteHTTPException) -> JSONResponse:
        return error_response(e.status_code, str(e.detail))

    @app.get("/health")
    async def health() -> dict[str, Any]:
        return {"status": "ok", "model": model_id, "device": engine.devices,
                "busy": lock.locked(), **counts}

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": model_id, "object": "model",
                                            "created": created, "owned_by": "edgespec"}]}

    def config_for(req: Sampling, prompt_tokens: int) -> GenerationConfig:
        if req.model != model_id:
            raise ApiError(404, f"model '{req.model}' is not served here; this server "
                           f"serves '{model_id}'.", param="model", code="model_not_found")
        if req.n != 1:
            raise ApiError(400, "only n=1 is supported.", param="n")
        room = engine.context_length - prompt_tokens
        if room < 1:
            raise ApiError(400, f"the prompt is {prompt_tokens} tokens but the model's "
                           f"context holds {engine.context_length}.", param="messages",
                           code="context_length_exceeded")
        wanted = req.max_completion_tokens or req.max_tokens or room
        stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
        return GenerationConfig(max_new_tokens=min(wanted, room),
                                temperature=req.temperature, top_p=req.top_p,
                                seed=req.seed, stop=stop, mode=req.mode or default_mode)

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

        async with lock:
            thread = threading.Thread(target=work, daemon=True)
            thread.start()
            checked = time.monotonic()
            try:
                while True:
                    try:
                        item = await asyncio.wait_for(queue.get(), timeout=0.5)
                    except asyncio.TimeoutError:
                        item = None
                    if time.monotonic() - checked > 0.5:
                        checked = time.monotonic()
                        if await request.is_disconnected():
                            engine.cancel()
                    if item is None:
                        continue
                    if item is done:
                        return
                    if isinstance(item, EdgespecError):
                        raise ApiError(400, str(item))
                    if isinstance(item, BaseException):
                        raise item
                    yield item
            finally:
                engine.cancel()  # no-op when finished; stops a stream whose client left
                await asyncio.to_thread(thread.join)

    async def respond(request: Request, req: Sampling, prompt_ids: list[int], chat: bool):
        config = config_for(req, len(prompt_ids))
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}"
        kind = "chat.completion" if chat else "text_completion"

        def usage(stats) -> dict[str, Any]:
            return {"prompt_tokens": len(prompt_ids), "completion_tokens": stats.new_tokens,
                    "total_tokens": len(prompt_ids) + stats.new_tokens}

        def choice(text: str | None, finish: str | None, delta: bool) -> dict[str, Any]:
            finish = {"cancelled": "stop"}.get(finish, finish)
            if not chat:
                return {"index": 0, "text": text or "", "logprobs": None,
                        "finish_reason": finish}
            body = {"role": "assistant", "content": text} if not delta else (
                {"content": text} if text is not None else {})
            return {"index": 0, "delta" if delta else "message": body, "finish_reason": finish}

        if not req.stream:
            text, record = [], None
            async for record in run(prompt_ids, config, request):
                text.append(record.text)
            return {"id": rid, "object": kind, "created": int(time.time()), "model": model_id,
                    "choices": [choice("".join(text), record.finish_reason, False)],
                    "usage": usage(record.stats), "edgespec": record.stats.to_dict()}

        async def events() -> AsyncIterator[str]:
            def chunk(payload: dict[str, Any]) -> str:
                return f"data: {json.dumps(payload)}\n\n"

            head = {"id": rid, "object": f"{kind}.chunk" if chat else kind,
                    "created": int(time.time()), "model": model_id}
            if chat:
                yield chunk({**head, "choices": [{"index": 0, "delta": {"role": "assistant"},
                                                  "finish_reason": None}]})
            try:
                async for record in run(prompt_ids, config, request):
                    if record.text:
                        yield chunk({**head, "choices": [choice(record.text, None, True)]})
                    if record.finish_reason:
                        yield chunk({**head, "choices": [choice(None, record.finish_reason,
                                                                True)],
                                     "usage": usage(record.stats),
                                     "edgespec": record.stats.to_dict()})
            except ApiError as e:
                yield chunk({"error": {"message": e.message, "type": e.kind}})
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    @app.post("/v1/chat/completions")
    async def chat_completions(req: ChatRequest, request: Request):
        try:
            ids = engine.tokenizer.encode_chat([m.model_dump() for m in req.messages])
        except EdgespecError as e:
            raise ApiError(400, str(e), param="messages") from None
        return await respond(request, req, ids, chat=True)

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, request: Request):
        ids = engine.tokenizer.encode(req.prompt)
        return await respond(request, req, ids, chat=False)

    return app


def serve(engine: Engine, model_id: str, host: str, port: int,
          api_key: str | None = None) -> None:
    import uvicorn

    uvicorn.run(create_app(engine, model_id, api_key), host=host, port=port,
                log_level="info")
