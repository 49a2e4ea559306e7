"""Rollout side: replicas that generate samples and the agent loop that streams them to rewards."""
