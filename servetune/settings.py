"""Settings read once at the edge (environment prefix ``SERVETUNE_``) and passed down."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_STUDY = REPO_ROOT / "studies" / "default.yaml"


class Settings(BaseSettings):
    """servetune settings; every field can be set as ``SERVETUNE_<NAME>``."""

    model_config = SettingsConfigDict(env_prefix="SERVETUNE_")

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
    embedding: Literal["auto", "minilm", "hashing"] = Field(
        "auto", description="lesson embedding: MiniLM int8 ONNX when installed, else hashing")
