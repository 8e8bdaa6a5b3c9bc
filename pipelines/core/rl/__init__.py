"""Reinforcement learning from rewards: GRPO's losses, rollouts, reward functions, tools and multi-turn episodes."""
