"""An empty package level, so that verl-omni's reward files import each other as upstream (``verl_omni.utils.reward_score.*``)."""
