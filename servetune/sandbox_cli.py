"""``servetune sandbox``: render the Kubernetes sandbox and SGLang deployments as YAML.

Every rendering is validated offline (``sandbox.validate``: kubernetes-validate strict for the
target release, the LeaderWorkerSet CRD schema) before anything is printed or written. Bad input
prints one line and exits with code 2; a rendering that fails validation (a servetune bug) prints
each problem and exits with code 1.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer
import yaml
from pydantic import ValidationError
from rich.console import Console
from rich.text import Text

from domain.config import ServingConfig
from domain.errors import ServetuneError
from sandbox.manifests import SglangOptions, render_sandbox, render_sglang
from sandbox.namespace import (
    CONFIGMAP_MAX_BYTES,
    DATA_DIR,
    DATA_PVC,
    IMAGE_REPO_ROOT,
    STUDY_DIR,
    check_cidr,
    study_with_trace,
    trace_key,
)
from sandbox.podspec import (
    MANAGED_BY_LABEL,
    STUDY_LABEL,
    TRIAL_LABEL,
    check_image,
    check_namespace,
    check_quantity,
    check_subdomain,
    label_value,
)
from sandbox.validate import check_k8s_version, validate

sandbox_app = typer.Typer(no_args_is_help=True, help="Kubernetes manifests: the sandbox for "
                                                     "headless runs, SGLang deployments.")
err_console = Console(stderr=True)

K8sVersionOpt = Annotated[str, typer.Option(
    "--k8s-version", help="target Kubernetes release (schemas, DRA apiVersion)")]
OutOpt = Annotated[Path | None, typer.Option(
    "--out", help="write one file per object into this folder instead of printing")]
TokenSecretOpt = Annotated[str | None, typer.Option(
    "--model-token-secret", help="Secret whose key 'token' becomes the engines' HF_TOKEN "
                                 "(gated weights); the one Secret the policy lets pods read")]


def _fail(message: str, code: int = 2) -> None:
    """Print ``error: <message>`` (the message as plain text, never Rich markup) and exit."""
    err_console.print(Text.assemble(("error:", "bold red"), " ", message), highlight=False,
                      soft_wrap=True)
    raise typer.Exit(code)


class _Dumper(yaml.SafeDumper):
    """Multi-line strings (the study in its ConfigMap) as literal blocks."""


def _str(dumper: yaml.SafeDumper, value: str) -> Any:
    style = "|" if "\n" in value else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)


_Dumper.add_representer(str, _str)


def to_yaml(objs: list[dict[str, Any]]) -> str:
    """``objs`` as one multi-document YAML stream (keys in rendering order)."""
    return yaml.dump_all(objs, Dumper=_Dumper, sort_keys=False, default_flow_style=False)


def _emit(objs: list[dict[str, Any]], k8s_version: str, out: Path | None) -> None:
    problems = validate(objs, k8s_version)
    if problems:
        for p in problems:
            err_console.print(f"invalid: {p}", highlight=False, soft_wrap=True, markup=False)
        _fail(f"{len(problems)} rendered object(s) fail validation for Kubernetes {k8s_version}"
              " (a servetune bug: please report it)", code=1)
    if out is None:
        typer.echo(to_yaml(objs), nl=False)
        return
    try:
        out.mkdir(parents=True, exist_ok=True)
        for i, obj in enumerate(objs):
            path = out / f"{i:02d}-{obj['kind'].lower()}-{obj['metadata']['name']}.yaml"
            path.write_text(to_yaml([obj]), encoding="utf-8")
            typer.echo(str(path))
    except OSError as e:
        _fail(f"--out {out}: cannot write ({e.strerror or e})")


def _version(k8s_version: str) -> str:
    try:
        return check_k8s_version(k8s_version)
    except ValueError as e:
        _fail(f"--k8s-version: {e}")
    raise AssertionError  # unreachable: _fail exits


@sandbox_app.command("render")
def render(
    namespace: Annotated[str, typer.Option("--namespace", help="sandbox namespace")],
    gpus: Annotated[int, typer.Option("--gpus", min=1, help="GPUs the study may hold (at "
                                                          "least the study's gpu_count)")],
    image: Annotated[str, typer.Option("--image", help="servetune image (sandbox/Dockerfile)")],
    study: Annotated[Path, typer.Option("--study", help="study YAML run by the Job")],
    k8s_version: K8sVersionOpt = "1.33",
    lws: Annotated[bool, typer.Option("--lws", help="grant LeaderWorkerSets")] = False,
    dra: Annotated[bool, typer.Option("--dra", help="grant DRA ResourceClaims")] = False,
    storage: Annotated[str, typer.Option(help="PVC size for runs and lessons")] = "20Gi",
    storage_class: Annotated[str | None, typer.Option(help="PVC storage class")] = None,
    run_id: Annotated[str, typer.Option("--run-id", help="servetune run --run-id")] = "sandbox",
    api_cidr: Annotated[str, typer.Option(
        "--api-cidr", help="API server address range for egress on 443/6443")] = "0.0.0.0/0",
    model_token_secret: TokenSecretOpt = None,
    out: OutOpt = None,
) -> None:
    """Print the sandbox (namespace, RBAC, quota, network policy, study, PVC, runner Job).

    The Job reads the study's replay trace from the image when it is a shipped trace (under
    the repository's data/), from the study's ConfigMap when it is the user's (study and trace
    together at most 1 MiB), or from the data PVC when the study names a path under /data.
    """
    from servetune.study_file import load_study

    try:
        check_namespace(namespace, what="--namespace")
        check_image(image, what="--image")
        check_cidr(api_cidr, "--api-cidr")
        check_quantity(storage, "--storage")
        if storage_class is not None:
            check_subdomain(storage_class, "--storage-class")
        if model_token_secret is not None:
            check_subdomain(model_token_secret, "--model-token-secret")
    except ValueError as e:
        _fail(str(e))
    version = _version(k8s_version)
    try:
        text = study.read_text(encoding="utf-8")
        spec = load_study(study)
    except (OSError, UnicodeDecodeError) as e:
        _fail(f"--study {study}: cannot read ({getattr(e, 'strerror', None) or e})")
    except ServetuneError as e:
        _fail(f"--study: {e}")
    if gpus < spec.gpu_count:
        _fail(f"--gpus {gpus}: the study {spec.name} uses {spec.gpu_count} {spec.gpu} GPUs; the "
              f"quota must allow at least that many (--gpus {spec.gpu_count})")
    text, files = _job_trace(spec, study, text)
    try:
        objs = render_sandbox(namespace, gpus, image=image, study_yaml=text,
                              k8s_version=version, lws=lws, dra=dra, storage=storage,
                              storage_class=storage_class, run_id=run_id, api_cidr=api_cidr,
                              model_token_secret=model_token_secret, files=files)
    except ValueError as e:
        _fail(str(e))
    _emit(objs, version, out)


def _job_trace(spec: Any, study: Path, text: str) -> tuple[str, dict[str, str]]:
    """The study text whose replay trace is a path inside the Job, and the ConfigMap files.

    A trace under the repository's data/ is in the image (``/opt/servetune/data/...``, see
    sandbox/Dockerfile); a path under /data that is not a file here is on the data PVC; any
    other trace is embedded in the ConfigMap (key ``replay-trace<suffix>``) when it fits.
    """
    from servetune.settings import REPO_ROOT
    from servetune.study_file import resolve_trace

    named = Path(spec.replay.trace)
    if named.is_absolute() and named.is_relative_to(DATA_DIR) and not named.exists():
        return text, {}  # the operator put it on the data PVC
    try:
        path = resolve_trace(spec, study)
    except ServetuneError as e:
        _fail(f"--study: {e}")
    shipped = (REPO_ROOT / "data").resolve()
    if path.is_relative_to(shipped):
        return study_with_trace(text, f"{IMAGE_REPO_ROOT}/{path.relative_to(REPO_ROOT.resolve())}"
                                ), {}
    room = CONFIGMAP_MAX_BYTES - len(text.encode())
    try:
        size = path.stat().st_size
        trace = path.read_text(encoding="utf-8") if size <= room else None
    except (OSError, UnicodeDecodeError) as e:
        _fail(f"--study: trace {path}: cannot read it as UTF-8 text "
              f"({getattr(e, 'strerror', None) or e})")
    if trace is None:
        _fail(f"--study: trace {path} is {size:,} bytes, more than the study's ConfigMap holds "
              f"(1 MiB with the study, {room:,} bytes left); copy it to the {DATA_PVC} PVC and "
              f"set replay.trace: {DATA_DIR}/<file>, or build an image that contains it under "
              f"{IMAGE_REPO_ROOT}/data/ (sandbox/Dockerfile) and name that path")
    key = trace_key(path.name)
    return study_with_trace(text, f"{STUDY_DIR}/{key}"), {key: trace}


@sandbox_app.command("render-config")
def render_config(
    config: Annotated[Path, typer.Option("--config", help="ServingConfig as JSON or YAML")],
    name: Annotated[str, typer.Option("--name", help="deployment name (DNS label)")],
    namespace: Annotated[str, typer.Option("--namespace", help="target namespace")],
    image: Annotated[str | None, typer.Option(
        "--image", help="engine image (default lmsysorg/sglang:v<engine_version>)")] = None,
    k8s_version: K8sVersionOpt = "1.33",
    router: Annotated[bool, typer.Option("--router", help="SGLang router in front")] = False,
    dra: Annotated[bool, typer.Option("--dra", help="GPUs through DRA")] = False,
    gpus_per_node: Annotated[int, typer.Option(min=1, max=64, help="GPUs per node")] = 8,
    model_cache_pvc: Annotated[str | None, typer.Option(help="PVC for weights/caches")] = None,
    study_name: Annotated[str, typer.Option(help="servetune.io/study label")] = "manual",
    trial: Annotated[str | None, typer.Option(help="servetune.io/trial label (default: "
                                                    "the config id)")] = None,
    model_token_secret: TokenSecretOpt = None,
    out: OutOpt = None,
) -> None:
    """Print the SGLang deployment of one ServingConfig (engine, Service, router, DRA claim)."""
    version = _version(k8s_version)
    try:
        for value, what in ((model_cache_pvc, "--model-cache-pvc"),
                            (model_token_secret, "--model-token-secret")):
            if value is not None:
                check_subdomain(value, what)
    except ValueError as e:
        _fail(str(e))
    from servetune.study_file import read_config_file

    try:
        data = read_config_file(config)
    except ValueError as e:
        _fail(str(e))
    try:
        cfg = ServingConfig(**data)
    except ValidationError as e:
        err = e.errors()[0]
        where = ".".join(map(str, err["loc"])) or "config"
        _fail(f"--config {config}: {where}: {err['msg'].removeprefix('Value error, ')}")
    except ServetuneError as e:
        _fail(f"--config {config}: {e}")
    labels = {MANAGED_BY_LABEL: "servetune", STUDY_LABEL: label_value(study_name) or "manual",
              TRIAL_LABEL: label_value(trial or cfg.config_id()) or cfg.config_id()}
    try:
        check_namespace(namespace, what="--namespace")
        if image is not None:
            check_image(image, what="--image")
        opts = SglangOptions(image=image, k8s_version=version, router=router, dra=dra,
                             gpus_per_node=gpus_per_node, model_cache_pvc=model_cache_pvc,
                             hf_token_secret=model_token_secret)
        objs = render_sglang(cfg, name, namespace, labels, opts=opts)
    except ValidationError as e:
        _fail(f"option {'.'.join(map(str, e.errors()[0]['loc']))}: {e.errors()[0]['msg']}")
    except (ValueError, ServetuneError) as e:
        _fail(str(e))
    _emit(objs, version, out)
