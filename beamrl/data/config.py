"""`DataConfig`: the recipe's `data` section, owned by the prompt loader and read under these names."""

from __future__ import annotations

import string

from pydantic import Field, model_validator

from beamrl.config import ConfigError, Section, registry_choice
from beamrl.data.formats import FORMATS


class SyntheticAdditionConfig(Section):
    """Generator of 'a+b=' prompts with a, b in [0, max_operand]; answers are str(a + b)."""

    num_samples: int = Field(1000, gt=0)
    max_operand: int = Field(9, ge=0)
    seed: int = 0


class DataConfig(Section):
    """Prompt source. `format`: a `FORMATS` name. `tokenizer`: 'digit' or 'byte' (built in, no files), an HF
    tokenizer directory (or a hub id in the HF cache), or null (the tokenizer saved beside model.checkpoint)."""

    format: registry_choice(FORMATS)  # type: ignore[valid-type]
    source: str | None = None
    split: str = "train"
    tokenizer: str | None = None
    prompt_template: str | None = None
    chat_template: bool = False
    shuffle: bool = True
    shuffle_seed: int = 0
    max_prompt_len: int = Field(gt=0)
    synthetic: SyntheticAdditionConfig | None = None

    @model_validator(mode="after")
    def _check(self) -> "DataConfig":
        if self.format == "synthetic-addition":
            self.refuse_changed(("split",), "format 'synthetic-addition' is generated in code, in one split")
            if self.source is not None:
                raise ConfigError("source", self.source, "format 'synthetic-addition' is generated in code; remove "
                                  "source")
        else:
            if self.source is None:
                raise ConfigError("source", None, f"format {self.format!r} needs a local jsonl/parquet path or a hub "
                                  "id")
            if self.synthetic is not None:
                raise ConfigError("synthetic", self.synthetic.model_dump(), "only used by format "
                                  "'synthetic-addition'")
        if self.prompt_template is not None:
            if self.chat_template:
                raise ConfigError("prompt_template", self.prompt_template, "choose one of prompt_template and "
                                  "chat_template: true")
            try:
                fields = {f for _, f, _, _ in string.Formatter().parse(self.prompt_template) if f is not None}
            except ValueError as e:
                raise ConfigError("prompt_template", self.prompt_template, f"not a valid format string ({e})") from None
            if fields != {"prompt"}:
                raise ConfigError("prompt_template", self.prompt_template,
                                  f"must use exactly the placeholder {{prompt}}, found {sorted(fields)}")
        if self.chat_template and self.tokenizer == "digit":
            raise ConfigError("chat_template", True, "the built-in 'digit' tokenizer has no chat template")
        return self
