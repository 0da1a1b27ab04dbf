"""A session's calls and the transcripts they make (actors/gateway/sessions.py): a call that
continues the transcript joins it with the ids between masked; a re-rendered history gets
the sampled ids back where the texts agree, counted; a rewritten one starts a transcript."""
import numpy as np
import pytest

from actors.gateway.server import cut_at_stop
from actors.gateway.sessions import Call, Session, answer_splice, same_answer, splice

pytestmark = pytest.mark.unit

VOCAB = {1: "a", 2: "b", 3: "c", 4: "d", 5: "e", 9: "ab", 7: "x", 8: "b!"}


def decode(ids):
    return "".join(VOCAB[i] for i in ids)


def call(prompt, ids, version=0):
    return Call(prompt_ids=prompt, token_ids=ids, logprobs=np.full(len(ids), -0.5), versions=np.full(len(ids), version),
                finish_reason="stop")


def test_a_call_that_continues_the_transcript_joins_it():
    s = Session("s", prompt_index=3, sample_index=1)
    s.record(call([1], [2, 3], version=0))
    assert s.prompt_for([1, 2, 3, 4, 5], decode) == [1, 2, 3, 4, 5]
    s.record(call([1, 2, 3, 4], [5], version=1))
    (t,) = s.transcripts
    assert t.prompt_ids == [1] and t.response == [2, 3, 4, 5] and t.mask == [True, True, False, True]
    assert t.logprobs == [-0.5, -0.5, 0.0, -0.5] and t.versions == [0, 0, 0, 1] and t.calls == 2
    assert s.counts == {"calls": 2, "joined": 1, "retokenize_mismatch": 0, "rewritten": 0, "prompt_tokens": 0,
                        "cached_tokens": 0}  # the gateway counts those


def test_a_re_rendered_history_gets_the_sampled_ids_back_where_the_texts_agree():
    s = Session("s", prompt_index=0, sample_index=0)
    s.record(call([3], [1, 2]))           # sampled "a" "b"; the caller re-renders "ab" as one token
    prompt = s.prompt_for([3, 9, 4], decode)
    assert prompt == [3, 1, 2, 4] and s.counts["retokenize_mismatch"] == 1
    s.record(call(prompt, [5]))
    assert len(s.transcripts) == 1 and s.transcripts[0].response == [1, 2, 4, 5]


def test_a_rewritten_history_starts_a_transcript_of_its_own():
    s = Session("s", prompt_index=0, sample_index=0)
    s.record(call([3], [1, 2]))
    assert s.prompt_for([7, 4], decode) == [7, 4]
    s.record(call([7, 4], [5]))
    assert [t.prompt_ids for t in s.transcripts] == [[3], [7, 4]] and s.counts["rewritten"] == 1


def test_splice_refuses_a_token_that_straddles_the_history():
    assert splice([1, 2], [1, 8], decode) is None     # "b!" runs past the history's "ab"
    assert splice([1, 2], [9, 4], decode) == [1, 2, 4]
    assert splice([1, 2], [4], decode) is None


def test_a_stop_string_cuts_the_text_before_it_and_the_ids_after_the_token_that_completed_it():
    assert cut_at_stop([1, 2, 3, 4], ("c",), decode) == (3, "ab")
    assert cut_at_stop([1, 9, 4], ("bd", "ab"), decode) == (2, "a")  # the first to occur
    assert cut_at_stop([1, 2], ("z",), decode) == (2, "ab")


def test_kept_sets_of_the_calls_line_up_with_their_tokens_and_context_rows_are_empty():
    s = Session("s", prompt_index=0, sample_index=0)
    first = call([1], [2, 3])
    first.kept_ids = np.array([[2, 4], [3, 5]], dtype=np.int32)
    second = call([1, 2, 3, 4], [5])
    second.kept_ids = np.array([[5, 1, 2]], dtype=np.int32)
    s.record(first)
    s.record(second)
    assert s.transcripts[0].kept_ids().tolist() == [[2, 4, -1], [3, 5, -1], [-1, -1, -1], [5, 1, 2]]
    assert Session("t", prompt_index=0, sample_index=0).transcripts == [] and \
        (s.record(call([7], [1])) or s.transcripts[-1].kept_ids() is None)


def test_a_reward_is_posted_once():
    from actors.gateway.api import ApiError
    s = Session("s", prompt_index=0, sample_index=0)
    s.post_reward(0.5)
    with pytest.raises(ApiError) as e:
        s.post_reward(1.0)
    assert e.value.status == 409 and s.score == 0.5 and "already posted for session 's' (0.5)" in str(e.value)


EOS = 0


def render(messages, generation_prompt):
    """A toy template, a char-level tokenizer: '<role>:' content, tool calls as JSON with spaces
    after the separators (not as the policy wrote them), EOS and a newline after each message."""
    import json

    ids = []
    for m in messages:
        text = m["role"] + ":" + (m.get("content") or "")
        for c in m.get("tool_calls") or ():
            text += json.dumps({"name": c["function"]["name"], "args": json.loads(c["function"]["arguments"])})
        ids += [ord(ch) for ch in text] + [EOS, ord("\n")]
    return ids + ([ord(ch) for ch in "assistant:"] if generation_prompt else [])


def test_an_answer_sent_back_as_returned_is_spliced_at_its_end_of_turn():
    calls = [{"id": "c1", "type": "function", "function": {"name": "add", "arguments": '{"a": 2}'}}]
    answer = {"content": "ok", "tool_calls": calls}
    asked = [{"role": "user", "content": "hi"}]
    prompt = render(asked, True)
    sampled = [ord(ch) for ch in 'ok{"name":"add","args":{"a":2}}'] + [EOS]  # the policy's own spacing
    history = prompt + sampled
    back = {"role": "assistant", "content": "ok", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "add", "arguments": '{"a":2}'}}]}  # JSON-equal
    messages = asked + [back, {"role": "tool", "content": "2"}]
    spliced = answer_splice(history, messages, answer, render, EOS)
    assert spliced == history + [ord("\n")] + [ord(ch) for ch in "tool:2"] + [EOS, ord("\n")] + [
        ord(ch) for ch in "assistant:"]
    assert same_answer(back, answer) and not same_answer({**back, "content": "ok!"}, answer)
    assert answer_splice(history, asked + [{"role": "user", "content": "x"}], answer, render, EOS) is None
    s = Session("s", prompt_index=0, sample_index=0)
    s.record(call(prompt, sampled))
    assert s.prompt_for(render(messages, True), decode=lambda ids: "".join(map(chr, ids)),
                        at_answer=lambda h: answer_splice(h, messages, answer, render, EOS)) == spliced
    assert s.counts["retokenize_mismatch"] == 1
