"""The RL algorithm: the policy loss (PPO clip + TIS), group advantages, tasks and their
rewards, judges' settings, evaluation statistics and the sampling seeds.

Imports: `base`. The loop, the trainers and the planner build on it.
"""
