"""What a Hugging Face forward says of a generator's rollouts: the reference the vLLM tests check against."""
import numpy as np
import torch


def encode(tokenizer, texts):
    return [np.asarray(tokenizer(t)["input_ids"]) for t in texts]


def hf_logprobs(model, rollout, temperature=1.0):
    """[R] log-prob of each response token under ``model`` (tempered), with the whole prefix."""
    ids = torch.tensor(np.concatenate([rollout.prompt_ids, rollout.response_ids]))[None]
    with torch.no_grad():
        logits = model(ids).logits[0, len(rollout.prompt_ids) - 1:-1].float()
    logp = torch.log_softmax(logits / temperature, dim=-1)
    return logp.gather(-1, torch.as_tensor(rollout.response_ids)[:, None])[:, 0].numpy()


def perturbed_lm(model_path, scale, seed):
    """The Hugging Face LM at ``model_path`` with N(0, scale) added to every weight (seeded):
    a policy that has moved, or a reference that differs from the policy."""
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(scale * torch.randn(p.shape, generator=generator))
    return model
