"""Metric names every backend and the console line agree on (the loop logs more; these have fixed meaning)."""

STEP = "step"
REWARD_MEAN = "reward/mean"  # mean total (weighted) reward of the step's samples
RESPONSE_LEN_MEAN = "response_length/mean"  # tokens
TIME_ROLLOUT = "time/rollout_s"
TIME_TRAIN = "time/train_s"
TIME_SYNC = "time/sync_s"
TIME_STEP = "time/step_s"
# Prompt + response tokens of the step's samples per second of the whole step (rollout + train + sync).
TOKENS_PER_S = "throughput/tokens_per_s"
