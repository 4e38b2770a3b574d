import pytest

from deepfreeze import Config, ConfigError


def write(tmp_path, text):
    p = tmp_path / "c.cfg"
    p.write_text(text)
    return str(p)


def test_reads_veloc_ini_and_env_and_overrides(tmp_path):
    path = write(tmp_path, "# comment\nmode = async\nscratch = /tmp/a  # trailing\npersistent=/tmp/b\n"
                           "max_versions = 4\nchksum = false\npersistent_interval = 1.5\n")
    c = Config.load(path, env={})
    assert (c.mode, c.scratch, c.persistent, c.max_versions, c.chksum, c.persistent_interval) == \
        ("async", "/tmp/a", "/tmp/b", 4, False, 1.5)
    assert c.keep_scratch == 4
    c = Config.load(path, env={"VELOC_SCRATCH": "/tmp/env", "VELOC_MODE": "sync"})
    assert (c.scratch, c.mode) == ("/tmp/env", "sync")
    c = Config.load(path, env={"VELOC_SCRATCH": "/tmp/env"}, scratch="/tmp/kw", scratch_versions=1)
    assert c.scratch == "/tmp/kw" and c.keep_scratch == 1


@pytest.mark.parametrize("text, needle", [
    ("scratch=/a\npersistent=/b\n", "'mode' is mandatory"),
    ("mode=fast\nscratch=/a\npersistent=/b\n", "mode = 'fast' is invalid"),
    ("mode=sync\nscratch=/a\npersistent=/b\nbogus=1\n", "unknown key 'bogus'"),
    ("mode=sync\nscratch=/a\npersistent=/b\nmax_versions=two\n", "max_versions = 'two' is invalid"),
    ("mode=sync\nscratch=/a\npersistent=/b\nmax_versions=-1\n", "must be >= 0"),
    ("mode=sync\nscratch=/a\npersistent=/b\nchksum=maybe\n", "not a boolean"),
    ("mode=sync\npersistent=/b\n", "'scratch' is missing"),
    ("mode=sync\nscratch=/a\npersistent=/a\n", "same directory"),
    ("mode=sync\nscratch /a\n", "expected 'key = value'"),
])
def test_bad_config_is_a_clear_error(tmp_path, text, needle):
    with pytest.raises(ConfigError, match=needle.replace("(", r"\(").replace(")", r"\)")) as e:
        Config.load(write(tmp_path, text), env={})
    assert isinstance(e.value, ValueError)


def test_missing_file_and_unknown_override(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        Config.load(str(tmp_path / "nope.cfg"))
    with pytest.raises(ConfigError, match="unknown key 'scrach'"):
        Config.load(None, mode="sync", scratch="/a", persistent="/b", scrach="/c")


def test_shipped_configs_parse():
    c = Config.load("veloc_cfg/local.cfg", env={})
    assert c.mode == "async" and c.chksum
    c = Config.load("veloc_cfg/cluster.cfg.template", env={})
    assert c.persistent_interval == 300
