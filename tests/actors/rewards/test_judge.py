"""reward.judge: the template, the parsers, and a Reward replica hosting the tiny judge's engine."""
import logging

import numpy as np
import pytest
from reward_configs import reward_config

from actors.rewards.judge import (
    check_template,
    judge_token_ids,
    parse_choice,
    parse_number,
    parse_verdicts,
    render,
    template_fields,
)

# A chat template whose rendering is easy to write by hand.
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@pytest.mark.unit
def test_template_fields_and_render():
    t = "Q: {prompt}\nA: {response}\nGold: {answer[0]} {meta.x} {{literal}}"
    assert template_fields(t) == {"prompt", "response", "answer", "meta"}
    assert render("{prompt}|{response}|{answer}", ["p1", "p2"], ["r1", "r2"], {"answer": [1, "b"], "other": [0, 0]}) \
        == ["p1|r1|1", "p2|r2|b"]


@pytest.mark.unit
@pytest.mark.parametrize("template, needle", [
    ("{prompt} {answer}", "names the field 'answer', which the data does not have (available: prompt, response, "
                          "source)"),
    ("{prompt", "is not a valid format string (expected '}' before end of string)"),
    ("{} {response}", "has a positional field {}"),
    ("{0}", "has a positional field {0}"),
])
def test_template_errors_are_one_line(template, needle):
    with pytest.raises(ValueError) as e:
        check_template(template, ["source"])
    assert needle in str(e.value) and "\n" not in str(e.value)
    check_template("{prompt}{response}{source}", ["source"])  # every field known


@pytest.mark.unit
@pytest.mark.parametrize("column", ["response", "prompt"])
def test_a_column_named_like_the_pair_is_refused_in_one_line(column):
    # str.format would get the name twice (a TypeError at the first scoring, stopping the run)
    with pytest.raises(ValueError) as e:
        check_template("{prompt} {response}", ["answer", column])
    assert str(e.value) == (f"the data has a column named {column!r}, which reward.judge.template cannot tell from "
                            f"the {column} being scored ({{{column}}}); rename that column in the data, or leave it "
                            "out of data.columns")
    with pytest.raises(ValueError, match=f"the data has a column named {column!r}"):  # a batch: the scorer's error
        render("{prompt} {response}", ["p"], ["r"], {column: ["x"]})


@pytest.mark.unit
def test_the_judge_reads_the_chat_templates_rendering_of_the_filled_template(policy_path):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(policy_path)
    tokenizer.chat_template = CHATML
    text = "Prompt: The cat was\nResponse: happy.\nScore:"
    ids = judge_token_ids(tokenizer, text, chat_template=True)
    assert all(isinstance(i, int) for i in ids)
    assert tokenizer.decode(ids) == f"<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n"
    assert tokenizer.decode(judge_token_ids(tokenizer, text, chat_template=False)) == text


@pytest.mark.unit
def test_parsers():
    assert parse_number(" 7/10") == 7.0
    assert parse_number("Score: -2.5e1 then 3") == -25.0
    assert parse_number(" 12", 0, 10) == 10.0 and parse_number("-3", 0, 10) == 0.0
    assert np.isnan(parse_number(" great"))
    choices = {"A": 1.0, "B": 0.0, "AB": 0.5}
    assert parse_choice(" B, not A", choices) == 0.0
    assert parse_choice("AB", choices) == 0.5  # the longer label at the same place
    assert np.isnan(parse_choice(" neither", choices))


@pytest.mark.unit
def test_unreadable_verdicts_are_invalid_with_one_line():
    res = parse_verdicts([" 1", " none", " 0", "?"], None, None, None, "reward judge j")
    assert res.valid.tolist() == [True, False, True, False] and not res.failed
    assert res.scores[0] == 1 and np.isnan(res.scores[1])
    assert len(res.errors) == 1 and "2 of 4 verdicts had no number (first at index 1: ' none')" in res.errors[0]


@pytest.mark.unit
def test_the_default_template_is_the_one_the_tiny_judge_learnt():
    from actors.rewards.config import DEFAULT_TEMPLATE
    from cluster.demo.judge import JUDGE_TEMPLATE
    assert DEFAULT_TEMPLATE == JUDGE_TEMPLATE


