"""Agents for tests/actors/gateway/test_gateway.py, imported by its agent workers, and a replica that fails."""
import os
import threading


def two_calls(prompt, columns, *, client):
    """Asks, then asks again with its answer in the history; scores by its row."""
    messages = [{"role": "user", "content": prompt}]
    first = client.chat.completions.create(model="policy", messages=messages)
    messages += [{"role": "assistant", "content": first.choices[0].message.content},
                 {"role": "user", "content": "Again?"}]
    client.chat.completions.create(model="policy", messages=messages, max_tokens=4)
    return float(columns["score"])


async def completes_once(prompt, columns, **kwargs):
    """An async agent on the completions API; leaves the score to the reward pool."""
    await kwargs["client"].completions.create(model="policy", prompt=prompt, max_tokens=4)
    assert kwargs["base_url"].endswith("/v1")


def fails(prompt, columns):
    """Each row says how its episode goes wrong."""
    how = columns["how"]
    if how == "raise":
        raise RuntimeError("tool server unreachable")
    if how == "hang":
        threading.Event().wait()  # never set: only the episode's timeout ends it
    if how == "die":
        os._exit(3)
    if how == "text":
        return "good"
    return 1.0


class Broken:
    """A replica whose every call fails (what the gateway sees of a generator that raised)."""

    def serve_turn(self, prompt, room, key):
        raise ValueError("engine broke")


def posts_reward(prompt, columns, *, client, base_url):
    """Answers once, posts its score to the session (twice: the second is refused), returns None."""
    import httpx

    client.completions.create(model="policy", prompt=prompt, max_tokens=4)
    url, http = base_url.removesuffix("/v1") + "/reward", httpx.Client(trust_env=False)
    assert http.post(url, json={"reward": columns["score"]}).json()["reward"] == columns["score"]
    again = http.post(url, json={"reward": 0.0})
    assert again.status_code == 409 and again.json()["error"]["code"] == "reward_already_posted"
    return None if columns.get("also_return") is None else columns["also_return"]


class Scripted:
    """A replica whose answer to a session's k-th call is ``answers[k]`` (the last one after those),
    then EOS, as the ids its tokenizer gives: what a policy trained on a tool-call format samples."""

    def __init__(self, tokenizer: str, *answers: str):
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(tokenizer)
        self.ids = [list(tok(a, add_special_tokens=False)["input_ids"]) + [tok.eos_token_id] for a in answers]

    def serve_turn(self, prompt, room, key):
        import numpy as np

        from actors.environments.episodes import Turn

        ids = self.ids[min(key[2], len(self.ids) - 1)][:room]
        return Turn(token_ids=ids, logprobs=np.full(len(ids), -0.5, dtype=np.float32), kept_ids=None,
                    versions=np.zeros(len(ids), dtype=np.int64))


def langgraph_adder(prompt, columns, *, base_url):
    """A LangGraph ReAct agent with one tool, on the session's URL: the policy calls ``add``, reads
    its result and answers; 1.0 if the answer holds the row's sum and the tool ran."""
    import httpx
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI
    from langgraph.prebuilt import create_react_agent

    ran = []

    @tool
    def add(a: int, b: int) -> int:
        """Adds two integers."""
        ran.append((a, b))
        return a + b

    model = ChatOpenAI(model="policy", base_url=base_url, api_key="tether", max_retries=0,
                       http_client=httpx.Client(trust_env=False), http_async_client=httpx.AsyncClient(trust_env=False))
    agent = create_react_agent(model, [add])
    out = agent.invoke({"messages": [{"role": "user", "content": prompt}]})
    final = out["messages"][-1].content
    return 1.0 if ran == [(2, 3)] and str(columns["sum"]) in final else 0.0


_together = threading.Barrier(3)


def together(prompt, columns):
    """Passes only with two other episodes running beside it in its process; a row may hang."""
    if columns.get("how") == "hang":
        threading.Event().wait()  # never set: only the episode's timeout ends it
    _together.wait(timeout=60)
    return 1.0


async def together_async(prompt, columns):
    """As ``together``, as tasks of one event loop."""
    import asyncio

    global _together_async
    if columns.get("how") == "hang":
        await asyncio.Event().wait()
    _together_async = globals().get("_together_async") or asyncio.Barrier(3)
    await asyncio.wait_for(_together_async.wait(), 60)
    return 1.0


async def agents_sdk_adder(prompt, columns, *, client):
    """An OpenAI Agents SDK agent with one function tool, on the session's client (the chat
    completions model: the gateway serves no Responses API): 1.0 if it answers the sum and the tool ran."""
    from agents import Agent, OpenAIChatCompletionsModel, Runner, function_tool, set_tracing_disabled

    set_tracing_disabled(True)  # the SDK would send its traces to OpenAI
    ran = []

    @function_tool
    def add(a: int, b: int) -> int:
        """Adds two integers."""
        ran.append((a, b))
        return a + b

    agent = Agent(name="adder", instructions="Use the tool.", tools=[add],
                  model=OpenAIChatCompletionsModel(model="policy", openai_client=client))
    result = await Runner.run(agent, prompt)
    return 1.0 if ran == [(2, 3)] and str(columns["sum"]) in result.final_output else 0.0
