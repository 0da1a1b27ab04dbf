"""The gateway as an agent meets it: the real `openai` client against a Gateway actor over two real
CPU generator actors (vLLM in each) on the shared Ray. Every answer is the ids vLLM sampled,
recorded with their log-probs; a conversation's calls make one transcript; what a run cannot
train on is refused in one line; a session whose replica is SIGKILLed goes on on the other,
with the same tokens the dead one would have sampled."""
import os
import shutil
import signal

import pytest

from core.columns import PromptColumns

pytestmark = pytest.mark.integration

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}{{ eos_token }}\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
SAMPLING = {"temperature": 1.0, "max_new_tokens": 12, "seed": 5}


@pytest.fixture(scope="module")
def chat_policy(policy_path, tmp_path_factory):
    """The tiny policy with a chat template on its tokenizer."""
    from transformers import AutoTokenizer

    path = tmp_path_factory.mktemp("chat-policy") / "policy"
    shutil.copytree(policy_path, path)
    tok = AutoTokenizer.from_pretrained(path)
    tok.chat_template = CHATML
    tok.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def gateway(ray_cluster, chat_policy):
    """A started Gateway over generator-0 and generator-1; -> (its handle, the replicas' handles)."""
    ray = ray_cluster
    from actors.gateway.server import Gateway
    from actors.generator import actor_class, engine_process_env
    from cluster.runtime.pools.threads import thread_env

    env = {**thread_env(1, vllm=True), **engine_process_env(num_gpus=0, tensor_parallel=1)}
    gens = {f"gw-generator-{i}": actor_class().options(name=f"gw-generator-{i}", num_cpus=1,
                                                       runtime_env={"env_vars": env}).remote(
        model=chat_policy, sampling=SAMPLING, engine={"max_model_len": 128, "kv_cache_bytes": 16 << 20})
        for i in range(2)}
    gw = ray.remote(num_cpus=0)(Gateway).options(name="gw-gateway").remote(
        generators=gens, tokenizer=chat_policy, model_name="policy", sampling=SAMPLING, max_model_len=128)
    try:
        ray.get([g.health.remote() for g in gens.values()])
        ray.get(gw.start.remote())
        yield gw, gens
    finally:
        for actor in [gw, *gens.values()]:
            ray.kill(actor)


def client(url):
    """The OpenAI client on a session's URL, as an agent gets it (no proxy from the environment)."""
    import httpx
    import openai
    return openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=120,
                         http_client=httpx.Client(trust_env=False))


