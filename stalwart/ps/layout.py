"""Names of the keys in the store: one place, so the PS, workers, replicas and runner agree.

``head``              JSON ``{"key": "epoch/version", "cursors": [...]}``: the committed state.
                      Moved only by compare-and-set, so a late write from a dead PS cannot win.
``state/E/V``         the weights committed as version V by the PS incarnation E (see wire.pack);
                      header: version, ``log`` (lineage ref), cursors.
``log/E/V``           audit record of the update that made E/V: gradient ids, lr, scale, parent.
``g/W/K``             worker W's K-th gradient; ``n/W`` how many W has pushed (only W writes it).
``trail/W``           a stateless worker's running sum of its gradients ``[from, to)`` while the
                      PS has not committed for a while (header: w, from, to).
``ready/W``, ``go``    worker W is loaded; all may start. ``done/W`` W has finished.
``halt``              workers stop producing (a timed run); ``stop`` the PS drains and exits.
``epoch``             counter: each PS incarnation takes the next number.
``event/E``           how incarnation E started (source, version, backlog, takeover time).
``checkpointed``      lineage ref of the newest checkpoint on disk (audit only).
``chain/...``         chain replication membership: addresses, the head, successors, and which
                      replicas hold a copy of the weights (``chain/held/I``).
``spare/S/...``       a pre-started process waiting to be assigned a role by a restart.
"""

from __future__ import annotations

HEAD = "head"
GO = "go"
HALT = "halt"
STOP = "stop"
EPOCH = "epoch"
CHECKPOINTED = "checkpointed"
CHAIN_COUNT = "chain/count"
CHAIN_HEAD = "chain/head"
#: The lineage ref of the initial weights (never a log record).
INIT = "init"
#: The state key of the initial weights, published by the runner and never collected.
INITIAL = "0/0"


def ref(epoch: int, version: int) -> str:
    """The ref ``E/V`` of version ``version`` committed by PS incarnation ``epoch``: the suffix
    of its ``state/`` and ``log/`` keys."""
    return f"{epoch}/{version}"


def parse_ref(ref: str) -> tuple[int, int]:
    """``"E/V"`` -> ``(epoch, version)``."""
    epoch, version = ref.split("/")
    return int(epoch), int(version)


def state(key: str) -> str:
    return f"state/{key}"


def log(ref: str) -> str:
    return f"log/{ref}"


def gradient(worker: int, step: int) -> str:
    return f"g/{worker}/{step}"


def trail(worker: int) -> str:
    return f"trail/{worker}"


def count(worker: int) -> str:
    return f"n/{worker}"


def done(worker: int) -> str:
    return f"done/{worker}"


def ready(worker: int) -> str:
    return f"ready/{worker}"


def event(epoch: int) -> str:
    return f"event/{epoch}"


def spare_ready(spare: str) -> str:
    return f"spare/{spare}/ready"


def spare_role(spare: str) -> str:
    return f"spare/{spare}/role"


def chain_address(index: int) -> str:
    return f"chain/addr/{index}"


def chain_successor(index: int) -> str:
    return f"chain/succ/{index}"


def chain_held(index: int) -> str:
    return f"chain/held/{index}"
