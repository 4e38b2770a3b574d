"""DeepFreeze in Hugging Face ``transformers.Trainer`` (deepfreeze/torch/hf.py): real 2-rank
torchrun jobs of Trainer on CPU (DDP from torchrun's environment), a tiny GPT-2 built from its
config, a hand-made dataset (tests/workers/hf_train.py).

A run resumed from the ``checkpoint-<step>`` directory that ``checkpoint_dir`` makes from a
DeepFreeze version must end bit-identical (model, optimizer state, scheduler, global step) to a
run resumed from Trainer's own ``checkpoint-<step>`` at the same step, and to the uninterrupted
run (Trainer's own resume is exact here: checked in the same job).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from importlib.util import find_spec

import pytest

torch = pytest.importorskip("torch", reason="PyTorch is not installed (scripts/setup.sh installs torch==2.13.0, CPU)")
# found, not imported: every pytest-xdist worker collects this module, one runs its tests (the tests
# import transformers where they use it)
pytestmark = [pytest.mark.skipif(find_spec("transformers") is None,
                                 reason="transformers is not installed (scripts/setup.sh installs it, pinned)"),
              pytest.mark.skipif(find_spec("accelerate") is None,
                                 reason="accelerate is not installed (Trainer needs it; scripts/setup.sh installs it)")]

from _util import ROOT, WORKERS  # noqa: E402
from test_torch import _env, torchrun  # noqa: E402

WORKER = os.path.join(WORKERS, "hf_train.py")
OWN_FILES = ("model.safetensors", "optimizer.pt", "scheduler.pt", "trainer_state.json", "rng_state_0.pth",
             "rng_state_1.pth")


def _leaves(x, path=""):
    if isinstance(x, dict):
        for k, v in x.items():
            yield from _leaves(v, f"{path}/{k}")
    elif isinstance(x, (list, tuple)):
        for i, v in enumerate(x):
            yield from _leaves(v, f"{path}/{i}")
    else:
        yield path, x


def differences(a, b) -> list[str]:
    """Paths where two nested states differ (tensors: dtype, shape and bytes)."""
    la, lb = dict(_leaves(a)), dict(_leaves(b))
    out = [f"{k}: only on one side" for k in sorted(set(la) ^ set(lb))]
    for k in sorted(set(la) & set(lb)):
        x, y = la[k], lb[k]
        if isinstance(x, torch.Tensor) or isinstance(y, torch.Tensor):
            same = (isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor) and x.dtype == y.dtype
                    and x.shape == y.shape and x.contiguous().view(-1).view(torch.uint8).equal(
                        y.contiguous().view(-1).view(torch.uint8)))
        elif hasattr(x, "tobytes"):  # numpy arrays (RNG states)
            same = type(x) is type(y) and x.dtype == y.dtype and x.tobytes() == y.tobytes()
        else:
            same = x == y
        if not same:
            out.append(k)
    return out


def result(out: str, run: str, rank: int) -> dict:
    return torch.load(os.path.join(out, f"{run}_rank{rank}.pt"), weights_only=True)


def check_resumes(out: str, at: int, runs: tuple[str, ...] = ("own", "df")) -> None:
    for r in (0, 1):
        full = result(out, "full", r)
        got = {run: result(out, run, r) for run in runs}
        assert all(g["resumed"] for g in got.values()), "a run that should have resumed did not"
        keys = ("model", "optim", "sched", "global_step")
        if "own" in got:  # the DeepFreeze route against Trainer's own checkpoint at the same step
            diff = {k: differences(got["df"][k], got["own"][k]) for k in keys}
            assert not any(diff.values()), f"rank {r}: DeepFreeze resume != Trainer's own resume at step {at}: {diff}"
            own_exact = not any(differences(got["own"][k], full[k]) for k in keys)
            assert own_exact, f"rank {r}: Trainer's own resume at step {at} is not exact here: the uninterrupted " \
                              "comparison below would not be meaningful"
        diff = {k: differences(got["df"][k], full[k]) for k in keys}
        assert not any(diff.values()), f"rank {r}: DeepFreeze resume != the uninterrupted run: {diff}"
        assert got["df"]["global_step"] == full["global_step"] > at


def check_dir_equals_trainers(own: str, df: str) -> None:
    """The directory checkpoint_dir made holds what Trainer's own checkpoint holds, bit for bit."""
    from safetensors.torch import load_file
    from transformers.trainer_pt_utils import safe_globals
    assert set(OWN_FILES) <= set(os.listdir(df)), sorted(os.listdir(df))
    mo, md = load_file(os.path.join(own, "model.safetensors")), load_file(os.path.join(df, "model.safetensors"))
    assert set(mo) <= set(md)  # Trainer's save_pretrained leaves out tied copies (lm_head.weight)
    assert not differences(mo, {k: md[k] for k in mo})
    for f in OWN_FILES[1:]:
        if f.endswith("json"):
            so, sd = (json.load(open(os.path.join(d, f))) for d in (own, df))
            # what Trainer updates after on_step_end, at its own save: total_flos (store_flos)
            diff = sorted(k for k in so if so[k] != sd.get(k) and k != "total_flos")
            assert not diff, {k: (so[k], sd.get(k)) for k in diff}
            continue
        with safe_globals():
            a, b = (torch.load(os.path.join(d, f), weights_only=True) for d in (own, df))
        assert not differences(a, b), f"{f}: {differences(a, b)[:5]}"


