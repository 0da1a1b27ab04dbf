"""The run's gateway (actors/gateway): started before the generators, which play agent episodes through it.

One Gateway actor on the driver's node (as the run's control actor: a node lost with it would
take every session with it), restarted by Ray if its process dies: its sessions are then
played again from the start by the generators that opened them (actors/gateway/producer.py),
on the port the new process binds. Each generator binds its own sessions to itself.
"""
from __future__ import annotations

import logging

log = logging.getLogger("tether")

MODEL_NAME = "policy"  # the model name the gateway serves (what an agent passes as ``model``)


def start_gateway(cfg, *, tokenizer_path: str, env_vars: dict):
    """-> (the Gateway actor's handle, its address); None, None without env.agent."""
    if not cfg.env.agent:
        return None, None
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from actors.gateway.server import Gateway

    beside_driver = NodeAffinitySchedulingStrategy(node_id=ray.get_runtime_context().get_node_id(), soft=False)
    gateway = ray.remote(Gateway).options(
        name="gateway", num_cpus=0, max_restarts=-1, max_task_retries=-1, scheduling_strategy=beside_driver,
        runtime_env={"env_vars": env_vars}).remote(
        generators={}, tokenizer=tokenizer_path, model_name=MODEL_NAME, sampling=cfg.generator.sampling,
        max_model_len=cfg.generator.engine.max_model_len, max_response_tokens=cfg.env.max_tokens,
        call_timeout_s=cfg.env.episode_timeout_s, tool_parser=cfg.env.tool_parser)
    address = ray.get(gateway.start.remote())
    log.info("gateway: %s/sessions/<id>/v1 serves model %r to env.agent %s", address, MODEL_NAME, cfg.env.agent)
    return gateway, address
