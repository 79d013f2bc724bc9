"""The request bodies `slimlm serve` accepts (inference/server.py), as pydantic models.

Strict: a string is not a number, nor "yes" a boolean; unknown fields are ignored, and the OpenAI
options the server does not implement are read so that it can refuse them (server.params_of).
A chat's model is made per server (`chat_request_model`): its limit on messages is the server's.
"""

# No `from __future__ import annotations`: FastAPI reads the request models from the endpoint signatures.

from typing import Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, create_model


class Sampling(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)  # "3" is not a number, nor "yes" a boolean
    model: Optional[str] = None
    max_tokens: Optional[int] = Field(default=None, ge=1)
    max_completion_tokens: Optional[int] = Field(default=None, ge=1)  # the chat API's newer name for it
    temperature: float = Field(default=1.0, ge=0)
    top_p: Optional[float] = Field(default=None, gt=0, le=1)
    top_k: Optional[int] = Field(default=None, ge=1)
    repetition_penalty: float = Field(default=1.0, gt=0)
    seed: Optional[int] = None
    stop: Union[str, list[str], None] = None
    stream: bool = False
    # OpenAI options this server does not implement: refused unless left at their defaults
    n: int = 1
    best_of: Optional[int] = None
    logprobs: Union[bool, int, None] = None
    top_logprobs: Optional[int] = None
    echo: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0


class CompletionRequest(Sampling):
    prompt: str


class Message(BaseModel):
    model_config = ConfigDict(strict=True)
    role: Literal["system", "user", "assistant"]
    content: str


class ChatRequest(Sampling):
    """A chat request; the server reads its body as `chat_request_model(max_messages)`."""

    messages: list[Message] = Field(min_length=1)


def chat_request_model(max_messages: int) -> type[ChatRequest]:
    """ChatRequest holding at least one and at most `max_messages` messages."""
    return create_model(
        "ChatRequest",
        __base__=ChatRequest,
        messages=(list[Message], Field(min_length=1, max_length=max_messages)),
    )
