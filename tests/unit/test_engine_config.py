"""EngineConfig: defaults, validation (ValueError naming field and value), loaders and precedence."""

from __future__ import annotations

import dataclasses
import pathlib

import pytest

from kvtier.engine.config import EngineConfig
from kvtier.engine.config_values import parse_size

MiB = 1 << 20
GiB = 1 << 30


def test_defaults_are_valid_and_documented_values():
    config = EngineConfig()
    assert config.cache_dir is None
    assert config.host_capacity_bytes == 256 * MiB
    assert config.eviction_policy == "lru" and config.host_eviction_policy == "lru" and config.host_policy() == "lru"
    assert config.disk_admission == "seen"
    assert config.disk_capacity_bytes is None
    assert config.lmdb_map_size_bytes == 1 * GiB
    assert config.store_queue_max_chunks == 4096
    assert config.spill_batch_max_bytes == 64 * MiB
    assert config.spill_batch_max_chunks == 256
    assert config.spill_enabled is True
    assert config.tier_timeout_s == 30.0
    assert config.compression_level == 1
    assert config.compression_min_savings_fraction == 0.10
    assert config.compression_enabled is True
    assert config.pressure_high_watermark_fraction == 0.90
    assert config.pressure_low_watermark_fraction == 0.80
    assert config.pressure_poll_interval_s == 1.0
    assert config.reader_check_interval_s == 30.0
    assert config.device_kind is None  # follows the view


def test_frozen_and_round_trips_through_dict():
    config = EngineConfig(cache_dir="/tmp/kv", disk_capacity_bytes=2 * GiB)
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.host_capacity_bytes = 1  # type: ignore[misc]
    assert EngineConfig.from_dict(config.to_dict()) == config
    assert list(config.to_dict()) == list(EngineConfig.field_names())


def test_path_and_int_values_are_normalised():
    config = EngineConfig(cache_dir=pathlib.Path("/tmp/kv"), tier_timeout_s=5)  # type: ignore[arg-type]
    assert config.cache_dir == "/tmp/kv"
    assert isinstance(config.tier_timeout_s, float) and config.tier_timeout_s == 5.0


