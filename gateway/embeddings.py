"""``POST /v1/embeddings`` (served with ``--runner pooling``): each input (text, token ids, or a
batch of either) runs as one pooling request through the same engine cores, scheduler and KV
path as generation (its prefill, pooled: ``workers.pooling``), and comes back as OpenAI's
embedding list, as floats or base64 (little-endian float32). ``dimensions`` shortens the
vectors (renormalized) where the model was trained for it (matryoshka), as vLLM allows.
"""

from __future__ import annotations

import asyncio
import base64
import math
import sys
from array import array
from typing import Literal

import msgspec
from aiohttp import web

from shoal.bus.messages.lora import LoRARequest
from shoal.engine.client.interface import EngineClientInterface
from shoal.gateway.embedding_options import EmbeddingOptions
from shoal.gateway.errors import ApiError, bad_request
from shoal.gateway.generation import engine_error
from shoal.gateway.params import completion_prompts
from shoal.gateway.request_types import PromptInput
from shoal.gateway.serving import ServingContext, decode_body, new_request_id, now_seconds


class EmbeddingRequest(msgspec.Struct, kw_only=True):
    input: PromptInput
    model: str | None = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    user: str | None = None
    add_special_tokens: bool = True  # vLLM's


class EmbeddingData(msgspec.Struct, tag="embedding", tag_field="object"):
    index: int
    embedding: list[float] | str


class EmbeddingUsage(msgspec.Struct):
    prompt_tokens: int
    total_tokens: int


class EmbeddingResponse(msgspec.Struct, tag="list", tag_field="object"):
    id: str
    created: int
    model: str
    data: list[EmbeddingData]
    usage: EmbeddingUsage


async def create_embedding(ctx: ServingContext, request: web.Request) -> web.Response:
    body = await decode_body(request, EmbeddingRequest)
    lora = ctx.check_model(body.model)
    ctx.check_ready()
    response = await embed(ctx.engine, body, ctx.embeddings, lora, ctx.model_name(lora))
    return web.Response(body=msgspec.json.encode(response), content_type="application/json")


async def embed(
    engine: EngineClientInterface,
    body: EmbeddingRequest,
    options: EmbeddingOptions | None,
    lora: LoRARequest | None,
    model_name: str,
) -> EmbeddingResponse:
    """The embeddings of a request's inputs (the HTTP and NATS APIs' shared part)."""
    if options is None:
        raise bad_request(
            "The model does not support Embeddings API (this server generates: start it with "
            "--runner pooling)",
            param="model",
        )
    check_dimensions(body.dimensions, options)
    prompts = completion_prompts(
        body.input,
        engine.tokenizer,
        engine.vocabulary,
        engine.max_model_len,
        body.add_special_tokens,
    )
    request_id = new_request_id("embd")
    try:
        outputs = await asyncio.gather(
            *(
                engine.embed(p.token_ids, f"{request_id}-{i}", lora_request=lora)
                for i, p in enumerate(prompts)
            )
        )
    except Exception as error:
        raise engine_error(error) from None
    data = []
    for index, output in enumerate(outputs):
        if output.error is not None or output.pooled is None:
            raise ApiError(503, f"the engine failed: {output.error}", code="engine_error")
        vector = shorten(output.pooled, body.dimensions)
        data.append(EmbeddingData(index, encode(vector, body.encoding_format)))
    num_tokens = sum(len(p.token_ids) for p in prompts)
    usage = EmbeddingUsage(num_tokens, num_tokens)
    return EmbeddingResponse(request_id, now_seconds(), model_name, data, usage)


def check_dimensions(dimensions: int | None, options: EmbeddingOptions) -> None:
    if dimensions is None:
        return
    if not options.matryoshka:
        raise bad_request(
            "Model does not support matryoshka representation, changing output dimensions "
            "will lead to poor results.",
            param="dimensions",
        )
    if dimensions < 1:
        raise bad_request("dimensions must be at least 1", param="dimensions")


def shorten(vector: list[float], dimensions: int | None) -> list[float]:
    """The first ``dimensions`` values, renormalized (all of them when None)."""
    if dimensions is None:
        return vector
    if dimensions > len(vector):
        raise bad_request(
            f"dimensions {dimensions} is more than the model's {len(vector)}", param="dimensions"
        )
    head = vector[:dimensions]
    norm = math.sqrt(sum(v * v for v in head))
    return [v / norm for v in head] if norm > 0 else head


def encode(vector: list[float], encoding_format: str) -> list[float] | str:
    """Floats, or OpenAI's base64 of little-endian float32 values."""
    if encoding_format != "base64":
        return vector
    packed = array("f", vector)
    if sys.byteorder == "big":  # pragma: no cover - every supported host is little-endian
        packed.byteswap()
    return base64.b64encode(packed.tobytes()).decode()
