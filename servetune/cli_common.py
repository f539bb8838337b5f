"""What every ``servetune`` command shares: the consoles, the one-line failure, the settings.

Bad input prints ``error: <message>`` as plain text and exits with code 2, never a traceback.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer
from pydantic import ValidationError
from rich.console import Console
from rich.text import Text

from servetune.settings import Settings

LESSONS_DIR_HELP = "lesson store (default $SERVETUNE_LESSONS_DIR or ./.servetune/lessons)"
# the --lessons-dir option of every command that opens the lesson store
LessonsDir = Annotated[Path | None, typer.Option("--lessons-dir", help=LESSONS_DIR_HELP)]

console = Console()
err_console = Console(stderr=True)

KubeconfigOpt = Annotated[Path | None, typer.Option(
    "--kubeconfig", help="kubernetes backend: kubeconfig file (default $KUBECONFIG or "
                         "~/.kube/config; in a pod, its service account)")]
ContextOpt = Annotated[str | None, typer.Option(
    "--context", help="kubernetes backend: kubeconfig context (default: the current one)")]
ModelTokenSecretOpt = Annotated[str | None, typer.Option(
    "--model-token-secret", help="kubernetes backend: Secret whose key 'token' becomes the "
                                 "engines' HF_TOKEN (gated weights); the one Secret the sandbox "
                                 "policy lets pods read (default: none)")]


def fail(message: str, code: int = 2) -> None:
    """Print ``error: <message>`` (the message as plain text, never Rich markup) and exit."""
    err_console.print(Text.assemble(("error:", "bold red"), " ", message), highlight=False,
                      soft_wrap=True)
    raise typer.Exit(code)


def open_store(settings: Settings, lessons_dir: Path | None) -> Any:
    """The lesson store at ``lessons_dir`` (default the settings' ``lessons_dir``)."""
    from memory.store import LessonStore

    return LessonStore(lessons_dir or settings.lessons_dir, settings.embedding)


def load_settings() -> Settings:
    """The settings from the environment; an invalid one exits 2 naming its variable."""
    try:
        return Settings()
    except ValidationError as e:
        err = e.errors()[0]
        fail(f"SERVETUNE_{str(err['loc'][0]).upper()}: {err['msg']}")
        raise  # unreachable: fail exits
