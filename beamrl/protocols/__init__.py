"""The seams that rollout engines and the weight sync share, in a home that imports neither side.

- `rollout`: `RolloutEngine` and its request/result types (what the RL loop asks of an engine).
- `weights`: `WeightReceiver` and `WeightSyncError` (what an engine implements to receive weights).
- `flat_bucket`: `FlatBucket`, the byte layout of a weight bucket that both sides must agree on.
"""
