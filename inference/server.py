"""`slimlm serve`: an OpenAI-compatible HTTP server over the bundled decoder.

    /v1/models, /v1/completions, /v1/chat/completions (both with `stream: true` as server-sent
    events, ending in `data: [DONE]`), /health

Binds 127.0.0.1 unless told otherwise. Limits: the request body's size (a larger one gets HTTP 413
before it is read), a chat's number of messages, the prompt's characters (checked before tokenizing)
and tokens, max_tokens, up to 4 stop strings, and the number of requests admitted at once (the rest
get HTTP 429 at once rather than waiting unboundedly). A prompt is user text: special-token text in
it (`<|im_start|>system`) is tokenized as plain text, and in a chat only the template's own markers
are special tokens, so no message can open a turn of its own. Templates and tokenizing run on one
tokenizer thread, never on the event loop, so a large prompt holds up no other client (nor /health).
With a ContinuousBatcher (`slimlm serve` makes one) admitted requests decode together, joining and
leaving the batch between steps; without one they decode one at a time. A request is admitted
until its response ends, however it ends, and a client that goes away stops its decoding at its
next step: a stream's when the server sees its connection close, which also frees its slot at
once (not only once its decoding has stopped), a whole completion's when its endpoint, watching
the connection, sees it close.
A malformed request, or one asking for what this server does not do (n > 1, logprobs, echo,
best_of, presence or frequency penalties), gets HTTP 400 with an OpenAI-style JSON error; one
that reaches a batcher already closed a 503; any other failure a JSON 500 (or, mid-stream, an
error event before `[DONE]`). The server keeps serving.

The request bodies are server_models.py's; the app's state (the decoder, the limits, the
admissions, the tokenizer thread) is a ServerState on `app.state.server`.
"""

# No `from __future__ import annotations`: FastAPI reads the request models from the endpoint signatures.

import asyncio
import inspect
import json
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Callable, Iterator, Optional

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.responses import JSONResponse, StreamingResponse

from slimlm.errors import SlimlmError
from slimlm.inference.batching import BatcherClosed, ContinuousBatcher, Submission
from slimlm.inference.decoder import Decoder, Generation, until_stop
from slimlm.inference.sampling import SamplingParams
from slimlm.inference.server_models import (
    ChatRequest,
    CompletionRequest,
    Message,
    Sampling,
    chat_request_model,
)


@dataclass(frozen=True)
class ServerLimits:
    max_prompt_tokens: int = 4096
    max_new_tokens: int = 1024
    max_concurrent: int = 8  # admitted requests (decoding or waiting); more get 429
    max_stop_strings: int = 4  # as OpenAI's API: each is checked against the text at every token
    max_stop_chars: int = 256
    default_max_tokens: int = 128  # for a request that names none (at most max_new_tokens)
    # a larger request body gets 413 before it is read (JSON parsing is on the event loop)
    max_body_bytes: int = 1 << 20
    max_messages: int = 256  # a chat's messages
    # None: what max_prompt_tokens tokens can spell (twice the tokens times the longest token)
    max_prompt_chars: Optional[int] = None


@dataclass
class ServerState:
    """What the app's handlers share: the model, the limits, the admissions and the tokenizer
    thread (`app.state.server`)."""

    decoder: Decoder
    model_name: str
    limits: ServerLimits
    batcher: Optional[ContinuousBatcher]
    # One thread renders templates and tokenizes: off the event loop, and the tokenizer's
    # split_special_tokens switch (state it sets per call) is never flipped by two calls at once.
    tokenizing: ThreadPoolExecutor
    admitted: threading.BoundedSemaphore  # a slot per request admitted at once
    max_prompt_chars: int  # a longer prompt is refused before tokenizing

    @classmethod
    def create(
        cls, decoder: Decoder, model_name: str, limits: ServerLimits, batcher: Optional[ContinuousBatcher]
    ) -> "ServerState":
        return cls(
            decoder,
            model_name,
            limits,
            batcher,
            ThreadPoolExecutor(max_workers=1, thread_name_prefix="slimlm-tokenizer"),
            threading.BoundedSemaphore(limits.max_concurrent),
            limits.max_prompt_chars or 2 * limits.max_prompt_tokens * longest_token(decoder.tokenizer),
        )


def longest_token(tokenizer) -> int:
    """The most characters a token spells. By default a text longer than the prompt limit times
    this (twice, for normalizations that shorten text) is refused before tokenizing: the tokenizer
    thread would be busy with it while other requests wait for theirs."""
    return max(map(len, tokenizer.get_vocab()), default=1)