# Pairs on which the tiny judge (cluster/demo/judge.py) agrees with is_positive by a clear margin: its
# logit for the right digit leads by 1.2 to 4.1 nats in fp32 and bf16 alike, so no CPU's bf16 kernels
# flip a verdict (" glad." led by 0.1 nats or trailed by 0.1, depending on the machine).
PROMPTS = ["The cat was", "My friend felt"] * 3
RESPONSES = [" happy in the park.", " sad at night.", " glad in the park.", " awful by the sea.", " lovely at home.",
             " cold in winter."]


def _judge(**settings):
    """reward.judge for the tiny judge, with ``settings`` over it."""
    from actors.rewards.config import DEFAULT_TEMPLATE, JudgeConfig
    from cluster.demo.judge import build_judge
    from core.modeling.engine_config import EngineConfig
    return JudgeConfig(**{"model": str(build_judge()), "template": DEFAULT_TEMPLATE,
                          "engine": EngineConfig(dtype="bfloat16", kv_cache_bytes=16 << 20), **settings})


def _encode(tokenizer, texts):
    return [np.array(tokenizer(t)["input_ids"]) for t in texts]


@pytest.mark.integration
def test_a_judge_replica_scores_pairs_with_the_judges_verdicts(policy_path, tokenizer, in_process_engine):
    from actors.reward import Reward
    from cluster.demo.sentiment import is_positive

    rw = Reward(config=reward_config(judge=_judge()), tokenizer=policy_path)
    res = rw.score(_encode(tokenizer, PROMPTS), _encode(tokenizer, RESPONSES))
    assert res.valid.all() and not res.errors
    assert res.scores.tolist() == is_positive(PROMPTS, RESPONSES) == [1.0, 0.0] * 3
    health = rw.health()
    assert health["dtype"] == "bfloat16" and health["judge_generated_tokens"] > 0 and health["invalid_items"] == 0


@pytest.mark.integration
def test_verdicts_without_a_label_are_invalid_and_the_replica_serves_on(policy_path, tokenizer, in_process_engine,
                                                                        caplog):
    from actors.reward import Reward

    rw = Reward(config=reward_config(judge=_judge(choices={"yes": 1.0, "no": 0.0})), tokenizer=policy_path)
    with caplog.at_level(logging.WARNING):
        res = rw.score(_encode(tokenizer, PROMPTS), _encode(tokenizer, RESPONSES))
    assert not res.valid.any() and np.isnan(res.scores).all() and not res.failed
    assert len(res.errors) == 1 and "6 of 6 verdicts had none of the labels 'yes', 'no'" in res.errors[0]
    assert rw.stats()["invalid_items"] == 6 and "verdicts had none of the labels" in caplog.text
    long = rw.score(_encode(tokenizer, ["The cat was"]), _encode(tokenizer, [" good" * 600]))  # past max_model_len
    assert not long.valid.any() and "do not fit reward.judge.engine.max_model_len=512" in long.errors[0]


@pytest.fixture
def chat_judge(tmp_path):
    """The tiny judge with a chat template added to its tokenizer (as an instruct judge has)."""
    import shutil

    from transformers import AutoTokenizer

    from cluster.demo.judge import build_judge
    path = tmp_path / "chat-judge"
    shutil.copytree(build_judge(), path)
    tok = AutoTokenizer.from_pretrained(path)
    tok.chat_template = CHATML
    tok.save_pretrained(path)
    return path


@pytest.mark.integration
def test_with_chat_template_the_engine_gets_the_templates_rendering(chat_judge, in_process_engine, monkeypatch):
    from actors.rewards.judge import JudgeScorer

    scorer = JudgeScorer(_judge(model=str(chat_judge), chat_template=True))
    seen, generate = [], scorer.llm.generate

    def recording(prompts, *args, **kwargs):  # the real engine, its input kept
        seen.extend(list(p["prompt_token_ids"]) for p in prompts)
        return generate(prompts, *args, **kwargs)

    monkeypatch.setattr(scorer.llm, "generate", recording)
    res = scorer.score_texts(PROMPTS[:2], RESPONSES[:2], {})
    assert len(seen) == 2 and not res.failed and len(res.scores) == 2
    for ids, prompt, response in zip(seen, PROMPTS, RESPONSES):
        text = scorer.template.format(prompt=prompt, response=response)
        assert scorer.tokenizer.decode(ids) == f"<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n"


