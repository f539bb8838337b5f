"""``servetune twin serve``: the digital twin as an OpenAI-compatible HTTP server."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any

import typer
from pydantic import ValidationError

from domain.errors import ServetuneError
from servetune.cli_common import (
    fail,
)
from servetune.settings import DEFAULT_STUDY

twin_app = typer.Typer(no_args_is_help=True, help="The digital twin as an OpenAI-compatible "
                                                  "server.")


def _twin_config(config: Path | None, study: Path | None, replicas: int | None) -> Any:
    """The ServingConfig to serve: a JSON/YAML file, a study's baseline, or the default's."""
    from domain.config import ServingConfig
    from domain.study_sources import USER_CATALOG_FILE, register_user_catalog
    from servetune.study_file import load_study, read_config_file

    if config is not None and study is not None:
        fail("give --config or --study, not both")
    try:
        if config is not None:
            try:
                data = read_config_file(config)
            except ValueError as e:
                fail(str(e))
            carried = config.parent / USER_CATALOG_FILE  # the local backend's study model/GPU
            if carried.is_file():
                try:
                    shipped = json.loads(carried.read_text(encoding="utf-8"))
                except (OSError, ValueError) as e:
                    fail(f"{carried}: cannot read the study's model and GPU ({e})")
                register_user_catalog(shipped, str(carried))
            cfg = ServingConfig(**data)
        else:
            cfg = load_study(study or DEFAULT_STUDY).base_config()
        if replicas is not None:
            cfg = ServingConfig(**{**cfg.model_dump(), "replicas": replicas})
    except ValidationError as e:
        err = e.errors()[0]
        where = ".".join(map(str, err["loc"])) or "config"
        fail(f"{config or study}: {where}: {err['msg'].removeprefix('Value error, ')}")
    except ServetuneError as e:
        fail(str(e))
    return cfg


@twin_app.command("serve")
def twin_serve(
    config: Annotated[Path | None, typer.Option(
        "--config", help="ServingConfig as a JSON or YAML file (e.g. the local backend's "
                         "{config_json})")] = None,
    study: Annotated[Path | None, typer.Option(
        "--study", help="serve this study's baseline config (default: the shipped study's)")
    ] = None,
    host: Annotated[str, typer.Option("--host", help="address to bind")] = "127.0.0.1",
    port: Annotated[int, typer.Option("--port", min=0, max=65535,
                                      help="port to bind (0: a free one)")] = 30000,
    port_file: Annotated[Path | None, typer.Option(
        "--port-file", help="write the bound port here once serving")] = None,
    speedup: Annotated[float, typer.Option(
        "--speedup", min=1e-3, max=1e4, envvar="SERVETUNE_TWIN_SPEEDUP",
        help="virtual seconds per wall second (10: every latency is a tenth of the engine's; "
             "default $SERVETUNE_TWIN_SPEEDUP, which the local backend's servers inherit, "
             "else 1)")] = 1.0,
    replicas: Annotated[int | None, typer.Option(
        "--replicas", min=1, max=512, help="serve this many replicas instead of the config's "
                                           "(1: one replica per process, as the local "
                                           "backend starts them)")] = None,
    record: Annotated[bool, typer.Option(
        "--record", help="keep each request's server-side timing (the twin's token times and "
                         "when each was written) for GET /twin/timing, to check a load "
                         "generator's bias")] = False,
) -> None:
    """Serve a config's twin over HTTP (OpenAI API, SSE, /metrics) with the engine's timing."""
    from twin_http.server import serve

    cfg = _twin_config(config, study, replicas)
    try:
        code = serve(cfg, host=host, port=port, port_file=port_file, speedup=speedup,
                     record=record)
    except OSError as e:
        fail(f"cannot serve on {host}:{port}: {e.strerror or e}", code=1)
    raise typer.Exit(code)
