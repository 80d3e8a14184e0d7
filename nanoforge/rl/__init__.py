"""RL on the one loop: prompts.py, rewards.py + reward_model.py, rollout.py + agent.py (multi-turn tools), losses.py
+ ppo.py + critic.py (PPO's value model), the stages stage.py + ppo_stage.py, the recipes grpo.py + ppo_recipe.py."""