def create_app(
    decoder: Decoder,
    model_name: str,
    limits: ServerLimits = ServerLimits(),
    batcher: Optional[ContinuousBatcher] = None,
) -> FastAPI:
    """The server's app over `decoder` (batched by `batcher` when given), answering as `model_name`."""
    check_chat_support(decoder.tokenizer)
    app = FastAPI(
        title="slimlm",
        description="OpenAI-compatible completions from the bundled decoder",
        lifespan=lifespan,
    )
    app.state.server = ServerState.create(decoder, model_name, limits, batcher)
    app.add_middleware(BodyLimit, max_bytes=limits.max_body_bytes)
    for error, handler in ERROR_HANDLERS.items():
        app.add_exception_handler(error, handler)
    app.add_api_route("/health", health, methods=["GET"])
    app.add_api_route("/v1/models", models, methods=["GET"])
    # The endpoints run on the event loop, so that a request without `stream` can watch its
    # connection; they only check what is cheap to check (sizes, sampling) there, and hand the
    # template and tokenizing to the tokenizer thread, the decoding to worker threads.
    app.add_api_route("/v1/completions", completions, methods=["POST"])
    app.add_api_route(
        "/v1/chat/completions", chat_endpoint(chat_request_model(limits.max_messages)), methods=["POST"]
    )
    return app


@asynccontextmanager
async def lifespan(app: FastAPI):
    yield
    app.state.server.tokenizing.shutdown(wait=False)


def server_state(request: Request) -> ServerState:
    return request.app.state.server


# --- errors -------------------------------------------------------------------------------------


def error_response(status: int, message: str, kind: str = "invalid_request_error") -> JSONResponse:
    """An OpenAI-style JSON error."""
    return JSONResponse(
        status_code=status, content={"error": {"message": message, "type": kind, "code": status}}
    )


async def bad_request(request: Request, exc: RequestValidationError) -> JSONResponse:
    problems = "; ".join(
        f"{'.'.join(str(p) for p in e['loc'][1:]) or 'body'}: {e['msg']}" for e in exc.errors()
    )
    return error_response(400, f"malformed request: {problems}")


async def refused(request: Request, exc: SlimlmError) -> JSONResponse:
    return error_response(400, str(exc))


async def http_error(request: Request, exc: HTTPException) -> JSONResponse:
    kind = (
        "rate_limit_error"
        if exc.status_code == 429
        else "invalid_request_error"
        if exc.status_code < 500
        else "server_error"
    )
    return error_response(exc.status_code, str(exc.detail), kind)


async def closing(request: Request, exc: BatcherClosed) -> JSONResponse:
    return error_response(503, f"{exc}: the server is shutting down", "server_error")


async def failed(request: Request, exc: Exception) -> JSONResponse:
    return error_response(
        500, f"the server failed on this request: {type(exc).__name__}: {exc}", "server_error"
    )


ERROR_HANDLERS = {
    RequestValidationError: bad_request,
    SlimlmError: refused,
    HTTPException: http_error,
    BatcherClosed: closing,
    Exception: failed,
}


# --- the request body's size --------------------------------------------------------------------


@dataclass
class BodyLimit:
    """ASGI middleware that answers a body over `max_bytes` with 413 before the app reads it: a
    declared Content-Length at once, a chunked body as soon as it passes the limit. The app then
    gets the body as read (parsing a large JSON body would hold up the event loop)."""

    app: Callable
    max_bytes: int

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and int(declared) > self.max_bytes:
            return await self.refuse(scope, receive, send)
        body, more = bytearray(), True
        while more:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            body += message.get("body", b"")
            if len(body) > self.max_bytes:
                return await self.refuse(scope, receive, send)
            more = message.get("more_body", False)
        await self.app(scope, replaying(bytes(body), receive), send)

    async def refuse(self, scope: dict, receive: Callable, send: Callable) -> None:
        message = f"the request body is over this server's limit of {self.max_bytes} bytes"
        await error_response(413, message)(scope, receive, send)


def replaying(body: bytes, receive: Callable) -> Callable:
    """An ASGI receive that gives `body` once, then what `receive` gives (a disconnect)."""
    given = False

    async def replay() -> dict:
        nonlocal given
        if given:
            return await receive()
        given = True
        return {"type": "http.request", "body": body, "more_body": False}

    return replay


# --- prompts ------------------------------------------------------------------------------------


