"""The ``tether`` command: ``tether <subcommand> [args...]`` runs one of the job entrypoints,
as ``python -m cluster.<module> [args...]`` does."""
from __future__ import annotations

import sys
from typing import Callable, NamedTuple

from cluster.job.errors import EXIT_DONE, user_error


# Each entrypoint is imported only when its subcommand runs: `tether --help` and a mistyped
# name answer at once, and a job's own dependency check runs before it imports the stack.
def _train(argv: list[str], prog: str) -> int:
    from cluster.train import main
    return main(argv, prog=prog)


def _sft(argv: list[str], prog: str) -> int:
    from cluster.sft import main
    return main(argv, prog=prog)


def _reward_model(argv: list[str], prog: str) -> int:
    from cluster.reward_model import main
    return main(argv, prog=prog)


def _pipeline(argv: list[str], prog: str) -> int:
    from cluster.pipeline import main
    return main(argv, prog=prog)


def _sweep(argv: list[str], prog: str) -> int:
    from cluster.sweep import main
    return main(argv, prog=prog)


def _scale(argv: list[str], prog: str) -> int:
    from cluster.scale import main
    return main(argv, prog=prog)


def _local_cluster(argv: list[str], prog: str) -> int:
    from cluster.local_cluster import main
    return main(argv, prog=prog)


class Subcommand(NamedTuple):
    run: Callable[[list[str], str], int]  # (arguments, the command as typed) -> exit code
    what: str


SUBCOMMANDS = {
    "train": Subcommand(_train, "PPO as a distributed actor-learner job on Ray"),
    "sft": Subcommand(_sft, "supervised fine-tuning: the policy PPO starts from"),
    "reward-model": Subcommand(_reward_model, "a reward model fitted to preference pairs"),
    "pipeline": Subcommand(_pipeline, "SFT, gold-labelled pairs, a proxy reward model and PPO in one run folder"),
    "sweep": Subcommand(_sweep, "a pipeline's PPO stage rerun at several KL coefficients"),
    "scale": Subcommand(_scale, "resize a running job's pools"),
    "cluster": Subcommand(_local_cluster, "a multi-node Ray cluster on this machine to try tether on"),
}


def usage() -> str:
    width = max(map(len, SUBCOMMANDS))
    lines = [f"  {name:<{width}}  {sub.what}" for name, sub in SUBCOMMANDS.items()]
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
    return SUBCOMMANDS[argv[0]].run(argv[1:], f"tether {argv[0]}")  # --help names what was typed


if __name__ == "__main__":
    sys.exit(main())
