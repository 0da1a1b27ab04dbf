"""An environment for tests/e2e/test_episodes_run.py, imported by name in the generators' workers."""


class SayMore:
    """Two turns: each step rewards the turn's length (characters / 40, at most 1) and asks again."""

    def reset(self, prompt, columns):
        self.turn = 0
        return "Say more."

    def step(self, action):
        self.turn += 1
        return "Again.", min(len(action), 40) / 40, self.turn >= 2, {"chars": len(action)}
