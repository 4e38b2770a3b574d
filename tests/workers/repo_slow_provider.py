"""A provider whose stores stop between writing their pack and committing (for the SIGKILL test
of tests/test_repo_provider.py): the store of a name starting with ``slow`` creates MARKER and
then sleeps, so the test can kill the process exactly there.

    python repo_slow_provider.py DIR MARKER [PORT]

Prints ``listening on HOST:PORT`` once it accepts connections (token from $DEEPFREEZE_TOKEN).
"""
import os
import sys
import time

from deepfreeze.repo.provider import serve
from deepfreeze.repo.store import EmbeddedRepository


class SlowRepository(EmbeddedRepository):
    marker = ""

    def _before_commit(self, name: str) -> None:
        if name.startswith("slow"):
            with open(self.marker, "w") as f:
                f.write(str(os.getpid()))
            time.sleep(600)


def main() -> int:
    directory, marker = sys.argv[1], sys.argv[2]
    port = int(sys.argv[3]) if len(sys.argv) > 3 else 0
    repo = SlowRepository(directory)
    repo.marker = marker
    serve(directory, "127.0.0.1", port, repository=repo, arena_bytes=4 << 20,
          ready=lambda addr: print(f"listening on {addr}", flush=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
