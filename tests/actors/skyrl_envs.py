"""SkyRL-gym environments as tests/actors/environments/test_episodes.py names them (env.environment specs)."""
from actors.environments.skyrl import skyrl_environment

GSM8kMultiTurn = skyrl_environment("gsm8k_multi_turn", ground_truth="answer", max_turns=2)