def play(episodes, rows, n, tokenizer_path):
    """``episodes.play`` on (prompt index, text, columns) rows, as a generator calls it."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer_path)
    columns = PromptColumns(ids=[idx for idx, _, _ in rows], rows=[c for _, _, c in rows])
    return episodes.play([(tok(text)["input_ids"], idx) for idx, text, _ in rows], columns, tok, n)


def open_session(gw, sid, prompt_index=0, sample_index=0):
    import ray
    return ray.get(gw.open_session.remote(sid, prompt_index=prompt_index, sample_index=sample_index))


def test_a_conversation_is_the_ids_vllm_sampled_in_one_transcript(gateway, chat_policy):
    import ray
    from transformers import AutoTokenizer

    gw, _ = gateway
    tok = AutoTokenizer.from_pretrained(chat_policy)

    def rendered(messages):
        out = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        return list(out["input_ids"] if hasattr(out, "keys") else out)

    chat = client(open_session(gw, "talk", prompt_index=4))
    messages = [{"role": "user", "content": "The cat was"}]
    first = chat.chat.completions.create(model="policy", messages=messages, logprobs=True)
    messages += [{"role": "assistant", "content": first.choices[0].message.content},
                 {"role": "user", "content": "And the dog?"}]
    second = chat.chat.completions.create(model="policy", messages=messages, max_tokens=6)
    session = ray.get(gw.close_session.remote("talk"))

    (t,) = session.transcripts  # the second call continued the first: one transcript
    assert t.calls == 2 and session.counts["calls"] == 2 and session.counts["joined"] == 1
    assert t.prompt_ids == rendered(messages[:1])
    k1 = t.mask.index(False)  # the first call's sampled ids, then the context up to the second's
    k2 = k1 + t.mask[k1:].index(True)
    assert tok.decode(t.response[:k1], skip_special_tokens=True) == first.choices[0].message.content
    shown = first.choices[0].logprobs.content
    assert [c.logprob for c in shown] == t.logprobs[:len(shown)] and all(lp < 0 for lp in t.logprobs[:k1])
    assert t.logprobs[k1:k2] == [0.0] * (k2 - k1)  # context: not the policy's, not trained
    # the transcript up to the second call reads as the template renders the whole conversation
    assert tok.decode(t.prompt_ids + t.response[:k2]) == tok.decode(rendered(messages))
    assert len(t.response) - k2 <= 6 and second.usage.completion_tokens <= 6
    assert second.usage.prompt_tokens == len(t.prompt_ids) + k2


def test_completions_and_a_stop_string(gateway, chat_policy):
    import ray

    gw, _ = gateway
    text = client(open_session(gw, "complete")).completions.create(
        model="policy", prompt="My friend felt", max_tokens=12, logprobs=1, stop=[" "])
    session = ray.get(gw.close_session.remote("complete"))
    (t,) = session.transcripts
    choice = text.choices[0]
    assert " " not in choice.text and choice.finish_reason in ("stop", "length")
    assert choice.logprobs.token_logprobs == pytest.approx(t.logprobs[:len(choice.logprobs.token_logprobs)], abs=0)


def test_what_a_run_cannot_train_on_is_refused_in_one_line(gateway):
    import openai
    import ray

    gw, _ = gateway
    chat = client(open_session(gw, "refused"))
    hi = [{"role": "user", "content": "hi"}]
    cases = [({"n": 2}, openai.BadRequestError, "one choice per call"),
             ({"temperature": 0.5}, openai.BadRequestError, "generator.sampling.temperature=1.0"),
             ({"max_tokens": 13}, openai.BadRequestError, "generator.sampling.max_new_tokens=12"),
             ({"stream": True}, openai.BadRequestError, "stream=false"),
             ({"model": "gpt-4o"}, openai.NotFoundError, "serves `policy`")]
    for extra, error, words in cases:
        with pytest.raises(error) as e:
            chat.chat.completions.create(**{"model": "policy", "messages": hi, **extra})
        assert words in e.value.body["message"] and "\n" not in e.value.body["message"]
    with pytest.raises(openai.NotFoundError) as e:
        client(ray.get(gw.health.remote())["address"] + "/sessions/nobody/v1").chat.completions.create(
            model="policy", messages=hi)
    assert "no session 'nobody' is open" in e.value.body["message"]
    assert ray.get(gw.close_session.remote("refused")).counts["calls"] == 0  # nothing was sampled


def test_a_session_whose_replica_dies_goes_on_with_the_same_tokens(gateway):
    """Seeds come from the session (prompt index, sample index, call number) and the policy
    version, not the replica: the call the dead replica was given, served again by the other,
    samples what any replica samples for it."""
    import ray

    gw, gens = gateway
    hi = [{"role": "user", "content": "The cat was"}]
    # two sessions of one key, each bound to a replica of its own (a new one goes to the least bound)
    a, b = client(open_session(gw, "a", prompt_index=9)), client(open_session(gw, "b", prompt_index=9))
    first_a = a.chat.completions.create(model="policy", messages=hi).choices[0].message.content
    first_b = b.chat.completions.create(model="policy", messages=hi).choices[0].message.content
    on_a, on_b = ray.get([gw.replica_of.remote("a"), gw.replica_of.remote("b")])
    assert on_a != on_b and first_a == first_b
    os.kill(ray.get(gens[on_a].health.remote())["pid"], signal.SIGKILL)
    follow = hi + [{"role": "assistant", "content": first_a}, {"role": "user", "content": "Why?"}]
    again_a = a.chat.completions.create(model="policy", messages=follow).choices[0].message.content
    again_b = b.chat.completions.create(model="policy", messages=follow).choices[0].message.content
    assert again_a == again_b
    assert ray.get(gw.replica_of.remote("a")) == on_b and ray.get(gw.health.remote())["failovers"] == 1
    for sid in ("a", "b"):
        (t,) = ray.get(gw.close_session.remote(sid)).transcripts
        assert t.calls == 2


def test_agents_play_their_episodes_through_their_sessions(gateway):
    import ray

    from actors.gateway.agents import AgentWorkers

    gw, _ = gateway
    for spec, scores in (("gateway_agents:two_calls", {0: 0.0, 1: 0.5, 2: 1.0}),
                         ("gateway_agents:completes_once", {0: None, 1: None, 2: None})):
        agents = AgentWorkers(spec, workers=2, episode_timeout_s=300)
        try:
            urls = {i: open_session(gw, f"ep{i}", prompt_index=i) for i in range(3)}
            out = agents.run({i: (urls[i], "The cat was", {"score": i / 2}) for i in range(3)})
        finally:
            agents.close()
        assert {i: o.score for i, o in out.items()} == scores and all(o.ok for o in out.values())
        calls = 2 if "two_calls" in spec else 1
        for i in range(3):
            (t,) = ray.get(gw.close_session.remote(f"ep{i}")).transcripts
            assert t.calls == calls and any(t.mask)


def test_an_agent_that_fails_ends_its_episode_and_the_next_one_plays():
    from actors.gateway.agents import AgentWorkers

    agents = AgentWorkers("gateway_agents:fails", workers=1, episode_timeout_s=5)
    try:
        rows = ["raise", "hang", "die", "text", "fine"]
        out = agents.run({i: ("http://unused/v1", "p", {"how": how}) for i, how in enumerate(rows)})
        assert agents.counts == {"errors": 2, "timeouts": 1, "crashes": 1, "restarts": 2}
    finally:
        agents.close()
    assert "agent gateway_agents:fails raised RuntimeError: tool server unreachable" == out[0].error
    assert out[1].timed_out and "within env.episode_timeout_s=5 s" in out[1].error
    assert out[2].crashed and "exit" in out[2].error
    assert "returned 'good'; return a finite number" in out[3].error
    assert out[4].ok and out[4].score == 1.0  # played by the replacement of the worker that died
    assert all("\n" not in o.error for o in out.values() if o.error)


@pytest.mark.parametrize("spec", ["gateway_agents:together", "gateway_agents:together_async"])
def test_a_worker_plays_its_episodes_at_once_and_one_that_hangs_times_out_alone(spec):
    """Three episodes that pass only side by side in one process, and a fourth that hangs: the three
    are answered, the fourth times out; a plain agent's worker is replaced (its hung thread cannot
    be stopped), an async agent's task is cancelled and its worker kept."""
    from actors.gateway.agents import AgentWorkers

    agents = AgentWorkers(spec, workers=1, per_worker=4, episode_timeout_s=5)
    try:
        rows = ["fine", "hang", "fine", "fine"]
        out = agents.run({i: ("http://unused/v1", "p", {"how": how}) for i, how in enumerate(rows)})
        assert [o.score for i, o in sorted(out.items()) if i != 1] == [1.0] * 3
        assert out[1].timed_out and "within env.episode_timeout_s=5 s" in out[1].error
        restarts = 0 if spec.endswith("async") else 1
        assert agents.counts == {"errors": 0, "timeouts": 1, "crashes": 0, "restarts": restarts}
    finally:
        agents.close()


