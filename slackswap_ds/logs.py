"""What SlackSwap says during a job, and which rank says it.

Library output goes through the ``slackswap_ds`` logger. A job of N ranks says things once: on
ranks other than 0 only warnings, errors and records marked `EVERY_RANK` (what differs on that
rank) get through, and not warnings marked `SAME_ON_EVERY_RANK` (what every rank would say alike).
`SayOnce` keeps a message that could repeat every step to its first time.
"""

from __future__ import annotations

import logging
import os

log = logging.getLogger("slackswap_ds")

EVERY_RANK = {"every_rank": True}  # `extra=` of a record other ranks log too (what differs on them)
SAME_ON_EVERY_RANK = {"same_on_every_rank": True}  # `extra=` of a warning only rank 0 logs (every rank has it alike)


class RankZeroFilter(logging.Filter):
    """On ranks other than 0, only warnings, errors and records marked EVERY_RANK get through (not
    those marked SAME_ON_EVERY_RANK)."""

    def __init__(self, rank: int):
        super().__init__()
        self.rank = rank

    def filter(self, record: logging.LogRecord) -> bool:
        if self.rank == 0:
            return True
        if getattr(record, "same_on_every_rank", False):
            return False
        return record.levelno >= logging.WARNING or getattr(record, "every_rank", False)


def job_rank() -> int:
    """This process's rank in the job: torch.distributed's, else the launcher's environment, else 0."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    for name in ("RANK", "PMI_RANK", "OMPI_COMM_WORLD_RANK"):
        if os.environ.get(name, "").isdigit():
            return int(os.environ[name])
    return 0


def setup_logging(level: str) -> None:
    """Set the logger's level; give it a console handler if the application configured none; say
    things once per job (`RankZeroFilter`, replacing an earlier one)."""
    log.setLevel(level.upper())
    if not log.handlers and not logging.getLogger().handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(message)s"))
        log.addHandler(handler)
    for old in [f for f in log.filters if isinstance(f, RankZeroFilter)]:
        log.removeFilter(old)
    log.addFilter(RankZeroFilter(job_rank()))


def said_once_per_job(error: BaseException) -> BaseException:
    """`error`, which every rank of the job raises alike (a config mistake): if nothing catches it,
    rank 0 prints it without a traceback and the other ranks print nothing, so the job's output says
    it once instead of once per rank under a traceback each; the process exits with status 1 as
    before. Other uncaught exceptions go to the hook that was there."""
    import sys

    previous = sys.excepthook

    def hook(kind, value, traceback):
        if value is not error:
            return previous(kind, value, traceback)
        if job_rank() == 0:
            print(f"slackswap: error: {error}", file=sys.stderr, flush=True)

    sys.excepthook = hook
    return error


class SayOnce:
    """Log each kind of message only the first time (`what` names the kind)."""

    def __init__(self) -> None:
        self.said: set[str] = set()

    def __call__(self, what: str, level: int, message: str, *args, **kwargs) -> None:
        if what not in self.said:
            self.said.add(what)
            log.log(level, message, *args, **kwargs)


__all__ = ["EVERY_RANK", "SAME_ON_EVERY_RANK", "RankZeroFilter", "SayOnce", "job_rank", "log", "said_once_per_job",
           "setup_logging"]
