"""Case 8 of issue 11: shared directories. Symbolic links planted in scratch and persistent are
never followed (reading, retention, gc); roots in world- or group-writable directories follow
the sticky / ``shared_group`` rules; files and directories of another user are refused (scratch)
or read only when trusted (persistent, ``trust_owners``).

Checkpoints are real ones, written by the framework-neutral engine (sync mode; async where the
backend's log is concerned) and read back with :func:`deepfreeze.loader.load`. "Another user"
is the existing unprivileged account ``nobody``: as root, files are chowned to it to simulate
what that user planted (no OS user is created); those tests skip when not run as root.
"""
import logging
import os
import pwd
import shutil
import stat
import threading

import numpy as np
import pytest

from deepfreeze import ownership
from deepfreeze.cli import main as cli_main
from deepfreeze.config import Config
from deepfreeze.engine import Engine
from deepfreeze.errors import (ConfigError, CorruptCheckpointError, DeepFreezeError, UnsafePathError,
                               UntrustedOwnerError)
from deepfreeze.loader import list_versions, load
from deepfreeze.shardplan import ShardPlan, TensorSpec

NAME = "job"


def arrays_of(v):
    r = np.random.default_rng(v)
    return [r.standard_normal((32, 20)).astype(np.float32), r.integers(0, 100, (7,), dtype=np.int64)]


def make_plan():
    return ShardPlan.build([TensorSpec(i, f"t{i}", a.dtype.name, a.shape) for i, a in enumerate(arrays_of(0))], 1,
                           min_shard_bytes=1024)


def config(tmp_path, **kw):
    kw.setdefault("scratch", str(tmp_path / "scratch"))
    kw.setdefault("persistent", str(tmp_path / "pfs"))
    return Config.load(None, mode=kw.pop("mode", "sync"), **kw)


def write(cfg, versions=(1, 2)):
    """Checkpoint ``versions`` of NAME with one rank; returns the config."""
    plan = make_plan()
    e = Engine(cfg, NAME, 0, plan)
    try:
        for v in versions:
            e.checkpoint(v, [a.reshape(-1) for a in arrays_of(v)], step=v, epoch=0)
    finally:
        e.close()
    return cfg


def same(ck, v):
    return all(a.tobytes() == b.tobytes() for a, b in zip(ck.arrays.values(), arrays_of(v)))


def vdir(cfg, level, v):
    return os.path.join(getattr(cfg, level), NAME, f"v{v:012d}")


def plant_link(path, target):
    """Replace ``path`` by a symbolic link to ``target``."""
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path)
    elif os.path.lexists(path):
        os.unlink(path)
    os.symlink(target, path)


def needs_root():
    if os.getuid() != 0:
        pytest.skip("simulating another user's files needs root (chown to 'nobody'); running as uid "
                    f"{os.getuid()}")
    try:
        return pwd.getpwnam("nobody").pw_uid
    except KeyError:
        pytest.skip("no 'nobody' account on this host (tests never create OS users)")


# ------------------------------------------------------------------ symlinks in version directories

@pytest.mark.scratch_files("replaces the scratch manifest with a link")
def test_symlinked_scratch_manifest_is_never_read(tmp_path):
    cfg = write(config(tmp_path))
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    real = os.path.join(vdir(cfg, "scratch", 2), "manifest.json")
    shutil.copy(real, outside / "manifest.json")  # a valid manifest: following the link would "work"
    plant_link(real, str(outside / "manifest.json"))
    assert list_versions(cfg, NAME)[2] == ["persistent"]  # v2 is not committed on scratch any more
    ck = load(cfg, NAME)
    assert ck.version == 2 and ck.level == "persistent" and same(ck, 2)


@pytest.mark.scratch_files("replaces a scratch shard with a link")
def test_symlinked_scratch_shard_is_never_read(tmp_path, caplog):
    cfg = write(config(tmp_path))
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    shard = os.path.join(vdir(cfg, "scratch", 2), "r000000.dfs")
    shutil.copy(shard, outside / "r000000.dfs")
    plant_link(shard, str(outside / "r000000.dfs"))
    assert list_versions(cfg, NAME)[2] == ["persistent"]
    ck = load(cfg, NAME)
    assert ck.version == 2 and ck.level == "persistent" and same(ck, 2)


