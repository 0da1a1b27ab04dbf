"""The module an objective trains (the policy with its value head, or a reward model) inside a
DeepSpeed engine, as one rank trains it."""
from __future__ import annotations

import contextlib
import sys
from typing import Callable

import torch

from learner.config import RankConfig

# Optional imports DeepSpeed makes that a rank never uses: its autotuner's MLflow (at import; with
# the trackers extra installed, ~40% of DeepSpeed's import) and, in initialize's optimizer check,
# its Muon optimizer, whose import torch.compiles kernels and so imports torch's inductor (~1-2 s
# of CPU at start-up, for a type comparison against an optimizer we do not use). DeepSpeed guards
# both with ``except ImportError``, the path it takes where they are not installed.
UNUSED_AT_IMPORT = ("mlflow",)
UNUSED_AT_INITIALIZE = ("deepspeed.runtime.zero.muon.muon_optimizer",)


@contextlib.contextmanager
def without_imports(modules: tuple[str, ...]):
    """Within the block, ``import`` of any of ``modules`` not yet loaded raises ImportError;
    after it they import as ever (tests/learner/test_engine_import.py)."""
    blocked = [m for m in modules if m not in sys.modules]
    for m in blocked:
        sys.modules[m] = None  # the import system's mark for "cannot be imported"
    try:
        yield
    finally:
        for m in blocked:
            if m in sys.modules and sys.modules[m] is None:
                del sys.modules[m]


def unused_at_initialize(ds_config: dict) -> tuple[str, ...]:
    """UNUSED_AT_INITIALIZE where DeepSpeed guards the import; none where it does not: its bf16
    optimizer (bf16 below ZeRO-2) and its ZeRO-3 optimizer import Muon in their constructors
    without a guard, so a block there fails the engine's build."""
    stage = ds_config["zero_optimization"]["stage"]
    if stage == 3 or (ds_config["bf16"]["enabled"] and stage < 2):
        return ()
    return UNUSED_AT_INITIALIZE


def import_deepspeed():
    """deepspeed, imported without the optional modules a rank never uses (UNUSED_AT_IMPORT)."""
    if "deepspeed" in sys.modules:
        return sys.modules["deepspeed"]
    with without_imports(UNUSED_AT_IMPORT):
        import deepspeed
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
    with without_imports(unused_at_initialize(ds_config)):
        engine, _, _, _ = deepspeed.initialize(model=policy, optimizer=optimizer, lr_scheduler=scheduler,
                                               config=ds_config, dist_init_required=False)
    if world_size == 1 and config.zero_stage == 0:
        # Alone, a rank has no gradients to average, but DeepSpeed still flattens, all-reduces
        # and copies back every gradient after each backward (~70 ms a step for 32M params on
        # CPU). ``enable_backward_allreduce`` is the engine's own switch for that pass (it
        # turns it off itself without a process group); the stages that partition keep theirs.
        engine.enable_backward_allreduce = False
    return engine
