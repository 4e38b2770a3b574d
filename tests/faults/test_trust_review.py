"""Issue 23, adversarial review of the merged result: holes found by attacking the paths the
per-part work left between its parts (each test failed before its fix).

"Another user" is the existing unprivileged account ``nobody`` (as root: files chowned to it);
tests that need it skip when not run as root. Real files, real devices under /dev/shm.
"""
import logging
import os
import pwd
import shutil
import stat

import numpy as np
import pytest

from deepfreeze import memtier
from deepfreeze.errors import UnsafePathError
from deepfreeze.memtier import device as mdev
from deepfreeze.tiers import memtier as mlevel
from deepfreeze.lease import new_job_id

from _util import memtier_device, nobody_ids






@pytest.fixture
def device():
    with memtier_device("review", "16M") as path:
        yield path


def _plant(path, text, uid, gid):
    with open(path, "w") as f:
        f.write(text)
    os.chown(path, uid, gid)


def test_job_id_files_planted_by_another_user_are_refused(shared_dir, device, tmp_path):
    """Two programs keep their job ids in files of a shared directory (memtier.job_id); nobody
    plants both files first with one id: before, both programs used nobody's id, so program A
    restored program B's newer model. Now a job id file of another user is refused naming it,
    and a checkpoint job whose <persistent>/<name>/job is nobody's reads nothing from the tier."""
    uid, gid = nobody_ids()
    shared = new_job_id()
    a, b = os.path.join(shared_dir, "a.job"), os.path.join(shared_dir, "b.job")
    for p in (a, b):
        _plant(p, shared + "\n", uid, gid)
    with pytest.raises(UnsafePathError, match="owned by nobody"):
        memtier.job_id(a)
    with pytest.raises(UnsafePathError, match="owned by nobody"):
        memtier.job_id(b)
    # program B (its own id file) checkpoints; nobody's id never reaches program A's restore
    jb = memtier.job_id(str(tmp_path / "b.job"))
    sb = {"w": np.arange(100, dtype=np.float32)}
    with memtier.register(device, "m", sb, job=jb) as mb:
        memtier.checkpoint(mb, sb, 7)
    # a checkpoint name whose directory nobody made in a sticky persistent root, with B's id in it
    os.mkdir(os.path.join(shared_dir, "m"))
    _plant(os.path.join(shared_dir, "m", "job"), jb + "\n", uid, gid)
    os.chown(os.path.join(shared_dir, "m"), uid, gid)
    assert mlevel.MemtierLevel(device, jb).committed("m")  # B's version, seen by B's job
    got = mlevel.job_of(shared_dir, "m")
    assert got is not jb and got != jb
    assert mlevel.MemtierLevel(device, got).committed("m") == {}
    assert stat.S_IMODE(os.lstat(a).st_mode) == 0o644 and open(a).read() == shared + "\n"  # untouched


def test_token_directories_are_created_private_and_a_writable_one_is_refused(tmp_path):
    """The token's missing directories are made 0700 (before: only the last one; its parents got
    0755 under umask 022), and an existing token directory others can write in is refused (before:
    only its owner was checked, so another user could add or rename entries beside the secret)."""
    from deepfreeze import net
    old = os.umask(0o022)
    try:
        path = tmp_path / "a" / "b" / "token"
        tok = net.ensure_token(str(path))
        assert net.load_token(str(path)) == tok
        for d in (tmp_path / "a", tmp_path / "a" / "b"):
            assert stat.S_IMODE(os.lstat(d).st_mode) == 0o700, d
        loose = tmp_path / "loose"
        loose.mkdir()
        os.chmod(loose, 0o777)  # writable by every user, not sticky
        with pytest.raises(UnsafePathError, match="writable by every user"):
            net.create_token(str(loose / "token"))
        assert os.listdir(loose) == []
    finally:
        os.umask(old)


