"""The step's KL penalty: built by the driver from ppo.kl and the controller's beta, the one
value the reward shaping and the learner ask whether the KL is a loss term."""
import pickle
from pathlib import Path

import numpy as np
import pytest

from core.kl import KLPenalty

pytestmark = pytest.mark.unit

CONFIG = Path(__file__).resolve().parents[4] / "configs" / "tiny-cpu.yaml"


def _driver(tmp_path, overrides):
    """A real Driver without pools: nothing these tests run reaches an actor."""
    from cluster.config.ppo import load_config
    from cluster.data.prompts import PromptDataset
    from cluster.runtime.loop.driver import Driver
    from cluster.runtime.observe.metrics import RunMetrics

    cfg = load_config(CONFIG, overrides)
    n = cfg.data.prompts_per_step
    prompts = PromptDataset(texts=["p"] * n, prompt_ids=[np.array([1])] * n, ids=np.arange(n))
    return Driver(cfg, pools=None, dataset=prompts, eval_dataset=None, tokenizer=None,
                  metrics=RunMetrics(run_dir=tmp_path, plot_every=0))


@pytest.mark.parametrize("placement, estimator", [("reward", "k1"), ("loss", "k3")])
def test_the_penalty_takes_the_controllers_beta_where_the_config_places_it(tmp_path, placement, estimator):
    driver = _driver(tmp_path, [f"ppo.kl.placement={placement}", f"ppo.kl.estimator={estimator}"])
    try:
        driver.kl_ctl.value = 0.3  # as an adaptive controller moved it
        kl = driver.kl_penalty()
        assert kl == KLPenalty(beta=0.3, estimator=estimator, placement=placement)
        assert kl.in_loss is (placement == "loss")
        assert pickle.loads(pickle.dumps(kl)) == kl  # it reaches the learner ranks through Ray
        shaping = driver.shaping()  # in the loss, the rewards are the scores alone; the KL is still measured
        assert (shaping.beta, shaping.kl_estimator) == (0.0 if kl.in_loss else 0.3, estimator)
    finally:
        driver.metrics.close()

