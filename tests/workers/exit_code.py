"""Runs one rank's command and records how it ended (for tests of processes that end with
``os._exit``, which write nothing on their way out):

    mpirun ... python exit_code.py OUT python worker.py ARGS...

The command runs as a child of this process, as the MPI process of the rank (it inherits the
launcher's environment); this process is not one. Writes ``OUT/exit<world rank>.json``:
``{"rc": exit status (negative: killed by that signal), "seconds": wall time of the command}``,
and the command's standard error in ``OUT/stderr<world rank>.txt``.
"""
import json
import os
import subprocess
import sys
import time

out, cmd = sys.argv[1], sys.argv[2:]
rank = os.environ.get("OMPI_COMM_WORLD_RANK") or os.environ.get("PMIX_RANK", "0")
t0 = time.monotonic()
with open(os.path.join(out, f"stderr{rank}.txt"), "wb") as err:
    rc = subprocess.run(cmd, stderr=err).returncode
path = os.path.join(out, f"exit{rank}.json")
with open(path + ".tmp", "w") as f:
    json.dump({"rc": rc, "seconds": time.monotonic() - t0}, f)
os.replace(path + ".tmp", path)