def text_prompt_ids(tokenizer, text: str) -> list[int]:
    """`text` as plain text: no BOS or EOS added, and special-token text (`<|endoftext|>`)
    spelled out rather than made the token (`add_special_tokens` alone would not stop that)."""
    return tokenizer(text, add_special_tokens=False, split_special_tokens=True)["input_ids"]


def chat_prompt_ids(tokenizer, messages: list[dict]) -> list[int]:
    """The chat template's rendering of `messages`, ready for the assistant's answer, where only
    the template's own markers are special tokens: special-token text inside a message is plain
    text (transformers marks it before rendering, so a message holding `<|im_start|>system`
    cannot open a system turn). Messages without such text tokenize as their rendering does."""
    from jinja2 import TemplateError

    try:
        return tokenizer.apply_chat_template(
            messages,
            add_generation_prompt=True,
            tokenize=True,
            sanitize_control_tokens=True,
            return_dict=False,
        )
    except (TemplateError, ValueError) as exc:  # the template's own refusals (roles must alternate, ...)
        raise SlimlmError(f"the model's chat template refused these messages: {exc}") from None


def check_chat_support(tokenizer) -> None:
    """Refuse to serve chat with a transformers that cannot keep special-token text in messages
    plain (its apply_chat_template would pass the option to the template and ignore it)."""
    if (
        getattr(tokenizer, "chat_template", None)
        and "sanitize_control_tokens" not in inspect.signature(tokenizer.apply_chat_template).parameters
    ):
        raise SlimlmError(
            "serving chat needs a transformers whose apply_chat_template takes sanitize_control_tokens "
            "(5.20 or later): pip install -U transformers"
        )


def checked_text(text: str, what: str) -> str:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise SlimlmError(
            f"{what} is not valid Unicode text ({exc.reason} at character {exc.start})"
        ) from None
    return text


def check_chars(state: ServerState, characters: int) -> None:
    if characters > state.max_prompt_chars:
        raise SlimlmError(
            f"the prompt has {characters} characters, more than this server's limit of "
            f"{state.max_prompt_chars}"
        )


def checked_ids(ids: list[int], limits: ServerLimits) -> list[int]:
    if not ids:
        raise SlimlmError("the prompt is empty")
    if len(ids) > limits.max_prompt_tokens:
        raise SlimlmError(
            f"the prompt has {len(ids)} tokens; this server accepts at most {limits.max_prompt_tokens}"
        )
    return ids


def completion_ids(state: ServerState, prompt: str) -> list[int]:
    """The prompt's tokens (on the tokenizer thread)."""
    ids = text_prompt_ids(state.decoder.tokenizer, checked_text(prompt, "the prompt"))
    return checked_ids(ids, state.limits)


def chat_ids(state: ServerState, messages: list[Message]) -> list[int]:
    """The chat's rendering, tokenized (on the tokenizer thread)."""
    turns = [
        {"role": m.role, "content": checked_text(m.content, f"message {i}'s content")}
        for i, m in enumerate(messages)
    ]
    return checked_ids(chat_prompt_ids(state.decoder.tokenizer, turns), state.limits)


# --- sampling -----------------------------------------------------------------------------------


def params_of(body: Sampling, limits: ServerLimits) -> SamplingParams:
    """The request's sampling, refused (SlimlmError) where it asks for what this server does not do
    or more than its limits."""
    refuse_unsupported(body)
    max_tokens = (
        body.max_completion_tokens or body.max_tokens or min(limits.default_max_tokens, limits.max_new_tokens)
    )
    if max_tokens > limits.max_new_tokens:
        raise SlimlmError(f"max_tokens={max_tokens} exceeds this server's limit of {limits.max_new_tokens}")
    stops = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    if len(stops) > limits.max_stop_strings or not all(
        0 < len(stop) <= limits.max_stop_chars for stop in stops
    ):
        raise SlimlmError(
            f"stop must be at most {limits.max_stop_strings} non-empty strings of at most "
            f"{limits.max_stop_chars} characters each"
        )
    return SamplingParams(
        max_new_tokens=max_tokens,
        temperature=body.temperature,
        top_k=body.top_k,
        top_p=body.top_p,
        repetition_penalty=body.repetition_penalty,
        seed=body.seed,
        stop=[checked_text(stop, "a stop string") for stop in stops],
    )


