"""Weight sync from the trainer to rollout engines: one orchestrator (`orchestrator.WeightSync`), one bucket plan
(`plan`), one packing function (`packing.pack_bucket`), transports (`transports`), and the receivers' checks
(`receive_session`). docs/weight-sync.md."""
