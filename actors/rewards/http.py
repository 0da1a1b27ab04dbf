"""Scores from a reward server over HTTP (reward.url), in OpenRLHF's remote reward convention.

A server written for OpenRLHF's ``--remote_rm_url`` works unchanged: it gets the request OpenRLHF
sends for the same pair. Each request is a POST of a JSON object, one entry per (prompt,
response) pair, in order::

    {"query":     [text of prompt + response ids, ...],  # OpenRLHF's fields
     "prompts":   [text of prompt ids, ...],
     "labels":    [row[label_field], ...],
     "responses": [text of response ids, ...],            # tether's additions: OpenRLHF servers ignore them
     "columns":   {name: [value, ...], ...}}              # every other field of the prompt rows

Text is decoded as OpenRLHF decodes it (``decoded_pairs``): the query is the whole sequence's
ids decoded at once with special tokens kept, so it ends in the end-of-turn token a reward
model was trained to score, and the prompt keeps its chat template's tokens. Labels are the
``label_field`` column; ``""`` per pair where the data has no such column or ``label_field`` is
null (what OpenRLHF sends without ``--label_key``), null where a row's value is missing.
``skip_special_tokens=True`` sends plain text instead: every field without special tokens,
prompt and response decoded apart, the query their concatenation.

The reply is a JSON object ``{"rewards": [float, ...]}`` (``"scores"`` is read when
``"rewards"`` is absent; other keys such as ``"extra_logs"`` are ignored). An item that is null
or not a number is invalid, as from a reward function.

A scoring call (one chunk of rollouts on one reward replica) sends its pairs in batches of
``batch_size``, ``concurrency`` requests at a time. A request that fails to connect, times out
(``timeout_s``) or gets a 5xx or 429 reply is retried up to ``retries`` times, after
``backoff_s``, 2x, 4x, ... seconds; a 4xx or malformed reply (not JSON, no list of rewards, a
wrong count) is the server's bug and invalidates its batch at once. ``budget_s`` bounds the
whole call, retries included: pairs still unscored then are invalid. Every failure is a
one-line message in ``ScoreResult.errors``; ``score_texts`` never raises.
"""
from __future__ import annotations

import asyncio
import json
import time

import aiohttp
import numpy as np

from actors.rewards.config import RewardHTTPConfig
from actors.rewards.scoring import Columns, ScoreResult, coerce_scores, invalid_result
from core.infra.errors import type_and_first_line

RETRY_STATUS = (429,)  # besides 5xx: the server asks to come back later


class Retryable(Exception):
    """A request failure worth another try (connection, timeout, 5xx/429)."""


class Malformed(Exception):
    """A reply no retry will fix (4xx, not JSON, no list of rewards)."""


def decoded_pairs(tokenizer, prompt_ids: list, response_ids: list, skip_special_tokens: bool = False):
    """(queries, prompts, responses) of token pairs, as text for the request.

    Kept special tokens: the query decodes prompt + response ids in one piece, as OpenRLHF does
    (decoding them apart differs where a character's bytes or a word's leading space straddle
    the join). Skipped: plain text, the query the concatenation of the two texts.
    """
    decode = lambda seqs: tokenizer.batch_decode([np.asarray(s).tolist() for s in seqs],
                                                 skip_special_tokens=skip_special_tokens)
    prompts, responses = decode(prompt_ids), decode(response_ids)
    if skip_special_tokens:
        return [p + r for p, r in zip(prompts, responses)], prompts, responses
    return decode([np.concatenate([p, r]) for p, r in zip(prompt_ids, response_ids)]), prompts, responses


def payload(queries: list[str], prompts: list[str], responses: list[str], columns: Columns,
            label_field: str | None) -> dict:
    """The request body for pairs (see the module docstring); values JSON cannot hold become strings."""
    labels = columns.get(label_field) if label_field else None
    # OpenRLHF sends "" for every label when it is given no label column: a server may expect a string
    return {"query": list(queries), "prompts": list(prompts),
            "labels": list(labels) if labels is not None else [""] * len(prompts),
            "responses": list(responses), "columns": {k: list(v) for k, v in columns.items()}}


