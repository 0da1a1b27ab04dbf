"""reward.http: how the reward replicas call a reward server (reward.url, actors/http_reward.py)."""
from __future__ import annotations

from typing import Optional
from urllib.parse import urlsplit

from cluster.config.loader import ConfigError
from core.infra.schema import config_class, setting


@config_class
class RewardHTTPConfig:
    """A reward server (reward.url): batching, concurrency, time limits and retries of its requests."""
    batch_size: int = setting(64, "(prompt, response) pairs per request")
    concurrency: int = setting(4, "requests in flight at once per scoring call (one call per chunk per replica)")
    timeout_s: float = setting(30.0, "one request not answered within this many seconds is retried")
    retries: int = setting(3, "retries of a request after a connection error, a timeout or a 5xx/429 reply, "
                              "waiting backoff_s, then twice that, ...; a 4xx or a malformed reply is not retried")
    backoff_s: float = setting(0.5, "the wait before the first retry; it doubles with each")
    budget_s: float = setting(120.0, "all requests of one scoring call, retries included, end within this many "
                                     "seconds; pairs still unscored by then are invalid")
    label_field: Optional[str] = setting("answer", "the prompt rows' column sent as the request's 'labels' (null "
                                                   "where a row has no value; \"\" per pair when the data has no "
                                                   "such column or this is null, as OpenRLHF without --label_key)")
    skip_special_tokens: bool = setting(False, "false: 'query' is the pair's prompt + response ids decoded at once "
                                               "with special tokens kept (the end-of-turn token included), as "
                                               "OpenRLHF sends it; true: plain text, every field without special "
                                               "tokens and the query the prompt's text + the response's")


def check_reward_http(url: Optional[str], http: RewardHTTPConfig) -> None:
    """One line naming the key and the fix for a URL or settings no request could honour."""
    if url is not None:
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ConfigError(f"config: reward.url={url!r} is not an http(s) URL; give the reward server's "
                              "endpoint, e.g. http://127.0.0.1:5000/get_reward")
    if http.batch_size < 1 or http.concurrency < 1 or http.retries < 0:
        raise ConfigError(f"config: reward.http.batch_size={http.batch_size} and concurrency={http.concurrency} "
                          f"must be >= 1 and retries={http.retries} >= 0")
    if not (http.timeout_s > 0 and http.budget_s > 0 and http.backoff_s >= 0):
        raise ConfigError(f"config: reward.http.timeout_s={http.timeout_s} and budget_s={http.budget_s} must be "
                          f"> 0 and backoff_s={http.backoff_s} >= 0 (seconds)")
