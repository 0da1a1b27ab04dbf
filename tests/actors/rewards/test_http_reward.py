"""reward.url: the HTTP scorer against a real server on loopback (a thread of this process).

Each behaviour is driven by what the server does with the i-th request, never by how fast this
machine is: a "slow" server is one that does not answer until the test ends.
"""
import json

import numpy as np
import pytest
from reward_configs import reward_config
from reward_server import ClosedPort, RewardServer, rewards_by_length

from actors.rewards.config import RewardHTTPConfig
from actors.rewards.http import HTTPScorer, probe_server

pytestmark = pytest.mark.unit

PROMPTS = ["Q: 1+1?", "Q: 2+2?", "Q: 3+3?"]
RESPONSES = [" 2", " four", " 6!"]
COLUMNS = {"answer": ["2", "4", "6"], "source": ["gsm", "gsm", "math"], "meta": [{"k": 1}, None, [1, 2]]}


def _scorer(url, **kw):
    settings = dict(batch_size=2, concurrency=2, timeout_s=10.0, retries=2, backoff_s=0.01, budget_s=30.0)
    return HTTPScorer(url, RewardHTTPConfig(**{**settings, **kw}))


def test_a_healthy_server_scores_every_pair_in_order_in_batches():
    with RewardServer() as server:
        result = _scorer(server.url).score_texts(PROMPTS, RESPONSES, COLUMNS)
    np.testing.assert_array_equal(result.scores, [2.0, 5.0, 3.0])
    assert result.valid.all() and result.errors == [] and not result.failed
    assert sorted(len(b["query"]) for b in server.bodies) == [1, 2]  # batch_size=2: 3 pairs in 2 requests
    assert result.counts["http_requests"] == 2 and result.counts["http_retries"] == 0
    assert result.counts["http_seconds"] > 0


def test_the_payload_is_openrlhfs_plus_responses_and_columns():
    with RewardServer() as server:
        _scorer(server.url, batch_size=8).score_texts(PROMPTS, RESPONSES, COLUMNS)
    assert server.bodies == [{
        "query": ["Q: 1+1? 2", "Q: 2+2? four", "Q: 3+3? 6!"],
        "prompts": PROMPTS,
        "labels": ["2", "4", "6"],
        "responses": RESPONSES,
        "columns": {"answer": ["2", "4", "6"], "source": ["gsm", "gsm", "math"], "meta": [{"k": 1}, None, [1, 2]]},
    }]


def test_labels_come_from_label_field_and_are_empty_strings_without_it():
    with RewardServer() as server:
        _scorer(server.url, batch_size=8, label_field="source").score_texts(PROMPTS, RESPONSES, COLUMNS)
        _scorer(server.url, batch_size=8).score_texts(PROMPTS, RESPONSES, {})
        _scorer(server.url, batch_size=8, label_field="meta").score_texts(PROMPTS, RESPONSES, COLUMNS)
    assert server.bodies[0]["labels"] == ["gsm", "gsm", "math"]
    assert server.bodies[1]["labels"] == ["", "", ""] and server.bodies[1]["columns"] == {}  # as OpenRLHF's
    assert server.bodies[2]["labels"] == [{"k": 1}, None, [1, 2]]  # a row without a value: null


def test_scores_key_is_read_when_rewards_is_absent_and_null_items_are_invalid():
    reply = lambda i, body: (200, json.dumps({"scores": [1.0, None][:len(body["query"])]}))
    with RewardServer(reply) as server:
        result = _scorer(server.url).score_texts(PROMPTS[:2], RESPONSES[:2], {})
    assert result.scores[0] == 1.0 and result.valid.tolist() == [True, False]
    assert "NoneType instead of a number for 1 of 2 items" in result.errors[0]


def test_500s_are_retried_with_backoff_until_the_server_recovers():
    reply = lambda i, body: (500, "oops") if i < 2 else rewards_by_length(body)
    with RewardServer(reply) as server:
        result = _scorer(server.url, batch_size=8).score_texts(PROMPTS, RESPONSES, {})
    assert result.valid.all() and result.errors == []
    assert result.counts["http_requests"] == 3 and result.counts["http_retries"] == 2


def test_a_server_that_never_recovers_leaves_its_items_invalid_after_the_retries():
    with RewardServer(lambda i, body: (503, "down")) as server:
        scorer = _scorer(server.url, batch_size=8)
        result = scorer.score_texts(PROMPTS, RESPONSES, {})
    assert not result.valid.any() and result.failed and len(server.bodies) == 3  # 1 + retries=2
    assert result.errors == [f"reward server {server.url} replied HTTP 503 (3 attempts); all 3 items of the batch "
                             "invalid (is the server up? reward.http.retries/budget_s allow longer outages)"]
    assert scorer.stats() == {"http_requests": 3, "http_retries": 2}


