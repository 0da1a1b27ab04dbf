"""bench.episodes' environment: answers every turn with a short observation after
TETHER_BENCH_STEP_MS of work, never done before max_turns."""
import os
import time


class Echo:
    def reset(self, prompt, columns):
        self.turn = 0
        return None

    def step(self, action):
        self.turn += 1
        time.sleep(float(os.environ.get("TETHER_BENCH_STEP_MS", "0")) / 1000)
        return f"Turn {self.turn} had {len(action)} characters. Go on.", 0.1, False, {}