def test_an_agent_that_does_not_import_is_one_line():
    from actors.gateway.agents import AgentWorkers

    with pytest.raises(ValueError) as e:
        AgentWorkers("gateway_agents_missing:agent", workers=1, episode_timeout_s=5)
    assert str(e.value).startswith("env.agent 'gateway_agents_missing:agent': cannot import module") \
        and "\n" not in str(e.value)


def test_agent_episodes_are_rollouts_of_the_sampled_ids_with_the_context_masked(gateway, chat_policy):
    import numpy as np

    from actors.gateway.agents import AgentWorkers
    from actors.gateway.producer import AgentEpisodes

    gw, _ = gateway
    agents = AgentWorkers("gateway_agents:two_calls", workers=2, episode_timeout_s=300)
    try:
        rollouts, counts = play(AgentEpisodes(gateway=gw, agents=agents),
                                [(3, "The cat was", {"score": 0.5}), (8, "My friend felt", {"score": 1.0})], 2,
                                chat_policy)
    finally:
        agents.close()
    assert sorted((r.prompt_index, r.sample_index) for r in rollouts) == [(3, 0), (3, 1), (8, 0), (8, 1)]
    assert counts["sessions"] == 4 and counts["calls"] == 8 and counts["errors"] == counts["invalid"] == 0
    for r in rollouts:
        assert r.env_score == {3: 0.5, 8: 1.0}[r.prompt_index] and r.env_error is None
        assert r.action_mask[0] and not r.action_mask.all() and r.action_mask[-1]  # policy, context, policy
        assert np.all(r.behaviour_logprobs[~r.action_mask] == 0) and np.all(r.behaviour_logprobs[r.action_mask] < 0)
        assert r.token_versions.tolist() == [0] * len(r.response_ids)
    bad = AgentWorkers("gateway_agents:fails", workers=1, episode_timeout_s=30)
    try:
        rollouts, counts = play(AgentEpisodes(gateway=gw, agents=bad, name="bad"), [(0, "p", {"how": "raise"})], 1,
                                chat_policy)
    finally:
        bad.close()
    assert rollouts == [] and counts["errors"] == 1 and counts["without_calls"] == 1


