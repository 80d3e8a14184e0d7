"""Reinforcement learning on the one loop: policy-gradient losses (losses.py), rewards (rewards.py,
reward_model.py) and RL prompt records with their resumable iterator (prompts.py)."""
