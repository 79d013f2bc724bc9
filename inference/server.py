"""`slimlm serve`: an OpenAI-compatible HTTP server over the bundled decoder.

    /v1/models, /v1/completions, /v1/chat/completions (both with `stream: true` as server-sent
    events, ending in `data: [DONE]`), /health

Binds 127.0.0.1 unless told otherwise. Limits: the prompt's length, max_tokens, and the number
of requests admitted at once (the rest get HTTP 429 at once rather than waiting unboundedly).
With a ContinuousBatcher (`slimlm serve` makes one) admitted requests decode together, joining
and leaving the batch between steps; without one they decode one at a time.
A malformed request gets HTTP 400 with an OpenAI-style JSON error, and the server keeps serving.
"""

# No `from __future__ import annotations`: FastAPI reads the request models from the endpoint signatures.

import json
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Iterator, Optional, Union

from slimlm.errors import SlimlmError


@dataclass(frozen=True)
class ServerLimits:
    max_prompt_tokens: int = 4096
    max_new_tokens: int = 1024
    max_concurrent: int = 8  # admitted requests (decoding or waiting); more get 429


def create_app(decoder, model_name: str, limits: ServerLimits = ServerLimits(), batcher=None):
    from fastapi import FastAPI, Request
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse, StreamingResponse
    from pydantic import BaseModel, ConfigDict, Field

    from slimlm.inference.decoder import Generation, until_stop
    from slimlm.inference.sampling import SamplingParams

    class Sampling(BaseModel):
        model_config = ConfigDict(extra="ignore")
        model: Optional[str] = None
        max_tokens: int = Field(default=128, ge=1)
        temperature: float = Field(default=1.0, ge=0)
        top_p: Optional[float] = Field(default=None, gt=0, le=1)
        top_k: Optional[int] = Field(default=None, ge=1)
        repetition_penalty: float = Field(default=1.0, gt=0)
        seed: Optional[int] = None
        stop: Union[str, list[str], None] = None
        stream: bool = False

    class CompletionRequest(Sampling):
        prompt: str

    class Message(BaseModel):
        role: str
        content: str

    class ChatRequest(Sampling):
        messages: list[Message] = Field(min_length=1)

    app = FastAPI(title="slimlm", description="OpenAI-compatible completions from the bundled decoder")
    admitted = threading.BoundedSemaphore(limits.max_concurrent)

    def error(status: int, message: str, kind: str = "invalid_request_error") -> JSONResponse:
        return JSONResponse(status_code=status, content={"error": {"message": message, "type": kind, "code": status}})

    @app.exception_handler(RequestValidationError)
    async def bad_request(request: Request, exc: RequestValidationError) -> JSONResponse:
        problems = "; ".join(f"{'.'.join(str(p) for p in e['loc'][1:]) or 'body'}: {e['msg']}" for e in exc.errors())
        return error(400, f"malformed request: {problems}")

    @app.exception_handler(SlimlmError)
    async def refused(request: Request, exc: SlimlmError) -> JSONResponse:
        return error(400, str(exc))

    def params_of(body: Sampling) -> SamplingParams:
        if body.max_tokens > limits.max_new_tokens:
            raise SlimlmError(f"max_tokens={body.max_tokens} exceeds this server's limit of {limits.max_new_tokens}")
        stops = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
        return SamplingParams(
            max_new_tokens=body.max_tokens, temperature=body.temperature, top_k=body.top_k, top_p=body.top_p,
            repetition_penalty=body.repetition_penalty, seed=body.seed, stop=stops,
        )

    def checked_ids(ids: list[int]) -> list[int]:
        if not ids:
            raise SlimlmError("the prompt is empty")
        if len(ids) > limits.max_prompt_tokens:
            raise SlimlmError(f"the prompt has {len(ids)} tokens; this server accepts at most {limits.max_prompt_tokens}")
        return ids

    def respond(ids: list[int], params: SamplingParams, stream: bool, chat: bool):
        if not admitted.acquire(blocking=False):
            return error(429, f"the server is busy ({limits.max_concurrent} requests admitted); retry later", "rate_limit_error")
        request_id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}"
        created = int(time.time())
        if not stream:
            try:
                if batcher is not None:
                    *_, generation = batcher.submit(ids, params)
                else:
                    (generation,) = decoder.generate_ids([ids], params)
            finally:
                admitted.release()
            usage = {"prompt_tokens": len(ids), "completion_tokens": len(generation.token_ids), "total_tokens": len(ids) + len(generation.token_ids)}
            if chat:
                choice = {"index": 0, "message": {"role": "assistant", "content": generation.text}, "finish_reason": generation.finish_reason}
            else:
                choice = {"index": 0, "text": generation.text, "logprobs": None, "finish_reason": generation.finish_reason}
            return {"id": request_id, "object": "chat.completion" if chat else "text_completion", "created": created, "model": model_name, "choices": [choice], "usage": usage}
        return StreamingResponse(events(request_id, created, ids, params, chat), media_type="text/event-stream")

    def batched_pieces(ids: list[int], params: SamplingParams, results: list) -> Iterator[str]:
        """The batcher's text pieces; its final Generation goes to `results`."""
        for item in batcher.submit(ids, params):
            if isinstance(item, Generation):
                results.append(item)
            else:
                yield item

    def events(request_id: str, created: int, ids: list[int], params: SamplingParams, chat: bool) -> Iterator[str]:
        kind = "chat.completion.chunk" if chat else "text_completion"

        def chunk(piece: Optional[str], finish: Optional[str], first: bool = False) -> str:
            if chat:
                delta = {"role": "assistant"} if first else ({} if piece is None else {"content": piece})
                choice = {"index": 0, "delta": delta, "finish_reason": finish}
            else:
                choice = {"index": 0, "text": piece or "", "logprobs": None, "finish_reason": finish}
            return f"data: {json.dumps({'id': request_id, 'object': kind, 'created': created, 'model': model_name, 'choices': [choice]})}\n\n"

        try:
            if chat:
                yield chunk(None, None, first=True)
            if batcher is not None:
                results: list[Generation] = []
                source = batched_pieces(ids, params, results)
                for piece in until_stop(source, params.stop):
                    yield chunk(piece, None)
                for _ in source:  # after a stop string: the sequence ends at once; collect its Generation
                    pass
                finish = results[0].finish_reason if results else "stop"
            else:
                for piece in decoder.stream_ids(ids, params):
                    yield chunk(piece, None)
                finish = decoder.last_generations[0].finish_reason if decoder.last_generations else "stop"
            yield chunk(None, finish)
            yield "data: [DONE]\n\n"
        finally:
            admitted.release()

    @app.get("/health")
    def health() -> dict:
        return {"status": "ok", "model": model_name}

    @app.get("/v1/models")
    def models() -> dict:
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": 0, "owned_by": "slimlm"}]}

    @app.post("/v1/completions")
    def completions(body: CompletionRequest):
        ids = checked_ids(decoder.tokenizer(body.prompt, add_special_tokens=False)["input_ids"])
        return respond(ids, params_of(body), body.stream, chat=False)

    @app.post("/v1/chat/completions")
    def chat_completions(body: ChatRequest):
        tokenizer = decoder.tokenizer
        if not getattr(tokenizer, "chat_template", None):
            raise SlimlmError(f"model '{model_name}' has no chat template; use /v1/completions")
        text = tokenizer.apply_chat_template([m.model_dump() for m in body.messages], tokenize=False, add_generation_prompt=True)
        ids = checked_ids(tokenizer(text, add_special_tokens=False)["input_ids"])
        return respond(ids, params_of(body), body.stream, chat=True)

    return app
