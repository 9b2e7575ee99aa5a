"""`strata-serve`: the engine behind an OpenAI-compatible HTTP API (docs/commands.md, strata-serve).

The engine is loaded once; requests wait in a bounded queue and are generated one at a time on a worker thread
(runtime/serve_queue.py), through the same `Engine.generate` call as `strata-run`, so greedy output is the same. A
client that disconnects stops its generation at the next window. Every response carries its speculative stats
under `strata`. Exit 0 ok, 1 failure of the work, 2 bad usage or input, 130 Ctrl-C."""

from __future__ import annotations

import asyncio
import hmac
import ipaddress
import json
import logging
import signal
import socket
import sys
import time
import traceback
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import typer
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import JSONResponse, StreamingResponse

from runtime import openai_schema as S
from runtime.errors import EXIT_INTERRUPTED, EXIT_USAGE, exit_code, message
from runtime.version import __version__

log = logging.getLogger("strata.serve")

DEFAULT_MAX_QUEUE = 16
DEFAULT_MAX_REQUEST_BYTES = 4 << 20
COMPLETION_DEFAULT_MAX_TOKENS = 16        # OpenAI's default for /v1/completions; chat defaults to the context
OPEN_PATHS = ("/health",)                 # answered without the API key (load balancers, scripts waiting for it)


class ApiError(Exception):
    """An error response: HTTP status and one sentence for the client (OpenAI's error object)."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.code = status, message, type_, code


def sampling_defaults(folder: Path) -> dict[str, Any]:
    """What a request that leaves temperature/top_p/top_k out gets: the model's generation_config.json (its
    `do_sample: false` means greedy), else OpenAI's defaults (temperature 1, top_p 1)."""
    doc: dict[str, Any] = {}
    p = Path(folder) / "generation_config.json"
    if p.is_file():
        try:
            loaded = json.loads(p.read_text())
            doc = loaded if isinstance(loaded, dict) else {}
        except (OSError, json.JSONDecodeError, UnicodeDecodeError):
            doc = {}
    if doc.get("do_sample") is False:
        return {"temperature": 0.0, "top_p": 1.0, "top_k": 0}

    def num(key: str, default: float, cast: Callable[[Any], Any]) -> Any:
        try:
            return cast(doc.get(key, default) if doc.get(key) is not None else default)
        except (TypeError, ValueError):
            return default

    return {"temperature": num("temperature", 1.0, float), "top_p": num("top_p", 1.0, float),
            "top_k": num("top_k", 0, int)}


def _strata_stats(outcome) -> dict[str, Any]:
    st = outcome.stats
    gen, windows = int(st.get("generated_tokens", 0)), int(st.get("windows", 0))
    proposed, accepted = int(st.get("proposed", 0)), int(st.get("accepted", 0))
    return {"drafter": str(st.get("drafter", "none")), "device": str(st.get("device", "")), "windows": windows,
            "proposed": proposed, "accepted": accepted,
            "acceptance": (accepted / proposed) if proposed else None,
            "tokens_per_window": ((gen - 1) / windows) if windows else None,
            "prompt_tokens": int(st.get("prompt_tokens", 0)), "generated_tokens": gen,
            "prefill_s": float(st.get("prefill_s", 0.0)), "decode_s": float(st.get("decode_s", 0.0)),
            "decode_tok_s": float(st.get("decode_tok_s", 0.0)), "queue_s": float(outcome.queue_s),
            "stop_reason": str(st.get("stop_reason", outcome.finish_reason)),
            "fallbacks": [str(x) for x in st.get("fallbacks", ())]}


