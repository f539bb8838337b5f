"""Settings read once at the edge (environment prefix ``SERVETUNE_``) and passed down."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from domain.usage import DEFAULT_PRICES

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_STUDY = REPO_ROOT / "studies" / "default.yaml"
# A model id as the Messages API, Bedrock and Vertex spell them (claude-sonnet-5-5,
# anthropic.claude-..., claude-...@2025...): no spaces, no leading '-'.
MODEL_NAME = r"^[A-Za-z0-9][A-Za-z0-9._:@/-]*$"
MAX_PRICE = 10_000.0  # USD per million tokens; anything above is a typo


class Settings(BaseSettings):
    """servetune settings; every field can be set as ``SERVETUNE_<NAME>``."""

    model_config = SettingsConfigDict(env_prefix="SERVETUNE_", env_ignore_empty=True)

    lessons_dir: Path = Field(Path(".servetune/lessons"),
                              description="lesson store shared by all runs (ChromaDB folder)")
    runs_dir: Path = Field(Path("runs"), description="where runs/<run-id>/ folders are made")
    state_dir: Path = Field(Path(".servetune/state"), description=(
        "deployment records of the cluster backends, shared by the cluster and bench MCP "
        "servers (two stdio processes) so bench can reach what cluster deployed"))
    sglang_source: Path | None = Field(None, description=(
        "SGLang source tree for the sglang-source server (unpacked wheel or git checkout); "
        "default: the tree `servetune source fetch` unpacked for the version"))
    source_cache: Path | None = Field(None, description=(
        "where `servetune source fetch` unpacks wheels (default ~/.cache/servetune/sglang)"))
    brains: Literal["auto", "claude", "deterministic"] = Field("auto", description=(
        "who plans, deploys, judges and researches: Claude agents (needs ANTHROPIC_API_KEY), "
        "the deterministic brains, or auto (Claude when ANTHROPIC_API_KEY is set)"))
    model: str | None = Field(None, pattern=MODEL_NAME, max_length=128, description=(
        "Claude model of every agent (default agents.claude.DEFAULT_MODEL), e.g. "
        "claude-sonnet-5-5"))
    price_input_per_mtok: float = Field(
        DEFAULT_PRICES["input"], ge=0, le=MAX_PRICE, allow_inf_nan=False, description=(
        "USD per million input tokens for the report's cost estimate (Claude Sonnet 5.5 list "
        "price, platform.claude.com/docs/en/about-claude/pricing, 2026-11)"))
    price_output_per_mtok: float = Field(
        DEFAULT_PRICES["output"], ge=0, le=MAX_PRICE, allow_inf_nan=False, description=(
        "USD per million output tokens (same source)"))
    price_cache_read_per_mtok: float = Field(
        DEFAULT_PRICES["cache_read"], ge=0, le=MAX_PRICE, allow_inf_nan=False, description=(
        "USD per million cache-read input tokens (same source)"))
    price_cache_write_per_mtok: float = Field(
        DEFAULT_PRICES["cache_write"], ge=0, le=MAX_PRICE, allow_inf_nan=False, description=(
        "USD per million 5-minute cache-write input tokens (same source)"))
    repeats: int = Field(1, ge=1, le=20, description=(
        "saturation runs per launched candidate when the study's acceptance.repeats is unset: "
        "the acceptance gate's bootstrap interval uses the repeats"))
    embedding: Literal["auto", "minilm", "hashing"] = Field(
        "auto", description="lesson embedding: MiniLM int8 ONNX when installed, else hashing")

    def prices(self) -> dict[str, float]:
        """USD per million tokens by kind (input, output, cache_read, cache_write).

        The form :func:`domain.usage.llm_cost_usd` takes.
        """
        return {"input": self.price_input_per_mtok, "output": self.price_output_per_mtok,
                "cache_read": self.price_cache_read_per_mtok,
                "cache_write": self.price_cache_write_per_mtok}