def test_a_replica_that_raises_is_one_line_to_the_caller_and_the_server_goes_on(ray_cluster, chat_policy):
    import openai
    ray = ray_cluster
    from gateway_agents import Broken

    from actors.admitted_calls import AGENT_CALLS_GROUP
    from actors.gateway.server import Gateway

    broken = ray.remote(num_cpus=0, concurrency_groups={AGENT_CALLS_GROUP: 1})(Broken).remote()
    gw = ray.remote(num_cpus=0)(Gateway).remote(generators={"broken": broken}, tokenizer=chat_policy,
                                                model_name="policy", sampling=SAMPLING, max_model_len=128)
    try:
        ray.get(gw.start.remote())
        chat = client(open_session(gw, "s"))
        for _ in range(2):
            with pytest.raises(openai.InternalServerError) as e:
                chat.chat.completions.create(model="policy", messages=[{"role": "user", "content": "hi"}])
            assert "ValueError: engine broke" in e.value.body["message"] and "\n" not in e.value.body["message"]
        assert ray.get(gw.health.remote())["failed"] == 2
    finally:
        ray.kill(gw)
        ray.kill(broken)


def test_an_agent_may_post_its_score_once_while_its_session_runs(gateway, chat_policy):
    import httpx
    import ray

    from actors.gateway.agents import AgentWorkers
    from actors.gateway.producer import AgentEpisodes

    gw, _ = gateway
    agents = AgentWorkers("gateway_agents:posts_reward", workers=1, episode_timeout_s=300)
    try:
        rollouts, counts = play(AgentEpisodes(gateway=gw, agents=agents, name="post"),
                                [(1, "The cat was", {"score": 0.75}),
                                 (2, "My friend felt", {"score": 0.25, "also_return": 1.0})], 1, chat_policy)
    finally:
        agents.close()
    by_prompt = {r.prompt_index: r for r in rollouts}
    assert by_prompt[1].env_score == 0.75 and by_prompt[1].env_error is None
    assert "returned 1.0 and posted 0.25" in by_prompt[2].env_error and counts["errors"] == 1
    url = open_session(gw, "finished")
    ray.get(gw.close_session.remote("finished"))
    finished = httpx.Client(trust_env=False).post(url.removesuffix("/v1") + "/reward", json={"reward": 1.0})
    assert finished.status_code == 404 and finished.json()["error"]["code"] == "session_not_found"


