"""Conversation turns over HTTP: one turn at a time per conversation, compaction, the kept KV (I/O shell).

The decisions are :mod:`gateway.conversations` (pure); this shell holds the store,
one FIFO turn lock per conversation (a ``trio.Semaphore(1)``: a streamed turn
holds it until its body ends, in another task than the one that took it), asks the
service whether a prompt fits (:meth:`GatewayService.prompt_fits`: a render and a
tokenization, nothing opened), has the model write a summary when the policy is
``summary``, and starts the turn as an ordinary chat request whose kept KV is the
conversation's: the gateway's prefix cache (``kv_key``) sends the next turn to the
route that holds it, and it prefills only what is new. A turn whose route died
finds no kept KV and prefills its whole prompt on another route.

A turn is added to the conversation when its answer went out whole (``Finished``);
a failed or disconnected turn leaves the conversation as it was. Every response
says what happened: a ``conversation`` object (in the body, and in a streamed
response's first chunk) and the ``X-Conversation-*`` headers.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, Protocol

import trio
from quart import Response

from common.logs import event
from gateway import openai_http
from gateway.api_keys import Principal
from gateway.conversations import (
    SUMMARY_PREFIX,
    ConversationBusy,
    ConversationError,
    DropSearch,
    Turn,
    leading_system,
    prompt_of,
)
from gateway.errors import ConversationConflict, GatewayError, RateLimited
from gateway.jobs import Job, Reply
from gateway.protocol import ChatMessage, GenerationRequest
from gateway.serving import GatewayService

log = logging.getLogger("swarm.gateway")

TURN_WAIT_S = 300.0  # a turn waits at most this long for the one before it (then 429 conversation_busy)
SUMMARY_INSTRUCTIONS = (
    "Summarize the conversation below for the assistant who continues it: keep names, facts, decisions, "
    "code identifiers and open questions; be brief; write the summary only."
)
SUMMARY_MAX_CHARS = 200_000  # the transcript given to the summarizer (its newest part)


class Starter(Protocol):
    async def __call__(self, req: GenerationRequest, who: Principal, *, kv_key: str, reply: Reply) -> Job: ...


class ConversationTurns:
    def __init__(self, service: GatewayService) -> None:
        self.service = service
        self.policy = service.config.conversation_compaction
        self.summary_tokens = service.config.conversation_summary_tokens
        self.store = service.conversations
        # One FIFO lock per conversation with a turn entered (dropped when none is left).
        self._locks: dict[tuple[str, str], trio.Semaphore] = {}

    async def respond(
        self,
        req: GenerationRequest,
        who: Principal,
        owner: str,
        start: Starter,
        where: openai_http.Where | None,
    ) -> Response:
        cid = req.conversation_id
        assert cid is not None  # the caller routes only requests that name one
        now = trio.current_time()
        try:
            conv = self.store.enter(owner, cid, now)
        except ConversationBusy as err:
            raise RateLimited(err.message, code=err.code, retry_after_s=1) from err
        key = (owner, cid)
        lock = self._locks.setdefault(key, trio.Semaphore(1))
        held = False

        def finish(turn: Turn | None, reply: Reply | None, dropped: int, summary: str) -> None:
            if turn is not None and reply is not None and reply.finished:
                message = ChatMessage("assistant", reply.text, tool_calls=reply.tool_calls)
                self.store.commit(turn, message, dropped, summary)
                self.service.metrics.inc("swarm_gateway_conversation_turns_total")
                if dropped > turn.dropped:
                    self.service.metrics.inc("swarm_gateway_conversation_compactions_total")
            if held:
                lock.release()
            self.store.leave(conv, trio.current_time())
            if conv.waiting == 0:  # no turn entered after this one: nobody holds or waits on the lock
                self._locks.pop(key, None)

        handed_off = False
        try:
            with trio.move_on_after(TURN_WAIT_S):
                await lock.acquire()
                held = True
            if not held:
                raise RateLimited(
                    f"the previous turn of this conversation is still running after {TURN_WAIT_S:g} s",
                    code="conversation_busy",
                    retry_after_s=5,
                )
            try:
                turn = self.store.begin(conv, req.messages)
                dropped, summary, note = await self._fit(req, turn)
            except ConversationError as err:
                self.service.metrics.inc("swarm_gateway_conversation_refusals_total", reason=err.code)
                raise ConversationConflict(err.message, code=err.code, param="conversation_id") from err
            prompt = prompt_of(turn.history, dropped, summary)
            reply = Reply()
            job = await start(
                dataclasses.replace(req, messages=prompt, conversation_id=None),
                who,
                kv_key=f"conversation\x00{owner}\x00{cid}",
                reply=reply,
            )
            info = {
                "id": cid,
                "turn": conv.turns + 1,
                "mode": turn.mode,
                "messages": len(turn.history) + 1,
                "compacted": dropped > turn.dropped,
                "left_out_messages": dropped,
                "compaction": note,
            }
            if summary:
                info["summary"] = summary  # what stands for the left-out messages
            headers = {
                "X-Conversation-Id": cid,
                "X-Conversation-Compacted": str(dropped) if dropped > turn.dropped else "0",
            }
            handed_off = True
            if req.stream:
                response = openai_http.streamed_response(
                    self._stream(job, where, info, lambda: finish(turn, reply, dropped, summary))
                )
                response.headers.update(headers)
                return response
            try:
                body = await openai_http.collect(job)
            finally:
                job.cancel()
                job.events.close()
                finish(turn, reply, dropped, summary)
            body["conversation"] = info
            return openai_http.json_response(body, headers=headers)
        finally:
            if not handed_off:
                finish(None, None, 0, "")

    async def _stream(
        self,
        job: Job,
        where: openai_http.Where | None,
        info: dict[str, Any],
        done: Callable[[], None],
    ) -> AsyncIterator[bytes]:
        try:
            async for chunk in openai_http.sse(job, where, extra={"conversation": info}):
                yield chunk
        finally:
            done()

    async def _fit(self, req: GenerationRequest, turn: Turn) -> tuple[int, str, str]:
        """The compaction the turn runs with: (messages left out, summary, what was done)."""
        fits = self._fits(req, turn)
        dropped, summary = turn.dropped, turn.summary
        if await fits(dropped, summary):
            return dropped, summary, "none" if dropped == 0 else "kept"
        more = await self._search(turn, dropped, summary, fits)
        if self.policy != "summary":
            return more, "", "drop_oldest"
        try:
            new_summary = await self._summarize(req, turn, dropped, more, summary)
        except GatewayError as err:
            event(log, "conversation_summary_failed", level=logging.WARNING, error=err.message)
            return more, "", "drop_oldest (the summary could not be made)"
        if await fits(more, new_summary):
            return more, new_summary, "summary"
        # The summary itself pushed the prompt over: drop more exchanges, unsummarized.
        return await self._search(turn, more, new_summary, fits), new_summary, "summary"

    def _fits(self, req: GenerationRequest, turn: Turn) -> Callable[[int, str], Awaitable[bool]]:
        async def fits(dropped: int, summary: str) -> bool:
            prompt = prompt_of(turn.history, dropped, summary)
            return await self.service.prompt_fits(dataclasses.replace(req, messages=prompt))

        return fits

    async def _search(
        self, turn: Turn, dropped: int, summary: str, fits: Callable[[int, str], Awaitable[bool]]
    ) -> int:
        search = DropSearch(turn.history, dropped)
        while (candidate := search.candidate()) is not None:
            search.answer(await fits(candidate, summary))
        return search.result()

    async def _summarize(self, req: GenerationRequest, turn: Turn, start: int, end: int, earlier: str) -> str:
        """The model's own summary of the messages left out (with the earlier summary), greedy."""
        head = leading_system(turn.history)
        lines = [SUMMARY_PREFIX + earlier] if earlier else []
        lines += [f"{m.role}: {m.content}" for m in turn.history[head + start : head + end]]
        transcript = "\n\n".join(lines)[-SUMMARY_MAX_CHARS:]
        ask = GenerationRequest(
            kind="chat",
            model=req.model,
            messages=(ChatMessage("system", SUMMARY_INSTRUCTIONS), ChatMessage("user", transcript)),
            max_tokens=self.summary_tokens,
            temperature=0.0,
            seed=0,
            cache_prompt=False,
        )
        while not await self.service.prompt_fits(ask) and len(transcript) > 1000:
            transcript = transcript[len(transcript) // 2 :]  # the newest half
            ask = dataclasses.replace(ask, messages=(ask.messages[0], ChatMessage("user", transcript)))
        job = await self.service.start_job(ask, "conversation-summary")
        try:
            body = await openai_http.collect(job)
        finally:
            job.cancel()
            job.events.close()
        text = str(body["choices"][0]["message"]["content"] or "").strip()
        self.service.metrics.inc("swarm_gateway_conversation_summaries_total")
        return text
