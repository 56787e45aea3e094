"""Serving one completion or chat request: tokenize, submit its choices, then stream or collect the outputs.

A request asks for `n` choices of each of its prompts (completions may send a list of prompts); each choice
is one engine request, and choice i*n + j is prompt i's j-th; the choices of one prompt enter the engine
together and share its KV. A request that fails before any output
(rejected by the engine, or ended by an engine failure or shutdown) is answered with an HTTP error status;
a stream that fails after its first chunk gets an error event and is cut (no `[DONE]`), so clients count it
as failed. A client that disconnects has every choice aborted.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time

from sanic.response import HTTPResponse

from . import protocol, stream
from .engine_client import EngineClient, RequestHandle
from .owner import Rejected
from .protocol import ApiError, GenerateRequest


async def serve(request, client: EngineClient, req: GenerateRequest) -> HTTPResponse | None:
    info = client.require_ready()
    where = "messages" if req.chat else "prompt"
    prompts = []
    for prompt in req.prompts:
        if isinstance(prompt, str):
            # Too long for any request: refused from its length, before tokenizing costs the event loop.
            protocol.check_prompt_chars(len(prompt), info, where)
            prompt = await client.encode(prompt)
        prompts.append(prompt)
    params = [protocol.sampling_params(req, len(ids), info) for ids in prompts]
    if params and params[0].structured is not None:  # the same for every prompt: one request's options
        await client.compile_grammar(params[0].structured)
    rid = protocol.response_id(request.ctx.request_id, req.chat)
    request.ctx.submitted = True  # from here on, a refusal is the engine's, counted by the client
    handles = _submit(client, request, prompts, params, req.n)
    try:
        if req.stream:
            return await _stream(request, handles, req, rid, client.token_text, prompts)
        return await _collect(handles, req, rid, client.token_text, prompts)
    except asyncio.CancelledError:
        for handle in handles:
            client.abort(handle, "disconnect")
        raise
    finally:
        for handle in handles:
            client.release(handle)


def _submit(client: EngineClient, request, prompts: list, params: list, n: int) -> list[RequestHandle]:
    """One engine request per choice, all or none: a refusal aborts the choices already submitted.
    The choices of one prompt (of equal prompts too) enter together: the engine computes it once."""
    client.require_room(len(prompts) * n)
    choices, same = [], {}
    for i, (ids, p) in enumerate(zip(prompts, params)):
        for j in range(n):
            # Seeded choices differ from one another, and each is reproducible.
            choices.append(p if p.seed is None or j == 0 else dataclasses.replace(p, seed=p.seed + j))
            same.setdefault(tuple(ids), []).append(i * n + j)
    handles: list[RequestHandle | None] = [None] * len(choices)
    try:
        for members in same.values():
            ids = prompts[members[0] // n]
            if len(members) == 1:
                handles[members[0]] = client.submit(ids, choices[members[0]], request.transport)
                continue
            group = client.submit_choices(ids, [choices[c] for c in members], request.transport)
            for c, handle in zip(members, group):
                handles[c] = handle
    except ApiError:
        for handle in handles:
            if handle is not None:
                client.abort(handle, "disconnect")
                client.release(handle)
        raise
    return handles


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


def _usage(req: GenerateRequest, prompts: list, finals: dict) -> dict:
    # Each prompt counts once, whatever n; every choice's tokens count (none for max_tokens 0).
    tokens = sum(f.completion_tokens for f in finals.values()) if req.generate else 0
    cached = {i: f.cached_tokens for i, f in finals.items()}
    return protocol.usage(sum(len(p) for p in prompts), tokens, _cached(req, cached))


def _cached(req: GenerateRequest, cached: dict[int, int]) -> int:
    """Prompt tokens reused from the prefix cache, each prompt once: the most any of its choices reports
    (choice index -> its output's cached_tokens)."""
    per_prompt: dict[int, int] = {}
    for i, n in cached.items():
        per_prompt[i // req.n] = max(per_prompt.get(i // req.n, 0), n)
    return sum(per_prompt.values())


async def _collect_one(handle: RequestHandle) -> tuple[str, list[int], list, object]:
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
            if final.finish_reason == "error":
                raise ApiError(500, final.error or "the engine failed", code="engine_error")
            return "".join(parts), ids, lps, final


async def _collect(handles: list[RequestHandle], req: GenerateRequest, rid: str, decode, prompts: list):
    created = int(time.time())
    results = await asyncio.gather(*(_collect_one(h) for h in handles))
    choices, tokens = [], 0
    for i, (text, ids, lps, final) in enumerate(results):
        prompt = prompts[i // req.n]
        if not req.generate:  # max_tokens 0: the one token made to run the prompt is no part of the reply
            text, ids, lps = "", [], []
        tokens += len(ids)
        prompt_lps = list(final.request.prompt_logprobs) if final.request is not None else []
        if req.echo:
            text = _prompt_text(req, i, prompt, decode) + text
            ids, lps = prompt + ids, [None, *prompt_lps] + lps
        body = protocol.choice(
            req, i, text, final.finish_reason, protocol.logprobs_body(req, ids, lps, decode)
        )
        if req.prompt_logprobs is not None:
            body["prompt_logprobs"] = protocol.prompt_logprobs_body(prompt, prompt_lps, decode)
        choices.append(body)
    cached = _cached(req, {i: final.cached_tokens for i, (*_, final) in enumerate(results)})
    usage = protocol.usage(sum(len(p) for p in prompts), tokens, cached)  # each prompt once, whatever n
    return json_response(protocol.completion_response(rid, created, req, choices, usage))


def _prompt_text(req: GenerateRequest, index: int, prompt: list[int], decode) -> str:
    given = req.prompts[index // req.n]
    return given if isinstance(given, str) else "".join(decode(t) for t in prompt)


async def _stream(
    request, handles: list[RequestHandle], req: GenerateRequest, rid: str, decode, prompts: list
):
    created = int(time.time())
    if len(handles) == 1:
        # One choice: its outputs are read where they arrive (no task between them and the sender).
        handle = handles[0]

        async def receive() -> tuple[int, list]:
            return 0, await handle.next()

        await _send_stream(request, receive, 1, req, rid, created, decode, prompts)
        return
    # One slot: a pump waits while the client reads slowly, so each choice's own bounded queue fills and
    # the engine client drops a client that falls behind, as it would with one choice.
    merged: asyncio.Queue = asyncio.Queue(maxsize=1)

    async def pump(index: int, handle: RequestHandle) -> None:
        while True:
            outs = await handle.next()
            await merged.put((index, outs))
            if outs[-1].finished or isinstance(outs[0], Rejected):
                return

    pumps = [asyncio.ensure_future(pump(i, h)) for i, h in enumerate(handles)]
    try:
        await _send_stream(request, merged.get, len(handles), req, rid, created, decode, prompts)
    finally:
        for task in pumps:
            task.cancel()


async def _send_stream(request, receive, count: int, req, rid: str, created: int, decode, prompts: list):
    """Stream `count` choices whose outputs `receive()` returns as (choice index, outputs)."""
    index, outs = await receive()
    # Errors before the first token are real HTTP errors: the response has not started.
    error = _failure(outs, False)
    if error is not None:
        raise error
    resp = await request.respond(content_type=stream.CONTENT_TYPE, headers=stream.HEADERS)
    first, offset, finals, produced, cached = [True] * count, [0] * count, {}, 0, {}
    prompt_tokens = sum(len(p) for p in prompts)
    if req.echo:  # each choice's first chunk starts with its prompt
        for i in range(count):
            text = _prompt_text(req, i, prompts[i // req.n], decode)
            await resp.send(stream.event(protocol.stream_chunk(rid, created, req, i, text, None, False)))
            offset[i] = len(text)
    while True:
        failed = _failure(outs, True) if isinstance(outs[0], Rejected) else None  # a later choice refused
        text, ids, lps, final = ("", [], [], None) if failed else _merge(outs)
        if not req.generate:
            text, ids, lps = "", [], []
        if failed or (final is not None and final.finish_reason == "error"):
            err = failed or ApiError(500, final.error or "the engine failed", code="engine_error")
            await resp.send(stream.event(err.body()))
            # Cut the connection (no terminating chunk): clients must see this request as failed.
            request.transport.close()
            return
        if ids or text or final is not None:
            logprobs = protocol.logprobs_body(req, ids, lps, decode, offset[index])
            offset[index] += len(text)
            finish = final.finish_reason if final is not None else None
            chunk = protocol.stream_chunk(rid, created, req, index, text, finish, first[index], logprobs)
            produced += len(ids)
            cached[index] = outs[-1].cached_tokens
            if req.continuous_usage:
                chunk["usage"] = protocol.usage(prompt_tokens, produced, _cached(req, cached))
            await resp.send(stream.event(chunk))
            first[index] = False
        if final is not None:
            finals[index] = final
            if len(finals) == count:
                break
        index, outs = await receive()
    if req.include_usage:
        await resp.send(stream.event(protocol.usage_chunk(rid, created, req, _usage(req, prompts, finals))))
    await resp.send(stream.DONE)
    await resp.eof()
