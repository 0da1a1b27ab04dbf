"""The critic-free estimators inside the learner, on real DeepSpeed (CPU, gloo): no value head,
advantages from the prompt groups, the same weights as a plain single-process update, on one
rank and on two ranks that hold whole groups, in equal or unequal numbers of rows."""
import dataclasses

import numpy as np
import pytest
import torch
from helpers import make_rollouts, max_abs_diff, reference_update, sgd_config

from core.choices import ESTIMATOR_TABLE
from core.rollout import shard_rollouts
from learner.batch import collate
from learner.group import LearnerGroup
from learner.policy import VALUE_HEAD_FILE
from learner.worker import LearnerWorker

pytestmark = pytest.mark.integration

TOL = 1e-5
VALUE_KEYS = ("ppo/value_loss", "ppo/vf_clip_frac", "ppo/explained_variance", "ppo/returns_mean",
              "ppo/values_mean")


@pytest.fixture(scope="module")
def grouped(policy_path):
    """8 rollouts, 2 prompts x 4 samples (one chunk); the second prompt's samples score alike."""
    out = []
    for i, r in enumerate(make_rollouts(policy_path, 8, seed=3)):
        r = dataclasses.replace(r, chunk_id=0, prompt_index=i // 4)
        if i >= 4:  # equal returns: a group that teaches nothing
            r = dataclasses.replace(r, score=1.0, reward_score=1.0,
                                    rewards=np.eye(r.response_ids.size, dtype=np.float32)[-1])
        out.append(r)
    return out


def config(name, stage=2):
    return sgd_config(zero_stage=stage, advantage=name)


def independent_advantages(name: str, group_std: bool, rollouts) -> list:
    """Each rollout's per-token advantages [n] (float64), written out from the estimators' definitions
    in numpy, not through core/estimators.py. A row's return-to-go is its score plus the KL penalty
    still to come, so the outcome estimators' "baselined score + KL returns-to-go" is the
    return-to-go less the baseline (grpo: plus the score's rescaling by the group's std)."""
    rtg = [np.cumsum(np.asarray(r.rewards, np.float64)[::-1])[::-1] for r in rollouts]
    score = np.array([r.reward_score for r in rollouts], np.float64)
    keys = [(r.chunk_id, r.prompt_index) for r in rollouts]
    peers = [np.array([k == key for k in keys]) for key in keys]
    mean = np.array([score[p].mean() for p in peers])
    others = np.array([(score[p].sum() - s) / (p.sum() - 1) for p, s in zip(peers, score)])
    std = np.array([score[p].std(ddof=1) for p in peers])

    def whiten(rows):  # over every token of the batch, biased variance (as PPO whitens)
        flat = np.concatenate(rows)
        return [(x - flat.mean()) / np.sqrt(flat.var() + 1e-8) for x in rows]

    if name == "grpo" and group_std:
        scaled = np.where(std > 0, (score - mean) / (std + 1e-6), 0.0)
        return [g - s + a for g, s, a in zip(rtg, score, scaled)]
    if name == "grpo":  # Dr. GRPO: the mean alone is taken off
        return [g - m for g, m in zip(rtg, mean)]
    if name == "rloo":
        return [g - o for g, o in zip(rtg, others)]
    if name == "reinforce_pp":
        return whiten(rtg)
    if name == "reinforce_pp_baseline":
        return whiten([g - m for g, m in zip(rtg, mean)])
    raise AssertionError(f"critic-free estimator {name!r} has no independent advantages here: write them "
                         "out above, so the learner's update with it is checked")


def as_batch(per_row: list, rollouts, pad_id) -> torch.Tensor:
    """[B, R] per-row advantages laid out as the learner's batch holds its responses."""
    mask = collate(rollouts, pad_id).response_mask
    out = torch.zeros_like(mask)
    for row, adv in enumerate(per_row):
        out[row, :adv.size] = torch.as_tensor(adv, dtype=out.dtype)
    return out


# Every critic-free estimator of the registry (a new one is a new case, and fails until it has
# independent advantages), and grpo without the std (ppo.group_std=false, Dr. GRPO).
CRITIC_FREE = [row.name for row in ESTIMATOR_TABLE if not row.needs_critic]
CASES = [pytest.param(name, True, id=name) for name in CRITIC_FREE] + \
    [pytest.param("grpo", False, id="grpo-group_std=false")]


@pytest.mark.parametrize("name, group_std", CASES)
def test_one_rank_critic_free_update_matches_plain_torch(policy_path, grouped, pad_id, tmp_path, name, group_std):
    cfg = sgd_config(zero_stage=2, advantage=name, group_std=group_std)
    assert cfg.value_model == "none"
    w = LearnerWorker(rank=0, world_size=1, model=policy_path, config=cfg)
    metrics = w.train(grouped)
    got = w.full_state_dict()
    assert not any(k.startswith("value_head") for k in got), "no critic: no value head to train"
    advantages = as_batch(independent_advantages(name, group_std, grouped), grouped, pad_id)
    ref, _ = reference_update(policy_path, grouped, cfg, pad_id, advantages=advantages)
    diff = max_abs_diff(got, ref)
    print(f"{name} group_std={group_std}: max |w - w_ref| = {diff:.2e}")
    assert diff < TOL
    assert not set(VALUE_KEYS) & set(metrics)
    # The second prompt's samples all returned the same: zero advantage under grpo and rloo,
    # more than a third of the tokens. The REINFORCE++ ones whiten over the batch afterwards,
    # which moves those zeros off 0.
    zero = metrics["advantage/zero_frac"]
    assert (zero > 0.3) if name in ("grpo", "rloo") else zero == 0.0
    assert metrics["advantage/abs_mean"] > 0.1
    if not group_std:  # the checkpoint does not depend on group_std: checked once per estimator
        return
    w.save(tmp_path / "ckpt")  # a checkpoint without a value model, and a resume from it
    assert not (tmp_path / "ckpt" / "policy" / VALUE_HEAD_FILE).exists()
    again = LearnerWorker(rank=0, world_size=1, model=policy_path, config=cfg)
    assert again.load(tmp_path / "ckpt") == 1
    assert max_abs_diff(again.full_state_dict(), got) == 0.0


@pytest.fixture
def two_ranks(ray_cluster, policy_path):
    """get(name, tag): the test's 2-rank group for an estimator, shut down after the test."""
    made = {}

    def get(name, tag=""):  # a new tag: a group at the initial weights
        if name + tag not in made:
            for g in made.values():  # done with the earlier one: its CPUs go to the new group
                g.shutdown()
            made.clear()
            made[name + tag] = LearnerGroup(model=policy_path, config=config(name), world_size=2,
                                            num_cpus_per_rank=1, name_prefix=f"learner-{name}{tag}")
        return made[name + tag]
    yield get
    for g in made.values():
        g.shutdown()


@pytest.mark.parametrize("name", ["grpo", "reinforce_pp_baseline"])
def test_two_ranks_with_whole_groups_match_one_process(two_ranks, policy_path, grouped, pad_id, name):
    """Each rank holds one whole prompt; the batch-wide statistics still cover both."""
    group = two_ranks(name)
    shards = shard_rollouts(grouped, 2)
    assert [{r.prompt_index for r in s} for s in shards] == [{0}, {1}]
    group.train(shards)
    ref, _ = reference_update(policy_path, grouped, group.config, pad_id)
    diff = max_abs_diff(group.state_dict(), ref)
    print(f"2 ranks {name}: max |w - w_ref| = {diff:.2e}")
    assert diff < TOL


def turns(r, rng):
    """``r`` as a two-turn episode: its middle token the environment's (no KL, no reward), each turn's
    reward on its last token (env.reward_placement=turn)."""
    n = r.response_ids.size
    mask = np.ones(n, bool)
    mask[n // 2] = False
    placed = np.zeros(n, np.float32)
    placed[n // 2 - 1], placed[n - 1] = rng.choice([0.0, 1.0]), rng.choice([0.0, 0.5])
    kl = np.where(mask, r.kl, 0.0).astype(np.float32)
    return dataclasses.replace(r, action_mask=mask, turn_rewards=placed, placed_rewards=placed, kl=kl,
                               rewards=placed - 0.05 * kl, score=float(placed.sum()), reward_score=float(placed.sum()))


def test_two_ranks_with_unequal_shards_match_one_process(two_ranks, policy_path, pad_id):
    """7 rollouts of 3 prompts (3 + 2 + 2 samples) on 2 ranks: 3 rows on rank 0, 4 on rank 1,
    nothing left out. Minibatch 0 (rows 0-3) is 3 rows on rank 0 and 1 on rank 1; minibatch 1
    (rows 4-6) is all rank 1's, so rank 0 runs it with empty micro-batches. Prompts 1 and 2 are
    episodes rewarded turn by turn, so each rank gathers every rank's (group, turn, return) for
    the turns' credit (prompt 0's single responses: one turn each). The weights are one process's
    update over all 7."""
    rng = np.random.default_rng(11)
    rollouts = [dataclasses.replace(r, chunk_id=0, prompt_index=(0, 0, 0, 1, 1, 2, 2)[i], sample_index=i)
                for i, r in enumerate(make_rollouts(policy_path, 7, seed=5, response_len=(4, 10)))]
    rollouts = rollouts[:3] + [turns(r, rng) for r in rollouts[3:]]
    shards = shard_rollouts(rollouts, 2)
    assert [len(s) for s in shards] == [3, 4] and sum(shards, []) == rollouts
    group = two_ranks("grpo", "-unequal")
    metrics = group.train(shards)
    assert metrics["learner/optimizer_steps"] == 4  # 2 minibatches x 2 epochs
    ref, _ = reference_update(policy_path, rollouts, group.config, pad_id)
    diff = max_abs_diff(group.state_dict(), ref)
    print(f"2 ranks, 3 + 4 rows: max |w - w_ref| = {diff:.2e}")
    assert diff < TOL
