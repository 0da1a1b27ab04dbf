"""Every model family as the frozen reference and as the reward model, against plain HF forwards.

The reference's log-probs (padded batches, response columns only) must equal a plain Hugging
Face forward of each sequence alone with eager attention; a sequence-classification reward
model of the family must load, and its scores (padded batches, last-token pooling) equal
the HF model's own forward of each sequence alone. Refused families fail in one line.
"""
import numpy as np
import pytest
import torch
from helpers import model_logprobs
from reward_configs import reward_config

from cluster.demo.families import FAMILIES, build_family_policy, build_family_reward
from core.modeling.architectures import UnsupportedModel, check_policy_config

TEXTS = [("the movie was great and i loved every minute of it", " and so did my friends"),
         ("a terrible, boring film", " that nobody liked at all, sadly"), ("i think", " so")]


def token_pairs(path):
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(path)
    return ([np.asarray(tok(p)["input_ids"]) for p, _ in TEXTS],
            [np.asarray(tok(r)["input_ids"]) for _, r in TEXTS])


@pytest.mark.integration
@pytest.mark.parametrize("family", list(FAMILIES))
def test_reference_and_reward_model_score_like_hf(family):
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    from actors.reference import Reference
    from actors.reward import Reward

    policy, reward = str(build_family_policy(family)), str(build_family_reward(family))
    prompts, responses = token_pairs(policy)
    lm = AutoModelForCausalLM.from_pretrained(policy, attn_implementation="eager", dtype=torch.float32).eval()
    truth = model_logprobs(lm, prompts, responses)
    got = Reference(model=policy, batch_size=4).logprobs(prompts, responses)
    ref_gap = max(float(np.abs(a - b).max()) for a, b in zip(got, truth))

    seq = AutoModelForSequenceClassification.from_pretrained(reward, attn_implementation="eager",
                                                             dtype=torch.float32).eval()
    with torch.no_grad():
        expected = np.array([float(seq(torch.as_tensor(np.concatenate([p, r]))[None]).logits[0, 0])
                             for p, r in zip(prompts, responses)])
    result = Reward(config=reward_config(model=reward, batch_size=4)).score(prompts, responses)
    print(f"family-table {family}: reference vs HF {ref_gap:.1e}, reward vs HF "
          f"{np.abs(result.scores - expected).max():.1e}")
    assert ref_gap < 1e-4
    assert result.valid.all() and np.allclose(result.scores, expected, atol=1e-4)
    assert np.ptp(result.scores) > 1e-3, "different responses must get different scores"


@pytest.mark.unit
@pytest.mark.parametrize("family, refusal", [
    ("bert", r"^model\.policy: architecture BertForMaskedLM is not a text causal LM that transformers' "
             r"AutoModelForCausalLM loads; [^\n]+$"),
])
def test_a_policy_that_is_no_causal_lm_is_refused_in_one_line(family, refusal):
    from transformers import AutoConfig
    with pytest.raises(UnsupportedModel, match=refusal):
        check_policy_config(AutoConfig.from_pretrained(build_family_policy(family)))


@pytest.mark.unit
def test_a_multimodal_checkpoint_is_refused():
    from transformers import Gemma3Config
    config = Gemma3Config(architectures=["Gemma3ForConditionalGeneration"])
    with pytest.raises(UnsupportedModel, match=r"^model\.policy: architecture Gemma3ForConditionalGeneration is not "
                                               r"a text causal LM"):
        check_policy_config(config)


@pytest.mark.unit
def test_a_quantized_checkpoint_is_refused(tmp_path):
    from transformers import AutoConfig
    config = AutoConfig.from_pretrained(build_family_policy("llama"))
    config.quantization_config = {"quant_method": "gptq", "bits": 4}
    with pytest.raises(UnsupportedModel, match=r"LlamaForCausalLM checkpoint is quantized .* unquantized"):
        check_policy_config(config)
    check_policy_config(AutoConfig.from_pretrained(build_family_policy("llama")))  # the same, unquantized


@pytest.mark.integration
def test_vllm_refuses_what_it_does_not_serve():
    from core.modeling.vllm_engine import check_served
    with pytest.raises(UnsupportedModel, match=r"^model\.policy: vLLM \S+ does not serve architecture "
                                               r"GPTNeoForCausalLM as a text generator; [^\n]+$"):
        check_served(str(build_family_policy("gpt-neo")))
    check_served(str(build_family_policy("gpt-neox")))  # served through vLLM's Transformers backend


@pytest.mark.integration
def test_a_refusal_in_an_actor_constructor_reaches_the_driver_as_its_line(ray_local):
    """Ray hands the driver an ActorDiedError whose text holds the actor's error: the driver
    finds the refusal's own line in it (core.modeling.architectures.unsupported_model)."""
    import ray

    from core.modeling.architectures import unsupported_model

    @ray.remote(num_cpus=0)
    class Refusing:
        def __init__(self):
            raise UnsupportedModel("model.policy: vLLM does not serve architecture FooForCausalLM")

        def health(self):
            return {}

    with pytest.raises(ray.exceptions.RayActorError) as died:
        ray.get(Refusing.remote().health.remote())
    assert unsupported_model(died.value) == "model.policy: vLLM does not serve architecture FooForCausalLM"
    assert unsupported_model(ValueError("something else")) is None