def test_flush_source_reads_the_device_it_checked(device, tmp_path, monkeypatch):
    """A flush from the memory tier (levels._open_source) checked the device (the user's own, a
    regular file, through the one trust check) and then opened the path again, unchecked, to copy
    the slot: a file another user put at the path in between (a device in a directory others can
    write in, the user's device renamed away) was copied to persistent storage. Now the bytes come
    from the descriptor that was checked. The test plays the attacker winning that race: right
    after the check it moves the device away and puts nobody's copy, with forged weights, there."""
    from deepfreeze.tiers import memtier as levels
    uid, gid = nobody_ids()
    s = {"w": np.arange(4096, dtype=np.float32)}
    with memtier.register(device, "m", s, job=memtier.job_id(str(tmp_path / "m.job"))) as m:
        memtier.checkpoint(m, s, 5)
    with mdev.open(device, writable=False) as dev:
        r = dev.find("m")[0]
        k, h = r.restorable()[0]
        real = bytes(r.read_image(k, verify=False))
    src = levels.SlotSource(device, r.entry_no, k, h.version.step, r.run, r.rank)
    opened = mdev.open

    def open_then_swap(path, **kw):
        got = opened(path, **kw)
        os.rename(path, path + ".moved")
        with open(path + ".moved", "rb") as f:
            data = bytearray(f.read())
        with opened(path + ".moved", writable=False) as d2:
            base = d2.region(r.entry_no).image_offset(k)
        data[base + len(real) - 64:base + len(real)] = b"\xff" * 64  # forged bytes at the slot's end
        with open(path, "wb") as f:
            f.write(data)
        os.chown(path, uid, gid)
        return got

    monkeypatch.setattr(mdev, "open", open_then_swap)
    try:
        with levels._open_source(None, src) as (fd, base, _idx, _label, _recheck):
            assert os.fstat(fd).st_uid == os.getuid()
            assert os.pread(fd, len(real), base) == real
    finally:
        if os.path.exists(device + ".moved"):
            os.replace(device + ".moved", device)  # (nobody's file goes with it)


def test_two_jobs_one_channel_name_on_one_redis(tmp_path, monkeypatch, caplog):
    """Two jobs of one user (one token) publish one channel name through one Redis, from different
    persistent directories: before, they shared the Redis keys, so job A's consumer connected to
    job B's producer (the one registered last) and received B's newer weights (v9 for A's v3).
    Now each job's records and notes live under its job id (<persistent>/<channel>/job) and each
    consumer gets its own job's versions, bit-exact. (As root, also a consumer that cannot read the
    job id: one of another account.)"""
    pytest.importorskip("redis", reason="the redis client is not installed (pip install redis)")
    import sys
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from test_stream_core import MODEL, SPECS, arrays_of, check, shard_of
    from test_stream_redis import RedisServer
    from deepfreeze.lease import RunInfo, Version, job_id
    from deepfreeze.shardplan import ShardPlan
    from deepfreeze.stream import Publisher, StreamOptions, Subscriber
    monkeypatch.setenv("DEEPFREEZE_TOKEN", "e" * 64)
    (tmp_path / "redis").mkdir()
    server = RedisServer(tmp_path / "redis")
    plan = ShardPlan.build(SPECS, 1, min_shard_bytes=0)
    opts = StreamOptions(shm_dir=str(tmp_path / "shm"), redis=server.url)
    os.makedirs(opts.shm_dir)
    pubs = {}
    try:
        for label, run in (("A", "aa" * 8), ("B", "bb" * 8)):
            pers = tmp_path / label
            os.makedirs(pers / "chan", mode=0o700)
            job = job_id(str(pers), "chan")  # what the job's first run makes
            pubs[label] = Publisher("chan", str(pers), rank=0, world=1, run=RunInfo(run, 0, job=job), plan=plan,
                                    model_tensors=MODEL, options=opts)
        for label, step in (("A", 3), ("B", 9)):  # B registered last, and newer
            pubs[label].publish(Version(0, step), shard_of(plan, 0, arrays_of(step)))
            pubs[label].wait(30)
        for label, step in (("A", 3), ("B", 9)):
            with Subscriber("chan", str(tmp_path / label), redis=server.url, tier="tcp") as sub:
                up = sub.next(30)
                assert up is not None and up.version == Version(0, step), (label, up and up.version)
                check(up, arrays_of(step))
        # a consumer that cannot read the job id (as one of another account: the producer's directory
        # is not its own) still finds a producer under the channel's keys, and says why, once
        if os.getuid() == 0:  # (chown needs root; the rest of the test runs for every user)
            os.chown(tmp_path / "B" / "chan" / "job", pwd.getpwnam("nobody").pw_uid, pwd.getpwnam("nobody").pw_gid)
            with caplog.at_level(logging.WARNING, logger="deepfreeze"):
                with Subscriber("chan", str(tmp_path / "B"), redis=server.url, tier="tcp") as sub:
                    up = sub.next(30)
                    assert up is not None and up.version == Version(0, 9)
                    check(up, arrays_of(9))
            assert sum("cannot read the producer's job id" in r.getMessage() for r in caplog.records) == 1
    finally:
        for p in pubs.values():
            p.close()
        server.stop()