@pytest.fixture(scope="module")
def hf_job(tmp_path_factory):
    """One job, four trainings (a fresh model and Trainer each): a run interrupted after step 6
    with Trainer's own checkpoints and DeepFreezeCallback (every 6 steps); the uninterrupted run
    to step 12; resumed from Trainer's checkpoint-6; resumed from checkpoint_dir's checkpoint-6
    (the callback continuing the name: v12 at the end). Dropout on, linear schedule with
    warm-up, AdamW."""
    out = str(tmp_path_factory.mktemp("hf"))
    torchrun(2, WORKER, out, "first", "full", "own", "df", "steps=12", "every=6", "stop=6", "at=6", timeout=400)
    return out


def df_keys(out: str) -> dict:
    return dict(config=None, name="hf", mode="sync", scratch=os.path.join(out, "scratch"),
                persistent=os.path.join(out, "persistent"))


def test_trainer_resume_from_deepfreeze_equals_trainers_own(hf_job):
    out = hf_job
    check_dir_equals_trainers(os.path.join(out, "own", "checkpoint-6"), os.path.join(out, "df", "checkpoint-6"))
    check_resumes(out, 6)
    with open(os.path.join(out, "df", "checkpoint-6", "deepfreeze.json")) as f:
        assert json.load(f)["version"] == 6
    from deepfreeze import Config, list_versions
    kw = df_keys(out)
    cfg = Config.resolve(None, mode="sync", scratch=kw["scratch"], persistent=kw["persistent"])
    assert sorted(list_versions(cfg, "hf")) == [6, 12]  # the resumed run continued the name at step 6


def test_checkpoint_dir_in_a_plain_process(hf_job, tmp_path, caplog):
    """At another world size (1 process, a 2-rank version): the shared files, no RNG file (logged);
    the newest version by default; a directory made before is replaced; Trainer's own (or any
    other) directory is refused; a missing version raises; a name without versions gives None."""
    from deepfreeze.errors import CheckpointNotFoundError, ExistingCheckpointError
    from deepfreeze.torch.hf import checkpoint_dir
    kw = df_keys(hf_job)
    path = checkpoint_dir(**kw, output_dir=str(tmp_path))
    assert path == os.path.join(str(tmp_path), "checkpoint-12")
    assert sorted(os.listdir(path)) == ["deepfreeze.json", "model.safetensors", "optimizer.pt", "scheduler.pt",
                                        "trainer_state.json"]
    with open(os.path.join(path, "trainer_state.json")) as f:
        assert json.load(f)["global_step"] == 12
    assert "no RNG files" in caplog.text
    stamp = os.stat(os.path.join(path, "optimizer.pt")).st_ino
    assert checkpoint_dir(**kw, output_dir=str(tmp_path), version=12) == path  # replaced
    assert os.stat(os.path.join(path, "optimizer.pt")).st_ino != stamp
    assert not [n for n in os.listdir(str(tmp_path)) if "deepfreeze-" in n]  # no temporary left
    with pytest.raises(ExistingCheckpointError, match="not made by checkpoint_dir"):
        checkpoint_dir(**kw, output_dir=os.path.join(hf_job, "own"), version=6)
    assert set(os.listdir(os.path.join(hf_job, "own", "checkpoint-6"))) >= set(OWN_FILES)  # untouched
    with pytest.raises(CheckpointNotFoundError):
        checkpoint_dir(**kw, output_dir=str(tmp_path), version=7)
    assert checkpoint_dir(**{**kw, "name": "nothing_here"}, output_dir=str(tmp_path)) is None