@pytest.mark.parametrize(
    ("changes", "match"),
    [
        ({"cache_dir": ""}, r"cache_dir must be a non-empty path or None, got ''"),
        ({"cache_dir": 5}, r"cache_dir must be a str path or None, got 5"),
        ({"host_capacity_bytes": 0}, r"host_capacity_bytes must be positive, got 0"),
        ({"host_capacity_bytes": True}, r"host_capacity_bytes must be an int, got True"),
        ({"host_capacity_bytes": "256MiB"}, r"host_capacity_bytes must be an int, got '256MiB'"),
        ({"host_eviction_policy": "fifo"}, r"host_eviction_policy must be one of 'arc', 'arc-lfuda', 'lfuda', 'lru', got 'fifo'"),
        ({"cache_dir": "/x", "disk_capacity_bytes": -1}, r"disk_capacity_bytes must be positive, got -1"),
        ({"disk_capacity_bytes": 1 << 30}, r"disk_capacity_bytes=1073741824 needs cache_dir"),
        ({"lmdb_map_size_bytes": 0}, r"lmdb_map_size_bytes must be >= 1048576, got 0"),
        ({"store_queue_max_chunks": 0}, r"store_queue_max_chunks must be positive, got 0"),
        ({"store_queue_max_chunks": 4096.0}, r"store_queue_max_chunks must be an int, got 4096.0"),
        ({"spill_batch_max_bytes": -5}, r"spill_batch_max_bytes must be positive, got -5"),
        ({"spill_batch_max_chunks": 0}, r"spill_batch_max_chunks must be positive, got 0"),
        ({"spill_enabled": 1}, r"spill_enabled must be a bool, got 1"),
        ({"tier_timeout_s": 0.0}, r"tier_timeout_s must be a positive, finite number of seconds, got 0.0"),
        ({"tier_timeout_s": float("inf")}, r"tier_timeout_s must be a positive, finite .* got inf"),
        ({"tier_timeout_s": float("nan")}, r"tier_timeout_s must be a number, got nan"),
        ({"tier_timeout_s": "30"}, r"tier_timeout_s must be a number, got '30'"),
        ({"compression_level": 0}, r"compression_level must be in \[1, 22\], got 0"),
        ({"compression_level": 23}, r"compression_level must be in \[1, 22\], got 23"),
        ({"compression_min_savings_fraction": 1.0}, r"compression_min_savings_fraction must be in \[0, 1\), got 1.0"),
        ({"compression_min_savings_fraction": -0.1}, r"compression_min_savings_fraction must be in \[0, 1\)"),
        ({"compression_enabled": "yes"}, r"compression_enabled must be a bool, got 'yes'"),
        ({"pressure_high_watermark_fraction": 1.5}, r"pressure_high_watermark_fraction must be in \(0, 1\], got 1.5"),
        ({"pressure_low_watermark_fraction": 0.0}, r"pressure_low_watermark_fraction must be in \(0, 1\], got 0.0"),
        (
            {"pressure_low_watermark_fraction": 0.9},
            r"pressure_low_watermark_fraction must be < pressure_high_watermark_fraction .* low=0.9, high=0.9",
        ),
        (
            {"pressure_low_watermark_fraction": 0.95},
            r"pressure_low_watermark_fraction must be < pressure_high_watermark_fraction",
        ),
        ({"pressure_poll_interval_s": -1.0}, r"pressure_poll_interval_s must be a positive, finite .* got -1.0"),
        ({"reader_check_interval_s": 0}, r"reader_check_interval_s must be a positive, finite .* got 0.0"),
        ({"device_kind": "tpu"}, r"device_kind must be one of 'cpu', 'cuda', got 'tpu'"),
    ],
)
def test_each_invalid_value_is_a_value_error_naming_field_and_value(changes, match):
    with pytest.raises(ValueError, match=match):
        EngineConfig(**changes)


def test_from_dict_unknown_key_lists_valid_keys():
    with pytest.raises(ValueError, match=r"unknown setting\(s\): host_capacity, zzz; valid: cache_dir, ") as info:
        EngineConfig.from_dict({"host_capacity": 1, "zzz": 2, "spill_enabled": False})
    for name in EngineConfig.field_names():
        assert name in str(info.value)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("256MiB", 256 * MiB),
        ("1GiB", GiB),
        ("1gib", GiB),
        ("1.5GiB", 3 * GiB // 2),
        ("64 MB", 64_000_000),
        ("2kB", 2000),
        ("512K", 512 * 1024),
        ("4_096", 4096),
        ("4096", 4096),
        ("7B", 7),
        (123, 123),
    ],
)
def test_parse_size(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["", "MiB", "-1MiB", "12XB", "1.5.2GiB", "0.5B", "1e9"])
def test_parse_size_rejects(text):
    with pytest.raises(ValueError, match="host_capacity_bytes"):
        parse_size(text, "host_capacity_bytes")


def test_from_dict_coerces_strings():
    config = EngineConfig.from_dict(
        {
            "cache_dir": "/var/cache/kvtier",
            "host_capacity_bytes": "256MiB",
            "disk_capacity_bytes": "1.5GiB",
            "lmdb_map_size_bytes": 2 * GiB,
            "store_queue_max_chunks": "1_024",
            "spill_enabled": "off",
            "compression_enabled": "TRUE",
            "tier_timeout_s": "2.5",
            "pressure_high_watermark_fraction": 1,
            "compression_level": "3",
        }
    )
    assert config.host_capacity_bytes == 256 * MiB
    assert config.disk_capacity_bytes == 3 * GiB // 2
    assert config.lmdb_map_size_bytes == 2 * GiB
    assert config.store_queue_max_chunks == 1024
    assert config.spill_enabled is False
    assert config.compression_enabled is True
    assert config.tier_timeout_s == 2.5
    assert config.pressure_high_watermark_fraction == 1.0
    assert config.compression_level == 3


