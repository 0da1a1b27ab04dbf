"""The whole recipe in miniature: python -m cluster.pipeline [--config configs/pipeline-cpu.yaml] [key=value ...]

The entrypoint; the recipe is cluster/recipes/pipeline.py.
"""
import sys

from cluster.recipes.pipeline import PipelineConfig, run
from cluster.recipes.stage import CONFIGS, stage_main


def main(argv=None) -> int:
    return stage_main(argv, prog="python -m cluster.pipeline", config_cls=PipelineConfig,
                      default_config=CONFIGS / "pipeline-cpu.yaml", run=run)


if __name__ == "__main__":
    sys.exit(main())
