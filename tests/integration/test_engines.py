"""The engine seam: the registry, the SGLang engine behind it, and what importing it costs."""

from __future__ import annotations

import subprocess
import sys

import pytest

from domain.config import ServingConfig
from domain.engines import ENGINES, engine, engine_for, failure_classes, resolved_settings
from domain.engines.sglang import SglangEngine


def test_registry_gives_the_newest_sglang_by_default_and_the_config_s_engine():
    e = engine()
    assert isinstance(e, SglangEngine) and (e.name, e.version) == ("sglang", "0.5.23")
    cfg = ServingConfig(model="glm-5", gpu="B200", tp_size=8, weights="fp8")
    assert engine_for(cfg) is engine("sglang", "0.5.23")
    assert e.image == "lmsysorg/sglang:v0.5.23" and e.image_allow == "lmsysorg/sglang:"
    assert e.argv(cfg)[:len(e.program)] == ["sglang", "serve"]
    assert e.metrics["prompt_tokens"].startswith(e.metric_prefix)
    assert resolved_settings(cfg) == e.resolved_settings(cfg) is not None


def test_unknown_engine_or_version_is_refused_naming_the_supported_ones():
    with pytest.raises(ValueError, match="supported: sglang"):
        engine("trtllm")
    with pytest.raises(ValueError, match=r"SGLang 0\.4\.0 has no flag inventory here \(have: "
                                         r"0\.5\.9, 0\.5\.19, 0\.5\.23.*\); fetch it with "
                                         r"`servetune source fetch --version 0\.4\.0`"):
        engine("sglang", "0.4.0")


def test_failure_classes_cover_every_engine_and_end_with_unknown():
    classes = failure_classes()
    assert classes[-1] == "UNKNOWN" and classes.count("UNKNOWN") == 1
    for name in ENGINES:
        assert set(engine(name).failure_classes) <= set(classes)


def test_importing_the_registry_imports_no_engine():
    code = ("import sys, domain.engines; "
            "print(any(m.startswith('domain.engines.') for m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout.strip()
    assert out == "False"
