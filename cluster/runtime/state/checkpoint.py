"""Resumable run checkpoints: the learner's state and the driver's, written atomically.

    <run>/checkpoints/resume/step-000010/
        learner/      DeepSpeed ZeRO state (weights, optimizer, scheduler) + the HF policy
        state.json    the driver's: step, version, data position, unfinished prompts, KL beta, pool sizes

A checkpoint is written as ``.step-000010.partial`` and renamed once complete, so a
folder a crash cut short is never loaded; only the newest ``run.keep_checkpoints`` stay.
The same checkpoints serve an in-job rollback (a learner rank died) and ``run.resume``.
"""
from __future__ import annotations

import json
import shutil
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Optional

from core.infra.errors import InputError
from core.infra.files import publish_dir

RESUME_DIR = "checkpoints/resume"

# Settings a checkpoint's meaning depends on: a resume that changes one is refused.
PINNED_KEYS = ("model.policy", "model.tokenizer", "learner.replicas", "learner.zero_stage",
               "data.path", "data.field", "data.seed", "data.prompts_per_step", "data.eval_prompts",
               "generator.sampling.n", "reference.model", "learner.dtype", "learner.critic",
               "learner.critic_model", "learner.lora.rank", "learner.lora.alpha", "learner.lora.target_modules",
               "learner.lora.critic")
# Pinned as resolved, not as written: model.dtype=auto may differ on another machine, and a
# null critic follows ppo.advantage (the learner state holds a value model or not).
RESOLVED = {"learner.dtype": lambda cfg: cfg.precision()["learner"][0],
            "learner.critic": lambda cfg: cfg.learner_config().value_model,
            "learner.lora.target_modules": lambda cfg: list(cfg.learner.lora.target_modules)}  # as JSON keeps it


class CheckpointError(InputError):
    """A checkpoint that cannot be resumed from: the message is one line naming why."""


@dataclass(frozen=True)
class RunState:
    step: int                  # PPO steps completed
    version: int               # policy version the generators run
    batches_issued: int        # prompt batches drawn from the data stream so far
    unfinished: tuple          # prompt indices issued but not trained on (async: in flight or buffered)
    kl_beta: float             # the KL controller's current beta
    pinned: dict               # PINNED_KEYS -> value at save time
    pool_sizes: dict = field(default_factory=dict)  # role -> serving replicas (as cluster.scale left them)

    def to_json(self) -> str:
        return json.dumps({**asdict(self), "unfinished": list(self.unfinished)}, indent=1)

    @classmethod
    def from_json(cls, text: str) -> "RunState":
        d = json.loads(text)
        return cls(step=int(d["step"]), version=int(d["version"]), batches_issued=int(d["batches_issued"]),
                   unfinished=tuple(int(i) for i in d["unfinished"]), kl_beta=float(d["kl_beta"]),
                   pinned=dict(d["pinned"]), pool_sizes={str(k): int(n) for k, n in d.get("pool_sizes", {}).items()})


def pinned_values(cfg) -> dict:
    out = {}
    for key in PINNED_KEYS:
        if key in RESOLVED:
            out[key] = RESOLVED[key](cfg)
            continue
        node = cfg
        for part in key.split("."):
            node = getattr(node, part)
        out[key] = node
    return out


def save(run_dir: Path, state: RunState, learner, *, keep: int) -> Path:
    """Write the learner's and the driver's state as one checkpoint; prune old ones."""
    root = Path(run_dir) / RESUME_DIR
    final = root / f"step-{state.step:06d}"
    with publish_dir(final) as tmp:  # replaces an existing one: a rollback may write the same step again
        learner.save(tmp / "learner")
        (tmp / "state.json").write_text(state.to_json())
    for old in complete(run_dir)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def complete(run_dir: Path) -> list[Path]:
    """The run's complete checkpoints, oldest first."""
    root = Path(run_dir) / RESUME_DIR
    if not root.is_dir():
        return []
    return sorted(p for p in root.glob("step-*") if (p / "state.json").is_file())


def latest(run_dir: Path) -> Optional[Path]:
    found = complete(run_dir)
    return found[-1] if found else None


def load_state(path: Path) -> RunState:
    if not (Path(path) / "learner").is_dir():
        raise CheckpointError(f"checkpoint {path} is incomplete (no learner/); resume from another "
                              "checkpoint of the run (delete this one) or start a new run")
    try:
        return RunState.from_json((Path(path) / "state.json").read_text())
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"checkpoint {path} is unreadable ({type(e).__name__}: {e}); "
                              "resume from another run folder or delete this checkpoint") from None


def check_compatible(state: RunState, cfg, path: Path) -> None:
    """Refuse a resume whose config changes what the checkpoint means, naming the key."""
    now = pinned_values(cfg)
    for key in PINNED_KEYS:
        if key in state.pinned and state.pinned[key] != now[key]:
            raise CheckpointError(f"run.resume: {key}={now[key]!r} differs from the checkpoint's "
                                  f"{state.pinned[key]!r} ({path}); resume with {key}={state.pinned[key]!r} "
                                  "or start a new run")
