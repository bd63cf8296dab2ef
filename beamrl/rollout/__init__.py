"""Rollout engines: the protocol, SGLang engines and the embedded `native` engine."""