def request_log_line(method: str, path: str, status: int, seconds: float, outcome=None) -> str:
    """One line per request: the HTTP facts, then (for a generation) tokens, speed and acceptance."""
    line = f"{method} {path} {status} in {seconds:.2f} s"
    if outcome is not None and outcome.stats:
        s = _strata_stats(outcome)
        acc = f"{s['accepted']}/{s['proposed']}"
        if s["acceptance"] is not None:
            acc += f" ({100 * s['acceptance']:.0f}%)"
        tpw = f"{s['tokens_per_window']:.2f}" if s["tokens_per_window"] is not None else "-"
        line += (f" | prompt {s['prompt_tokens']} tok, generated {s['generated_tokens']} tok, "
                 f"{s['decode_tok_s']:.1f} tok/s, accepted {acc}, {tpw} tok/window, "
                 f"queued {s['queue_s']:.2f} s, {outcome.finish_reason}")
    elif outcome is not None:
        line += f" | {outcome.finish_reason} before generating"
    return line


class RequestGuard:
    """ASGI middleware in front of the API: the API key (401), a bounded request body (413), a disconnect watch
    the handlers read (`scope["strata.disconnected"]`), and the one log line per request."""

    def __init__(self, app, *, api_key: str | None, max_request_bytes: int, worker=None) -> None:
        self.app, self.api_key, self.max_bytes = app, api_key, max_request_bytes
        self.worker = worker      # the app's Worker, for whoever stops the server (StrataServer)

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        t0 = time.perf_counter()
        status = [0]

        async def send_status(message) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            await self._guarded(scope, receive, send_status)
        finally:
            log.info(request_log_line(scope.get("method", "?"), scope.get("path", "?"), status[0],
                                      time.perf_counter() - t0, scope.get("strata.outcome")))

    @staticmethod
    async def _reply(scope, receive, send, status: int, message: str, type_: str,
                     headers: dict | None = None) -> None:
        await JSONResponse(S.error_body(message, type_), status, headers=headers)(scope, receive, send)

    async def _guarded(self, scope, receive, send) -> None:
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        if self.api_key is not None and scope.get("path") not in OPEN_PATHS:
            given = headers.get("authorization", "")
            if not hmac.compare_digest(given.encode(), f"Bearer {self.api_key}".encode()):
                what = "no API key" if not given else "a wrong API key"
                await self._reply(scope, receive, send, 401, f"the request has {what}; send the header "
                                  f"'Authorization: Bearer KEY' with the key strata-serve was started with.",
                                  "authentication_error", {"WWW-Authenticate": "Bearer"})
                return
        too_big = (f"the request body is larger than {self.max_bytes} bytes (--max-request-bytes); send a "
                   f"shorter prompt.")
        try:
            declared = int(headers.get("content-length", "0"))
        except ValueError:
            declared = 0
        if declared > self.max_bytes:
            await self._reply(scope, receive, send, 413, too_big, "invalid_request_error")
            return
        body = bytearray()
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            body += message.get("body", b"")
            if len(body) > self.max_bytes:
                await self._reply(scope, receive, send, 413, too_big, "invalid_request_error")
                return
            if not message.get("more_body", False):
                break
        gone = asyncio.Event()
        scope["strata.disconnected"] = gone

        async def watch() -> None:
            while (await receive())["type"] != "http.disconnect":
                pass
            gone.set()

        watcher = asyncio.ensure_future(watch())
        delivered = False

        async def replay():
            nonlocal delivered
            if not delivered:
                delivered = True
                return {"type": "http.request", "body": bytes(body), "more_body": False}
            await gone.wait()
            return {"type": "http.disconnect"}

        try:
            await self.app(scope, replay, send)
        finally:
            watcher.cancel()