def test_callback_refuses_fsdp_deepspeed_and_bad_arguments(tmp_path):
    """FSDP and DeepSpeed are refused when the callback is attached (Trainer's on_init_end), with
    a ConfigError naming them; arguments the callback sets itself, and a bad interval, too."""
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments
    from deepfreeze.errors import ConfigError
    from deepfreeze.torch.hf import DeepFreezeCallback
    with pytest.raises(ConfigError, match="every_n_steps"):
        DeepFreezeCallback(name="x", every_n_steps=0)
    with pytest.raises(ConfigError, match="resume"):
        DeepFreezeCallback(name="x", resume=True)
    cb = DeepFreezeCallback(name="x", every_n_steps=2, scratch=str(tmp_path / "s"), persistent=str(tmp_path / "p"))
    model = GPT2LMHeadModel(GPT2Config(vocab_size=16, n_positions=8, n_embd=8, n_layer=1, n_head=1))
    args = TrainingArguments(output_dir=str(tmp_path / "o"), use_cpu=True, report_to=[])
    Trainer(model=model, args=args, callbacks=[cb])  # DDP-less CPU: accepted
    args.deepspeed = {"zero_optimization": {"stage": 2}}  # as TrainingArguments keeps it (building it needs deepspeed)
    with pytest.raises(ConfigError, match="DeepSpeed"):
        cb.on_init_end(args, None, None)
    args.deepspeed, args.fsdp = None, True  # what TrainingArguments makes of fsdp="full_shard" (FSDP1 or 2)
    with pytest.raises(ConfigError, match="FSDP"):
        cb.on_init_end(args, None, None)
    with pytest.raises(ConfigError, match="FSDP"):
        cb.on_train_begin(args, None, None)


@pytest.mark.slow
def test_trainer_kill9_gradient_accumulation_then_resume(tmp_path):
    """Gradient accumulation (2 micro-batches per step), rank 1 SIGKILLed at the start of step 10
    (v8, captured in step 8, is handed off in step 9: the newest), the job relaunched through
    checkpoint_dir(newest): ends equal to the uninterrupted run and to Trainer's own resume from checkpoint-8."""
    out = str(tmp_path)
    common = ("steps=14", "every=4", "accum=2")
    p = torchrun(2, WORKER, out, "first", *common, "kill_at=10", check=False, timeout=400)
    assert p.returncode != 0
    torchrun(2, WORKER, out, "full", "own", "df", *common, "at=8", "df_at=0", timeout=400)  # df_at=0: the newest
    assert result(out, "df", 0)["resumed"].endswith("checkpoint-8")
    check_resumes(out, 8)


def test_import_deepfreeze_torch_does_not_import_transformers():
    code = ("import sys, deepfreeze.torch; bad = [m for m in ('transformers', 'accelerate', 'pytorch_lightning', "
            "'lightning') if m in sys.modules]; assert not bad, bad")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=240, env=_env(),
                       cwd=ROOT)
    assert p.returncode == 0, p.stderr[-3000:]


