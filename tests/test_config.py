from __future__ import annotations

from pathlib import Path

import pytest

from rendezvous.config import ENV_VARS, Config, env_flag
from rendezvous.errors import InvalidArgument

README = Path(__file__).resolve().parent.parent / "README.md"


def test_defaults_env_then_overrides():
    cfg = Config.load(env={})
    assert cfg.chunk_bytes == 1 << 20
    cfg = Config.load(env={"RENDEZVOUS_CHUNK_BYTES": "65536", "RENDEZVOUS_UVLOOP": "0"})
    assert cfg.chunk_bytes == 65536 and cfg.uvloop is False
    cfg = Config.load({"chunk_bytes": 4096}, env={"RENDEZVOUS_CHUNK_BYTES": "65536"})
    assert cfg.chunk_bytes == 4096


def test_unknown_and_bad_values_are_named():
    with pytest.raises(InvalidArgument, match="unknown config key 'chunk_size'"):
        Config.load({"chunk_size": 1}, env={})
    with pytest.raises(InvalidArgument, match="RENDEZVOUS_CHUNK_BYTES"):
        Config.load(env={"RENDEZVOUS_CHUNK_BYTES": "lots"})
    with pytest.raises(InvalidArgument, match="chunk_bytes"):
        Config.load({"chunk_bytes": 10}, env={})


@pytest.mark.parametrize("raw,on", [("1", True), ("1yes", True), ("0", False), ("true", False), ("", False)])
def test_tensorflow_toggle_reading(raw, on):
    assert env_flag(raw) is on


def test_readme_lists_every_variable():
    text = README.read_text()
    missing = [env for env in ENV_VARS if f"`{env}`" not in text]
    assert not missing, f"README's configuration table lacks {missing}"