@pytest.mark.parametrize(
    ("data", "match"),
    [
        ({"spill_enabled": "maybe"}, r"spill_enabled must be a bool .* got 'maybe'"),
        ({"store_queue_max_chunks": "lots"}, r"store_queue_max_chunks must be an int, got 'lots'"),
        ({"tier_timeout_s": "soon"}, r"tier_timeout_s must be a number, got 'soon'"),
        ({"host_capacity_bytes": "big"}, r"host_capacity_bytes must be a size .* got 'big'"),
        ({"host_capacity_bytes": [1]}, r"host_capacity_bytes must be an int or a size string"),
        ({"host_capacity_bytes": "0MiB"}, r"host_capacity_bytes must be positive, got 0"),
    ],
)
def test_from_dict_bad_values(data, match):
    with pytest.raises(ValueError, match=match):
        EngineConfig.from_dict(data)


def test_from_toml(tmp_path):
    path = tmp_path / "kvtier.toml"
    path.write_text(
        'cache_dir = "/data/kv"\n'
        'host_capacity_bytes = "512MiB"\n'
        "disk_capacity_bytes = 10_000_000_000\n"
        'host_eviction_policy = "arc"\n'
        "spill_enabled = false\n"
        "tier_timeout_s = 10\n"
        "pressure_low_watermark_fraction = 0.7\n"
    )
    config = EngineConfig.from_toml(path)
    assert config.cache_dir == "/data/kv"
    assert config.host_capacity_bytes == 512 * MiB
    assert config.disk_capacity_bytes == 10_000_000_000
    assert config.host_eviction_policy == "arc"
    assert config.spill_enabled is False
    assert config.tier_timeout_s == 10.0
    assert config.pressure_low_watermark_fraction == 0.7


def test_eviction_policies_by_name_from_every_loader(tmp_path):
    """eviction_policy names both tiers' policy; host_eviction_policy (unset: the same) only the host's."""
    path = tmp_path / "kvtier.toml"
    path.write_text('eviction_policy = "lru"\n')
    config = EngineConfig.from_toml(path)
    assert (config.eviction_policy, config.host_eviction_policy, config.host_policy()) == ("lru", "lru", "lru")
    config = EngineConfig.from_env({"KVTIER_EVICTION_POLICY": "lru", "KVTIER_HOST_EVICTION_POLICY": "arc"})
    assert (config.eviction_policy, config.host_policy()) == ("lru", "arc")
    assert EngineConfig.from_env({"KVTIER_HOST_EVICTION_POLICY": "none"}).host_policy() == "lru"
    assert EngineConfig.from_env({"KVTIER_DISK_ADMISSION": "all"}).disk_admission == "all"
    path.write_text('disk_admission = "all"\n')
    assert EngineConfig.from_toml(path).disk_admission == "all"
    with pytest.raises(ValueError, match=r"disk_admission must be one of 'all', 'seen', got 'tiny'"):
        EngineConfig.from_env({"KVTIER_DISK_ADMISSION": "tiny"})
    with pytest.raises(ValueError, match=r"eviction_policy must be one of 'arc-lfuda', 'lfuda', 'lru', got 'arc'"):
        EngineConfig(eviction_policy="arc")  # ARC has no disk-tier variant


def test_from_toml_errors_name_the_file(tmp_path):
    bad_syntax = tmp_path / "broken.toml"
    bad_syntax.write_text("host_capacity_bytes = \n")
    with pytest.raises(ValueError, match=r"broken\.toml.* is not valid TOML"):
        EngineConfig.from_toml(bad_syntax)
    unknown = tmp_path / "unknown.toml"
    unknown.write_text("host_capcity_bytes = 1\n")
    with pytest.raises(ValueError, match=r"unknown setting\(s\): host_capcity_bytes; valid: "):
        EngineConfig.from_toml(unknown)
    with pytest.raises(ValueError, match=r"host_capacity_bytes \(from .*layer\.toml\) must be a size"):
        layer = tmp_path / "layer.toml"
        layer.write_text('host_capacity_bytes = "lots"\n')
        EngineConfig.load(layer, environ={})