def test_resumed_trainer_with_a_newer_deepfreeze_version_is_refused(hf_job, tmp_path):
    """A Trainer resumed from its own checkpoint-6 while the callback's name has v12: the
    Checkpointer the callback builds continues v12, which is not Trainer's step: a
    ModelMismatchError before the first step (a plain process, the 2-rank job's files)."""
    sys.path.insert(0, WORKERS)
    from hf_train import SEQ, VOCAB, Tokens
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments
    from deepfreeze.errors import ModelMismatchError
    from deepfreeze.torch.hf import DeepFreezeCallback
    kw = df_keys(hf_job)
    cb = DeepFreezeCallback(**kw, every_n_steps=6)
    args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[], max_steps=12,
                             per_device_train_batch_size=2, save_strategy="no", disable_tqdm=True)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=32, n_layer=2, n_head=2))
    trainer = Trainer(model=model, args=args, train_dataset=Tokens(), callbacks=[cb])
    with pytest.raises(ModelMismatchError, match="global step 12, but Trainer resumed at step 6"):
        trainer.train(resume_from_checkpoint=os.path.join(hf_job, "own", "checkpoint-6"))
    assert cb.checkpointer is None


def test_new_name_under_a_trainer_resumed_from_its_own_checkpoint(hf_job, tmp_path):
    """A Trainer resumed from its own checkpoint-6 with the callback on a name without versions:
    the versions start at global step 6 (start_step), the next at 9 (a plain process)."""
    sys.path.insert(0, WORKERS)
    from hf_train import SEQ, VOCAB, Tokens
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments
    from deepfreeze import Config, list_versions
    from deepfreeze.torch.hf import DeepFreezeCallback
    kw = dict(mode="sync", scratch=str(tmp_path / "scratch"), persistent=str(tmp_path / "persistent"))
    cb = DeepFreezeCallback(name="fresh", every_n_steps=3, **kw)
    args = TrainingArguments(output_dir=str(tmp_path / "o"), use_cpu=True, report_to=[], max_steps=9,
                             per_device_train_batch_size=2, save_strategy="no", disable_tqdm=True)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=32, n_layer=2, n_head=2))
    trainer = Trainer(model=model, args=args, train_dataset=Tokens(), callbacks=[cb])
    trainer.train(resume_from_checkpoint=os.path.join(hf_job, "own", "checkpoint-6"))
    assert trainer.state.global_step == 9 and cb.checkpointer is None
    assert sorted(list_versions(Config.resolve(None, **kw), "fresh")) == [9]


class _TrainerStateLike:
    """What the callback records as its Trainer state (``state=`` key ``hf_trainer_state``)."""

    def __init__(self, step: int) -> None:
        self.text = json.dumps({"global_step": step})

    def state_dict(self) -> dict:
        return {"trainer_state": self.text}

    def load_state_dict(self, sd: dict) -> None:
        self.text = sd["trainer_state"]


@pytest.fixture(scope="module")
def one_version(tmp_path_factory):
    """A version shaped like the callback's, written in this process (no Trainer, a second): v2 of 'hfx'."""
    from deepfreeze.torch import Checkpointer
    from deepfreeze.torch.hf import TRAINER_STATE
    d = tmp_path_factory.mktemp("hfx")
    kw = dict(config=None, name="hfx", mode="sync", scratch=str(d / "s"), persistent=str(d / "p"))
    net = torch.nn.Linear(3, 2)
    opt = torch.optim.AdamW(net.parameters(), lr=1e-3)
    with Checkpointer(net, opt, every_n_steps=2, state={TRAINER_STATE: _TrainerStateLike(2)}, **kw):
        for _ in range(2):
            net(torch.ones(1, 3)).sum().backward()
            opt.step()
            opt.zero_grad()
    return kw


