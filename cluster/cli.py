"""The ``tether`` command: ``tether <subcommand> [args...]`` runs one of the job entrypoints,
as ``python -m cluster.<module> [args...]`` does."""
from __future__ import annotations

import importlib
import sys

from cluster.job.errors import EXIT_DONE, user_error

# subcommand -> (module with main(argv, prog=...), what it does); modules are imported only when run.
SUBCOMMANDS = {
    "train": ("cluster.train", "PPO as a distributed actor-learner job on Ray"),
    "sft": ("cluster.sft", "supervised fine-tuning: the policy PPO starts from"),
    "reward-model": ("cluster.reward_model", "a reward model fitted to preference pairs"),
    "pipeline": ("cluster.pipeline", "SFT, gold-labelled pairs, a proxy reward model and PPO in one run folder"),
    "sweep": ("cluster.sweep", "a pipeline's PPO stage rerun at several KL coefficients"),
    "scale": ("cluster.scale", "resize a running job's pools"),
    "cluster": ("cluster.local_cluster", "a multi-node Ray cluster on this machine to try tether on"),
}


def usage() -> str:
    width = max(map(len, SUBCOMMANDS))
    lines = [f"  {name:<{width}}  {what}" for name, (_, what) in SUBCOMMANDS.items()]
    return "\n".join(["usage: tether <subcommand> [args...]   (tether <subcommand> --help for its own)", "",
                      "subcommands:", *lines])


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] in (["-h"], ["--help"]):
        print(usage())
        return EXIT_DONE
    choices = ", ".join(SUBCOMMANDS)
    if not argv:
        return user_error(f"name a subcommand: one of {choices} (tether --help says what each does)")
    if argv[0] not in SUBCOMMANDS:
        return user_error(f"unknown subcommand {argv[0]!r}; choose one of {choices}")
    module, _ = SUBCOMMANDS[argv[0]]
    return importlib.import_module(module).main(argv[1:], prog=f"tether {argv[0]}")  # --help names what was typed


if __name__ == "__main__":
    sys.exit(main())