@pytest.mark.scratch_files("the version must also be on scratch, which the test removes")
def test_symlinked_persistent_files_are_never_read(tmp_path, capsys):
    cfg = write(config(tmp_path))
    shutil.rmtree(os.path.join(cfg.scratch, NAME))  # node lost: persistent only
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    model = os.path.join(vdir(cfg, "persistent", 2), "model.dfz")
    shutil.copy(model, outside / "model.dfz")
    plant_link(model, str(outside / "model.dfz"))
    with pytest.raises(CorruptCheckpointError, match="symbolic link"):
        load(cfg, NAME, 2)
    ck = load(cfg, NAME)  # the newest readable one
    assert ck.version == 1 and same(ck, 1)
    capsys.readouterr()
    assert cli_main(["verify", "--name", NAME, "--set", "mode=sync", "--set", f"scratch={cfg.scratch}", "--set",
                     f"persistent={cfg.persistent}", "--version", "2"]) == 1
    assert "symbolic link" in capsys.readouterr().out
    manifest = os.path.join(vdir(cfg, "persistent", 1), "manifest.json")
    shutil.copy(manifest, outside / "manifest.json")
    plant_link(manifest, str(outside / "manifest.json"))
    assert 1 not in list_versions(cfg, NAME)  # a linked manifest commits nothing


@pytest.mark.parametrize("level", ["scratch", "persistent"])
@pytest.mark.scratch_files("removes the version's directory on the other level")
def test_symlinked_version_directory_is_never_followed(tmp_path, level):
    cfg = write(config(tmp_path))
    other = "persistent" if level == "scratch" else "scratch"
    shutil.rmtree(vdir(cfg, other, 2))
    outside = tmp_path / "elsewhere"
    shutil.move(vdir(cfg, level, 2), outside)  # a whole, valid version directory, reached by a link
    os.symlink(str(outside), vdir(cfg, level, 2))
    assert 2 not in list_versions(cfg, NAME)
    ck = load(cfg, NAME)
    assert ck.version == 1 and same(ck, 1)
    assert sorted(os.listdir(outside))  # untouched


@pytest.mark.parametrize("level", ["scratch", "persistent"])
@pytest.mark.scratch_files("the scratch side: written once, nothing goes through <scratch>/<name>")
def test_name_directory_precreated_as_symlink_is_refused(tmp_path, level, capsys):
    cfg = config(tmp_path)
    target = tmp_path / "root-only"
    target.mkdir(mode=0o700)
    os.makedirs(getattr(cfg, level))
    os.symlink(str(target), os.path.join(getattr(cfg, level), NAME))
    with pytest.raises(UnsafePathError, match="symbolic link") as e:
        write(cfg, (1,))
    assert "remove the link" in str(e.value).lower()
    assert os.listdir(target) == []  # nothing written through the link
    with pytest.raises(UnsafePathError, match="symbolic link"):  # readers do not follow it either
        load(cfg, NAME)
    capsys.readouterr()
    rc = cli_main(["ls", "--set", "mode=sync", "--set", f"scratch={cfg.scratch}", "--set",
                   f"persistent={cfg.persistent}"])
    if level == "scratch":
        assert rc == 0  # a link among the names is not a checkpoint (nothing reached persistent)
    else:  # v1 is on scratch; listing its persistent side is one clear error, not a traceback
        assert rc == 1 and "is a symbolic link" in capsys.readouterr().err


@pytest.mark.scratch_files("checks the modes of the scratch directories a version makes")
def test_directories_are_created_owner_only(tmp_path):
    cfg = write(config(tmp_path, scratch=str(tmp_path / "a" / "b" / "scratch")), (1,))
    for d in (tmp_path / "a", tmp_path / "a" / "b", cfg.scratch, os.path.join(cfg.scratch, NAME),
              vdir(cfg, "scratch", 1), os.path.join(cfg.persistent, NAME), vdir(cfg, "persistent", 1)):
        assert stat.S_IMODE(os.lstat(d).st_mode) == 0o700, d


def test_group_writable_directory_of_deepfreeze_is_refused(tmp_path):
    cfg = write(config(tmp_path), (1,))
    os.chmod(os.path.join(cfg.persistent, NAME), 0o770)
    with pytest.raises(UnsafePathError, match="chmod go-w"):
        write(cfg, (2,))


# ------------------------------------------------------------------ gc and retention