def refuse_unsupported(body: Sampling) -> None:
    """Refuse the OpenAI options this server does not implement, unless left at their defaults."""
    unsupported = {
        "n": body.n != 1,
        "best_of": body.best_of not in (None, 1),
        "logprobs": bool(body.logprobs) or body.top_logprobs is not None,
        "echo": body.echo,
        "presence_penalty": body.presence_penalty != 0,
        "frequency_penalty": body.frequency_penalty != 0,
    }
    asked = [name for name, used in unsupported.items() if used]
    if asked:
        raise SlimlmError(
            f"this server does not support {', '.join(asked)}: it returns one choice, without log "
            "probabilities or the prompt (penalties: use repetition_penalty)"
        )


# --- admission and decoding ---------------------------------------------------------------------


def admission(state: ServerState) -> Callable[[], None]:
    """Admit a request (429 when full); returns its release, safe to call more than once."""
    if not state.admitted.acquire(blocking=False):
        raise HTTPException(
            429, f"the server is busy ({state.limits.max_concurrent} requests admitted); retry later"
        )
    once = threading.Lock()

    def release() -> None:
        if once.acquire(blocking=False):
            state.admitted.release()

    return release


@dataclass
class Decoding:
    """A request handed to the decoding: the batcher's submission (None one at a time), the event
    a one-at-a-time decoding stops at, and the call that stops either."""

    submission: Optional[Submission]
    cancel: threading.Event
    stop: Callable[[], None]


def begin(state: ServerState, ids: list[int], params: SamplingParams) -> Decoding:
    """Queue the request with the batcher, or check that the decoder can complete it: its
    refusals come before any response."""
    gone = threading.Event()
    if state.batcher is not None:
        submission = state.batcher.submit(ids, params)
        return Decoding(submission, gone, submission.cancel)
    state.decoder.check_prompts([ids], params)
    return Decoding(None, gone, gone.set)


async def completed_unless_gone(
    state: ServerState, request: Request, ids: list[int], params: SamplingParams
) -> Generation:
    """The whole completion, decoded in a worker thread while this watches the connection:
    a client that goes away stops the decoding at its next token (its answer would go nowhere)."""
    decoding = begin(state, ids, params)

    def on_token(row: int, token: int) -> None:
        if decoding.cancel.is_set():
            raise SlimlmError("the client went away")

    def work() -> Generation:
        if decoding.submission is not None:
            return list(decoding.submission)[-1]
        return state.decoder.generate_ids([ids], params, on_token)[0]

    task = asyncio.ensure_future(run_in_threadpool(work))
    while not (await asyncio.wait({task}, timeout=0.1))[0]:
        if await request.is_disconnected():
            decoding.stop()
            break
    return await task


# --- answers ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Reply:
    """What every part of one answer carries: its id, when it was made, the model, and whether it
    answers a chat."""

    id: str
    created: int
    model: str
    chat: bool

    @classmethod
    def new(cls, model: str, chat: bool) -> "Reply":
        return cls(f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}", int(time.time()), model, chat)

    def whole(self, ids: list[int], generation: Generation) -> dict:
        """The answer without `stream`."""
        usage = {
            "prompt_tokens": len(ids),
            "completion_tokens": len(generation.token_ids),
            "total_tokens": len(ids) + len(generation.token_ids),
            # found in the cache, not prefilled again
            "prompt_tokens_details": {"cached_tokens": generation.cached_tokens},
        }
        if self.chat:
            choice = {
                "index": 0,
                "message": {"role": "assistant", "content": generation.text},
                "finish_reason": generation.finish_reason,
            }
        else:
            choice = {
                "index": 0,
                "text": generation.text,
                "logprobs": None,
                "finish_reason": generation.finish_reason,
            }
        return {
            "id": self.id,
            "object": "chat.completion" if self.chat else "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": [choice],
            "usage": usage,
        }

    def chunk(self, piece: Optional[str], finish: Optional[str], first: bool = False) -> str:
        """One event of the answer with `stream`."""
        if self.chat:
            delta = {"role": "assistant"} if first else ({} if piece is None else {"content": piece})
            choice = {"index": 0, "delta": delta, "finish_reason": finish}
        else:
            choice = {"index": 0, "text": piece or "", "logprobs": None, "finish_reason": finish}
        event = {
            "id": self.id,
            "object": "chat.completion.chunk" if self.chat else "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": [choice],
        }
        return f"data: {json.dumps(event)}\n\n"


