"""The KL-coefficient sweep:
python -m cluster.sweep [--config configs/pipeline-cpu.yaml] [--betas 0 0.05 0.5] [key=value ...]

The entrypoint; the recipe is cluster/recipes/sweep.py.
"""
import sys
from functools import partial

from cluster.config.pipeline import PipelineConfig
from cluster.job.errors import UserError, report_error
from cluster.recipes.stage import stage_main
from cluster.recipes.sweep import split_betas, sweep


def main(argv=None, *, prog: str = "python -m cluster.sweep") -> int:
    try:  # --betas first: the rest is a pipeline's command line
        betas, rest = split_betas(list(sys.argv[1:] if argv is None else argv))
    except UserError as e:
        return report_error(e)
    return stage_main(rest, name="sweep", config_cls=PipelineConfig, default_config="pipeline-cpu.yaml",
                      run=partial(sweep, betas=betas), prog=prog)


if __name__ == "__main__":
    sys.exit(main())
