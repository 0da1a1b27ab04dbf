"""The merged export of a LoRA adapter, in every family the stages train (the SFT policy and the
reward model): the saved model scores as the model with its adapter does. GPT-2 keeps its
projections as Conv1D, weights stored (in, out), so its delta is B A transposed."""
import pytest
import torch

from cluster.demo.families import FAMILIES, build_family_policy
from core.modeling.architectures import load_pretrained
from learner.lora_config import LoraConfig
from learner.objectives.preference import RewardModule
from learner.policy import PolicyWithValueHead

pytestmark = pytest.mark.unit
IDS = torch.tensor([[5, 17, 301, 44, 9, 88, 120, 7]])
# fp32 throughout: the merged and the adapted forwards differ only in summation order (~1e-6 on
# logits of order 1); a delta merged the wrong way round moves them by more than 0.1.
TOLERANCE = 1e-4


def _nonzero_adapter(module: torch.nn.Module) -> None:
    for name, p in module.named_parameters():
        if ".lora_B." in name:
            p.normal_(0, 0.1)  # B starts at zero: the merge would have nothing to fold in


@pytest.mark.parametrize("family", sorted(FAMILIES))
@torch.no_grad()
def test_merged_export_scores_as_the_adapter(family, tmp_path):
    from transformers import AutoModelForCausalLM

    path, lora, mask = build_family_policy(family), LoraConfig(rank=4), torch.ones_like(IDS)
    torch.manual_seed(0)
    policy = PolicyWithValueHead.from_pretrained(path, lora=lora).eval()
    reward = RewardModule.from_pretrained(path, lora=lora).eval()  # the RM stage starts from the SFT LM
    _nonzero_adapter(policy)
    _nonzero_adapter(reward)
    logits, score = policy.lm(IDS).logits, reward(IDS, mask)
    policy.save_pretrained(tmp_path / "policy")
    reward.save_pretrained(tmp_path / "rm")
    # Loaded as tether loads a model (load_pretrained: the family's attention, e.g. Gemma-2's soft-capped one)
    merged = load_pretrained(AutoModelForCausalLM, tmp_path / "policy").eval()(IDS).logits
    merged_rm = RewardModule.from_pretrained(tmp_path / "rm").eval()
    base = load_pretrained(AutoModelForCausalLM, path).eval()(IDS).logits
    gap, score_gap = float((logits - merged).abs().max()), float((score - merged_rm(IDS, mask)).abs().max())
    print(f"{family}: merged logit gap {gap:.1e}, score gap {score_gap:.1e}, adapter moved logits by "
          f"{float((logits - base).abs().max()):.2f}")
    assert float((logits - base).abs().max()) > 10 * TOLERANCE  # the adapter is there to merge
    assert gap < TOLERANCE and score_gap < TOLERANCE