@pytest.mark.scratch_files("gc of scratch versions beside the planted links")
def test_gc_does_not_follow_symlinks(tmp_path):
    """Symbolic links planted in scratch and persistent, named like version directories or inside
    an abandoned one, point to directories holding a canary: gc removes what is its own, the
    canaries survive."""
    cfg = write(config(tmp_path, max_versions=1), (3, 4, 5))
    victims = []
    for i in range(4):
        d = tmp_path / f"victim{i}"
        d.mkdir()
        (d / "r000000.dfs").write_bytes(b"canary")
        (d / "manifest.json").write_bytes(b"canary")
        (d / "canary").write_bytes(b"canary")
        victims.append(d)
    os.symlink(str(victims[0]), vdir(cfg, "scratch", 1))  # an old "version" of scratch
    os.symlink(str(victims[1]), vdir(cfg, "persistent", 1))  # and of persistent
    abandoned = vdir(cfg, "persistent", 2)  # an abandoned flush, older than the newest commit
    os.mkdir(abandoned, 0o700)
    (tmp_path / "pfs" / NAME / f"v{2:012d}" / "model.dfz.partial.0123456789abcdef").write_bytes(b"x")
    os.symlink(str(victims[2]), os.path.join(abandoned, "sub"))
    os.symlink(str(victims[3] / "canary"), os.path.join(abandoned, "done.r000000.0123456789abcdef.json"))
    argv = ["gc", "--name", NAME, "--set", "mode=sync", "--set", f"scratch={cfg.scratch}",
            "--set", f"persistent={cfg.persistent}", "--set", "max_versions=1"]
    assert cli_main(argv) == 0
    for d in victims:
        assert sorted(os.listdir(d)) == ["canary", "manifest.json", "r000000.dfs"], d
        assert (d / "canary").read_bytes() == b"canary"
    assert not os.path.lexists(abandoned)  # removed, links as links
    ck = load(cfg, NAME)
    assert ck.version == 5 and same(ck, 5)


def test_remove_tree_nofollow_removes_a_link_not_its_target(tmp_path):
    d = tmp_path / "d"
    d.mkdir()
    (d / "f").write_bytes(b"1")
    os.symlink(str(d), tmp_path / "link")
    ownership.remove_tree_nofollow(str(tmp_path / "link"))
    assert not os.path.lexists(tmp_path / "link") and (d / "f").read_bytes() == b"1"
    ownership.remove_tree_nofollow(str(tmp_path / "missing"))  # no error


# ------------------------------------------------------------------ roots

@pytest.mark.scratch_files("the unsafe root is scratch, which write once does not write")
def test_world_writable_non_sticky_parent_is_refused(tmp_path):
    ww = tmp_path / "ww"
    ww.mkdir()
    os.chmod(ww, 0o777)
    cfg = config(tmp_path, scratch=str(ww / "scratch"))
    with pytest.raises(UnsafePathError, match="not sticky"):
        write(cfg, (1,))
    with pytest.raises(ConfigError, match="not sticky"):
        cfg.check_directories()
    assert os.listdir(ww) == []
    os.mkdir(ww / "scratch", 0o700)  # an existing root below such a parent: refused as well
    with pytest.raises(UnsafePathError, match="not sticky"):
        write(cfg, (1,))


@pytest.mark.scratch_files("the sticky root is scratch: its <name> directory must be made")
def test_sticky_world_writable_root_is_accepted(tmp_path):
    tmp_like = tmp_path / "tmp"
    tmp_like.mkdir()
    os.chmod(tmp_like, 0o1777)
    cfg = config(tmp_path, scratch=str(tmp_like), persistent=str(tmp_path / "shared" / "pfs"))
    os.mkdir(tmp_path / "shared")
    os.chmod(tmp_path / "shared", 0o1777)
    cfg.check_directories()
    write(cfg, (1, 2))
    assert stat.S_IMODE(os.lstat(os.path.join(cfg.scratch, NAME)).st_mode) == 0o700
    ck = load(cfg, NAME)
    assert ck.version == 2 and same(ck, 2)


