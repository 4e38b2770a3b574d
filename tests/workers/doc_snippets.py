"""Runs the python blocks of documentation files as tests/test_doc_snippets.py planned them.

    python tests/workers/doc_snippets.py PLAN.json             # every doc of the plan, in order
    python tests/workers/doc_snippets.py PLAN.json --only KEY  # one block, alone (a second process)

PLAN.json: ``{"docs": [{"doc", "cwd", "env", "blocks": [{"key", "line", "stubs", "code", "after",
"file", "ns", "spawned"}]}]}``. The blocks of one doc run in order in one namespace (``__name__`` is
``"__main__"``), in the doc's own working directory (on ``sys.path``) with its ``env`` set; each
block's declared ``stubs`` run before it and its ``after`` after it, in the same namespace. A block
with ``file`` is a script (``# train.py``): written there under that name (later blocks import it)
and run in a namespace of its own, kept under that name; a block with ``ns`` (an edit of such a
script) runs in that script's namespace. A ``spawned`` block is skipped in the sequence: another
block's stubs start it as a second process with ``_spawn(key)``. The code keeps the doc's line
numbers, so a traceback names the doc's line. Prints ``RAN <key> (<seconds> s)`` after each block;
exits 1 at the first failure.
"""
import json
import os
import subprocess
import sys
import time
import traceback

#: what torchrun sets in a worker: removed for a block that is "one plain process"
TORCHRUN_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
                "ROLE_RANK", "ROLE_WORLD_SIZE", "ROLE_NAME", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID")


class Spawned:
    """A block run alone in a second process (``--only``), as a plain process (no torchrun variables)."""

    def __init__(self, plan_path: str, key: str) -> None:
        self.key = key
        self.log = os.path.join(os.path.dirname(plan_path), "spawned-" + key.replace("/", "_").replace("#", "_"))
        env = {k: v for k, v in os.environ.items() if k not in TORCHRUN_ENV}
        with open(self.log, "w") as out:
            self.proc = subprocess.Popen([sys.executable, __file__, plan_path, "--only", key], env=env,
                                         stdout=out, stderr=subprocess.STDOUT)

    def poll(self):
        return self.proc.poll()

    def wait(self, timeout: float = 300) -> int:
        return self.proc.wait(timeout)

    @property
    def returncode(self):
        return self.proc.returncode

    def output(self) -> str:
        with open(self.log) as f:
            return f.read()


def _exec(text: str, where: str, line: int, ns: dict) -> None:
    if text.strip():
        exec(compile("\n" * (line - 1) + text, where, "exec"), ns)


def run_block(b: dict, doc: str, ns: dict, scripts: dict) -> None:
    if b["file"]:
        with open(b["file"], "w") as f:
            f.write(b["code"])
        ns = scripts[b["file"]] = dict(ns, __name__="__main__")
    elif b["ns"]:
        ns = scripts[b["ns"]]
    t0 = time.monotonic()
    _exec(b["stubs"], f"<stubs of {b['key']}>", 1, ns)
    _exec(b["code"], doc, b["line"], ns)
    _exec(b["after"], f"<after {b['key']}>", 1, ns)
    print("RAN", b["key"], f"({time.monotonic() - t0:.1f} s)", flush=True)


def enter(d: dict) -> None:
    os.makedirs(d["cwd"], exist_ok=True)
    os.chdir(d["cwd"])
    sys.path.insert(0, d["cwd"])
    os.environ.update(d["env"])


def main() -> int:
    plan_path = sys.argv[1]
    with open(plan_path) as f:
        plan = json.load(f)
    only = sys.argv[3] if len(sys.argv) > 3 and sys.argv[2] == "--only" else None
    for d in plan["docs"]:
        if only is not None:
            blocks = [b for b in d["blocks"] if b["key"] == only]
            if not blocks:
                continue
        else:
            blocks = [b for b in d["blocks"] if not b["spawned"]]
        enter(d)
        ns, scripts = {"__name__": "__main__", "_spawn": lambda key: Spawned(plan_path, key)}, {}
        for b in blocks:
            try:
                run_block(b, d["doc"], ns, scripts)
            except BaseException:
                print(f"FAILED {b['key']} (the block at {d['doc']}:{b['line']})", flush=True)
                traceback.print_exc()
                sys.stdout.flush()
                return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
