"""Ray nodes as tether sees them: how fast a lost node is noticed (health.py), and losing one
on purpose, found by its node id (kill.py)."""
