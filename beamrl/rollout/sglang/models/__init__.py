"""Out-of-tree SGLang model classes (SGLang's `SGLANG_EXTERNAL_MODEL_PACKAGE` hook; docs/lora.md).

SGLang imports every module of this package in its scheduler processes and registers each module's
`EntryClass` ahead of its built-in models. Only the engine launcher sets the hook, in the engine's own
environment, and only for engines that serve LoRA adapters (`SGLangEngineConfig.lora`)."""

#: `get_weights_by_name` name of the LoRA status query of beamrl's Beam class.
STATUS_NAME = "beamrl.lora.status"
