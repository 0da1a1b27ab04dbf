"""tether's service side: the job entrypoints and what runs beside the driver."""
import time as _time

# When Python began importing tether's entrypoint package (`python -m cluster.train`, also
# under `ray job submit`): where a job's start-up clock starts (cluster/job/startup.py). The
# process's own start time would count whatever ran before an `exec` into Python, such as
# scripts/run.sh's set-up.
STARTED = _time.time()
