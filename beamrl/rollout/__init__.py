"""Rollout engines: SGLang engines and the embedded `native` engine (the protocol is `beamrl.protocols.rollout`)."""