async def respond(
    request: Request, prepare: Callable[[], list[int]], params: SamplingParams, stream: bool, chat: bool
):
    """Admit the request, then tokenize it (`prepare`, on the tokenizer thread: only admitted
    requests queue there) and answer it."""
    state = server_state(request)
    release = admission(state)
    reply = Reply.new(state.model_name, chat)
    try:
        ids = await asyncio.get_running_loop().run_in_executor(state.tokenizing, prepare)
        if stream:  # refusals (a prompt too long for a row or the model) come now, as a 400, not in a stream
            decoding = begin(state, ids, params)
        else:
            generation = await completed_unless_gone(state, request, ids, params)
    except BaseException:
        release()
        raise
    if not stream:
        release()
        return reply.whole(ids, generation)

    def end_admission() -> None:
        decoding.stop()  # a no-op once the decoding has finished
        release()

    return AdmittedStream(events(state, reply, ids, params, decoding, end_admission), end_admission)


class AdmittedStream(StreamingResponse):
    """Ends its request's admission however the response ends: as soon as the client's connection
    closes (its decoding stopping at its next step, and its slot free at once, not only once that
    step is over), also when the client left before the body started (Starlette then never runs
    the body's generator)."""

    def __init__(self, body: Iterator[str], end_admission: Callable[[], None]):
        super().__init__(body, media_type="text/event-stream")
        self.end_admission = end_admission

    async def __call__(self, scope, receive, send) -> None:
        async def watched() -> dict:  # Starlette stops the stream at the disconnect this hands it
            message = await receive()
            if message["type"] == "http.disconnect":
                self.end_admission()
            return message

        try:
            await super().__call__(scope, watched, send)
        finally:
            self.end_admission()


def events(
    state: ServerState,
    reply: Reply,
    ids: list[int],
    params: SamplingParams,
    decoding: Decoding,
    end_admission: Callable[[], None],
) -> Iterator[str]:
    """The answer's server-sent events, ending in `[DONE]`; the admission ends before that."""
    try:
        if reply.chat:
            yield reply.chunk(None, None, first=True)
        # the Generation, whose finish reason the last chunk gives; none after a stop string
        results: list[Generation] = []
        for piece in pieces(state, ids, params, decoding, results):
            yield reply.chunk(piece, None)
        yield reply.chunk(None, results[0].finish_reason if results else "stop")
    except Exception as exc:  # the headers went out with 200: the client learns of it in the stream
        failure = {
            "message": f"{type(exc).__name__}: {exc}",
            "type": "invalid_request_error" if isinstance(exc, SlimlmError) else "server_error",
        }
        yield f"data: {json.dumps({'error': failure})}\n\n"
    finally:
        end_admission()
    yield "data: [DONE]\n\n"


def pieces(
    state: ServerState, ids: list[int], params: SamplingParams, decoding: Decoding, results: list
) -> Iterator[str]:
    """The answer's text pieces, up to a stop string; its Generation goes to `results`."""
    if decoding.submission is None:
        yield from state.decoder.stream_ids(ids, params, results, decoding.cancel)
        return
    source = batched_pieces(decoding.submission, results)
    yield from until_stop(source, params.stop)
    for _ in source:  # after a stop string: the sequence ends at once; collect its Generation
        pass


def batched_pieces(submission: Submission, results: list) -> Iterator[str]:
    """The batcher's text pieces; its final Generation goes to `results`."""
    for item in submission:
        if isinstance(item, Generation):
            results.append(item)
        else:
            yield item


# --- endpoints --------------------------------------------------------------------------------


def health(request: Request) -> dict:
    return {"status": "ok", "model": server_state(request).model_name}


def models(request: Request) -> dict:
    card = {"id": server_state(request).model_name, "object": "model", "created": 0, "owned_by": "slimlm"}
    return {"object": "list", "data": [card]}


async def completions(body: CompletionRequest, request: Request):
    state = server_state(request)
    params = params_of(body, state.limits)
    check_chars(state, len(body.prompt))
    return await respond(request, lambda: completion_ids(state, body.prompt), params, body.stream, chat=False)


async def answer_chat(body: ChatRequest, request: Request):
    state = server_state(request)
    if not getattr(state.decoder.tokenizer, "chat_template", None):
        raise SlimlmError(f"model '{state.model_name}' has no chat template; use /v1/completions")
    params = params_of(body, state.limits)
    check_chars(state, sum(len(m.content) for m in body.messages))
    return await respond(request, lambda: chat_ids(state, body.messages), params, body.stream, chat=True)


def chat_endpoint(model: type[ChatRequest]) -> Callable:
    """The chat endpoint, reading its body as `model` (a ChatRequest with the server's limit on
    messages, which FastAPI takes from the signature)."""

    async def chat_completions(body: model, request: Request):
        return await answer_chat(body, request)

    return chat_completions