def test_group_writable_root_needs_shared_group(tmp_path):
    root = tmp_path / "group"
    root.mkdir()
    os.chmod(root, 0o770)
    cfg = config(tmp_path, persistent=str(root))
    with pytest.raises(ConfigError, match="shared_group"):
        cfg.check_directories()
    with pytest.raises(UnsafePathError, match="shared_group = true"):
        write(cfg, (1,))
    shared = config(tmp_path, persistent=str(root), shared_group="true")
    assert shared.shared_group is True
    shared.check_directories()
    write(shared, (1, 2))
    ck = load(shared, NAME)
    assert ck.version == 2 and same(ck, 2)
    assert stat.S_IMODE(os.lstat(root / NAME).st_mode) == 0o700  # below the shared root: owner-only


def test_shared_group_is_validated(tmp_path, monkeypatch):
    with pytest.raises(ConfigError, match="shared_group"):
        config(tmp_path, shared_group="maybe")
    monkeypatch.setenv("VELOC_SHARED_GROUP", "yes")
    assert Config.load(None, mode="sync", scratch=str(tmp_path / "s"), persistent=str(tmp_path / "p")).shared_group


def test_trust_owners_rejects_unknown_user():
    with pytest.raises(ConfigError, match="no user named"):
        ownership.trusted_uids(["no-such-user-deepfreeze"])
    assert 0 in ownership.trusted_uids() and os.getuid() in ownership.trusted_uids()


# ------------------------------------------------------------------ another user's files (as root: 'nobody')

def test_backend_log_through_symlink_is_refused(tmp_path):
    """Root's backend must not append its log through a link into a root-only file."""
    needs_root()
    secret = tmp_path / "root-only"
    secret.write_bytes(b"secret\n")
    os.chmod(secret, 0o600)
    cfg = config(tmp_path, mode="async")
    os.makedirs(cfg.scratch, mode=0o700)
    os.symlink(str(secret), os.path.join(cfg.scratch, ".deepfreeze-backend.log"))
    with pytest.raises(UnsafePathError, match="symbolic link"):
        Engine(cfg, NAME, 0, make_plan())
    assert secret.read_bytes() == b"secret\n"


