"""Every prompt a driver issued and every prompt a take consumed, by prompt index: what the
fault tests check a run lost or trained twice against."""


class Accounting:
    """Every prompt the driver issued and every rollout the learner took, by prompt index."""

    def __init__(self, driver):
        self.issued, self.trained = [], []
        issue, consumed = driver.prompts.issue, driver.rollouts.ledger.consumed

        def issue_and_note():
            chunks = issue()
            self.issued += [i for c in chunks for i in c.prompt_indices]
            return chunks

        def consumed_and_note(pairs):
            self.trained += [i for _, i in pairs]
            return consumed(pairs)

        driver.prompts.issue, driver.rollouts.ledger.consumed = issue_and_note, consumed_and_note

    def assert_each_prompt_trained_once(self, samples=4):
        assert sorted(self.trained) == sorted(i for i in self.issued for _ in range(samples))

    def lost_and_twice(self, samples: int = 4) -> tuple[int, int]:
        """(prompts issued but never trained, rollouts trained more than once)."""
        issued, trained = sorted(self.issued), sorted(self.trained)
        lost = len([i for i in set(issued) if i not in trained])
        twice = sum(max(0, trained.count(i) - samples) for i in set(trained))
        return lost, twice

    def follow_rollbacks(self, driver) -> None:
        """Cut the record back at each rollback to what it was at the checkpoint restored: the
        abandoned step's prompts are issued (and trained) again, which is not a duplicate."""
        marks = {0: (0, 0)}
        checkpoint, restore = driver.checkpoint, driver.restore

        def checkpoint_and_mark():
            path = checkpoint()
            marks[driver.step_count] = (len(self.issued), len(self.trained))
            return path

        def restore_and_cut(path):
            state = restore(path)
            issued, trained = marks[state.step]
            del self.issued[issued:], self.trained[trained:]
            return state

        driver.checkpoint, driver.restore = checkpoint_and_mark, restore_and_cut