def test_a_request_past_the_timeout_is_retried_and_the_retry_can_succeed():
    with RewardServer() as healthy:  # how long an answered request takes on this machine
        answered = _scorer(healthy.url, batch_size=8).score_texts(PROMPTS, RESPONSES, {}).counts["http_seconds"]
    server = RewardServer(lambda i, body: server.hang() if i == 0 else rewards_by_length(body))
    with server:  # a timeout the retry's answer is far within, here as on any machine
        result = _scorer(server.url, batch_size=8, timeout_s=0.5 + 20 * answered).score_texts(PROMPTS, RESPONSES, {})
    assert result.valid.all() and result.counts["http_retries"] == 1


def test_a_server_that_does_not_answer_leaves_items_invalid_within_the_budget():
    server = RewardServer(lambda i, body: server.hang())
    with server:
        result = _scorer(server.url, timeout_s=0.2, retries=100, budget_s=1.0).score_texts(PROMPTS, RESPONSES, {})
    assert not result.valid.any() and result.counts["http_seconds"] < 100 * 0.2  # the budget, not 100 retries' timeouts
    assert any("reward.http.budget_s=1 s" in e or "timeout_s" in e for e in result.errors), result.errors


@pytest.mark.parametrize("status, text, message", [
    (200, "not json", "replied with text that is not JSON ('not json')"),
    (200, '{"score": [1, 2, 3]}', "replied with JSON without a \"rewards\" list (keys ['score'])"),
    (200, "[1, 2, 3]", "replied with JSON without a \"rewards\" list (list)"),
    (200, '{"rewards": [1.0]}', "returned 1 scores for 3 items; all invalid"),
    (404, "no such route", "replied HTTP 404 ('no such route')"),
])
def test_a_malformed_reply_invalidates_its_batch_at_once(status, text, message):
    with RewardServer(lambda i, body: (status, text)) as server:
        result = _scorer(server.url, batch_size=8).score_texts(PROMPTS, RESPONSES, {})
    assert not result.valid.any() and len(server.bodies) == 1  # not retried: the server's bug
    assert len(result.errors) == 1 and message in result.errors[0], result.errors


def test_a_server_that_is_down_leaves_items_invalid_and_never_raises():
    with ClosedPort() as port:
        result = _scorer(port.url, batch_size=1).score_texts(PROMPTS, RESPONSES, {})
    assert not result.valid.any() and result.counts["http_retries"] == 6
    assert result.errors[0].startswith(f"reward server {port.url} did not answer (ClientConnectorError")
    assert len(result.errors) == 1 and result.errors[0].endswith("[3 batches alike]")  # one line, not three


def test_the_probe_names_the_url_and_the_fix():
    refused = r"^reward.url='http://127.0.0.1:\d+/get_reward': the reward server did not answer .* start the server"
    with ClosedPort() as port, pytest.raises(ValueError, match=refused):
        probe_server(port.url, PROMPTS, RESPONSES)
    with RewardServer(lambda i, body: (200, '{"score": 1}')) as server:
        with pytest.raises(ValueError, match=r'without a "rewards" list .* with \{"rewards": \[one float per pair\]\}'):
            probe_server(server.url, PROMPTS, RESPONSES)
    with RewardServer(lambda i, body: (200, '{"rewards": [null, null, null]}')) as server:
        with pytest.raises(ValueError, match="reply one finite float per pair"):
            probe_server(server.url, PROMPTS, RESPONSES)
    with RewardServer() as server:
        probe_server(server.url, PROMPTS, RESPONSES, {"answer": ["2", "4", "6"]})
    assert server.bodies[0]["labels"] == ["2", "4", "6"]


def test_a_reward_replica_with_a_url_sends_the_decoded_pairs_and_their_columns(policy_path, tokenizer):
    from actors.reward import Reward

    encode = lambda texts: [np.array(tokenizer(t)["input_ids"]) for t in texts]
    with RewardServer() as server:
        rw = Reward(config=reward_config(url=server.url, http={"batch_size": 8, "label_field": "gold"}),
                    tokenizer=policy_path)
        res = rw.score(encode(["Once", "Then"]), encode(["the cat was good", "it rained"]), {"gold": ["x", "y"]})
    (body,) = server.bodies
    assert body["query"] == ["Oncethe cat was good", "Thenit rained"] and body["labels"] == ["x", "y"]
    np.testing.assert_array_equal(res.scores, [16.0, 9.0])
    assert rw.stats()["http_requests"] == 1 and rw.health()["url"] == server.url
