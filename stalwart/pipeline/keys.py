"""Every key of the pipeline's rendezvous store, in one place.

The workers, the one-machine agent, the torchrun node agent and the Lightning driver talk only
through a c10d store, under the :data:`RUN_PREFIX` prefix. A key written by one of them and
polled by another must be spelled the same on both sides, so each is built here and nowhere
else.

Example:
    >>> dead(2), done(1, 5, 3), digest(4, 0, "replica@1")
    ('dead/2', 'done/1/5/3', 'digest/4/0/replica@1')
"""

from __future__ import annotations

#: the prefix of every key below (a ``PrefixStore`` over the hosted ``TCPStore``)
RUN_PREFIX = "run"
#: the driver tells the workers to finish (driven mode)
STOP = "stop"
#: counter of the recoveries recorded so far (``event(n)`` holds the n-th, from 1)
EVENTS = "events"
#: the two roles whose state digests are compared (``"owner@i"`` for pipeline ``i > 0``)
ROLES = ("owner", "replica")


def _join(*parts: object) -> str:
    return "/".join(str(p) for p in parts)


# -- liveness and membership ---------------------------------------------------------------
def dead(rank: int) -> str:
    """Set (with the reason) when ``rank`` is lost: by its agent, or by itself on SIGTERM."""
    return _join("dead", rank)


def finished(rank: int) -> str:
    """Set when ``rank`` ended the run normally."""
    return _join("finished", rank)


def left(rank: int) -> str:
    """Set when the survivors' decision sends ``rank`` away (its value: the decision kind)."""
    return _join("left", rank)


def standby(rank: int) -> str:
    """Set when ``rank`` waits on standby (its value: the generation)."""
    return _join("standby", rank)


def abort(gen: int) -> str:
    """Set by the first rank of generation ``gen`` that saw a failure."""
    return _join("abort", gen)


def report(gen: int, rank: int) -> str:
    """Why ``rank`` left generation ``gen``."""
    return _join("report", gen, rank)


def join(gen: int, rank: int) -> str:
    """Set when ``rank`` joins the rendezvous of generation ``gen``."""
    return _join("join", gen, rank)


def members(gen: int) -> str:
    """The recovery decision of generation ``gen`` (first proposal wins, compare-and-set)."""
    return _join("members", gen)


def event(n: int) -> str:
    """The ``n``-th recovery (JSON), counted from 1 by :data:`EVENTS`."""
    return _join("event", n)


def group(gen: int, stage: int | None = None) -> str:
    """Prefix of generation ``gen``'s process group, or of its all-reduce group of ``stage``."""
    return f"gen{gen}" if stage is None else f"gen{gen}/reduce{stage}"


# -- one step -------------------------------------------------------------------------------
def batch(step: int) -> str:
    """Driven mode: the batch of ``step`` (``torch.save`` of ``(inputs, targets)``)."""
    return _join("batch", step)


def sync(step: int) -> str:
    """Driven mode: the driver asks for the stage files of ``step``."""
    return _join("sync", step)


def ready(gen: int, step: int, stage: int, rank: int | None = None) -> str:
    """Announces ``rank`` at the all-reduce of ``stage`` (``rank=None``: the common prefix)."""
    prefix = _join("ready", gen, step, stage)
    return prefix if rank is None else _join(prefix, rank)


def done(gen: int, step: int, rank: int) -> str:
    """Set when ``rank`` finished ``step`` in generation ``gen``."""
    return _join("done", gen, step, rank)


# -- results --------------------------------------------------------------------------------
def loss(step: int) -> str:
    """The training loss of ``step`` (the mean over its data shards)."""
    return _join("loss", step)


def shard_loss(step: int, shard: int) -> str:
    """The loss of one data shard of ``step`` (set by that pipeline's last stage)."""
    return _join("shard_loss", step, shard)


def step_time(step: int) -> str:
    """Wall seconds of ``step`` on the last stage of the first pipeline."""
    return _join("time", step)


def digest(step: int, stage: int, role: str) -> str:
    """SHA-256 of the state of ``stage`` held in ``role`` after ``step`` (see :data:`ROLES`)."""
    return _join("digest", step, stage, role)


def role(kind: str, pipeline: int | None) -> str:
    """``kind`` (one of :data:`ROLES`) as held in ``pipeline``: pipeline 0 keeps the plain name."""
    return kind + (f"@{pipeline}" if pipeline else "")


def profile(step: int, rank: int) -> str:
    """The op time breakdown of ``rank`` in ``step`` (JSON)."""
    return _join("profile", step, rank)


def programs(rank: int) -> str:
    """Counter: how many times ``rank`` ran a step's program (a re-run counts)."""
    return _join("programs", rank)


def frc_reused(rank: int) -> str:
    """Counter: forwards ``rank`` took from its eager-FRC cache after a failover."""
    return _join("frc_reused", rank)
