"""A reward function that takes prompt-row columns, for tests/e2e/test_columns_run.py: it records
what reached it (prompt, answer, source, process) in columns.jsonl of the folder
$TETHER_TEST_MARKS names (tests/rays.py) and scores sentiment."""
import json
import os
from pathlib import Path

from cluster.demo.sentiment import sentiment


def graded(prompts, responses, *, answer, source):
    marks = os.environ.get("TETHER_TEST_MARKS")
    if marks:
        path = Path(marks) / "columns.jsonl"
        lines = "".join(json.dumps({"prompt": p, "answer": a, "source": s, "pid": os.getpid()}) + "\n"
                        for p, a, s in zip(prompts, answer, source))
        with open(path, "a") as f:  # one append per call: whole lines from every process
            f.write(lines)
    return sentiment(prompts, responses)
