from __future__ import annotations

from pathlib import Path

import pytest

from rendezvous.config import ENV_VARS, Config, env_flag
from rendezvous.errors import InvalidArgument

#: the configuration page, where the table of every setting lives (README.md links to it)
CONFIG_DOC = Path(__file__).resolve().parent.parent / "docs" / "configuration.md"


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


@pytest.mark.parametrize("raw,on", [
    ("1", True), ("true", True), ("TRUE", True), ("Yes", True), ("on", True), (" on\n", True),
    ("0", False), ("false", False), ("False", False), ("NO", False), ("off", False),
    ("1yes", True), ("10", True),  # TensorFlow's reading: starts with 1
])
def test_switch_reading(raw, on):
    assert env_flag(raw) is on


@pytest.mark.parametrize("raw", ["garbage", "2", "-1", "y", "enable", "0x1", "none"])
def test_switch_values_that_mean_nothing_are_refused(raw):
    with pytest.raises(ValueError, match="not a switch value"):
        env_flag(raw)


BOOLEAN_VARIABLES = [env for env, (name, default, _) in ENV_VARS.items()
                     if isinstance(default, bool) or name == "cuda_aware"]


def test_every_boolean_variable_is_a_switch():
    assert {"MPI_DISABLED", "MPI_OPTIMAL_PATH", "RENDEZVOUS_MPI_REQUESTS", "RENDEZVOUS_TLS_CLIENT_AUTH",
            "RENDEZVOUS_UVLOOP", "RENDEZVOUS_CUDA_AWARE"} <= set(BOOLEAN_VARIABLES)


@pytest.mark.parametrize("env", BOOLEAN_VARIABLES)
def test_switches_read_as_written_and_refuse_the_rest(env):
    name = ENV_VARS[env][0]
    # mutual TLS is valid only with a certificate, its key and a CA
    needs = {"RENDEZVOUS_TLS_CERT": "c.pem", "RENDEZVOUS_TLS_KEY": "k.pem", "RENDEZVOUS_TLS_CA": "ca.pem"} \
        if env == "RENDEZVOUS_TLS_CLIENT_AUTH" else {}
    for word, on in (("true", True), ("on", True), ("yes", True), ("false", False), ("off", False), ("0", False)):
        assert getattr(Config.load(env={env: word, **needs}), name) is on, (env, word)
    with pytest.raises(InvalidArgument, match=f"^{env}: 'maybe' is not a switch value"):
        Config.load(env={env: "maybe", **needs})


def test_switch_in_a_config_file_is_refused_with_the_file_and_key(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text('mpi_disabled = "sure"\n')
    with pytest.raises(InvalidArgument, match="c.toml: mpi_disabled: 'sure' is not a switch value"):
        Config.load(env={}, file=path)
    path.write_text('mpi_disabled = "yes"\n')
    assert Config.load(env={}, file=path).mpi_disabled is True


def test_the_configuration_page_lists_every_variable():
    text = CONFIG_DOC.read_text()
    missing = [env for env in ENV_VARS if f"`{env}`" not in text]
    assert not missing, f"docs/configuration.md's tables lack {missing}"


def test_the_configuration_page_shows_the_real_defaults_and_field_names():
    import re

    wrong, checked, rows = [], set(), 0
    for env, name in re.findall(r"^\| `([A-Z_]+)`(?: \(`(\w+)`\))? \|", CONFIG_DOC.read_text(), re.M):
        rows += 1
        if env not in ENV_VARS or name != ENV_VARS[env][0]:  # every row names its Config field, the file's key
            wrong.append((env, name, ENV_VARS.get(env, ("not a setting",))[0]))
    for env, name, default in re.findall(r"^\| `([A-Z_]+)`(?: \(`(\w+)`\))? \| `([^`]*)` \|", CONFIG_DOC.read_text(), re.M):
        if env not in ENV_VARS:  # named above
            continue
        checked.add(env)
        real = ENV_VARS[env][1]
        shown = {True: "1", False: "0"}.get(real, str(real)) if isinstance(real, bool) else str(real)
        if default != shown:
            wrong.append((env, default, shown))
    assert rows == len(ENV_VARS), f"{rows} rows for {len(ENV_VARS)} settings: one row each"
    assert len(checked) >= 30, sorted(set(ENV_VARS) - checked)  # the rest show a blank or words ("probed")
    assert not wrong, f"docs/configuration.md differs from Config: {wrong}"


BLANKS = [" ", "   ", "\t", "\n", " \t\r\n "]


@pytest.mark.parametrize("env", BOOLEAN_VARIABLES)
def test_a_blank_switch_is_refused_naming_it_and_an_empty_one_is_unset(env, tmp_path):
    """A switch of blanks (MPI_OPTIMAL_PATH=" ") is neither on nor unset: refused
    at start-up with the variable named, from the environment, an argument or
    a config file. An empty variable keeps the default."""
    name, default, _ = ENV_VARS[env]
    for blank in BLANKS:
        with pytest.raises(InvalidArgument, match=f"^{env}: "):
            Config.load(env={env: blank})
        with pytest.raises(InvalidArgument, match=f"^{name}: "):
            Config.load({name: blank}, env={})
    path = tmp_path / "c.toml"
    path.write_text(f'{name} = " "\n')
    with pytest.raises(InvalidArgument, match=f"c.toml: {name}: "):
        Config.load(env={}, file=path)
    assert getattr(Config.load(env={env: ""}), name) == default


@pytest.mark.parametrize("blank", BLANKS)
def test_env_flag_says_a_blank_value_is_not_a_switch(blank):
    with pytest.raises(ValueError, match=r"not a switch value \(it is blank"):
        env_flag(blank)


@pytest.mark.parametrize("env", sorted(ENV_VARS))
def test_a_blank_variable_of_any_setting_is_refused_naming_it(env):
    """Blanks are never a value: RENDEZVOUS_TIMELINE=" " named a file " ", and a
    blank token or address meant nothing either. Empty stays unset."""
    with pytest.raises(InvalidArgument, match=f"^{env}: ' ' is blank"):
        Config.load(env={env: " "})
    assert Config.load(env={env: ""}).sources[ENV_VARS[env][0]] == "default"


def test_the_timeline_cap_is_a_setting_with_a_floor():
    assert Config.load(env={}).timeline_max_bytes == 1 << 30
    assert Config.load(env={"RENDEZVOUS_TIMELINE_MAX_BYTES": "65536"}).timeline_max_bytes == 65536
    with pytest.raises(InvalidArgument, match="timeline_max_bytes must be at least 65536"):
        Config.load({"timeline_max_bytes": 4096}, env={})
