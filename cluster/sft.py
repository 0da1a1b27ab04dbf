"""SFT stage: python -m cluster.sft [--config configs/sft-tiny.yaml] [section.key=value ...]

The entrypoint; the recipe is cluster/recipes/sft.py.
"""
import sys

from cluster.config.stages import SFTConfig
from cluster.recipes.sft import run
from cluster.recipes.stage import CONFIGS, stage_main


def main(argv=None) -> int:
    return stage_main(argv, prog="python -m cluster.sft", config_cls=SFTConfig,
                      default_config=CONFIGS / "sft-tiny.yaml", run=run)


if __name__ == "__main__":
    sys.exit(main())
