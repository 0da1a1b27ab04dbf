"""The gateway: an OpenAI-compatible HTTP endpoint over the generator pool, one base URL per session.

An agent written for any OpenAI-compatible endpoint is pointed at its session's base URL,
``http://<node>:<port>/sessions/<id>/v1``, and calls ``/chat/completions`` or ``/completions``
there as often as it likes. Each call is rendered to ids (the policy's chat template, the
caller's ``tools`` passed to it), continued from the session's exact transcript where the
caller's history re-renders it (sessions.py), sampled by one generator replica at the run's
sampling settings, and recorded token by token: the ids, their behaviour log-probs and the
policy version of each, which is what the learner trains on.

A session's calls go to one replica while it lives (its prefix cache holds the session's
history); when that replica dies mid-call the call is served again by another with the same
seed (seeded by the session's prompt index, sample index and call number, and the policy
version), so the session goes on as it would have. The server binds this node's address on
a port the OS picks; ``start()`` returns the address.

    gateway = ray.remote(Gateway).remote(generators={"generator-0": handle}, tokenizer=path,
                                         model_name="policy", sampling=cfg.generator.sampling,
                                         max_model_len=512)
    address = ray.get(gateway.start.remote())
    url = ray.get(gateway.open_session.remote("s1", prompt_index=0, sample_index=0))
    openai.OpenAI(base_url=url, api_key="unused").chat.completions.create(model="policy", messages=[...])
    session = ray.get(gateway.close_session.remote("s1"))   # its transcripts
"""
from __future__ import annotations

import asyncio
import os
import time
from typing import Callable, Optional

import numpy as np

from actors.admitted_calls import AGENT_CALLS_GROUP
from actors.gateway.api import (
    Answer,
    ApiError,
    CallRequest,
    chat_request,
    chat_response,
    completion_request,
    completion_response,
    models_response,
    reward_of,
)
from actors.gateway.sessions import Call, Session, answer_splice
from actors.gateway.tool_calls import ToolCallReader
from core.infra.errors import type_and_first_line
from core.modeling.engine_config import SamplingConfig


def cut_at_stop(ids: list[int], stops: tuple[str, ...], decode: Callable[[list[int]], str]) -> tuple[int, str]:
    """(how many of ``ids`` the answer keeps, its text): the text up to the first stop string
    (which is not returned), the ids up to the token that completed it; all of them when none occurs."""
    text = decode(ids)
    hits = [(text.find(s), s) for s in stops if s in text]
    if not hits:
        return len(ids), text
    at, stop = min(hits)
    for k in range(1, len(ids) + 1):
        if len(decode(ids[:k])) >= at + len(stop):
            return k, text[:at]
    return len(ids), text[:at]