def rewards_of(body: str):
    """The reward list of a reply's text; Malformed (one line) if it has none."""
    try:
        reply = json.loads(body)
    except ValueError:
        raise Malformed(f"replied with text that is not JSON ({body[:60]!r})") from None
    if not isinstance(reply, dict) or not isinstance(reply.get("rewards", reply.get("scores")), list):
        what = f"keys {sorted(reply)[:6]}" if isinstance(reply, dict) else type(reply).__name__
        raise Malformed(f'replied with JSON without a "rewards" list ({what}); reply {{"rewards": [float, ...]}}')
    return reply["rewards"] if "rewards" in reply else reply["scores"]


class HTTPScorer:
    """A TextScorer (actors/rewards/scoring.py) asking the server at ``url``; settings as reward.http.*."""

    def __init__(self, url: str, settings: RewardHTTPConfig | None = None):
        s = settings or RewardHTTPConfig()
        self.url, self.name = url, f"reward server {url}"
        self.batch_size, self.concurrency, self.label_field = int(s.batch_size), int(s.concurrency), s.label_field
        self.skip_special_tokens = bool(s.skip_special_tokens)
        self.timeout_s, self.retries = s.timeout_s, int(s.retries)
        self.backoff_s, self.budget_s = s.backoff_s, s.budget_s
        self.totals = {"http_requests": 0, "http_retries": 0}

    def score_ids(self, tokenizer, prompt_ids: list, response_ids: list, columns: Columns) -> ScoreResult:
        """score_texts of token pairs, decoded with ``tokenizer`` as OpenRLHF decodes them (decoded_pairs)."""
        queries, prompts, responses = decoded_pairs(tokenizer, prompt_ids, response_ids, self.skip_special_tokens)
        return self.score_texts(prompts, responses, columns, queries=queries)

    def score_texts(self, prompts: list[str], responses: list[str], columns: Columns,
                    queries: list[str] | None = None) -> ScoreResult:
        """Scores of text pairs; ``queries`` (default: prompt + response) is the request's 'query'."""
        queries = [p + r for p, r in zip(prompts, responses)] if queries is None else queries
        n = len(prompts)
        if n == 0:
            return ScoreResult(np.zeros(0, np.float32), np.zeros(0, bool))
        start = time.perf_counter()
        counts = {"http_requests": 0, "http_retries": 0}
        try:
            parts = asyncio.run(self._score_all(queries, prompts, responses, columns, counts))
        except Exception as e:  # noqa: BLE001 - a bug here must not take the replica down
            parts = [invalid_result(n, f"{self.name}: scoring failed: {type_and_first_line(e)}; all {n} items "
                                       "invalid")]
        result = ScoreResult(np.concatenate([p.scores for p in parts]), np.concatenate([p.valid for p in parts]),
                             _summarise([e for p in parts for e in p.errors]), failed=all(p.failed for p in parts))
        for k, v in counts.items():
            self.totals[k] += v
        result.counts = {**counts, "http_seconds": time.perf_counter() - start}
        return result

    async def _score_all(self, queries, prompts, responses, columns: Columns, counts: dict) -> list[ScoreResult]:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.budget_s
        spans = [(i, min(i + self.batch_size, len(prompts))) for i in range(0, len(prompts), self.batch_size)]
        results: list = [None] * len(spans)
        gate = asyncio.Semaphore(self.concurrency)

        async def one(k: int, a: int, b: int) -> None:
            body = payload(queries[a:b], prompts[a:b], responses[a:b], {c: v[a:b] for c, v in columns.items()},
                           self.label_field)
            async with gate:
                results[k] = await self._batch(session, body, b - a, deadline, counts)

        async with aiohttp.ClientSession(json_serialize=lambda x: json.dumps(x, default=str)) as session:
            tasks = [asyncio.create_task(one(k, a, b)) for k, (a, b) in enumerate(spans)]
            _, pending = await asyncio.wait(tasks, timeout=max(deadline - loop.time(), 0))
            for t in pending:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        return [r if r is not None else invalid_result(b - a, self._budget_spent(b - a))
                for r, (a, b) in zip(results, spans)]

    async def _batch(self, session, body: dict, n: int, deadline: float, counts: dict) -> ScoreResult:
        """One batch's scores: its request, retried while the budget lasts."""
        loop = asyncio.get_running_loop()
        for attempt in range(self.retries + 1):
            left = deadline - loop.time()
            if left <= 0:
                return invalid_result(n, self._budget_spent(n))
            counts["http_requests"] += 1
            try:
                return coerce_scores(await self._post(session, body, min(self.timeout_s, left)), n, self.name)
            except Malformed as e:
                return invalid_result(n, f"{self.name} {e}; all {n} items of the batch invalid (not retried)")
            except Retryable as e:
                last = str(e)
            wait = self.backoff_s * 2 ** attempt
            if attempt == self.retries or loop.time() + wait >= deadline:
                break
            counts["http_retries"] += 1
            await asyncio.sleep(wait)
        return invalid_result(n, f"{self.name} {last} ({attempt + 1} attempts); all {n} items of the batch invalid "
                                 "(is the server up? reward.http.retries/budget_s allow longer outages)")

    async def _post(self, session, body: dict, timeout: float):
        try:
            async with session.post(self.url, json=body, timeout=aiohttp.ClientTimeout(total=timeout)) as resp:
                text = await resp.text()
                if resp.status >= 500 or resp.status in RETRY_STATUS:
                    raise Retryable(f"replied HTTP {resp.status}")
                if resp.status >= 300:
                    raise Malformed(f"replied HTTP {resp.status} ({text[:80]!r})")
        except asyncio.TimeoutError:
            raise Retryable(f"did not answer within reward.http.timeout_s={timeout:g} s") from None
        except aiohttp.ClientError as e:
            raise Retryable(f"did not answer ({type_and_first_line(e)})") from None
        return rewards_of(text)

    def _budget_spent(self, n: int) -> str:
        return (f"{self.name} did not score a batch of {n} items within reward.http.budget_s={self.budget_s:g} s "
                "(retries included); those items are invalid")

    def stats(self) -> dict:
        return dict(self.totals)

    def close(self) -> None:
        pass  # each call opens and closes its own session


