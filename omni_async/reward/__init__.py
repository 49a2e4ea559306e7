"""Reward loop: reward managers, scorers, dispatch."""