class Gateway:
    """OpenAI's chat and completions APIs over ``generators`` (replica name -> Generator handle)."""

    def __init__(self, *, generators: dict, tokenizer: str, model_name: str,
                 sampling: SamplingConfig | dict, max_model_len: int, max_response_tokens: Optional[int] = None,
                 host: Optional[str] = None, call_timeout_s: float = 300.0, tool_parser: Optional[str] = None) -> None:
        """max_response_tokens: what one transcript's response (the calls' tokens and the context
        between them) may hold, the learner's horizon (env.max_tokens); None: max_model_len alone.
        tool_parser: the vLLM tool parser that reads a chat answer's tool calls when the call passes
        ``tools`` (tool_calls.py); None: answers are text."""
        from transformers import AutoTokenizer

        self.generators = dict(generators)
        self.tokenizer = AutoTokenizer.from_pretrained(tokenizer)
        self.model_name, self.max_model_len, self.host = model_name, int(max_model_len), host
        self.max_response_tokens = max_response_tokens
        self.tool_calls = None if tool_parser is None else ToolCallReader(tool_parser, self.tokenizer)
        self.sampling = sampling if isinstance(sampling, SamplingConfig) else SamplingConfig(**sampling)
        self.call_timeout_s = float(call_timeout_s)
        self.sessions: dict[str, Session] = {}
        self._incarnations: dict[str, str] = {}  # replica name -> the actor id its sessions were opened by
        self.address: Optional[str] = None
        self.counts = {"requests": 0, "refused": 0, "failed": 0, "in_flight": 0, "failovers": 0}
        self._runner, self._starting = None, asyncio.Lock()
        self._created = int(time.time())

    # ---- the server
    async def start(self) -> str:
        """Serve on this node's address, on a port the OS picks; -> ``http://host:port``."""
        async with self._starting:  # sessions opened at once on a restarted gateway: one server
            if self.address is None:
                await self._serve_http()
        return self.address

    async def _serve_http(self) -> None:
        from aiohttp import web

        app = web.Application()
        app.add_routes([web.post("/sessions/{sid}/v1/chat/completions", self._chat),
                        web.post("/sessions/{sid}/v1/completions", self._completions),
                        web.get("/sessions/{sid}/v1/models", self._models),
                        web.post("/sessions/{sid}/reward", self._reward)])
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        host = self.host or _node_address()
        await web.TCPSite(self._runner, host, 0).start()
        port = self._runner.addresses[0][1]
        self.address = f"http://{host}:{port}"

    # ---- sessions (called by whoever runs the episodes)
    async def open_session(self, sid: str, *, prompt_index: int, sample_index: int,
                           replica: Optional[str] = None, handle=None, incarnation: str = "") -> str:
        """A new session's base URL (the agent's ``base_url``). ``replica``, with its ``handle``
        and ``incarnation`` (its actor id): the generator its calls go to while it lives, e.g.
        the one playing the episode; a new incarnation of a known name is its replacement, and
        the dead one's sessions are dropped."""
        if sid in self.sessions:
            raise ValueError(f"gateway: session {sid!r} is already open")
        address = await self.start()  # a restarted gateway serves again, on a port of its own
        if handle is not None:
            if self._incarnations.get(replica, incarnation) != incarnation:
                self.sessions = {k: s for k, s in self.sessions.items() if s.replica != replica}
            self.generators[replica], self._incarnations[replica] = handle, incarnation
        session = self.sessions[sid] = Session(sid, prompt_index=prompt_index, sample_index=sample_index)
        session.replica = replica
        return f"{address}/sessions/{sid}/v1"

    def close_session(self, sid: str) -> Optional[Session]:
        """The session's record (its transcripts and counts), None if this gateway does not hold
        it (it restarted since the session opened); later calls to it are refused."""
        return self.sessions.pop(sid, None)

    def replica_of(self, sid: str) -> Optional[str]:
        """The replica the session's calls go to now (None before its first)."""
        return self.sessions[sid].replica

    def health(self) -> dict:
        return {"address": self.address, "pid": os.getpid(), "sessions": len(self.sessions),
                "replicas": sorted(self.generators), **self.counts}

    # ---- the routes
    async def _chat(self, request):
        return await self._handle(request, chat_request, chat_response)

    async def _completions(self, request):
        return await self._handle(request, completion_request, completion_response)

    async def _models(self, request):
        from aiohttp import web
        return web.json_response(models_response(self.model_name, self._created))

    async def _reward(self, request):
        """``POST /sessions/<id>/reward`` ``{"reward": x}``: the episode's score, once, while it runs."""
        return await self._answer(request, self._post_reward)

    async def _post_reward(self, session: Session, body) -> dict:
        session.post_reward(reward_of(body))
        return {"session": session.sid, "reward": session.score}

    async def _answer(self, request, respond):
        """``respond(session, body)`` for a request to an open session; an ApiError as OpenAI's error body."""
        from aiohttp import web

        try:
            session = self.sessions.get(request.match_info["sid"])
            if session is None:
                raise ApiError(f"no session {request.match_info['sid']!r} is open on this gateway (a session's URL "
                               "is valid from its opening to the end of its episode)", status=404,
                               code="session_not_found")
            try:
                body = await request.json()
            except ValueError:
                raise ApiError("the request body is not valid JSON") from None
            return web.json_response(await respond(session, body))
        except ApiError as e:
            self.counts["refused"] += 1
            return web.json_response(e.body(), status=e.status)

    async def _handle(self, request, parse, respond):
        """A chat or completions call: parsed, served, answered; a replica's failure as a 500 in one line."""
        from aiohttp import web

        self.counts["requests"] += 1

        async def serve(session: Session, body) -> dict:
            call = parse(body, served=self.model_name, sampling=self.sampling)
            return respond(await self._serve(session, call), model=self.model_name, logprobs=call.logprobs)

        try:
            return await self._answer(request, serve)
        except Exception as e:  # noqa: BLE001 - a replica's failure: the caller gets one line, the server goes on
            self.counts["failed"] += 1
            cause = e.cause if getattr(e, "cause", None) is not None else e  # a replica's own error, not Ray's banner
            error = ApiError(f"the call failed: {type_and_first_line(cause)}", status=500, type="server_error")
            return web.json_response(error.body(), status=500)

    # ---- one call
    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def _render(self, call: CallRequest) -> list[int]:
        if not call.chat:
            return list(self.tokenizer(call.prompt)["input_ids"])
        return self._template(call.messages, call.tools, True)

    def _template(self, messages: list[dict], tools, generation_prompt: bool) -> list[int]:
        if not getattr(self.tokenizer, "chat_template", None):
            raise ApiError("the policy's tokenizer has no chat template: call /v1/completions with a text prompt, "
                           "or train a policy whose tokenizer has one", param="messages")
        try:
            out = self.tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=generation_prompt,
                                                     tokenize=True)
        except Exception as e:  # noqa: BLE001 - the template's own refusal (a role it does not know, ...)
            raise ApiError(f"the policy's chat template cannot render these messages: {type_and_first_line(e)}",
                           param="messages") from None
        return [int(i) for i in (out["input_ids"] if hasattr(out, "keys") else out)]

    def _at_answer(self, session: Session, call: CallRequest):
        """The history's splice at the last answer, as sent back (sessions.answer_splice)."""
        if not call.chat or session.answer is None:
            return lambda history: None
        render = lambda messages, generation_prompt: self._template(messages, call.tools, generation_prompt)  # noqa: E731
        return lambda history: answer_splice(history, call.messages, session.answer, render,
                                             self.tokenizer.eos_token_id)

    async def _serve(self, session: Session, call: CallRequest) -> Answer:
        prompt = session.prompt_for(self._render(call), self._decode, self._at_answer(session, call))
        room = min(call.max_tokens, self.max_model_len - len(prompt))
        if room < 1:
            raise ApiError(f"the conversation is {len(prompt)} tokens: no room for an answer within the engine's "
                           f"max_model_len={self.max_model_len}", param="messages", code="context_length_exceeded")
        if self.max_response_tokens is not None:
            used = session.response_tokens(prompt)
            room = min(room, self.max_response_tokens - used)
            if room < 1:
                raise ApiError(f"this episode's transcript already holds {used} response tokens (its calls and the "
                               f"context between them): env.max_tokens={self.max_response_tokens} leaves no room "
                               "for another call; end the episode", param="messages", code="context_length_exceeded")
        key = (session.prompt_index, session.sample_index, session.counts["calls"])
        self.counts["in_flight"] += 1
        try:
            turn = await self._sample(session, prompt, room, key)
        finally:
            self.counts["in_flight"] -= 1
        session.counts["prompt_tokens"] += len(prompt)
        session.counts["cached_tokens"] += turn.cached_tokens
        ids = list(turn.token_ids)
        keep, text = cut_at_stop(ids, call.stop, self._decode)
        eos = self.tokenizer.eos_token_id
        finish = "stop" if keep < len(ids) or (ids and ids[-1] == eos) else "length"
        versions = np.asarray(turn.versions[:keep], dtype=np.int64)  # sample_turns labels every token
        kept = None if turn.kept_ids is None else np.asarray(turn.kept_ids)[:keep]
        session.record(Call(prompt_ids=prompt, token_ids=ids[:keep], logprobs=np.asarray(turn.logprobs[:keep]),
                            versions=versions, finish_reason=finish, kept_ids=kept))
        shown = [t for t in ids[:keep] if t != eos]
        calls = ()
        if call.chat and call.tools and self.tool_calls is not None:  # the tags may be special tokens
            text, calls = self.tool_calls.read(self.tokenizer.decode(shown), call.messages, call.tools)
            finish = "tool_calls" if calls else finish
        session.answer = {"content": text, "tool_calls": list(calls)} if call.chat else None
        return Answer(call_id=f"{session.sid}-{session.counts['calls']}", text=text,
                      tokens=[self._decode([t]) for t in shown],
                      logprobs=[float(v) for v in turn.logprobs[:len(shown)]],
                      finish_reason=finish, prompt_tokens=len(prompt), created=int(time.time()),
                      tool_calls=tuple(calls))

    async def _sample(self, session: Session, prompt: list[int], room: int, key: tuple):
        """One turn from the session's replica; another one's, with the same seed, if it dies."""
        from ray.exceptions import RayActorError

        while True:
            if not self.generators:
                raise ApiError("no generator replica is alive to serve this call; retry once the pool has "
                               "replaced it", status=503, type="server_error", code="no_replica")
            session.replica = self.route(session)
            handle = self.generators[session.replica]
            try:
                call = handle.serve_turn.options(concurrency_group=AGENT_CALLS_GROUP).remote(prompt, room, key)
                return await asyncio.wait_for(call, timeout=self.call_timeout_s)
            except RayActorError:
                self.generators.pop(session.replica, None)
                self.counts["failovers"] += 1
            except asyncio.TimeoutError:
                raise ApiError(f"the generator did not answer within {self.call_timeout_s:.0f}s", status=504,
                               type="server_error", code="timeout") from None

    def route(self, session: Session) -> str:
        """The live replica the session's next call goes to: its own while it lives (affinity:
        that replica's prefix cache holds the session's history), else the least bound one."""
        if session.replica in self.generators:
            return session.replica
        return min(self.generators, key=self._load)

    def _load(self, name: str) -> int:
        """Sessions bound to replica ``name`` (a new session goes to the least bound)."""
        return sum(s.replica == name for s in self.sessions.values())


def _node_address() -> str:
    import ray

    return ray.util.get_node_ip_address()
