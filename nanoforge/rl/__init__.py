"""RL on the one loop: prompts.py, rewards.py + reward_model.py, rollout.py + agent.py (multi-turn tools), losses.py
+ ppo_update.py + critic.py (PPO's value model), the batch sources grpo_batches.py + ppo_batches.py."""
