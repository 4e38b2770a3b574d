"""What a rank does once DeepFreeze has seen it lose a peer (framework-neutral).

Open MPI 4.1 here has no fault-tolerant MPI and Horovod 0.28 no recovery: under
``mpirun --enable-recovery`` the job outlives a dead rank, DeepFreeze's own waits end with an
error (each is bounded), but the survivors then wait forever in the framework's next collective
(Horovod's all-reduce), and even at exit (``MPI_Finalize`` waits for every rank). The policy
``on_peer_loss`` says what a rank does when DeepFreeze sees a peer lost:

* ``"raise"`` (the default, the behaviour before this option): the error is raised (a
  :class:`~deepfreeze.errors.CloneTimeoutError`, ...); ending the process is the program's job.
* ``"exit"``: the rank logs the error by name at level CRITICAL (logger ``deepfreeze``), flushes
  every log handler, ``sys.stdout`` and ``sys.stderr``, and ends its process at once with
  ``os._exit(`` :data:`EXIT_CODE` ``)`` (75, ``EX_TEMPFAIL``: "try again"), so a job launcher or
  scheduler that restarts jobs on a non-zero exit restarts it (from its last checkpoint, with
  ``resume=True``). Nothing else runs (no ``atexit`` handler, no ``MPI_Finalize``): a checkpoint
  being written is left as a crash leaves it (the commit protocol ignores unfinished versions).

The one options place is the environment variable :data:`ENV` (``DEEPFREEZE_ON_PEER_LOSS``), read
by every part that can see a peer lost, on every rank (``mpirun -x DEEPFREEZE_ON_PEER_LOSS=exit``):
the clone transfer (:mod:`deepfreeze.clone.transfer`: a hello, a send, a receive, the source or clone
group's agreement ending with :class:`~deepfreeze.errors.CloneTimeoutError`, or a clone rank learning
in the agreement that another failed) and the Keras adapter's bounded vote
(:func:`deepfreeze.keras._dist.any_rank`, :class:`~deepfreeze.errors.StreamTimeoutError`). Each
part checks the value when it starts (:func:`policy`: a bad value is a
:class:`~deepfreeze.errors.ConfigError` then, not at the loss). The bound: the process ends as soon
as the error is raised, i.e. within the wait's own bound (``clone_timeout``, 2 x for the clone
group's agreement; the vote's ``timeout``).
"""
from __future__ import annotations

import logging
import os
import sys

from .errors import ConfigError

__all__ = ["ENV", "POLICIES", "EXIT_CODE", "policy", "peer_lost"]

#: the environment variable holding the policy
ENV = "DEEPFREEZE_ON_PEER_LOSS"
#: the policies
POLICIES = ("raise", "exit")
#: the exit code of a process ended by ``on_peer_loss = "exit"`` (``EX_TEMPFAIL``)
EXIT_CODE = 75

log = logging.getLogger("deepfreeze")


def policy() -> str:
    """The policy in force: :data:`ENV`, or ``"raise"`` when unset or empty.
    :class:`~deepfreeze.errors.ConfigError` for any other value."""
    value = os.environ.get(ENV, "").strip() or "raise"
    if value not in POLICIES:
        raise ConfigError(f"{ENV}={value[:40]!r}: use 'raise' (the default: a lost peer is an error the program "
                          f"handles) or 'exit' (the process ends with exit code {EXIT_CODE}, for a launcher to "
                          "restart the job)")
    return value


def _flush() -> None:
    for logger in [logging.getLogger()] + [logging.getLogger(n) for n in list(logging.root.manager.loggerDict)]:
        for h in getattr(logger, "handlers", []):
            try:
                h.flush()
            except Exception:  # a broken handler must not keep the process alive
                pass
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass


def peer_lost(error: BaseException, where: str) -> None:
    """DeepFreeze saw a peer lost (``error``, about to be raised, in ``where``). Under ``"exit"``,
    log it by name and end the process with :data:`EXIT_CODE`; under ``"raise"``, return (the
    caller raises ``error``). A bad :data:`ENV` value here (changed since the part started) is
    taken as ``"raise"``."""
    try:
        chosen = policy()
    except ConfigError:
        return
    if chosen != "exit":
        return
    log.critical("deepfreeze: %s: a peer is lost: %s: %s. %s=exit: ending this process (pid %d) now with exit "
                 "code %d, so that the job launcher can restart the job (resume=True continues from the last "
                 "checkpoint)", where, type(error).__name__, error, ENV, os.getpid(), EXIT_CODE)
    _flush()
    os._exit(EXIT_CODE)