def test_checkpoint_dir_refuses_an_output_dir_of_another_user(one_version, tmp_path):
    """Issue 41, item 2, with a real second user: ``output_dir`` owned by the account ``nobody``
    (who could rename the returned checkpoint-N aside and put their own model.safetensors in its
    place) is refused with an UnsafePathError naming the directory, its owner and mode and the
    rule; nothing is written there. Before: written without a word."""
    from deepfreeze.errors import UnsafePathError
    from deepfreeze.torch.hf import checkpoint_dir
    from test_cli import other_users_dir
    d = other_users_dir(tmp_path / "theirs")
    with pytest.raises(UnsafePathError, match=f"{d} \\(owned by nobody \\(uid \\d+\\), mode 0755\\) breaks the rule"):
        checkpoint_dir(**one_version, output_dir=d)
    assert os.listdir(d) == []
    with pytest.raises(UnsafePathError, match="owned by nobody"):  # a missing output_dir below it: not created
        checkpoint_dir(**one_version, output_dir=os.path.join(d, "below"))
    assert os.listdir(d) == []


def test_checkpoint_dir_output_dir_rule_and_the_link_renamed_aside(one_version, tmp_path):
    """Issue 41, item 2: an output_dir every user may write in (0777, not sticky) is refused, a
    group-writable one unless shared_group = true; a missing one is created 0700. A checkpoint-N
    that is a link (to a directory checkpoint_dir made) is replaced, and the link renamed aside
    (checkpoint-N.deepfreeze-old-<pid>) removed, its target untouched. Before: the 0777 and 0770
    directories were written into and the link was left behind."""
    from deepfreeze.errors import UnsafePathError
    from deepfreeze.torch.hf import checkpoint_dir
    open_dir = tmp_path / "open"
    open_dir.mkdir()
    os.chmod(open_dir, 0o777)
    with pytest.raises(UnsafePathError, match="mode 0777.*writable by every user"):
        checkpoint_dir(**one_version, output_dir=str(open_dir))
    assert os.listdir(open_dir) == []
    group = tmp_path / "group"
    group.mkdir()
    os.chmod(group, 0o770)
    with pytest.raises(UnsafePathError, match="shared_group = true"):
        checkpoint_dir(**one_version, output_dir=str(group))
    assert os.listdir(group) == []
    assert checkpoint_dir(**one_version, output_dir=str(group), shared_group=True) == str(group / "checkpoint-2")
    out = tmp_path / "new" / "out"
    path = checkpoint_dir(**one_version, output_dir=str(out))
    assert path == str(out / "checkpoint-2") and os.stat(out).st_mode & 0o777 == 0o700
    elsewhere = tmp_path / "elsewhere"
    os.rename(path, elsewhere)  # a directory checkpoint_dir made, now behind a link
    os.symlink(elsewhere, path)
    assert checkpoint_dir(**one_version, output_dir=str(out)) == path
    assert os.listdir(out) == ["checkpoint-2"] and not os.path.islink(path)
    assert "deepfreeze.json" in os.listdir(elsewhere) and "model.safetensors" in os.listdir(elsewhere)


def test_train_end_keeps_the_last_step(tmp_path):
    """Issue 42, finding 4: on_train_end closes the Checkpointer normally, which checkpoints the last
    step (save_last, the default): 5 steps at every 3 keep v3 and v5, v5 holding the trained model."""
    sys.path.insert(0, WORKERS)
    from hf_train import SEQ, VOCAB, Tokens
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments
    from deepfreeze import Config, list_versions
    from deepfreeze.torch import load
    from deepfreeze.torch.hf import DeepFreezeCallback
    kw = dict(scratch=str(tmp_path / "scratch"), persistent=str(tmp_path / "persistent"))
    cb = DeepFreezeCallback(name="last", every_n_steps=3, **kw)
    args = TrainingArguments(output_dir=str(tmp_path / "o"), use_cpu=True, report_to=[], max_steps=5,
                             per_device_train_batch_size=2, save_strategy="no", disable_tqdm=True)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=32, n_layer=2, n_head=2))
    trainer = Trainer(model=model, args=args, train_dataset=Tokens(), callbacks=[cb])
    trainer.train()
    assert trainer.state.global_step == 5
    assert sorted(list_versions(Config.resolve(None, **kw), "last")) == [3, 5]
    got = load(name="last", **kw)
    want = model.state_dict()
    assert set(want) <= set(got), sorted(set(want) - set(got))[:5]
    for k, v in want.items():
        assert got[k].numpy().tobytes() == v.detach().numpy().tobytes(), k