def test_gc_never_rewrites_a_pack_of_another_user_into_one_of_yours(tmp_path):
    """A pack of another user in the repository (e.g. copied in with its owner kept) is refused by
    get; before, gc's compaction read it without the trust check and rewrote its bytes into a new
    pack of yours, after which get returned them. Now gc's pack check goes through the one trust
    check too: the pack is reported (naming its owner) and left as it is, and get still refuses it."""
    from deepfreeze.repo.store import EmbeddedRepository
    uid, gid = nobody_ids()
    rng = np.random.default_rng(5)
    a = rng.standard_normal(100).astype(np.float32)
    big = rng.standard_normal(100_000).astype(np.float32)
    d = str(tmp_path / "repo")
    with EmbeddedRepository(d) as repo:
        repo.put("m1", {"a": a, "big": big})
        repo.put("m2", {"a": a})  # shares blob a: m1's pack stays, mostly dead once m1 is gone
        repo.delete("m1")
        packs = os.listdir(os.path.join(d, "packs"))
        for p in packs:
            os.chown(os.path.join(d, "packs", p), uid, gid)
        with pytest.raises(UnsafePathError, match="owned by nobody"):
            repo.get("m2")
        out = repo.gc(grace=0)
        assert out["packs_rewritten"] == 0 and any("owned by nobody" in x for x in out["damaged"]), out
        assert sorted(os.listdir(os.path.join(d, "packs"))) == sorted(packs)
        assert all(os.stat(os.path.join(d, "packs", p)).st_uid == uid for p in packs)
        with pytest.raises(UnsafePathError, match="owned by nobody"):
            repo.get("m2")


def test_import_of_another_users_file_is_copied_not_linked(tmp_path):
    """add_pack (the import of a checkpoint's assembled file) hard-linked the file into packs/
    when it could: as root, a file of another (trusted) user became a pack owned by that user, so
    the imported model could never be read (get refuses another user's pack) and that user could
    still change its bytes. Now only a file of your own is linked; another owner's is copied into
    a pack of yours, and get returns it bit-exact."""
    from deepfreeze.repo.store import EmbeddedRepository, tensor_entries
    uid, gid = nobody_ids()
    w = {"w": np.arange(1000, dtype=np.float32), "b": np.ones(10, np.float32)}
    with EmbeddedRepository(str(tmp_path / "r1")) as r1:
        r1.put("m", w)
    pack = os.listdir(tmp_path / "r1" / "packs")[0]
    src = str(tmp_path / "theirs.dfz")  # a DeepFreeze-format file of another user
    shutil.copy(tmp_path / "r1" / "packs" / pack, src)
    os.chown(src, uid, gid)
    entries = tensor_entries(src)
    with EmbeddedRepository(str(tmp_path / "r2")) as r2:
        out = r2.add_pack("imp", src, {f"t{i}": e for i, e in entries.items()})
        assert out["how"] == "copied"
        packs = os.listdir(tmp_path / "r2" / "packs")
        assert all(os.stat(tmp_path / "r2" / "packs" / p).st_uid == os.getuid() for p in packs)
        got = r2.get("imp")
    assert got["t0"].tobytes() == w["w"].tobytes() and got["t1"].tobytes() == w["b"].tobytes()
    assert os.stat(src).st_nlink == 1  # never linked
