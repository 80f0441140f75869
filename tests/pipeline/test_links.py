"""PeerLinks' host-staged path (CUDA with fewer GPUs than ranks), exercised on CPU tensors.

On a GPU the same path is covered by tests/gpu; here the staging branch is forced so that its
bookkeeping (receive into a host buffer, then into the caller's tensor; send a host copy;
all-reduce a host copy, then copy back) runs in CI too.
"""

from __future__ import annotations

import datetime
from concurrent.futures import ThreadPoolExecutor

import torch
from torch.distributed import TCPStore

from stalwart.pipeline.links import ACT, PeerLinks, tag


def test_host_staged_links_deliver_into_the_callers_tensors():
    timeout = datetime.timedelta(seconds=30)
    master = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timeout)
    # One client per rank, as each worker process has: a client blocked in a rendezvous must
    # not hold up the other rank's requests.
    clients = [TCPStore("127.0.0.1", master.port, timeout=timeout) for _ in range(2)]
    links = [PeerLinks(client, torch.device("cpu"), timeout=30.0) for client in clients]
    for link in links:
        link.host_staged = True
    sent = torch.arange(12, dtype=torch.float32).reshape(3, 4).t()  # not contiguous
    received = torch.zeros(4, 3)
    summed = [torch.full((5,), 1.0), torch.full((5,), 2.0)]

    def rank(r: int) -> None:
        links[r].connect(0, [0, 1], r)
        if r == 0:
            links[0].isend(sent, 1, tag(ACT, 1, 0))
            links[0].wait_sends()
        else:
            links[1].recv(received, 0, tag(ACT, 1, 0))
        links[r].allreduce(summed[r], 0, [0, 1], r)

    with ThreadPoolExecutor(2) as pool:
        list(pool.map(rank, [0, 1]))
    assert torch.equal(received, sent)
    assert all(torch.equal(t, torch.full((5,), 3.0)) for t in summed)
    for link in links:
        link.drop()
