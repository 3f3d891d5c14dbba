"""CommConfig has one home: the core defines each setting and its default, Python fills it by name."""

from __future__ import annotations

import dataclasses

import pytest

import elastic
from elastic.ring import _native


def _core_settings() -> set:
    return {name for name, v in vars(_native.CommConfig).items() if isinstance(v, property)}


def test_every_core_setting_is_a_python_field_with_the_cores_default():
    core = _native.CommConfig()
    fields = {f.name: f.default for f in dataclasses.fields(elastic.CommConfig)}
    assert set(fields) == _core_settings()
    for name, default in fields.items():
        assert default == getattr(core, name), name


def test_every_setting_reaches_the_core_by_name():
    chosen = dict(timeout=7.5, form_timeout=2.0, dead_link_timeout=4.5, segment_bytes=4096, small_bytes=0, fusion_bytes=12_500,
                  transport="tcp", algorithm="hierarchical", hierarchical_bytes=1 << 10)
    assert set(chosen) == _core_settings()
    native = elastic.CommConfig(**chosen).to_native()
    assert {name: getattr(native, name) for name in chosen} == chosen


@pytest.mark.parametrize("setting, value, says", [
    ("timeout", 0, "CommConfig.timeout must be positive"),
    ("form_timeout", -1.0, "CommConfig.form_timeout must be positive"),
    ("timeout", float("nan"), "CommConfig.timeout must be positive"),
    ("dead_link_timeout", 1.5, "CommConfig.dead_link_timeout must be between 2 and 86400 seconds"),
    ("dead_link_timeout", 86401, "CommConfig.dead_link_timeout must be between 2 and 86400 seconds"),
    ("dead_link_timeout", float("inf"), "CommConfig.dead_link_timeout must be between 2 and 86400 seconds"),
    ("dead_link_timeout", float("nan"), "CommConfig.dead_link_timeout must be between 2 and 86400 seconds"),
    ("segment_bytes", 63, "CommConfig.segment_bytes must be at least 64"),
    ("small_bytes", -1, "CommConfig.small_bytes must not be negative"),
    ("fusion_bytes", -1, "CommConfig.fusion_bytes must not be negative"),
    ("hierarchical_bytes", -1, "CommConfig.hierarchical_bytes must not be negative"),
    ("transport", "carrier-pigeon", "unknown transport 'carrier-pigeon'"),
    ("algorithm", "tree", "unknown allreduce algorithm 'tree'"),
])
def test_the_core_refuses_a_bad_value_naming_the_setting(setting, value, says):
    with pytest.raises(ValueError, match=says):
        elastic.CommConfig(**{setting: value})


def test_a_bad_value_from_the_environment_names_the_variable():
    with pytest.raises(ValueError, match="ELASTIC_SEGMENT_BYTES='32': CommConfig.segment_bytes must be at least 64"):
        elastic.CommConfig.from_env({"ELASTIC_SEGMENT_BYTES": "32"})
    with pytest.raises(ValueError, match="ELASTIC_FUSION_THRESHOLD='lots' is not a valid int"):
        elastic.CommConfig.from_env({"ELASTIC_FUSION_THRESHOLD": "lots"})
    with pytest.raises(ValueError, match="ELASTIC_DEAD_LINK_TIMEOUT='1': CommConfig.dead_link_timeout must be between"):
        elastic.CommConfig.from_env({"ELASTIC_DEAD_LINK_TIMEOUT": "1"})
    cfg = elastic.CommConfig.from_env({"ELASTIC_COLLECTIVE_TIMEOUT": "12", "ELASTIC_TRANSPORT": " TCP ",
                                       "ELASTIC_DEAD_LINK_TIMEOUT": "8"}, small_bytes=0)
    assert (cfg.timeout, cfg.transport, cfg.small_bytes, cfg.dead_link_timeout) == (12.0, "tcp", 0, 8.0)


def test_the_native_communicator_checks_the_config_it_is_given():
    bad = _native.CommConfig()
    bad.form_timeout = 0.0
    with pytest.raises(ValueError, match="CommConfig.form_timeout must be positive"):
        _native.Communicator(None, "j", b"s", 1, 0, ["127.0.0.1:1"], bad)
    one = _native.Communicator(None, "j", b"s", 1, 0, ["127.0.0.1:1"])  # the core's defaults
    one.form()
    one.close()