def test_from_env_reads_prefixed_variables_and_ignores_others():
    environ = {
        "KVTIER_CACHE_DIR": "/nvme/kv",
        "KVTIER_HOST_CAPACITY_BYTES": "1GiB",
        "KVTIER_DISK_CAPACITY_BYTES": "100GiB",
        "KVTIER_SPILL_ENABLED": "0",
        "KVTIER_PRESSURE_POLL_INTERVAL_S": "0.25",
        "KVTIER_DEVICE_KIND": "cuda",
        "KVTIER_LOG_LEVEL": "debug",  # not a setting: ignored
        "HOST_CAPACITY_BYTES": "1",  # no prefix: ignored
    }
    config = EngineConfig.from_env(environ)
    assert config.cache_dir == "/nvme/kv"
    assert config.host_capacity_bytes == GiB
    assert config.disk_capacity_bytes == 100 * GiB
    assert config.spill_enabled is False
    assert config.pressure_poll_interval_s == 0.25
    assert config.device_kind == "cuda"
    assert EngineConfig.from_env({"MY_STORE_QUEUE_MAX_CHUNKS": "8"}, prefix="MY_").store_queue_max_chunks == 8


def test_from_env_empty_optional_is_none_and_bad_value_names_environment():
    assert EngineConfig.from_env({"KVTIER_CACHE_DIR": ""}).cache_dir is None
    with pytest.raises(ValueError, match=r"spill_batch_max_chunks \(from KVTIER_SPILL_BATCH_MAX_CHUNKS\) must be an int, got 'x'"):
        EngineConfig.from_env({"KVTIER_SPILL_BATCH_MAX_CHUNKS": "x"})


def test_from_env_defaults_to_os_environ(monkeypatch):
    monkeypatch.setenv("KVTIER_STORE_QUEUE_MAX_CHUNKS", "17")
    assert EngineConfig.from_env().store_queue_max_chunks == 17


def test_load_precedence_defaults_toml_env_overrides(tmp_path):
    path = tmp_path / "kvtier.toml"
    path.write_text(
        'host_capacity_bytes = "512MiB"\n'
        "store_queue_max_chunks = 100\n"
        "spill_batch_max_chunks = 10\n"
        'host_eviction_policy = "arc"\n'
    )
    environ = {
        "KVTIER_STORE_QUEUE_MAX_CHUNKS": "200",  # beats TOML
        "KVTIER_SPILL_BATCH_MAX_CHUNKS": "20",  # beats TOML, loses to overrides
    }
    config = EngineConfig.load(path, overrides={"spill_batch_max_chunks": "30"}, environ=environ)
    assert config.host_capacity_bytes == 512 * MiB  # TOML beats default
    assert config.host_eviction_policy == "arc"
    assert config.store_queue_max_chunks == 200  # env beats TOML
    assert config.spill_batch_max_chunks == 30  # overrides beat env
    assert config.tier_timeout_s == 30.0  # untouched default


def test_load_validates_merged_result_and_environment_switch(monkeypatch):
    monkeypatch.setenv("KVTIER_PRESSURE_LOW_WATERMARK_FRACTION", "0.5")
    assert EngineConfig.load().pressure_low_watermark_fraction == 0.5
    assert EngineConfig.load(environ={}).pressure_low_watermark_fraction == 0.80
    # Each layer alone is fine; together they cross the watermarks.
    with pytest.raises(ValueError, match=r"low=0.95, high=0.9"):
        EngineConfig.load(
            overrides={"pressure_low_watermark_fraction": 0.95}, environ={"KVTIER_PRESSURE_HIGH_WATERMARK_FRACTION": "0.9"}
        )
    with pytest.raises(ValueError, match=r"unknown setting\(s\): nope"):
        EngineConfig.load(overrides={"nope": 1}, environ={})
