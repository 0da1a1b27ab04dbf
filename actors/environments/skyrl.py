"""SkyRL-gym's text environments run unchanged as tether environments.

A SkyRL-gym environment (``skyrl_gym.make(id, env_config=..., extras=...)``, a ``BaseTextEnv``)
starts from the prompt's messages (``init``) and answers each turn with a step output: the
next messages, this turn's reward, done, metadata. ``skyrl_environment`` makes a tether
environment class of one (base.py: ``reset``/``step``), for a module of the user's that names it::

    # my_envs.py
    from actors.environments.skyrl import skyrl_environment
    GSM8kMultiTurn = skyrl_environment("gsm8k_multi_turn", ground_truth="answer")

    # config: env.environment: my_envs:GSM8kMultiTurn

Each episode makes the environment with ``extras`` as SkyRL's own trainer builds them from a
dataset row: ``reward_spec.ground_truth`` from the row's ``ground_truth`` column and
``extra_info`` the whole row. The messages a step returns are joined into one observation
(rendered as ``env.observation_role``); what ``init`` makes of the prompt is not used (the
policy's prompt is the dataset's, rendered by tether), so an environment that rewrites its
prompt there needs its data rendered that way. Needs the ``skyrl-gym`` package (the ``envs``
extra).
"""
from __future__ import annotations

from typing import Any, Optional


def skyrl_environment(env_id: str, *, ground_truth: str = "answer", env_config: Optional[dict] = None,
                      max_turns: Optional[int] = None) -> type:
    """A tether environment class playing SkyRL-gym's ``env_id`` (module docstring).
    max_turns: passed to the environment in ``extras`` (its own default otherwise)."""

    class SkyRLEnvironment:
        def reset(self, prompt: str, columns: dict) -> None:
            import skyrl_gym

            if ground_truth not in columns:
                raise ValueError(f"SkyRL-gym {env_id}: the prompt row has no {ground_truth!r} column (its "
                                 f"reward_spec.ground_truth); name the column with ground_truth=")
            extras: dict[str, Any] = {"reward_spec": {"method": "rule", "ground_truth": columns[ground_truth]},
                                      "extra_info": dict(columns)}
            if max_turns is not None:
                extras["max_turns"] = max_turns
            self.env = skyrl_gym.make(env_id, env_config=env_config or {}, extras=extras)
            self.env.init([{"role": "user", "content": prompt}])
            return None

        def step(self, action: str):
            out = self.env.step(action)
            messages = out.get("observations") or []
            observation = "\n".join(str(m.get("content", "")) for m in messages) or None
            info = {k: v for k, v in (out.get("metadata") or {}).items() if isinstance(v, (int, float, str, bool))}
            return (None if out["done"] else observation), out["reward"], bool(out["done"]), info

        def close(self) -> None:
            env = getattr(self, "env", None)
            if env is not None:
                env.close()

    SkyRLEnvironment.__name__ = SkyRLEnvironment.__qualname__ = f"SkyRL[{env_id}]"
    return SkyRLEnvironment
