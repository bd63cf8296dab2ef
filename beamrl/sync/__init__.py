"""Weight sync from the trainer to rollout engines: buckets, transports and the versioned update session."""