def test_an_episode_is_held_to_its_token_budget_and_a_replaced_replicas_sessions_are_dropped(gateway, chat_policy):
    """env.max_tokens bounds a transcript's response (its calls and the context between them): the
    call that has no room left is refused in one line. A replica that opens sessions as a new
    incarnation (its replacement, under its name) drops the dead one's."""
    import openai
    import ray

    from actors.gateway.server import Gateway

    _, gens = gateway
    gw = ray.remote(num_cpus=0)(Gateway).remote(generators={}, tokenizer=chat_policy, model_name="policy",
                                                sampling=SAMPLING, max_model_len=128, max_response_tokens=4)
    try:
        handle = gens["gw-generator-1"]
        bound = dict(replica="gw-generator-1", handle=handle, incarnation="first")
        chat = client(ray.get(gw.open_session.remote("budget", prompt_index=2, sample_index=0, **bound)))
        hi = [{"role": "user", "content": "The cat was"}]
        first = chat.chat.completions.create(model="policy", messages=hi)
        assert first.usage.completion_tokens <= 4
        follow = hi + [{"role": "assistant", "content": first.choices[0].message.content},
                       {"role": "user", "content": "Why?"}]
        with pytest.raises(openai.BadRequestError) as e:
            chat.chat.completions.create(model="policy", messages=follow)
        assert "env.max_tokens=4 leaves no room" in e.value.body["message"] and "\n" not in e.value.body["message"]
        ray.get(gw.open_session.remote("again", prompt_index=2, sample_index=1,
                                       **{**bound, "incarnation": "second"}))
        assert ray.get(gw.close_session.remote("budget")) is None  # the first incarnation's: dropped
        assert ray.get(gw.close_session.remote("again")).replica == "gw-generator-1"
    finally:
        ray.kill(gw)


# ChatML with tool calls rendered as Qwen's template renders them: the arguments string through
# tojson, so a call sent back renders to other text than the policy wrote.
TOOLS_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% if m['content'] %}{{ m['content'] }}{% endif %}"
    "{% if m.tool_calls is defined and m.tool_calls %}{% for c in m.tool_calls %}<tool_call>\n"
    "{\"name\": \"{{ c['function']['name'] }}\", \"arguments\": {{ c['function']['arguments'] | tojson }}}"
    "\n</tool_call>{% endfor %}{% endif %}{{ eos_token }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


SAID = 'Let me add. <tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'
ANSWERED = "The sum is 5."
ADD = {"type": "function", "function": {"name": "add", "description": "a + b", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}}}


@pytest.fixture(scope="module")
def tools_gateway(ray_cluster, chat_policy, tmp_path_factory):
    """A Gateway reading hermes tool calls, over a scripted replica: a session's first call is
    answered with a call of ``add``, the next ones with its sum; -> (gateway, tokenizer)."""
    import shutil

    ray = ray_cluster
    from gateway_agents import Scripted
    from transformers import AutoTokenizer

    from actors.admitted_calls import AGENT_CALLS_GROUP
    from actors.gateway.server import Gateway

    policy = tmp_path_factory.mktemp("tools") / "policy"
    shutil.copytree(chat_policy, policy)
    tok = AutoTokenizer.from_pretrained(policy)
    tok.chat_template = TOOLS_TEMPLATE
    tok.save_pretrained(policy)
    replica = ray.remote(num_cpus=0, concurrency_groups={AGENT_CALLS_GROUP: 4})(Scripted).remote(
        str(policy), SAID, ANSWERED)
    gw = ray.remote(num_cpus=0)(Gateway).remote(generators={"scripted": replica}, tokenizer=str(policy),
                                                model_name="policy", sampling={**SAMPLING, "max_new_tokens": 160},
                                                max_model_len=512, tool_parser="hermes")
    try:
        ray.get(gw.start.remote())
        yield gw, tok
    finally:
        ray.kill(gw)
        ray.kill(replica)


