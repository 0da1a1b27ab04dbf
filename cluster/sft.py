"""SFT stage: python -m cluster.sft [--config configs/sft-tiny.yaml] [section.key=value ...]

The entrypoint; the recipe is cluster/recipes/sft.py.
"""
import sys
from functools import partial

from cluster.config.stages import SFTConfig
from cluster.recipes.sft import run
from cluster.recipes.stage import stage_main

main = partial(stage_main, name="sft", config_cls=SFTConfig, default_config="sft-tiny.yaml", run=run)

if __name__ == "__main__":
    sys.exit(main())