@pytest.mark.unit
@pytest.mark.parametrize("reply, n, scores", [
    ("1: 7\n2: 3", 2, [7.0, 3.0]),
    ("Response 1: 7/10\nResponse 2: 3/10", 2, [7.0, 3.0]),
    ("**Response 2**: 9\n**Response 1**: 4", 2, [4.0, 9.0]),  # in any order, by their numbers
    ("Scores: [7, 3.5, 0]", 3, [7.0, 3.5, 0.0]),
    ("#1 - 8.5\n#2 - 12", 2, [8.5, 10.0]),  # clipped to max_score
    ("6\n2", 2, [6.0, 2.0]),  # one number per line, unnumbered
    (" 1.5", 1, [1.5]),  # a decimal, not "1." numbering a 5
    ("1: 7", 2, None),  # one score for two responses
    ("[7, 3, 5]", 2, None),  # a list of three
    ("1: 7\n1: 3", 2, None),  # an index twice
    ("1: 7\n3: 2", 2, None),  # 2 missing
    ("all fine", 2, None),
])
def test_a_group_verdict_gives_exactly_n_scores_or_none(reply, n, scores):
    from actors.rewards.group_judge import parse_group_scores

    read = parse_group_scores(reply, n, 0.0, 10.0)
    assert (read is None) if scores is None else read.tolist() == scores


@pytest.mark.unit
def test_the_group_template_enumerates_the_responses_and_its_fields_are_checked():
    from actors.rewards.config import GROUP_TEMPLATE
    from actors.rewards.group_judge import check_group_template, render_group

    text = render_group(GROUP_TEMPLATE, "3 plus 4 is", [" 7", " 8."], {"answer": "7"})
    assert text.startswith("Prompt: 3 plus 4 is\n\nResponse 1:  7\n\nResponse 2:  8.\n\nScore each of the 2 responses")
    check_group_template("{prompt} {responses} {n} {answer}", ["answer"])
    with pytest.raises(ValueError, match="names the field 'response', which it does not have"):
        check_group_template("{prompt} {response}", ["answer"])
    with pytest.raises(ValueError, match="the data has a column named 'n'"):
        check_group_template("{prompt} {responses}", ["n"])


@pytest.mark.integration
def test_a_group_judge_calls_once_per_group_and_voids_a_group_without_n_scores(policy_path, tokenizer,
                                                                               in_process_engine, monkeypatch):
    from actors.reward import Reward

    # The tiny judge writes one digit and stops: a verdict for a group of one, too few for a group of two.
    template = "Prompt: {prompt}\n{responses}\nScore:"
    rw = Reward(config=reward_config(judge=_judge(mode="group", group_template=template)), tokenizer=policy_path)
    calls, generate = [], rw.scorer.llm.generate

    def recording(prompts, *args, **kwargs):  # the real engine, its inputs counted
        calls.append(len(prompts))
        return generate(prompts, *args, **kwargs)

    monkeypatch.setattr(rw.scorer.llm, "generate", recording)
    prompts, responses = _encode(tokenizer, PROMPTS[:4]), _encode(tokenizer, RESPONSES[:4])
    pairs = rw.score(prompts, responses, groups=[0, 0, 1, 1])  # two groups of two
    assert calls == [2] and not pairs.valid.any() and np.isnan(pairs.scores).all()
    assert len(pairs.errors) == 1 and "2 of 2 groups' verdicts did not give one score per response" in pairs.errors[0]
    single = rw.score(prompts, responses, groups=[0, 1, 2, 3])  # each response its own group
    assert calls == [2, 4] and single.valid.all() and set(single.scores.tolist()) <= {0.0, 1.0}
