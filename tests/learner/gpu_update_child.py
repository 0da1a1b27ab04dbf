"""One learner rank's PPO update on CUDA, in a process of its own (DeepSpeed picks its
accelerator once, at import: DS_ACCELERATOR=cuda must be set before it loads, whatever the test
process imported first). Reads (policy path, rollouts, config) pickled in <dir>/in.pkl and writes
the updated weights, on the CPU, to <dir>/out.pt. Used by test_gpu_update.py."""
import pickle
import sys
from pathlib import Path

import torch

from learner.worker import LearnerWorker


def main(folder: str) -> None:
    folder = Path(folder)
    policy_path, rollouts, cfg = pickle.loads((folder / "in.pkl").read_bytes())
    worker = LearnerWorker(rank=0, world_size=1, model=policy_path, config=cfg)
    assert worker.device.type == "cuda", worker.device
    metrics = worker.train(rollouts)
    torch.save({"weights": {k: v.cpu() for k, v in worker.full_state_dict().items()}, "metrics": metrics},
               folder / "out.pt")


if __name__ == "__main__":
    main(sys.argv[1])