def test_backend_log_is_private(tmp_path):
    cfg = write(config(tmp_path, mode="async"), (1,))
    st = os.lstat(os.path.join(cfg.scratch, ".deepfreeze-backend.log"))
    assert stat.S_ISREG(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o600 and st.st_uid == os.getuid()


def test_backend_log_of_another_user_is_refused(tmp_path):
    nobody = needs_root()
    cfg = config(tmp_path, mode="async")
    os.makedirs(cfg.scratch, mode=0o700)
    log = os.path.join(cfg.scratch, ".deepfreeze-backend.log")
    with open(log, "wb"):
        pass
    os.chown(log, nobody, -1)
    with pytest.raises(UnsafePathError, match="nobody"):
        Engine(cfg, NAME, 0, make_plan())


@pytest.mark.parametrize("level", ["scratch", "persistent"])
@pytest.mark.scratch_files("the precreated directory is a scratch version directory")
def test_directory_precreated_by_another_user_is_refused(tmp_path, level):
    nobody = needs_root()
    cfg = write(config(tmp_path), (1,))
    d = vdir(cfg, level, 2)
    os.mkdir(d, 0o700)
    os.chown(d, nobody, -1)  # "nobody" prepared v2 for us
    with pytest.raises(UnsafePathError, match="owned by nobody") as e:
        write(cfg, (2,))
    assert "Remove it" in str(e.value)
    assert os.listdir(d) == []


def test_name_directory_of_another_user_is_refused(tmp_path):
    nobody = needs_root()
    cfg = config(tmp_path)
    os.makedirs(os.path.join(cfg.persistent, NAME), mode=0o755)
    os.chown(os.path.join(cfg.persistent, NAME), nobody, -1)
    with pytest.raises(UnsafePathError, match="owned by nobody"):
        write(cfg, (1,))


def test_root_owned_by_another_user_is_refused(tmp_path):
    nobody = needs_root()
    root = tmp_path / "theirs"
    root.mkdir(mode=0o755)
    os.chown(root, nobody, -1)
    cfg = config(tmp_path, persistent=str(root))
    with pytest.raises(UnsafePathError, match="owned by nobody"):
        write(cfg, (1,))
    with pytest.raises(ConfigError, match="owned by nobody"):
        cfg.check_directories()


def _chown_tree(path, uid):
    for dirpath, dirnames, filenames in os.walk(path):
        for n in dirnames + filenames:
            os.chown(os.path.join(dirpath, n), uid, -1, follow_symlinks=False)


@pytest.mark.parametrize("what", ["r000000.dfs", "manifest.json"])
@pytest.mark.scratch_files("gives a scratch file to another user")
def test_scratch_file_of_another_user_is_never_restored(tmp_path, caplog, what):
    nobody = needs_root()
    cfg = write(config(tmp_path))
    os.chown(os.path.join(vdir(cfg, "scratch", 2), what), nobody, -1)
    with caplog.at_level(logging.WARNING, logger="deepfreeze"):
        if what == "manifest.json":  # (a shard's owner is checked when it is read, as its checksums)
            assert list_versions(cfg, NAME)[2] == ["persistent"]
        ck = load(cfg, NAME)
    assert ck.version == 2 and ck.level == "persistent" and same(ck, 2)
    assert "owned by nobody" in caplog.text and "never restored" in caplog.text


@pytest.mark.scratch_files("removes the scratch copies so that persistent is read")
def test_persistent_files_of_another_user_need_trust(tmp_path, capsys):
    nobody = needs_root()
    cfg = write(config(tmp_path))
    shutil.rmtree(os.path.join(cfg.scratch, NAME))
    _chown_tree(vdir(cfg, "persistent", 2), nobody)
    with pytest.raises(UntrustedOwnerError, match="nobody") as e:
        load(cfg, NAME)
    assert "trust_owners=['nobody']" in str(e.value) and "--trust-owner nobody" in str(e.value)
    assert isinstance(e.value, DeepFreezeError)
    assert 2 not in list_versions(cfg, NAME)
    ck = load(cfg, NAME, trust_owners=["nobody"])
    assert ck.version == 2 and same(ck, 2)
    assert list_versions(cfg, NAME, trust_owners=[str(nobody)])[2] == ["persistent"]  # a uid works too
    # only the model file planted (the manifest is ours): still refused
    os.chown(os.path.join(vdir(cfg, "persistent", 2), "manifest.json"), 0, -1)
    with pytest.raises(UntrustedOwnerError, match="model.dfz is owned by nobody"):
        load(cfg, NAME, 2)
    # the CLI: refused without --trust-owner (exit 1, the message names the owner), read with it
    base = ["--name", NAME, "--set", "mode=sync", "--set", f"scratch={cfg.scratch}", "--set",
            f"persistent={cfg.persistent}"]
    out = tmp_path / "w.npz"
    assert cli_main(["export", *base, "-o", str(out)]) == 1
    assert "nobody" in capsys.readouterr().err
    assert cli_main(["export", *base, "-o", str(out), "--trust-owner", "nobody"]) == 0
    with np.load(out) as z:
        assert z["t0"].tobytes() == arrays_of(2)[0].tobytes()
    capsys.readouterr()
    assert cli_main(["ls", *base, "--trust-owner", "nobody"]) == 0
    assert "newest restorable: v2" in capsys.readouterr().out


def test_files_of_root_are_trusted(tmp_path):
    """A non-root reader trusts root's files; here (root) the rule is checked on the trust set."""
    assert 0 in ownership.trusted_uids()
    st = os.stat("/")
    ownership.check_owner(st, "/", ownership.trusted_uids(), "persistent")  # root-owned: no error


def test_export_never_writes_through_a_planted_temporary_link(tmp_path, capsys):
    """The export's temporary file has an unpredictable name (host, pid, thread, random) and is
    created exclusively, owner-only, without following a link: a link planted at a guessable name
    (into a file of someone else) is never written through."""
    cfg = write(config(tmp_path), (1,))
    outdir = tmp_path / "out"
    outdir.mkdir()
    os.chmod(outdir, 0o1777)  # a /tmp-like output directory
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious\n")
    out = outdir / "w.npz"
    tmp = outdir / f".w.npz.tmp{os.getpid()}.{threading.get_ident()}"
    os.symlink(str(victim), tmp)
    base = ["--name", NAME, "--set", "mode=sync", "--set", f"scratch={cfg.scratch}", "--set",
            f"persistent={cfg.persistent}", "-o", str(out)]
    assert cli_main(["export", *base]) == 0
    assert stat.S_IMODE(os.lstat(out).st_mode) == 0o600 and victim.read_bytes() == b"precious\n"
    assert os.path.islink(tmp)  # not ours: left alone
