"""StoreConfig: the store's settings, loaded like EngineConfig's, and EngineConfig's part of them."""

from __future__ import annotations

import dataclasses

import pytest

from kvtier.engine.config import EngineConfig, StoreConfig

GiB = 1 << 30


def test_the_engine_holds_the_store_settings_with_their_defaults():
    assert EngineConfig().store == StoreConfig()
    config = EngineConfig(cache_dir="/tmp/kv", disk_capacity_bytes=2 * GiB, remote_url="redis://h:6379",
                          compression_enabled=False, host_capacity_bytes=1 << 20)
    store = config.store
    assert type(store) is StoreConfig
    assert store.to_dict() == {name: getattr(config, name) for name in StoreConfig.field_names()}
    assert (store.cache_dir, store.disk_capacity_bytes, store.remote_url) == ("/tmp/kv", 2 * GiB, "redis://h:6379")
    assert store.codec_config() == config.codec_config()
    # Every store setting is an engine setting of the same name (the TOML/env keys stay flat).
    assert set(StoreConfig.field_names()) < set(EngineConfig.field_names())
    assert StoreConfig().lmdb_verify_on_open is True and StoreConfig().quarantine_corrupt_cache_dir is True
    assert StoreConfig().read_only is False and StoreConfig().read_workers == 8


def test_store_config_from_toml_env_and_dict(tmp_path):
    path = tmp_path / "store.toml"
    path.write_text('cache_dir = "/nvme/kv"\ndisk_capacity_bytes = "4GiB"\nread_only = true\n'
                    'remote_url = "redis://10.0.0.1:6379"\n')
    store = StoreConfig.from_toml(path)
    assert (store.cache_dir, store.disk_capacity_bytes, store.read_only) == ("/nvme/kv", 4 * GiB, True)
    env = {"KVTIER_CACHE_DIR": "/nvme/kv", "KVTIER_READ_WORKERS": "8", "KVTIER_HOST_CAPACITY_BYTES": "1GiB"}
    from_env = StoreConfig.from_env(env)
    assert type(from_env) is StoreConfig and from_env.read_workers == 8 and from_env.cache_dir == "/nvme/kv"
    merged = StoreConfig.load(path, overrides={"read_only": "no"}, environ=env)
    assert merged.read_only is False and merged.read_workers == 8 and merged.disk_capacity_bytes == 4 * GiB
    # The engine's loaders read the same keys into the same store settings.
    engine = EngineConfig.load(path, overrides={"read_only": "no"}, environ=env)
    assert engine.store == merged and engine.host_capacity_bytes == GiB
    with pytest.raises(ValueError, match=r"unknown setting\(s\): host_capacity_bytes; valid: cache_dir, "):
        StoreConfig.from_dict({"host_capacity_bytes": 1})


@pytest.mark.parametrize(
    ("changes", "match"),
    [
        ({"read_workers": 0}, r"^read_workers must be positive, got 0$"),
        ({"read_only": "yes"}, r"^read_only must be a bool, got 'yes'$"),
        ({"disk_capacity_bytes": GiB}, r"^disk_capacity_bytes=1073741824 needs cache_dir"),
        ({"remote_namespace": "a b"}, r"^remote_namespace must match"),
    ],
)
def test_store_config_validates_its_fields(changes, match):
    with pytest.raises(ValueError, match=match):
        StoreConfig(**changes)
    with pytest.raises(ValueError, match=match):
        EngineConfig(**changes)


def test_a_read_only_engine_takes_no_spills():
    with pytest.raises(ValueError, match=r"^read_only=True needs spill_enabled=False"):
        EngineConfig(cache_dir="/x", read_only=True)
    config = EngineConfig(cache_dir="/x", read_only=True, spill_enabled=False)
    assert config.store.read_only is True
    assert dataclasses.replace(config.store, read_only=False) == StoreConfig(cache_dir="/x")
