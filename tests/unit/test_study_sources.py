"""A study's model and GPU given by source: a config.json path or mapping, an inline GPU spec
or a GPU file (domain/study_sources.py, servetune/study_file.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from fixtures.cli import tiny_study
from fixtures.paths import DEFAULT_STUDY
from fixtures.user_model import (
    H20_SPEC,
    LAB_MOE_KV_BF16,
    LAB_MOE_PARAMS,
    clean_registry,  # noqa: F401 (a fixture)
    write_model_dir,
)

from domain.config import ServingConfig
from domain.errors import ConfigInvalid
from domain.hardware import get_gpu
from domain.lesson import STORED, Scope
from domain.models import get_model
from domain.study import parse_study
from servetune.study_file import load_study

pytestmark = pytest.mark.usefixtures("clean_registry")
CKPTS = {"bf16": "lab/Lab-MoE", "fp8": "lab/Lab-MoE-FP8"}


def study(tmp: Path, **over) -> Path:
    """A study file in ``tmp`` (the tiny study, on H200 at TP 1-2 unless ``over`` says)."""
    s = tiny_study(gpu="H200", gpu_count=2, baseline={"tp_size": 1, "weights": "bf16"},
                   knobs={"tp_size": [1, 2]})
    s.update(over)
    p = tmp / "study.yaml"
    p.write_text(yaml.safe_dump(s))
    return p


def test_string_form_studies_keep_their_digest() -> None:
    # the digest main gave studies/default.yaml before models and GPUs could be given by source
    s = load_study(DEFAULT_STUDY)
    assert s.sources == {} and s.digest() == "805587d8b02c1008"


def test_mapping_form_registers_the_model_with_its_checkpoints(tmp_path: Path) -> None:
    write_model_dir(tmp_path / "models")
    s = load_study(study(tmp_path, model={"hf_config": "models/lab-moe/config.json",
                                          "name": "lab-moe-a", "checkpoints": CKPTS}))
    assert s.model == "lab-moe-a" and s.sources["model"].name == "lab-moe-a"
    arch = get_model("lab-moe-a")
    assert arch.total_params == LAB_MOE_PARAMS
    assert arch.kv_bytes_per_token(2, 1) == LAB_MOE_KV_BF16
    assert {k: c.model_path for k, c in arch.checkpoints.items()} == CKPTS
    cfg = s.base_config()
    assert (cfg.model, cfg.weights) == ("lab-moe-a", "bf16")


def test_path_forms_read_the_folder_relative_to_the_study(tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch
                                                          ) -> None:
    d = write_model_dir(tmp_path / "models", name="lab-moe-b")
    monkeypatch.chdir(Path("/"))  # relative to the study file, not the working folder
    for value in ("models/lab-moe-b", "models/lab-moe-b/config.json", str(d)):
        s = load_study(study(tmp_path, model=value))
        assert s.model == "lab-moe-b"  # named after its folder
        ckpt = get_model("lab-moe-b").checkpoint("bf16")  # the folder's own precision
        assert Path(ckpt.model_path) == d.resolve()


def test_inline_gpu_and_gpu_file_register_the_gpu(tmp_path: Path) -> None:
    write_model_dir(tmp_path)
    s = load_study(study(tmp_path, model="lab-moe", gpu=dict(H20_SPEC, name="H20-inline")))
    assert s.gpu == "H20-inline" and get_gpu("H20-inline").hbm_gb == 96.0
    (tmp_path / "gpus").mkdir()
    (tmp_path / "gpus" / "h20.json").write_text(json.dumps(dict(H20_SPEC, name="H20-file")))
    s2 = load_study(study(tmp_path, model="lab-moe", gpu="gpus/h20.json"))
    assert s2.gpu == "H20-file" and "h20.json" in get_gpu("H20-file").source
    # the user's model and GPU pass every catalog check a config and a lesson scope make
    cfg = ServingConfig(model="lab-moe", gpu="H20-file", weights="bf16")
    assert Scope(gpu="H20-file", model="lab-moe", quantization="bf16").matches(cfg)


def test_digest_follows_the_config_and_the_spec(tmp_path: Path) -> None:
    write_model_dir(tmp_path)
    path = study(tmp_path, model="lab-moe", gpu=dict(H20_SPEC, name="H20-d"))
    first = load_study(path).digest()
    assert load_study(path).digest() == first  # a resume reads the same study again
    write_model_dir(tmp_path, num_experts_per_tok=8)
    assert load_study(path).digest() != first
    path = study(tmp_path, model="lab-moe", gpu=dict(H20_SPEC, name="H20-d", hbm_gb=80.0))
    assert load_study(path).digest() != first


def test_a_stored_lesson_on_an_unregistered_model_stays_readable() -> None:
    scope = {"gpu": "H20-gone", "model": "lab-gone", "quantization": "w4a16"}
    with pytest.raises(ValueError, match="scope.gpu 'H20-gone' is not in the GPU catalog"):
        Scope.model_validate(scope)
    assert Scope.model_validate(scope, context=STORED).model == "lab-gone"


@pytest.mark.parametrize(("model", "line"), [
    ({"hf_config": "x/config.json", "nmae": "a"}, "model.nmae: Extra inputs are not permitted"),
    ({"name": "a"}, "model.hf_config: Field required"),
    ({"hf_config": "x", "name": "a b"}, "model.name: String should match pattern"),
    ({"hf_config": "x", "checkpoints": {"bf16": 3}}, "model.checkpoints.bf16: Input should be "
                                                     "a valid string"),
    (8, "model: give a catalog key"),
    ("nowhere/config.json", "model config"),
    ("./My Model", "the folder name 'My Model' is not a servetune name"),
])
def test_bad_model_values_give_one_line_naming_model(tmp_path: Path, model, line) -> None:
    write_model_dir(tmp_path, "My Model")
    with pytest.raises(ConfigInvalid) as e:
        parse_study(dict(tiny_study(), model=model), base_dir=tmp_path)
    assert len(e.value.violations) == 1
    assert e.value.violations[0].startswith("model") and line in e.value.violations[0]


def test_a_catalog_key_is_never_read_as_a_path(tmp_path: Path) -> None:
    (tmp_path / "glm-5").mkdir()  # a folder named like a catalog key next to the study
    assert load_study(study(tmp_path, **{k: v for k, v in tiny_study().items()
                                         if k in ("model", "gpu", "gpu_count", "baseline",
                                                  "knobs")})).sources == {}


def test_the_local_backend_carries_the_study_model_and_gpu_to_its_servers(tmp_path: Path
                                                                          ) -> None:
    """The deployment folder's user-catalog.json (mcp_servers/cluster/local.py writes it) lets
    a ``servetune twin serve --config`` process, which registered nothing, read the config."""
    from domain import hardware, models
    from domain.study_sources import USER_CATALOG_FILE, user_catalog
    from servetune.cli_twin import _twin_config

    write_model_dir(tmp_path)
    s = load_study(study(tmp_path, model="lab-moe", gpu=dict(H20_SPEC, name="H20-carried")))
    cfg = s.base_config()
    assert user_catalog("glm-5", "B200") == {"models": [], "gpus": []}
    carried = user_catalog(cfg.model, cfg.gpu)
    (tmp_path / "config.json").write_text(cfg.model_dump_json())
    (tmp_path / USER_CATALOG_FILE).write_text(json.dumps(carried))
    for registry in (models._REGISTERED, models.MODELS, hardware._REGISTERED):
        registry.pop("lab-moe", None)
        registry.pop("H20-carried", None)  # as in a fresh process
    assert _twin_config(tmp_path / "config.json", None, None) == cfg
    assert get_model("lab-moe") == s.sources["model"] and get_gpu("H20-carried") == s.sources["gpu"]


def test_the_shipped_example_reads_its_own_config() -> None:
    s = load_study(DEFAULT_STUDY.parent / "qwen3-30b-a3b-own-config.yaml")
    arch = s.sources["model"]
    assert s.model == "qwen3-30b-a3b-own" and s.gpu == "L40S" and "gpu" not in s.sources
    assert abs(arch.total_params / 30.5e9 - 1) < 0.03  # Qwen3-30B-A3B model card: 30.5B
    assert {k: c.model_path for k, c in arch.checkpoints.items()} == {
        "bf16": "Qwen/Qwen3-30B-A3B", "fp8": "Qwen/Qwen3-30B-A3B-FP8"}
