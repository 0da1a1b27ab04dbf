"""The whole recipe in miniature: python -m cluster.pipeline [--config configs/pipeline-cpu.yaml] [key=value ...]

The entrypoint; the recipe is cluster/recipes/pipeline.py.
"""
import sys
from functools import partial

from cluster.config.pipeline import PipelineConfig
from cluster.recipes.pipeline import run
from cluster.recipes.stage import stage_main

main = partial(stage_main, name="pipeline", config_cls=PipelineConfig, default_config="pipeline-cpu.yaml", run=run)

if __name__ == "__main__":
    sys.exit(main())
