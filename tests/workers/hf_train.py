"""Hugging Face ``transformers.Trainer`` worker for DeepFreeze (one rank of ``torchrun``).

    torchrun --standalone --nproc-per-node 2 tests/workers/hf_train.py OUT RUN [RUN ...] [key=value ...]

A tiny GPT-2 built from its config (nothing from a hub; dropout on), a hand-made dataset of
token sequences, Trainer on CPU with DDP from torchrun's environment, a linear schedule with
warm-up. Every RUN is one ``trainer.train()`` in this process (a fresh model and Trainer each):

  full         from scratch to ``steps`` (no checkpoints)
  first        from scratch, Trainer's own checkpoints (OUT/own, every ``every`` steps) and
               DeepFreezeCallback (name ``hf``, every ``every`` steps); stops at ``stop`` (a
               callback sets should_training_stop), or rank ``kill_rank`` SIGKILLs itself at
               the start of step ``kill_at``
  own          resumed from Trainer's own OUT/own/checkpoint-``at``
  df           resumed from deepfreeze.torch.hf.checkpoint_dir(...) (version ``df_at``, default
               ``at``; the newest with df_at=0) in OUT/df, with DeepFreezeCallback continuing the name

keys: steps, every, stop, at, df_at, accum (gradient_accumulation_steps), kill_at, kill_rank.
Per rank and RUN it writes OUT/<RUN>_rank<r>.pt (torch.save: model state dict, optimizer state
dict, scheduler state dict, global step; read back with weights_only=True).
"""
import os
import signal
import sys

os.environ["HF_HUB_OFFLINE"] = "1"  # nothing from a hub: any attempt fails the run
os.environ["TRANSFORMERS_OFFLINE"] = "1"

import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from transformers import (GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback,  # noqa: E402
                          TrainingArguments, set_seed)

import deepfreeze.torch.hf as dfhf  # noqa: E402

VOCAB, SEQ, N = 64, 16, 48


class Tokens(torch.utils.data.Dataset):
    """N fixed sequences of SEQ token ids (a generator of its own: the same data in every run)."""

    def __init__(self) -> None:
        g = torch.Generator().manual_seed(1234)
        self.ids = torch.randint(0, VOCAB, (N, SEQ), generator=g)

    def __len__(self) -> int:
        return N

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


class Stop(TrainerCallback):
    """Ends training after step ``stop`` (an interrupted run), or SIGKILLs rank ``kill_rank`` at
    the start of step ``kill_at`` (a crash)."""

    def __init__(self, stop: int, kill_at: int, kill_rank: int) -> None:
        self.stop, self.kill_at, self.kill_rank = stop, kill_at, kill_rank

    def on_step_begin(self, args, state, control, **kw):
        if self.kill_at and state.global_step + 1 == self.kill_at and args.process_index == self.kill_rank:
            os.kill(os.getpid(), signal.SIGKILL)

    def on_step_end(self, args, state, control, **kw):
        if self.stop and state.global_step >= self.stop:
            control.should_training_stop = True


def main() -> None:
    out, rest = sys.argv[1], sys.argv[2:]
    runs = [a for a in rest if "=" not in a]
    kv = dict(a.split("=", 1) for a in rest if "=" in a)
    steps, every = int(kv.get("steps", 12)), int(kv.get("every", 6))
    stop, at, accum = int(kv.get("stop", 0)), int(kv.get("at", 6)), int(kv.get("accum", 1))
    df_at = int(kv.get("df_at", at))
    kill_at, kill_rank = int(kv.get("kill_at", 0)), int(kv.get("kill_rank", 1))
    df = dict(config=None, name="hf", mode="sync", scratch=os.path.join(out, "scratch"),
              persistent=os.path.join(out, "persistent"))
    for run in runs:
        own = run == "first"
        args = TrainingArguments(
            output_dir=os.path.join(out, "own"), use_cpu=True, dataloader_num_workers=0, seed=7, report_to=[],
            max_steps=steps, per_device_train_batch_size=2, gradient_accumulation_steps=accum, learning_rate=3e-3,
            warmup_steps=2, lr_scheduler_type="linear", weight_decay=0.01, logging_steps=1000,
            save_strategy="steps" if own else "no", save_steps=every, disable_tqdm=True)
        set_seed(7)
        model = GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=32, n_layer=2, n_head=2))
        callbacks = [Stop(stop if own else 0, kill_at if own else 0, kill_rank)]
        if run in ("first", "df"):
            callbacks.append(dfhf.DeepFreezeCallback(**{k: v for k, v in df.items()}, every_n_steps=every))
        trainer = Trainer(model=model, args=args, train_dataset=Tokens(), callbacks=callbacks)
        resume = None
        if run == "own":
            resume = os.path.join(out, "own", f"checkpoint-{at}")
        elif run == "df":
            resume = dfhf.checkpoint_dir(**df, output_dir=os.path.join(out, "df"), version=df_at or None)
        trainer.train(resume_from_checkpoint=resume)
        result = {"model": {k: v.detach().clone() for k, v in trainer.model.state_dict().items()},
                  "optim": trainer.optimizer.state_dict(), "sched": trainer.lr_scheduler.state_dict(),
                  "global_step": trainer.state.global_step, "resumed": resume or ""}
        torch.save(result, os.path.join(out, f"{run}_rank{args.process_index}.pt"))
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
