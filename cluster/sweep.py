"""The KL-coefficient sweep:
python -m cluster.sweep [--config configs/pipeline-cpu.yaml] [--betas 0 0.05 0.5] [key=value ...]

The entrypoint; the recipe is cluster/recipes/sweep.py.
"""
import sys

from cluster.job.errors import UserError
from cluster.recipes.pipeline import PipelineConfig
from cluster.recipes.stage import CONFIGS, stage_main
from cluster.recipes.sweep import split_betas, sweep


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        betas, rest = split_betas(argv)
    except UserError as e:
        print(f"tether: error: {e}", file=sys.stderr)
        return 2
    return stage_main(rest, prog="python -m cluster.sweep", config_cls=PipelineConfig,
                      default_config=CONFIGS / "pipeline-cpu.yaml", run=lambda cfg: sweep(cfg, betas))


if __name__ == "__main__":
    sys.exit(main())
