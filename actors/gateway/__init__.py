"""The gateway: agents written for OpenAI-compatible endpoints sample from the policy being trained.

    server.py     the Gateway actor: `/sessions/<id>/v1/chat/completions` and `/completions` over
                  the generator pool, one replica per session while it lives
    sessions.py   a session's calls and the token-exact transcripts they make
    api.py        OpenAI's request and response bodies, checked against what the run can train on
    tool_calls.py a chat answer's tool calls, read by one of vLLM's tool parsers
    agents.py     the user's agent programs in worker processes, one episode each
    producer.py   AgentEpisodes: a generator's episodes played by agents through their sessions
"""