def probe_server(url: str, prompts: list[str], responses: list[str], columns: Columns | None = None,
                 settings: RewardHTTPConfig | None = None) -> None:
    """Ask the server once, without retries, to score example pairs, as the replicas will; a
    one-line ValueError naming reward.url and the fix if it is down, does not answer within
    reward.http.timeout_s, replies an error or no list of rewards, or scores no pair with a number."""
    s = settings or RewardHTTPConfig()
    timeout_s = s.timeout_s
    n, where = len(prompts), f"reward.url={url!r}: the reward server"
    body = payload([p + r for p, r in zip(prompts, responses)], prompts, responses, columns or {}, s.label_field)

    async def ask():
        async with aiohttp.ClientSession(json_serialize=lambda x: json.dumps(x, default=str)) as session:
            return await HTTPScorer(url)._post(session, body, timeout_s)
    try:
        rewards = asyncio.run(ask())
    except Retryable as e:
        raise ValueError(f"{where} {e} on a start-up probe with {n} example (prompt, response) pairs; start the "
                         "server (or correct reward.url) before the run") from None
    except Malformed as e:
        raise ValueError(f"{where} {e} on a start-up probe with {n} example (prompt, response) pairs; it must "
                         'answer a POST of {"query", "prompts", "labels"} with {"rewards": [one float per pair]}'
                         ) from None
    result = coerce_scores(rewards, n, where)
    if n and not result.valid.any():
        raise ValueError(f"{result.errors[0]} (a start-up probe); reply one finite float per pair, in order "
                         "(null marks a pair invalid, and a run whose every pair is invalid trains on nothing)")


def _summarise(errors: list[str], keep: int = 3) -> list[str]:
    """Distinct messages, the first ``keep`` of them, and how many more: a call of many batches
    failing alike logs one line, not one per batch."""
    shown = list(dict.fromkeys(errors))[:keep]
    extra = len(errors) - sum(errors.count(e) for e in shown)
    return [e + (f" [{errors.count(e)} batches alike]" if errors.count(e) > 1 else "") for e in shown] + \
        ([f"... and {extra} more failed batches"] if extra > 0 else [])
