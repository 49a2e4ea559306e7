"""Reward functions in the verl convention: compute_score(data_source, solution_image|solution_str, ground_truth, extra_info, **kwargs)."""
