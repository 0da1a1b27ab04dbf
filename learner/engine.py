"""The module an objective trains (the policy with its value head, or a reward model) inside a
DeepSpeed engine, as one rank trains it."""
from __future__ import annotations

import sys
from typing import Callable

import torch

from learner.config import RankConfig


def import_deepspeed():
    """deepspeed, imported without its autotuner's optional ``import mlflow``.

    DeepSpeed's autotuner imports MLflow if it can (for its own tuning runs, which a rank never
    does); with the trackers extra installed that is about 40% of DeepSpeed's import, paid by
    every rank at start-up. While deepspeed imports, ``mlflow`` is marked unimportable, so the
    autotuner's ``try: import mlflow`` takes its except branch; the mark is removed right after,
    and a later ``import mlflow`` in the process works as ever (tests/learner/test_engine_import.py).
    """
    if "deepspeed" in sys.modules:
        return sys.modules["deepspeed"]
    blocked = "mlflow" not in sys.modules
    if blocked:
        sys.modules["mlflow"] = None  # import mlflow now raises ImportError
    try:
        import deepspeed
    finally:
        if blocked and sys.modules.get("mlflow", False) is None:
            del sys.modules["mlflow"]
    return deepspeed


def build_engine(model: str, config: RankConfig, world_size: int, *, load: Callable[[str, RankConfig], tuple]):
    """Load the module an objective trains (``load``: its ``load_module``, -> (module, HF body))
    and wrap it with its optimizer and lr schedule in a DeepSpeed engine.

    The process group must exist already (DeepSpeed is told not to create one).
    """
    deepspeed = import_deepspeed()

    torch.manual_seed(config.seed)  # identical value-head / score-head init on every rank
    policy, body = load(model, config)
    if config.gradient_checkpointing:
        body.gradient_checkpointing_enable()
    policy.train()  # HF loads in eval mode; checkpointing needs train mode (dropout is off anyway)
    optim = config.optim
    # Only what trains gets optimizer state: with a LoRA adapter the frozen base has none.
    trainable = [p for p in policy.parameters() if p.requires_grad]
    optimizer = optim.build(trainable)
    # A plain closure: LambdaLR then leaves it out of its state_dict (checkpoints stay picklable).
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: optim.lr_factor(s))
    ds_config = config.deepspeed_config(world_size, sum(p.numel() for p in trainable))
    engine, _, _, _ = deepspeed.initialize(model=policy, optimizer=optimizer, lr_scheduler=scheduler,
                                           config=ds_config, dist_init_required=False)
    if world_size == 1 and config.zero_stage == 0:
        # Alone, a rank has no gradients to average, but DeepSpeed still flattens, all-reduces
        # and copies back every gradient after each backward (~70 ms a step for 32M params on
        # CPU). ``enable_backward_allreduce`` is the engine's own switch for that pass (it
        # turns it off itself without a process group); the stages that partition keep theirs.
        engine.enable_backward_allreduce = False
    return engine
