"""Reward-model stage: python -m cluster.reward_model [--config configs/rm-tiny.yaml] [section.key=value ...]

The entrypoint; the recipe is cluster/recipes/reward_model.py.
"""
import sys
from functools import partial

from cluster.config.stages import RMConfig
from cluster.recipes.reward_model import run
from cluster.recipes.stage import stage_main

main = partial(stage_main, name="reward_model", config_cls=RMConfig, default_config="rm-tiny.yaml", run=run)

if __name__ == "__main__":
    sys.exit(main())