def create_app(engine: Any, *, model_name: str, api_key: str | None = None, max_queue: int = DEFAULT_MAX_QUEUE,
               max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES, debug: bool = False):
    """The ASGI app around one loaded engine (its worker thread starts and stops with the app's lifespan)."""
    from runtime.chat_template import ChatTemplate, ChatTemplateError, load_chat_template
    from runtime.sampling import SamplingParams
    from runtime.serve_queue import Job, QueueFullError, ShuttingDownError, Worker

    worker = Worker(engine, max_queue=max_queue)
    defaults = sampling_defaults(engine.target_dir)
    try:
        template: ChatTemplate | None = load_chat_template(engine.target_dir)
        template_problem: str | None = None
    except ChatTemplateError as e:       # a broken template: completions still work, chat says why not
        template, template_problem = None, str(e)
    created = S.now()
    vocab = int(engine.model.cfg.vocab_size)

    @asynccontextmanager
    async def lifespan(app) -> AsyncIterator[None]:
        worker.start()
        try:
            yield
        finally:
            await asyncio.to_thread(worker.stop)

    app = FastAPI(title="strata-serve", version=__version__, lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.worker = worker
    app.state.engine = engine
    app.state.model_name = model_name

    def error(status: int, message: str, type_: str = "invalid_request_error", code: str | None = None):
        return JSONResponse(S.error_body(message, type_, code), status)

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError):
        return error(exc.status, exc.message, exc.type, exc.code)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError):
        return error(400, validation_message(exc.errors()))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException):
        if exc.status_code == 404:
            msg = (f"there is no {request.url.path}; this server answers GET /v1/models, POST /v1/completions, "
                   f"POST /v1/chat/completions and GET /health.")
        elif exc.status_code == 405:
            msg = f"{request.method} is not allowed on {request.url.path}."
        else:
            msg = str(exc.detail)
        return error(exc.status_code, msg, "not_found_error" if exc.status_code == 404 else "invalid_request_error")

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception):
        log.error("unexpected error on %s: %s", request.url.path, "".join(traceback.format_exception(exc)))
        return error(500, f"internal error: {type(exc).__name__}: {exc}", "server_error")

    # ------------------------------------------------------------------------------------------------ helpers
    def sampling_for(req) -> SamplingParams:
        t = defaults["temperature"] if req.temperature is None else req.temperature
        p = defaults["top_p"] if req.top_p is None else req.top_p
        k = defaults["top_k"] if req.top_k is None else max(0, req.top_k)
        try:
            return SamplingParams(temperature=float(t), top_p=float(p), top_k=int(k), seed=req.seed)
        except ValueError as e:
            raise ApiError(400, str(e)) from e

    def budget(n_prompt: int, max_tokens: int | None, default: int | None) -> int:
        ctx = int(engine.context)
        if n_prompt == 0:
            raise ApiError(400, "the prompt is empty; send some text.")
        if max_tokens is None:
            if n_prompt >= ctx:
                raise ApiError(400, f"the prompt has {n_prompt} tokens and the context holds {ctx}; shorten the "
                                    f"prompt.", code="context_length_exceeded")
            return min(default, ctx - n_prompt) if default is not None else ctx - n_prompt
        if n_prompt + max_tokens > ctx:
            raise ApiError(400, f"the prompt has {n_prompt} tokens and max_tokens is {max_tokens}: together "
                                f"{n_prompt + max_tokens}, more than the context of {ctx} tokens; shorten the "
                                f"prompt or lower max_tokens.", code="context_length_exceeded")
        return max_tokens

    def generation_error(exc: Exception) -> ApiError:
        if debug:
            log.error("generation failed: %s", "".join(traceback.format_exception(exc)))
        if isinstance(exc, ValueError):
            return ApiError(400, str(exc))
        if isinstance(exc, MemoryError) or "OutOfMemory" in type(exc).__name__:
            return ApiError(500, "out of memory while generating; lower the context or max_tokens.", "server_error")
        return ApiError(500, f"generation failed: {type(exc).__name__}: {exc}", "server_error")

    def cancelled_error() -> ApiError:
        return ApiError(503, "the generation was cancelled: the server is shutting down.", "server_error")

    def submit(request: Request, req, ids: list[int], max_tokens: int) -> tuple[Job, asyncio.Queue]:
        loop = asyncio.get_running_loop()
        events: asyncio.Queue = asyncio.Queue()

        def sink(kind: str, value: Any) -> None:
            try:
                loop.call_soon_threadsafe(events.put_nowait, (kind, value))
            except RuntimeError:        # the loop is closed: the server stopped, nobody is listening
                pass

        gone = request.scope.get("strata.disconnected")
        job = Job(prompt_ids=ids, max_tokens=max_tokens, sampling=sampling_for(req), sink=sink, stop=req.stops,
                  client_gone=gone.is_set if gone is not None else (lambda: False))
        try:
            worker.submit(job)
        except QueueFullError as e:
            raise ApiError(503, str(e), "server_busy") from e
        except ShuttingDownError as e:
            raise ApiError(503, str(e), "server_error") from e
        return job, events

    async def outcome_of(request: Request, job: Job, events: asyncio.Queue):
        try:
            while True:
                kind, value = await events.get()
                if kind == "error":
                    raise generation_error(value)
                if kind == "done":
                    request.scope["strata.outcome"] = value
                    if value.finish_reason == "cancelled":
                        raise cancelled_error()
                    return value
        finally:
            job.cancelled.set()       # no-op once done; stops the engine if this handler was cancelled

    def dump(model) -> dict[str, Any]:
        d = model.model_dump(mode="json", exclude_none=True)
        for c in d.get("choices", []):
            c.setdefault("logprobs", None)
            c.setdefault("finish_reason", None)
        return d

    def sse(doc: dict[str, Any]) -> str:
        return f"data: {json.dumps(doc, ensure_ascii=False)}\n\n"

    def usage(n_prompt: int, outcome) -> S.Usage:
        n = int(outcome.stats.get("generated_tokens", 0))
        return S.Usage(prompt_tokens=n_prompt, completion_tokens=n, total_tokens=n_prompt + n)

    def streaming(request: Request, req, job: Job, events: asyncio.Queue, first: list[dict],
                  piece: Callable[[str], dict], final: Callable[[Any], dict], usage_doc: Callable[[Any], dict]):
        async def body() -> AsyncIterator[str]:
            try:
                for doc in first:
                    yield sse(doc)
                while True:
                    kind, value = await events.get()
                    if kind == "text":
                        yield sse(piece(value))
                        continue
                    if kind == "error":
                        e = generation_error(value)
                        yield sse(S.error_body(e.message, e.type))
                        break
                    request.scope["strata.outcome"] = value
                    if value.finish_reason == "cancelled":
                        e = cancelled_error()
                        yield sse(S.error_body(e.message, e.type))
                        break
                    yield sse(final(value))
                    if req.include_usage:
                        yield sse(usage_doc(value))
                    break
                yield "data: [DONE]\n\n"
            finally:
                job.cancelled.set()   # the client left mid-stream: the engine stops at its next window

        return StreamingResponse(body(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    # ------------------------------------------------------------------------------------------------ routes
    @app.get("/health")
    async def health():
        doc = {"status": "ok" if worker.alive else "stopped", "model": model_name, "running": worker.running,
               "waiting": worker.waiting, "max_queue": worker.max_queue}
        return JSONResponse(doc, 200 if worker.alive else 503)

    @app.get("/v1/models")
    async def models():
        return dump(S.ModelList(data=[S.ModelCard(id=model_name, created=created)]))

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str):
        if model_id != model_name:
            raise ApiError(404, f"there is no model {model_id!r} here; this server serves {model_name!r}.",
                           "not_found_error", "model_not_found")
        return dump(S.ModelCard(id=model_name, created=created))

    @app.post("/v1/completions")
    async def completions(req: S.CompletionRequest, request: Request):
        if isinstance(req.prompt, str):
            ids = await run_in_threadpool(engine.encode, req.prompt)
        else:
            ids = list(req.prompt)
            bad = [t for t in ids if not 0 <= t < vocab]
            if bad:
                raise ApiError(400, f"prompt token id {bad[0]} is outside the vocabulary (0..{vocab - 1}).")
        max_tokens = budget(len(ids), req.max_tokens, COMPLETION_DEFAULT_MAX_TOKENS)
        job, events = submit(request, req, ids, max_tokens)
        rid, ts = S.new_id("cmpl"), S.now()

        def doc(text: str, finish: str | None = None, outcome=None) -> dict:
            return dump(S.CompletionResponse(
                id=rid, created=ts, model=model_name, choices=[S.CompletionChoice(text=text, finish_reason=finish)],
                strata=S.StrataStats(**_strata_stats(outcome)) if outcome is not None else None))

        if req.stream:
            return streaming(request, req, job, events, [], piece=doc,
                             final=lambda o: doc("", o.finish_reason, o),
                             usage_doc=lambda o: dump(S.CompletionResponse(id=rid, created=ts, model=model_name,
                                                                           choices=[], usage=usage(len(ids), o))))
        outcome = await outcome_of(request, job, events)
        out = doc(outcome.text, outcome.finish_reason, outcome)
        out["usage"] = usage(len(ids), outcome).model_dump()
        return out

    @app.post("/v1/chat/completions")
    async def chat(req: S.ChatRequest, request: Request):
        if template is None:
            raise ApiError(400, template_problem or (
                f"the model {model_name!r} has no chat template (no chat_template in its tokenizer_config.json), "
                f"so it cannot chat; send plain text to /v1/completions instead."), code="no_chat_template")

        def render() -> list[int]:
            text = template.render([m.for_template() for m in req.messages], add_generation_prompt=True,
                                   **(req.chat_template_kwargs or {}))
            return template.encode(engine.tokenizer, text)

        try:
            ids = await run_in_threadpool(render)
        except ChatTemplateError as e:
            raise ApiError(400, str(e)) from e
        max_tokens = budget(len(ids), req.limit, None)
        job, events = submit(request, req, ids, max_tokens)
        rid, ts = S.new_id("chatcmpl"), S.now()

        def chunk(delta: S.ChatDelta, finish: str | None = None, outcome=None) -> dict:
            return dump(S.ChatChunk(id=rid, created=ts, model=model_name,
                                    choices=[S.ChatChunkChoice(delta=delta, finish_reason=finish)],
                                    strata=S.StrataStats(**_strata_stats(outcome)) if outcome is not None else None))

        if req.stream:
            return streaming(request, req, job, events, [chunk(S.ChatDelta(role="assistant", content=""))],
                             piece=lambda t: chunk(S.ChatDelta(content=t)),
                             final=lambda o: chunk(S.ChatDelta(), o.finish_reason, o),
                             usage_doc=lambda o: dump(S.ChatChunk(id=rid, created=ts, model=model_name, choices=[],
                                                                  usage=usage(len(ids), o))))
        outcome = await outcome_of(request, job, events)
        return dump(S.ChatResponse(
            id=rid, created=ts, model=model_name,
            choices=[S.ChatChoice(message=S.ChatMessageOut(content=outcome.text),
                                  finish_reason=outcome.finish_reason)],
            usage=usage(len(ids), outcome), strata=S.StrataStats(**_strata_stats(outcome))))

    return RequestGuard(app, api_key=api_key, max_request_bytes=max_request_bytes, worker=worker)


def validation_message(errors: list[dict[str, Any]]) -> str:
    """pydantic's first complaint as one sentence naming the field."""
    if not errors:
        return "the request is not valid."
    e = errors[0]
    if e.get("type") == "json_invalid":
        return "the request body is not valid JSON; send a JSON object."
    loc = [str(x) for x in e.get("loc", ()) if x != "body"]
    where = ".".join(loc)
    msg = str(e.get("msg", "not valid")).removeprefix("Value error, ")
    if e.get("type") == "missing":
        return f"{where or 'the request body'} is required."
    if e.get("type") in ("model_attributes_type", "dict_type") and not where:
        return "the request body must be a JSON object."
    return f"{where}: {msg}." if where else f"{msg}."


# ---------------------------------------------------------------------------------------------------- serving
class StrataServer:
    """uvicorn's server, stopping the engine's work first on Ctrl-C/SIGTERM so a long generation does not hold
    the shutdown (its client gets a 'shutting down' error), then joining the worker thread (the app's lifespan)."""

    def __init__(self, app, *, host: str, port: int, log_level: str = "info") -> None:
        import uvicorn

        outer = self

        class _Server(uvicorn.Server):
            def handle_exit(self, sig, frame) -> None:
                if outer.stopped_by is None:
                    outer.stopped_by = sig
                outer.cancel_work()
                super().handle_exit(sig, frame)

        # the first signal that stopped the server: uvicorn raises it again after its shutdown, but whether that
        # reaches the caller as KeyboardInterrupt races with asyncio's own SIGINT handling, so the exit code is
        # decided from this
        self.stopped_by: int | None = None
        self.app = app
        self.config = uvicorn.Config(app, host=host, port=port, log_level=log_level, access_log=False,
                                     timeout_graceful_shutdown=10, lifespan="on")
        self.server = _Server(self.config)

    def cancel_work(self) -> None:
        worker = getattr(self.app, "worker", None)
        if worker is not None:
            worker.cancel_all()

    def run(self, sockets: list[socket.socket] | None = None) -> None:
        self.server.run(sockets=sockets)

    @property
    def started(self) -> bool:
        return bool(self.server.started)

    def stop(self) -> None:
        """Stop from another thread (tests, embedding): as Ctrl-C does."""
        self.cancel_work()
        self.server.should_exit = True


def bind(host: str, port: int) -> socket.socket:
    """The listening socket, made here so a port in use is one sentence before the model loads (clients that
    connect while it loads wait in the backlog)."""
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    family, _, _, _, addr = infos[0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(addr)
        sock.listen(2048)
    except OSError:
        sock.close()
        raise
    sock.set_inheritable(True)
    return sock


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


# ---------------------------------------------------------------------------------------------------- the command
cli = typer.Typer(name="strata-serve", help="Serve a model set up by strata-setup over an OpenAI-compatible API.",
                  add_completion=False)


def _version(value: bool) -> None:
    if value:
        typer.echo(f"strata-serve {__version__}")
        raise typer.Exit()


def _fail(msg: str, code: int, debug: bool) -> None:
    if debug:
        traceback.print_exc()
    typer.echo(f"strata-serve: {msg}", err=True)
    raise typer.Exit(code)


@cli.command()
def serve(
    name: str = typer.Argument(None, metavar="NAME", help="A config strata-setup wrote, by name "
                               "($STRATA_HOME/configs/NAME.toml)."),
    config: str = typer.Option(None, "--config", help="strata-setup config (TOML path, or its name)."),
    host: str = typer.Option("127.0.0.1", "--host", help="Address to listen on (loopback unless you say so)."),
    port: int = typer.Option(8080, "--port", help="TCP port."),
    api_key: str = typer.Option(None, "--api-key", envvar="STRATA_API_KEY",
                                help="Require 'Authorization: Bearer KEY' on every request but /health."),
    max_queue: int = typer.Option(DEFAULT_MAX_QUEUE, "--max-queue", help="Requests that may wait behind the one "
                                  "being generated; more get 503."),
    max_request_bytes: int = typer.Option(DEFAULT_MAX_REQUEST_BYTES, "--max-request-bytes",
                                          help="Largest request body accepted (413 beyond)."),
    model_name: str = typer.Option(None, "--model-name", help="The model id clients see (default: the config's "
                                   "name)."),
    threads: int = typer.Option(None, "--threads", help="CPU threads for torch."),
    vram_limit_mib: int = typer.Option(None, "--vram-limit-mib", help="Cap the GPU memory the server may use, MiB "
                                       "(default: the config's)."),
    debug: bool = typer.Option(False, "--debug", help="Show tracebacks."),
    version: bool = typer.Option(False, "--version", callback=_version, is_eager=True, help="Print the version."),
) -> None:
    """Load the model once and answer /v1/completions, /v1/chat/completions, /v1/models and /health."""
    from runtime.paths import resolve_config

    if name and config:
        _fail("give the config either as NAME or as --config, not both.", 2, False)
    if not (name or config):
        _fail("which model? pass a config NAME (strata-setup wrote it) or --config PATH.", 2, False)
    if not 0 <= port <= 65535:
        _fail(f"--port must be between 0 and 65535, got {port}.", 2, False)
    if max_queue < 0:
        _fail(f"--max-queue must be >= 0, got {max_queue}.", 2, False)
    if max_request_bytes < 1024:
        _fail(f"--max-request-bytes must be at least 1024, got {max_request_bytes}.", 2, False)
    if threads is not None and threads < 1:
        _fail(f"--threads must be >= 1, got {threads}.", 2, False)
    if vram_limit_mib is not None and vram_limit_mib < 1:
        _fail(f"--vram-limit-mib must be a positive number of MiB, got {vram_limit_mib}.", 2, False)
    if api_key is not None and not api_key.strip():
        _fail("--api-key is empty; give a key or leave the option out.", 2, False)
    try:
        path = resolve_config(name or config)
    except ValueError as e:
        _fail(str(e), EXIT_USAGE, debug)
    try:
        sock = bind(host, port)
    except (OSError, UnicodeError) as e:
        _fail(f"cannot listen on {host}:{port} ({e.strerror or e}); pass another --port or --host.", EXIT_USAGE,
              debug)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S",
                        stream=sys.stderr)
    try:
        import torch

        from runtime.engine import Engine

        if threads is not None:
            torch.set_num_threads(threads)
        if vram_limit_mib is not None and not torch.cuda.is_available():
            sock.close()
            _fail("--vram-limit-mib caps GPU memory, but no CUDA GPU is usable here; drop the flag.", 2, False)
        typer.echo(f"strata-serve: loading {path} ...", err=True)
        engine = Engine.from_config(path, **({"vram_limit_mib": vram_limit_mib} if vram_limit_mib else {}))
        engine.compile_missing(lambda m: typer.echo(f"strata-serve: {m}", err=True))
        app = create_app(engine, model_name=model_name or path.stem, api_key=api_key, max_queue=max_queue,
                         max_request_bytes=max_request_bytes, debug=debug)
    except KeyboardInterrupt:
        sock.close()
        _fail("interrupted.", EXIT_INTERRUPTED, False)
    except Exception as e:  # one sentence and the code runtime/errors.py gives it; traceback only with --debug
        sock.close()
        code = exit_code(e)
        _fail(message(e) if code is not None else f"loading failed: {type(e).__name__}: {e}", code or 1, debug)
    shown = f"[{host}]" if ":" in host else host
    bound_port = sock.getsockname()[1]
    if not is_loopback(host) and api_key is None:
        typer.echo(f"strata-serve: warning: listening on {host} without --api-key; anyone who can reach this "
                   f"machine can use the model.", err=True)
    typer.echo(f"strata-serve: serving {model_name or path.stem} at http://{shown}:{bound_port}/v1 "
               f"({engine.drafter_kind} drafter on {engine.device_name}); Ctrl-C stops.", err=True)
    server = StrataServer(app, host=host, port=bound_port, log_level="warning")

    def terminated(sig, frame) -> None:
        raise _Terminated()

    # uvicorn shuts down cleanly on SIGTERM, then raises it again with this handler back in place
    previous = signal.signal(signal.SIGTERM, terminated)
    interrupted = False
    try:
        server.run(sockets=[sock])
    except KeyboardInterrupt:     # likewise for Ctrl-C
        interrupted = True
    except _Terminated:
        pass
    finally:
        signal.signal(signal.SIGTERM, previous)
    typer.echo("strata-serve: stopped.", err=True)
    if interrupted or server.stopped_by == signal.SIGINT:
        raise typer.Exit(EXIT_INTERRUPTED)


class _Terminated(Exception):
    """SIGTERM after uvicorn's clean shutdown: a normal stop (exit 0)."""


def main() -> None:
    cli()
