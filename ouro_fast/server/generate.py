"""Serving one completion or chat request: tokenize, submit, then stream or collect the outputs.

A request that fails before any output (rejected by the engine, or ended by an
engine failure or shutdown) is answered with an HTTP error status; a stream that
fails after its first chunk gets an error event and is cut (no `[DONE]`), so
clients count it as failed. A client that disconnects has its request aborted.
"""

from __future__ import annotations

import asyncio
import time

from sanic.response import HTTPResponse

from . import protocol, stream
from .engine_client import EngineClient, RequestHandle
from .owner import Rejected
from .protocol import ApiError, GenerateRequest


async def serve(request, client: EngineClient, req: GenerateRequest) -> HTTPResponse | None:
    info = client.require_ready()
    if isinstance(req.prompt, list):
        prompt_ids = req.prompt
    else:
        # Too long for any request: refused from its length, before tokenizing costs the event loop.
        protocol.check_prompt_chars(len(req.prompt), info, "messages" if req.chat else "prompt")
        prompt_ids = await client.encode(req.prompt)
    params = protocol.sampling_params(req, len(prompt_ids), info)
    rid = protocol.request_id(request.headers.get("x-request-id"), req.chat)
    request.ctx.submitted = True  # from here on, a refusal is the engine's, counted by the client
    handle = client.submit(prompt_ids, params, request.transport)
    try:
        if req.stream:
            return await _stream(request, handle, req, rid, client.token_text)
        return await _collect(handle, req, rid, client.token_text)
    except asyncio.CancelledError:
        client.abort(handle, "disconnect")
        raise
    finally:
        client.release(handle)


def json_response(body: dict, status: int = 200, headers: dict | None = None) -> HTTPResponse:
    return HTTPResponse(protocol.dumps(body), status=status, headers=headers, content_type="application/json")


def _failure(outs: list, sent_tokens: bool) -> ApiError | None:
    """The HTTP error to answer with, when outs end the request before it produced anything."""
    first = outs[0]
    if isinstance(first, Rejected):
        retry = 1 if first.status in (429, 503) else None
        return ApiError(first.status, first.message, retry_after=retry)
    if sent_tokens or any(o.new_token_ids for o in outs):
        return None
    final = outs[-1]
    if final.finish_reason == "error":
        return ApiError(500, final.error or "the engine failed", code="engine_error")
    if final.finish_reason == "abort":
        return ApiError(503, final.error or "the request was aborted", code="aborted", retry_after=1)
    return None


def _merge(outs: list) -> tuple[str, list[int], list, object]:
    """(text, new token ids, their log-probabilities, the final output or None) of consecutive outputs
    of one request."""
    text = "".join(o.text_delta for o in outs)
    final = outs[-1] if outs[-1].finished else None
    ids = [t for o in outs for t in o.new_token_ids]
    lps = [lp for o in outs for lp in (o.logprobs or ())]
    return text, ids, lps, final


async def _collect(handle: RequestHandle, req: GenerateRequest, rid: str, decode) -> HTTPResponse:
    created = int(time.time())
    parts: list[str] = []
    ids: list[int] = []
    lps: list = []
    while True:
        outs = await handle.next()
        error = _failure(outs, bool(ids))
        if error is not None:
            raise error
        text, new, new_lps, final = _merge(outs)
        parts.append(text)
        ids += new
        lps += new_lps
        if final is not None:
            break
    if final.finish_reason == "error":
        raise ApiError(500, final.error or "the engine failed", code="engine_error")
    logprobs = protocol.logprobs_body(req, ids, lps, decode)
    body = protocol.completion_response(rid, created, req, "".join(parts), final.finish_reason,
                                        final.prompt_tokens, final.completion_tokens, logprobs)  # fmt: skip
    return json_response(body)


async def _stream(request, handle: RequestHandle, req: GenerateRequest, rid: str, decode) -> None:
    created = int(time.time())
    outs = await handle.next()
    # Errors before the first token are real HTTP errors: the response has not started.
    error = _failure(outs, False)
    if error is not None:
        raise error
    resp = await request.respond(content_type=stream.CONTENT_TYPE, headers=stream.HEADERS)
    first, offset = True, 0
    while True:
        text, ids, lps, final = _merge(outs)
        if final is not None and final.finish_reason == "error":
            err = ApiError(500, final.error or "the engine failed", code="engine_error")
            await resp.send(stream.event(err.body()))
            # Cut the connection (no terminating chunk): clients must see this request as failed.
            request.transport.close()
            return
        if ids or text or final is not None:
            logprobs = protocol.logprobs_body(req, ids, lps, decode, offset)
            offset += len(text)
            chunk = protocol.stream_chunk(
                rid, created, req, text, final and final.finish_reason, first, logprobs
            )
            await resp.send(stream.event(chunk))
            first = False
        if final is not None:
            break
        outs = await handle.next()
    if req.include_usage:
        await resp.send(stream.event(protocol.usage_chunk(rid, created, req, final.prompt_tokens,
                                                          final.completion_tokens)))  # fmt: skip
    await resp.send(stream.DONE)
    await resp.eof()
