"""Prompt data: sources (HF datasets, synthetic), formats, prompt formatting and a resumable loader."""

from beamrl.data.loader import PromptLoader, build_prompt_loader
from beamrl.data.sample import PromptSample

__all__ = ["PromptLoader", "PromptSample", "build_prompt_loader"]