def test_a_chat_answer_in_the_policys_tool_call_format_reaches_the_client_as_tool_calls(tools_gateway):
    """With a tool parser named (vLLM's hermes), an answer holding <tool_call> tags is OpenAI's
    tool_calls to a call that passed tools, and text to one that did not. Sent back with the
    tool's result, the call renders to other text than the policy wrote; the session's transcript
    still goes on from the sampled ids (one rollout: answer, the tool's result as context, answer)."""
    import json

    import ray

    gw, tok = tools_gateway
    chat = client(open_session(gw, "tools"))
    asked = [{"role": "user", "content": "What is 2 plus 3?"}]
    answer = chat.chat.completions.create(model="policy", messages=asked, tools=[ADD]).choices[0]
    (call,) = answer.message.tool_calls
    assert answer.finish_reason == "tool_calls" and answer.message.content == "Let me add. "
    assert call.function.name == "add" and json.loads(call.function.arguments) == {"a": 2, "b": 3}
    replied = asked + [answer.message.model_dump(exclude_none=True),
                       {"role": "tool", "tool_call_id": call.id, "content": "5"}]
    final = chat.chat.completions.create(model="policy", messages=replied, tools=[ADD]).choices[0]
    assert final.message.content == ANSWERED and final.message.tool_calls is None and final.finish_reason == "stop"
    ids = lambda text: tok(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    said, answered = ids(SAID) + [tok.eos_token_id], ids(ANSWERED) + [tok.eos_token_id]
    session = ray.get(gw.close_session.remote("tools"))
    (t,) = session.transcripts  # joined, though the call sent back renders otherwise
    context = ids("\n<|im_start|>tool\n5") + [tok.eos_token_id] + ids("\n<|im_start|>assistant\n")
    assert t.response == said + context + answered and t.calls == 2
    assert t.mask == [True] * len(said) + [False] * len(context) + [True] * len(answered)
    assert session.counts["retokenize_mismatch"] == 1 and session.counts["rewritten"] == 0
    plain = client(open_session(gw, "plain")).chat.completions.create(model="policy", messages=asked).choices[0]
    assert plain.message.tool_calls is None and "<tool_call>" in plain.message.content


@pytest.mark.parametrize("spec", ["gateway_agents:langgraph_adder", "gateway_agents:agents_sdk_adder"])
def test_an_agent_frameworks_tool_call_goes_through_the_gateway_and_is_one_rollout(tools_gateway, spec):
    """A LangGraph ReAct agent (langchain-openai's ChatOpenAI on the session's URL) and an OpenAI
    Agents SDK agent (its chat completions model on the session's client) as env.agent, in
    tether's agent workers: the policy's tool call reaches the framework, which runs the tool and
    sends the call and its result back; the episode is one rollout, the tool's result context."""
    from actors.gateway.agents import AgentWorkers
    from actors.gateway.producer import AgentEpisodes

    gw, tok = tools_gateway
    agents = AgentWorkers(spec, workers=1, episode_timeout_s=300)
    try:
        rollouts, counts = AgentEpisodes(gateway=gw, agents=agents, name=spec.split(":")[1]).play(
            [(tok("What is 2 plus 3?")["input_ids"], 0)], PromptColumns(ids=[0], rows=[{"sum": 5}]), tok, 2)
    finally:
        agents.close()
    assert counts["sessions"] == 2 and counts["invalid"] == 0 and counts["calls"] == 4 and counts["rewritten"] == 0
    assert len(rollouts) == 2 and all(r.env_score == 1.0 for r in rollouts)
    for r in rollouts:  # the tool call, the tool's result as context, the answer
        mask = r.action_mask.astype(int)
        assert mask[0] == 1 and mask[-1] == 1 and (abs(mask[1:] - mask[:-1]).sum()) == 2
        assert "5" in tok.decode(r.response_ids[~r.action_mask])
