"""reward.url sends what OpenRLHF sends: a reward replica's request for token pairs, read by a
real server on loopback, against the payload OpenRLHF's own code builds for the same pair.

The reference is OpenRLHF 0.11.2 (pip wheel), reimplemented below in a few lines:
- openrlhf/datasets/prompts_dataset.py, preprocess_data: the prompt is the chat template's text
  (``apply_chat_template(chat, tokenize=False, add_generation_prompt=True)``) and the label is
  ``data[label_key]``, or ``""`` without ``--label_key``;
- openrlhf/utils/agent.py, SingleTurnAgentExecutor.execute: ``prompt_token_ids =
  hf_tokenizer(text=prompt, add_special_tokens=False)``, the response is vLLM's token ids (the
  EOS included), and ``query = hf_tokenizer.decode(prompt_token_ids + action_token_ids,
  skip_special_tokens=False)``;
- ibid., _fetch_rewards_via_http: the body is ``{"query": [...], "prompts": [...], "labels": [...]}``.
OpenRLHF 0.8.11 (openrlhf/trainer/ppo_utils/experience_maker.py) decodes the same ids the same way,
after dropping padding by the attention mask (utils.remove_pad_token); unpadded, as here, that is
the same string.
"""
import numpy as np
import pytest
from reward_configs import reward_config
from reward_server import RewardServer

from cluster.demo.tiny_models import build_tokenizer

pytestmark = pytest.mark.unit

# ChatML whose end of turn is the tokenizer's EOS; <|im_start|> is made a special token below.
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}{{ eos_token }}\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
CHATS = [[{"role": "user", "content": "What is 2+2?"}], [{"role": "user", "content": "Say hi."}]]
ANSWERS = ["4", "hi"]


@pytest.fixture(scope="module")
def chat_tok(tmp_path_factory):
    """(path, tokenizer): the tiny byte-level BPE with a chat template and two special tokens."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(build_tokenizer()))
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>"]})
    tok.chat_template = CHATML
    path = tmp_path_factory.mktemp("chat-tok")
    tok.save_pretrained(path)
    return str(path), tok


def _pairs(tok):
    """Token ids as tether's data and generator hold them: the templated prompt (data.chat_template
    tokenizes without adding special tokens) and a response, the first ending in EOS as a stopped
    generation does, the second cut off by the length limit."""
    prompts = [tok.apply_chat_template(c, tokenize=False, add_generation_prompt=True) for c in CHATS]
    prompt_ids = [tok(p, add_special_tokens=False)["input_ids"] for p in prompts]
    response_ids = [tok(" The sum is 4.", add_special_tokens=False)["input_ids"] + [tok.eos_token_id],
                    tok(" hi there", add_special_tokens=False)["input_ids"]]
    return prompts, prompt_ids, response_ids


def openrlhf_body(tok, prompts, prompt_ids, response_ids, labels):
    """The request OpenRLHF 0.11.2 POSTs for these pairs (see the module docstring)."""
    queries = [tok.decode(p + r, skip_special_tokens=False) for p, r in zip(prompt_ids, response_ids)]
    return {"query": queries, "prompts": prompts, "labels": labels}


def _request(tok_path, prompt_ids, response_ids, columns, **http):
    from actors.reward import Reward

    with RewardServer() as server:
        rw = Reward(config=reward_config(url=server.url, http={"batch_size": 8, **http}), tokenizer=tok_path)
        result = rw.score([np.array(p) for p in prompt_ids], [np.array(r) for r in response_ids], columns)
    assert result.valid.all(), result.errors
    (body,) = server.bodies
    return body


def test_the_request_is_the_payload_openrlhf_builds_for_the_same_pairs(chat_tok):
    path, tok = chat_tok
    prompts, prompt_ids, response_ids = _pairs(tok)
    body = _request(path, prompt_ids, response_ids, {"answer": ANSWERS})
    expected = openrlhf_body(tok, prompts, prompt_ids, response_ids, labels=ANSWERS)
    assert {k: body[k] for k in expected} == expected
    # the point of it: an OpenRLHF reward model scores the end-of-turn token, not the last word
    assert body["query"][0].endswith("The sum is 4." + tok.eos_token)
    assert body["query"][0].startswith("<|im_start|>user\n")
    assert body["responses"] == [tok.decode(r, skip_special_tokens=False) for r in response_ids]


def test_without_a_label_column_the_labels_are_empty_strings_as_openrlhfs(chat_tok):
    path, tok = chat_tok
    prompts, prompt_ids, response_ids = _pairs(tok)
    for http in ({}, {"label_field": None}):  # no 'answer' column; no label field at all
        body = _request(path, prompt_ids, response_ids, {"source": ["a", "b"]}, **http)
        assert body["labels"] == openrlhf_body(tok, prompts, prompt_ids, response_ids, ["", ""])["labels"]


def test_skip_special_tokens_sends_plain_text_decoded_apart(chat_tok):
    path, tok = chat_tok
    _, prompt_ids, response_ids = _pairs(tok)
    body = _request(path, prompt_ids, response_ids, {}, skip_special_tokens=True)
    plain = lambda seqs: tok.batch_decode(seqs, skip_special_tokens=True)
    assert body["prompts"] == plain(prompt_ids) == ["user\nWhat is 2+2?\nassistant\n", "user\nSay hi.\nassistant\n"]
    assert body["responses"] == plain(response_ids) == [" The sum is 4.", " hi there"]
    assert body["query"] == [p + r for p, r in zip(body["prompts"], body["responses"])]
