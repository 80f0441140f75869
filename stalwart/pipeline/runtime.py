"""The worker: interprets its instruction list, keeps replicas fresh, survives lost peers.

One process per node. Each worker owns one or more stages of its pipeline and holds replicas of
its ring successor's stages. Per step it runs its program (see :mod:`stalwart.pipeline.schedule`)
once per data shard of its pipeline, with eager FRC run on otherwise idle CPU (a SCHED_IDLE
thread, or layer by layer while it waits; see :mod:`stalwart.pipeline.redundancy`); sums each
owned stage's gradient over the D pipelines; sends it to the replica holder; commits the step
through the store; pauses the FRC; and then both owner and shadow apply the optimizer — so the
replica equals the owner bit for bit.

On a lost peer (a send/recv raises, or the agent reports a death) the worker reports it in the
store, drops its process groups — closing their sockets wakes every rank blocked on it — and
joins the rendezvous of the next generation on a fresh ``PrefixStore``. The survivors agree on a
new :class:`~stalwart.pipeline.placement.Layout` (:func:`~stalwart.pipeline.placement.plan_layout`)
and the pipeline that lost a node re-runs the interrupted step (communication comes before
computation, so the step is re-runnable): the shadow now also runs the victim's merged stream,
reusing the eager-FRC outputs and saved intermediates of that step for the victim's forward and
backward (lazy BRC). Whole pipelines keep the gradients they finished and only re-join the
all-reduce. A pipeline with a stage that has no live copy is dropped (its shards go to the
others); when no pipeline is whole, the survivors load the last complete checkpoint instead.

Run as ``python -m stalwart.pipeline.runtime --job JOB.json --rank R --port PORT``; the
launcher (:mod:`stalwart.pipeline.launch`) or a node agent (:mod:`stalwart.pipeline.node`)
does that.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import datetime
import hashlib
import io
import json
import os
import signal
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed import PrefixStore, ProcessGroupGloo, TCPStore

from stalwart.pipeline.faults import Fault, FaultInjector
from stalwart.pipeline.job import PipelineJob, optimizer_spec
from stalwart.pipeline.placement import Layout, LayoutRecovery, Placement, plan_layout
from stalwart.pipeline.redundancy import EagerFRC
from stalwart.pipeline.schedule import SCHEDULES, Instruction, Op, add_eager_frc, merge_streams
from stalwart.pipeline.threadclock import ThreadClock
from stalwart.pipeline.workloads import load_workload

ACT, GRAD, REPLICA = 0, 1, 2


class PeerFailure(Exception):
    """A peer stopped answering (its process died, or it abandoned the group)."""


def tag(kind: int, stage: int, mb: int) -> int:
    return (kind * 256 + stage) * 65536 + mb


def state_digest(module: nn.Module, optimizer: torch.optim.Optimizer | None) -> str:
    """SHA-256 over parameter bytes and every optimizer-state tensor (bit-for-bit identity)."""
    h = hashlib.sha256()
    for p in module.parameters():
        h.update(p.detach().cpu().contiguous().numpy().tobytes())
        state = optimizer.state.get(p, {}) if optimizer is not None else {}
        for key in sorted(state):
            value = state[key]
            data = value if torch.is_tensor(value) else torch.tensor(value)
            h.update(key.encode())
            h.update(data.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


def atomic_save(obj: object, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    torch.save(obj, tmp)
    os.replace(tmp, path)


def latest_checkpoint(directory: Path, num_stages: int) -> int | None:
    """The newest step for which every stage's file exists."""
    steps = []
    for d in directory.glob("step-*"):
        if all((d / f"stage-{s}.pt").exists() for s in range(num_stages)):
            steps.append(int(d.name.split("-")[1]))
    return max(steps) if steps else None


class Worker:
    """One pipeline node. See the module docstring."""

    def __init__(self, job: PipelineJob, rank: int, store: TCPStore, faults: list[Fault]):
        self.job, self.rank, self.store = job, rank, store
        self.injector = FaultInjector(rank, faults)
        self.P, self.M, self.D = job.num_stages, job.num_microbatches, job.num_pipelines
        self.last = self.P - 1
        self.workload = load_workload(job.workload, job.workload_kwargs)
        self.ckpt_dir = Path(job.checkpoint_dir) if job.checkpoint_dir else None
        self.base = SCHEDULES[job.schedule](self.P, self.M)
        self.gen = 0
        self.layout = Layout.initial(
            self.P, self.D, range(job.num_nodes), redundancy=job.redundancy != "none"
        )
        self.members = self.layout.members
        self._done_shards: set[int] = set()  # shards whose backward this rank finished this step
        self._local_grads: dict[int, torch.Tensor] = {}  # stage -> gradient before all-reduce
        self._groups: dict[tuple[int, int], Any] = {}
        self._interrupted = False  # a program was cut short by a failure
        self.device = torch.device("cpu")
        if job.device == "cuda":  # one GPU per worker process (UNTESTED here: no GPU)
            local = int(os.environ.get("LOCAL_RANK", rank))
            self.device = torch.device("cuda", local % torch.cuda.device_count())
            torch.cuda.set_device(self.device)
        self.modules: dict[int, nn.Module] = {}
        self.optimizers: dict[int, torch.optim.Optimizer | None] = {}
        self._build(self._held_stages(), checkpoint=None)
        self._meta: dict[tuple, dict[int, tuple[torch.Size, torch.dtype]]] = {}
        self._shape_model: list[nn.Module] | None = None
        self._batches: dict[int, tuple] = {}
        self.frc = self._new_frc()
        self._waiter = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="recv-wait")
        self._step = 0
        self._op_label = ""
        self.pg: Any = None
        self.pending: list = []
        self.clock: dict[str, list] = {}
        self._program: tuple[object, list[Instruction]] = (None, [])
        # A schedstat read per op costs a system call: only when the profile is published.
        self._runq = ThreadClock(enabled=self.job.profile)
        self._timer_start = (time.perf_counter(), time.thread_time(), self._runq.read()[1])

    # ----------------------------------------------------------------- model state
    @property
    def placement(self) -> Placement:
        """This rank's pipeline."""
        index = self.layout.pipeline_of(self.rank)
        if index is None:
            raise RuntimeError(f"rank {self.rank} is on standby: it has no pipeline")
        return self.layout.pipelines[index]

    @property
    def shards(self) -> tuple[int, ...]:
        """The data shards this rank's pipeline trains each step."""
        index = self.layout.pipeline_of(self.rank)
        return () if index is None else self.layout.shards[index]

    def _held_stages(self) -> list[int]:
        return self.placement.stages_of(self.rank) + self.placement.replicas_of(self.rank)

    def _new_frc(self) -> EagerFRC:
        executor = self.job.frc_executor
        if self.job.redundancy != "eager" or self.device.type != "cpu":
            # Nothing to run (no idle thread needed), or on a GPU: FRC is launched from the main
            # thread and overlaps through the device's streams.
            executor = "main_thread"
        return EagerFRC(self.modules, self._frc_input, executor)

    def _stage_module(self, layers: list[nn.Module], stage: int) -> nn.Sequential:
        start, end = self.job.bounds[stage]
        return nn.Sequential(*layers[start:end])

    def _make_optimizer(self, module: nn.Module) -> torch.optim.Optimizer | None:
        if not any(True for _ in module.parameters()):
            return None  # e.g. a stage of only activations: nothing to optimise
        cls, kwargs = optimizer_spec(self.job)
        return cls(module.parameters(), **kwargs)

    def _build(self, stages: list[int], checkpoint: int | None) -> None:
        """(Re)build the held stages from the seed, or from checkpoint step files."""
        torch.manual_seed(self.job.seed)
        layers = self.workload.layers()
        self.modules, self.optimizers = {}, {}
        for s in stages:
            module = self._stage_module(layers, s).to(self.device)
            opt = self._make_optimizer(module)
            if checkpoint is not None and self.ckpt_dir is not None:
                path = self.ckpt_dir / f"step-{checkpoint:06d}" / f"stage-{s}.pt"
                state = torch.load(path, weights_only=True, map_location=self.device)
                module.load_state_dict(state["module"])
                if opt is not None:
                    opt.load_state_dict(state["optimizer"])
            self.modules[s], self.optimizers[s] = module, opt

    def _boundary_meta(self, step: int, mb: int) -> dict[int, tuple[torch.Size, torch.dtype]]:
        """Shape and dtype of every stage's output for micro-batch ``mb`` of ``step``, from one
        no-grad pass of a full model copy, cached per input shape (the last batch of an epoch
        may be smaller)."""
        x = self._microbatch(step, mb)[0].cpu()
        key = (tuple(x.shape), x.dtype)
        if key not in self._meta:
            if self._shape_model is None:
                torch.manual_seed(self.job.seed)
                layers = self.workload.layers()
                self._shape_model = [self._stage_module(layers, s) for s in range(self.P)]
            meta = {}
            with torch.no_grad():
                for s, module in enumerate(self._shape_model):
                    x = module(x)
                    meta[s] = (x.shape, x.dtype)
            self._meta[key] = meta
        return self._meta[key]

    def _microbatch(self, step: int, mb: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Input and target of micro-batch ``mb`` of ``step``: from the workload, or split from
        the batch the driver put in the store for that step."""
        if not self.job.batches_from_store:
            x, y = self.workload.microbatch(step, mb, self.M * self.D, self.job.batch_size)
            return x.to(self.device), y.to(self.device)
        if step not in self._batches:
            raw = self.store.get(self._key("batch", step))
            x, y = torch.load(io.BytesIO(raw), weights_only=True)[:2]
            parts = self.M * self.D
            self._batches = {step: (x.tensor_split(parts), y.tensor_split(parts))}
        xs, ys = self._batches[step]
        return xs[mb].to(self.device), ys[mb].to(self.device)

    # ----------------------------------------------------------------- program
    def program(self, shards: Sequence[int]) -> list[Instruction]:
        """This rank's instruction list for the current placement, one pass per data shard
        (micro-batch ``k`` of shard ``j`` is global micro-batch ``j * M + k``). Built once per
        generation: a merged stream costs a symbolic run of the whole schedule."""
        key = (self.gen, self.placement)
        if self._program[0] != key:
            self._program = (key, self._build_program())
        one = self._program[1]
        return [Instruction(i.op, i.stage, j * self.M + i.mb) for j in shards for i in one]

    def _build_program(self) -> list[Instruction]:
        own = self.placement.stages_of(self.rank)
        prog = list(self.base[own[0]])
        for s in own[1:]:
            prog = merge_streams(prog, self.base[s], self.base)
        if self.job.redundancy == "eager":
            prog = add_eager_frc(prog, own[-1], self.placement.replicas_of(self.rank))
        return prog

    # ----------------------------------------------------------------- communication
    def _grank(self, rank: int) -> int:
        return self.members.index(rank)

    def _recv(self, t: torch.Tensor, src: int, tg: int) -> None:
        """Blocking receive. With the main-thread FRC executor, queued FRC runs layer by layer
        while it is outstanding (the bubble): a gloo receive only reports completion through
        ``wait()``, so a helper thread waits (without the GIL) and this thread polls it between
        layers."""
        error = None
        try:
            work = self.pg.recv([t], self._grank(src), tg)
            if self.frc.background or not self.frc.pending or self.device.type != "cpu":
                # (On a GPU, wait() only orders the compute stream after the receive; FRC
                # overlaps through the streams instead and runs at the end-of-step wait.)
                work.wait()
                return
            arrived = self._waiter.submit(work.wait)
            while self.frc.pending and not arrived.done():
                self._tick(self._op_label)
                self.frc.advance()
                self._tick(Op.FRC.value)
            error = arrived.exception()
        except RuntimeError as exc:
            error = exc
        if error is not None:
            # A message only: the exception's traceback would keep this frame, and with it
            # the group's sockets, alive — and closing them is what wakes blocked peers.
            message = str(error)
            del error
            raise PeerFailure(f"recv from rank {src}: {message}")

    def _isend(self, t: torch.Tensor, dst: int, tg: int) -> None:
        try:
            self.pending.append((self.pg.send([t.contiguous()], self._grank(dst), tg), dst))
        except RuntimeError as exc:
            raise PeerFailure(f"send to rank {dst}: {exc}") from None

    def _wait_sends(self) -> None:
        for work, dst in self.pending:
            try:
                work.wait()
            except RuntimeError as exc:
                raise PeerFailure(f"send to rank {dst}: {exc}") from None
        self.pending = []

    def _new_group(self, prefix: str, rank: int, size: int) -> Any:
        """A process group of this generation: gloo on CPU; NCCL on GPUs (UNTESTED here — no
        GPU on this machine. NCCL matches point-to-point messages per pair in posting order,
        not by tag, and a dead peer does not fail pending NCCL operations promptly: detection
        then rests on the agent's ``dead/<rank>`` report and ``failure_timeout``)."""
        timeout = datetime.timedelta(seconds=self.job.failure_timeout)
        store = PrefixStore(prefix, self.store)
        if self.device.type == "cuda":
            from torch.distributed import ProcessGroupNCCL

            options = ProcessGroupNCCL.Options()
            options._timeout = timeout
            return ProcessGroupNCCL(store, rank, size, options)
        return ProcessGroupGloo(store, rank, size, timeout)

    def _connect(self) -> None:
        try:
            self.pg = self._new_group(f"gen{self.gen}", self._grank(self.rank), len(self.members))
        except RuntimeError as exc:
            raise PeerFailure(f"forming generation {self.gen}: {exc}") from None

    # ----------------------------------------------------------------- one step
    def _frc_input(self, stage: int, mb: int) -> torch.Tensor:
        if stage != 0:
            raise RuntimeError(f"FRC of stage {stage} has no input (its predecessor's is gone)")
        return self._microbatch(self._step, mb)[0]

    def run_step(self, step: int) -> None:
        """Execute this rank's program for the shards of ``step`` it has not finished, reduce
        the gradients across pipelines and send them to the replica holders."""
        owner = self.placement.owner
        todo = [j for j in self.shards if j not in self._done_shards]
        if todo and self._local_grads:
            # More shards to accumulate (a dropped pipeline's): start from the local gradient,
            # not from one already summed across pipelines.
            self._restore_local_grads()
        if todo:
            self.store.add(self._key("programs", self.rank), 1)
        ins_buf: dict[tuple[int, int], torch.Tensor] = {}
        outs: dict[tuple[int, int], torch.Tensor] = {}
        grads: dict[tuple[int, int], torch.Tensor] = {}
        labels: dict[int, torch.Tensor] = {}
        losses: dict[int, float] = {}
        self._step = step
        self.injector.check(step, None)
        self._timer_start = (time.perf_counter(), time.thread_time(), self._runq.read()[1])
        self._interrupted = bool(todo)  # until the program completes
        self.frc.resume()  # paused since the last commit or failure
        for ins in self.program(todo):
            self.injector.check(step, ins)
            s, k = ins.stage, ins.mb
            self._op_label = ins.op.value
            if ins.op is Op.LOAD:
                x, y = self._microbatch(step, k)
                if s == 0:
                    ins_buf[(0, k)] = x
                if s == self.last:
                    labels[k] = y
            elif ins.op is Op.RECV_ACT:
                shape, dtype = self._boundary_meta(step, k)[s - 1]
                t = torch.empty(shape, dtype=dtype, device=self.device)
                self._recv(t, owner[s - 1], tag(ACT, s, k))
                ins_buf[(s, k)] = t.requires_grad_(t.is_floating_point())
            elif ins.op is Op.FORWARD:
                cached = self.frc.take(s, k)
                if cached is not None:
                    # Failover: the shadow already ran this forward eagerly (FRC) with the
                    # same weights; reuse its output and saved intermediates.
                    ins_buf[(s, k)], out = cached
                    self.store.add(self._key("frc_reused", self.rank), 1)
                else:
                    if s > 0 and (s - 1, k) in outs and owner[s - 1] == self.rank:
                        ins_buf[(s, k)] = outs[(s - 1, k)].detach().requires_grad_()
                    out = self.modules[s](ins_buf[(s, k)])
                if s == self.last:
                    # Scaled by the global number of micro-batches: summing the gradients of
                    # all pipelines then gives the gradient of the whole batch.
                    out = self.workload.loss(out, labels.pop(k)) / (self.M * self.D)
                    losses[k] = out.item() * self.M * self.D
                outs[(s, k)] = out
            elif ins.op is Op.SEND_ACT:
                self._isend(outs[(s, k)].detach(), owner[s + 1], tag(ACT, s + 1, k))
            elif ins.op is Op.RECV_GRAD:
                shape, dtype = self._boundary_meta(step, k)[s]
                t = torch.empty(shape, dtype=dtype, device=self.device)
                self._recv(t, owner[s + 1], tag(GRAD, s, k))
                grads[(s, k)] = t
            elif ins.op is Op.BACKWARD:
                out = outs.pop((s, k))
                if s == self.last:
                    out.backward()
                else:
                    g = grads.pop((s, k), None)
                    if g is None:  # the next stage is local: its input gradient is ours
                        g = ins_buf.pop((s + 1, k)).grad
                    torch.autograd.backward(out, g)
                if s == 0:
                    ins_buf.pop((0, k), None)
            elif ins.op is Op.SEND_GRAD:
                self._isend(ins_buf.pop((s, k)).grad, owner[s - 1], tag(GRAD, s - 1, k))
            elif ins.op is Op.FRC:
                # Posted, not run: it runs on idle CPU (see EagerFRC). Stage 0's input is
                # loaded here, in this thread: the idle thread must not touch the batch cache.
                source = self._microbatch(step, k)[0] if s == 0 else outs.get((s - 1, k))
                self.frc.post(s, k, source)
            self._tick(ins.op.value)
        self._done_shards |= set(todo)
        self._interrupted = False
        for j in todo if losses else ():
            mean = sum(losses[j * self.M + k] for k in range(self.M)) / self.M
            self.store.set(self._key("shard_loss", step, j), repr(mean))
        self._op_label = "AllReduce"
        self._reduce_grads(step)
        self._tick("AllReduce")
        self._op_label = "ReplicaGrads"
        self._exchange_replica_grads()
        self._tick("ReplicaGrads")
        if self.job.frc_policy == "complete":
            # What did not fit into idle time, run here at normal priority before "done" (the
            # idle thread, paused by finish(), could be starved by the other stages).
            self.frc.finish()
            self._tick(Op.FRC.value)
        self._wait_sends()
        self._tick("WaitSends")

    def _tick(self, name: str) -> None:
        """Charge the CPU, wall and run-queue time since the last tick to ``name`` (the op
        breakdown that ``PipelineJob.profile`` publishes). Wall minus CPU minus run-queue time
        is time this thread was blocked: waiting for a message in a receive, waiting for the GIL
        in a compute op."""
        wall0, cpu0, runq0 = self._timer_start
        now, cpu, runq = time.perf_counter(), time.thread_time(), self._runq.read()[1]
        entry = self.clock.setdefault(name, [0.0, 0.0, 0, 0.0])
        entry[0] += cpu - cpu0
        entry[1] += now - wall0
        entry[2] += 1
        entry[3] += runq - runq0
        self._timer_start = (now, cpu, runq)

    def _optimizer_step(self, stages: Sequence[int]) -> None:
        for s in stages:
            if (opt := self.optimizers[s]) is not None:
                opt.step()
            self.modules[s].zero_grad(set_to_none=True)

    def _flat_grad(self, stage: int) -> torch.Tensor:
        params = list(self.modules[stage].parameters())
        return torch.cat([
            (p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in params
        ])  # fmt: skip

    def _set_grad(self, stage: int, flat: torch.Tensor) -> None:
        offset = 0
        for p in self.modules[stage].parameters():
            p.grad = flat[offset : offset + p.numel()].view_as(p).clone()
            offset += p.numel()

    def _restore_local_grads(self) -> None:
        for stage, flat in self._local_grads.items():
            self._set_grad(stage, flat)
        self._local_grads = {}

    def _reduce_grads(self, step: int) -> None:
        """Sum each owned stage's gradient over the pipelines (one gloo group per stage).

        Before reducing, each participant announces itself in the store and waits for the
        others (thesis §3.5): if another pipeline is failing over, the abort of this generation
        shows up there, this rank joins the rendezvous keeping its finished gradients, and
        reduces in the next generation once the failed pipeline has re-run its step.
        """
        if len(self.layout.pipelines) < 2:
            return
        for s in sorted(self.placement.stages_of(self.rank)):
            if not any(True for _ in self.modules[s].parameters()):
                continue
            peers = sorted(p.owner[s] for p in self.layout.pipelines)
            self._await_peers(self._key("ready", self.gen, step, s), peers)
            local = self._local_grads.setdefault(s, self._flat_grad(s))
            summed = local.clone()  # a failed all-reduce leaves p.grad and the local copy intact
            try:
                self._group(s, peers).allreduce([summed]).wait()
            except RuntimeError as exc:
                raise PeerFailure(f"all-reduce of stage {s}: {exc}") from None
            self._set_grad(s, summed)

    def _await_peers(self, prefix: str, peers: Sequence[int]) -> None:
        self.store.set(f"{prefix}/{self.rank}", "1")
        while not self.store.check([f"{prefix}/{m}" for m in peers]):
            if self.store.check([self._key("abort", self.gen)]):
                raise PeerFailure(f"generation {self.gen} aborted: another pipeline fails over")
            dead = [m for m in self.members if self.store.check([self._key("dead", m)])]
            if dead:
                raise PeerFailure(f"rank(s) {dead} died before the all-reduce")
            if self.frc.pending and not self.frc.background:
                self.frc.advance()
            else:
                time.sleep(0.002)

    def _group(self, stage: int, peers: Sequence[int]) -> Any:
        key = (self.gen, stage)
        if key not in self._groups:
            self._groups = {k: g for k, g in self._groups.items() if k[0] == self.gen}
            try:
                self._groups[key] = self._new_group(
                    f"gen{self.gen}/reduce{stage}", peers.index(self.rank), len(peers)
                )
            except RuntimeError as exc:
                raise PeerFailure(f"forming the all-reduce group of stage {stage}: {exc}") from None
        return self._groups[key]

    def _exchange_replica_grads(self) -> None:
        """Owners send their stage gradient to the replica holder, which applies the same
        optimizer step (cheaper than shipping weights and optimizer state; see the report)."""
        for s in self.placement.stages_of(self.rank):
            holder = self.placement.replica[s]
            if holder is not None and self.optimizers[s] is not None:
                self._isend(self._flat_grad(s), holder, tag(REPLICA, s, 0))
        for s in self.placement.replicas_of(self.rank):
            params = list(self.modules[s].parameters())
            if not params:
                continue
            flat = torch.empty(sum(p.numel() for p in params), device=self.device)
            self._recv(flat, self.placement.owner[s], tag(REPLICA, s, 0))
            self._set_grad(s, flat)

    # ----------------------------------------------------------------- store protocol
    def _key(self, *parts: object) -> str:
        return "/".join(str(p) for p in parts)

    def _commit(self, step: int) -> None:
        """All members finished the step, or the step is aborted (raise PeerFailure)."""
        self.store.set(self._key("done", self.gen, step, self.rank), "1")
        deadline = time.monotonic() + self.job.failure_timeout
        while True:
            # Read deaths before completions: a dead rank cannot finish later, so "dead and
            # not done" is final and every survivor reaches the same verdict.
            dead = [m for m in self.members if self.store.check([self._key("dead", m)])]
            done = [
                m for m in self.members if self.store.check([self._key("done", self.gen, step, m)])
            ]
            if len(done) == len(self.members):
                # Committed, whatever happens next: an abort seen now comes from the next step
                # (a faster rank already in it), and failing this step here would leave this
                # rank one optimizer step behind the others.
                return
            if self.store.check([self._key("abort", self.gen)]):
                raise PeerFailure(f"generation {self.gen} aborted by a peer")
            if any(m not in done for m in dead):
                raise PeerFailure(f"rank(s) {dead} died before finishing step {step}")
            if time.monotonic() > deadline:
                raise PeerFailure(f"step {step} not finished by all within the failure timeout")
            if self.frc.pending and not self.frc.background:
                # Waiting for the slowest stage is bubble too. FRC still queued once every
                # stage is done is dropped: after the commit no failure can need it.
                self._tick("Commit")
                self.frc.advance()
                self._tick(Op.FRC.value)
            else:
                time.sleep(0.002)

    def _rendezvous(self, step: int, reason: str) -> int | None:
        """Form the next generation; returns the step to (re-)run, or None on standby."""
        started = time.monotonic()
        old = list(self.members)
        self.store.set(self._key("abort", self.gen), str(self.rank))
        self.store.set(self._key("report", self.gen, self.rank), reason[:300])
        self.gen += 1
        self.store.set(self._key("join", self.gen, self.rank), "1")
        deadline = time.monotonic() + self.job.failure_timeout
        while True:
            joined = [m for m in old if self.store.check([self._key("join", self.gen, m)])]
            dead = [m for m in old if self.store.check([self._key("dead", m)])]
            if set(joined) | set(dead) >= set(old) or time.monotonic() > deadline:
                break
            time.sleep(0.005)
        standby = [r for r in self.layout.standby if not self.store.check([self._key("dead", r)])]
        recovery = plan_layout(
            self.layout, joined + standby, self.D, redundancy=self.job.redundancy != "none"
        )
        resume = step
        kind = recovery.kind
        if kind == "fallback":
            ckpt = latest_checkpoint(self.ckpt_dir, self.P) if self.ckpt_dir else None
            if ckpt is None:
                kind, recovery = "suspend", LayoutRecovery("suspend", None, recovery.lost)
            else:
                resume = ckpt
        proposal = json.dumps(
            {"kind": kind, "resume": resume, "step": step, "lost": list(recovery.lost),
             "reason": recovery.reason, "layout": _encode(recovery.layout)}
        )  # fmt: skip
        decision = json.loads(self.store.compare_set(self._key("members", self.gen), "", proposal))
        if decision["kind"] == "suspend":
            self.store.set(self._key("left", self.rank), "suspend")
            sys.exit(3)
        layout = _decode(decision["layout"])
        if self.rank == min(layout.members):
            event = {k: v for k, v in decision.items() if k != "layout"}
            event.update(
                members=layout.members, standby=list(layout.standby),
                pipelines=len(layout.pipelines), gen=self.gen,
                seconds=round(time.monotonic() - started, 4),
            )  # fmt: skip
            n = self.store.add("events", 1)
            self.store.set(self._key("event", n), json.dumps(event))
        if self.rank not in layout.members:
            self.layout, self.members = layout, layout.members
            if self.rank in layout.standby:
                return None
            self.store.set(self._key("left", self.rank), decision["kind"])
            sys.exit(0)
        before = self.placement if self.layout.pipeline_of(self.rank) is not None else None
        self.layout, self.members = layout, layout.members
        if decision["kind"] == "fallback":
            self._build(self._held_stages(), checkpoint=decision["resume"])
            self.frc.close()
            self.frc = self._new_frc()
            changed = True
        else:
            keep = set(self.placement.stages_of(self.rank))
            keep |= set(self.placement.replicas_of(self.rank))
            for s in list(self.modules):
                if s not in keep:
                    del self.modules[s], self.optimizers[s]
            # The victim's stages are ours now: finish their queued FRC (that forward is needed
            # for the re-run anyway) and keep the FRC cached for stages still held.
            self.frc.forget(keep)
            self.frc.finish(self.placement.stages_of(self.rank))
            # A program cut short left a partial gradient sum: that is redone as well.
            changed = before != self.placement or self._interrupted
        if changed:  # this pipeline lost a node: it re-runs the step from the start
            for module in self.modules.values():
                module.zero_grad(set_to_none=True)
            self._done_shards, self._local_grads = set(), {}
        self._interrupted = False
        # else: the pipeline is whole; it keeps the gradients of the shards it finished and
        # only (re-)joins the all-reduce (and trains any shards a dropped pipeline left it).
        return decision["resume"]

    def _standby(self) -> None:
        """No pipeline for this node: wait, alive, until the run ends. (Bringing a standby node
        into a pipeline — copying a stage's layers to it — is not implemented.)"""
        self.store.set(self._key("standby", self.rank), str(self.gen))
        while not self.store.check([self._key("stop")]):
            ended = [
                self.store.check([self._key("finished", m)])
                or self.store.check([self._key("dead", m)])
                or self.store.check([self._key("standby", m)])
                for m in self.members
            ]
            if all(ended):
                return
            time.sleep(0.01)

    # ----------------------------------------------------------------- main loop
    def _checkpoint(self, step: int) -> None:
        if self.ckpt_dir is None or self.layout.pipeline_of(self.rank) != 0:
            return  # pipelines hold identical weights: the first one writes them
        for s in self.placement.stages_of(self.rank):
            state = {
                "module": self.modules[s].state_dict(),
                "optimizer": opt.state_dict() if (opt := self.optimizers[s]) else {},
            }
            atomic_save(state, self.ckpt_dir / f"step-{step:06d}" / f"stage-{s}.pt")

    def _publish_digests(self, step: int) -> None:
        index = self.layout.pipeline_of(self.rank)
        suffix = f"@{index}" if index else ""  # pipeline 0's roles keep their plain names
        for s in self.placement.stages_of(self.rank):
            if self.placement.replica[s] is not None or len(self.layout.pipelines) > 1:
                digest = state_digest(self.modules[s], self.optimizers[s])
                self.store.set(self._key("digest", step, s, "owner" + suffix), digest)
        for s in self.placement.replicas_of(self.rank):
            digest = state_digest(self.modules[s], self.optimizers[s])
            self.store.set(self._key("digest", step, s, "replica" + suffix), digest)

    def _await_step(self, step: int) -> bool:
        """Driven mode: wait (idle) until the driver puts ``step``'s batch in the store
        (True) or says stop (False). Meanwhile serve weight requests and notice ranks the agent
        reported dead, so a node lost between steps is failed over before the next one."""
        served = False
        while True:
            if self.store.check([self._key("stop")]):
                return False
            dead = [m for m in self.members if self.store.check([self._key("dead", m)])]
            if dead:
                raise PeerFailure(f"rank(s) {dead} left between steps")
            if not served and self.store.check([self._key("sync", step)]):
                self._checkpoint(step)  # the driver loads the stage files (validation, saving)
                served = True
            if self.store.check([self._key("batch", step)]):
                return True
            time.sleep(0.002)

    def train(self) -> None:
        """Run steps until ``job.steps`` (or, driven, until the driver says stop), failing
        over, reconfiguring or falling back whenever a peer is lost."""
        if self.layout.pipeline_of(self.rank) is None:
            self._standby()
            self.store.set(self._key("finished", self.rank), "1")
            return
        self._checkpoint(0)
        step = 0
        driven = self.job.batches_from_store
        while driven or step < self.job.steps:
            try:
                if driven and not self._await_step(step):
                    break
                if self.pg is None:
                    self._connect()
                started = time.perf_counter()
                self.clock = {}
                self.frc.completed = self.frc.posted = 0
                self.frc.thread_clock = [0.0, 0.0, 0, 0.0]
                self.run_step(step)
                self._commit(step)
                self._tick("Commit")
            except PeerFailure as exc:
                reason = str(exc)
                self.frc.pause()  # recovery works on the FRC queue and cache itself
            else:
                frc_done = self.frc.completed
                # Owned stages first: meanwhile the idle thread may finish its FRC layer in
                # flight. The replicas' weights must not change under it: pause it, then step.
                replicas = self.placement.replicas_of(self.rank)
                self._optimizer_step([s for s in self.modules if s not in replicas])
                self._tick("OptimizerStep")
                self.frc.pause()
                self._tick("FRCPause")
                self._optimizer_step(replicas)
                self._done_shards, self._local_grads = set(), {}
                self.frc.forget()
                self._tick("OptimizerStep")
                if self.job.profile:
                    if self.frc.thread_clock[2]:  # the idle thread's FRC: not in our ticks
                        entry = self.clock.setdefault(Op.FRC.value, [0.0, 0.0, 0, 0.0])
                        for i, value in enumerate(self.frc.thread_clock):
                            entry[i] += value
                    self.clock["frc_tasks"] = [frc_done, self.frc.posted, 0]
                    self.store.set(self._key("profile", step, self.rank), json.dumps(self.clock))
                if self.rank == self.layout.pipelines[0].owner[self.P - 1]:
                    keys = [self._key("shard_loss", step, j) for j in range(self.D)]
                    loss = sum(float(self.store.get(k)) for k in keys) / self.D
                    self.store.set(self._key("time", step), repr(time.perf_counter() - started))
                    self.store.set(self._key("loss", step), repr(loss))
                if self.job.verify_replicas:
                    self._publish_digests(step)
                step += 1
                if self.job.checkpoint_every and step % self.job.checkpoint_every == 0:
                    self._checkpoint(step)
                continue
            # Drop every reference to the broken groups: their destructors close the sockets,
            # which wakes any peer still blocked on this rank ("Connection closed by peer").
            self.pending = []
            self.pg = None
            self._groups = {}
            resume = self._rendezvous(step, reason)
            if resume is None:  # on standby now
                self._standby()
                break
            step = resume
        if not driven and (self.job.checkpoint_every == 0 or step % self.job.checkpoint_every):
            self._checkpoint(step)  # the final weights, for whoever launched us
        self.store.set(self._key("finished", self.rank), "1")


def _encode(layout: Layout | None) -> dict | None:
    if layout is None:
        return None
    return {
        "pipelines": [[list(p.owner), list(p.replica)] for p in layout.pipelines],
        "shards": [list(s) for s in layout.shards],
        "standby": list(layout.standby),
    }


def _decode(data: dict) -> Layout:
    pipelines = tuple(Placement(tuple(o), tuple(r)) for o, r in data["pipelines"])
    shards = tuple(tuple(s) for s in data["shards"])
    return Layout(pipelines, shards, tuple(data["standby"]))


def run_worker(
    job_json: str, rank: int, port: int, faults_json: str = "[]", host: str = "127.0.0.1"
) -> None:
    """Entry point of one worker process (forked or started with ``python -m``)."""
    torch.set_num_threads(1)

    job = PipelineJob.from_json(job_json)
    faults = [Fault(**f) for f in json.loads(faults_json)]
    timeout = datetime.timedelta(seconds=max(30.0, job.failure_timeout))
    store = PrefixStore("run", TCPStore(host, port, is_master=False, timeout=timeout))

    def leave(signum: int, frame: object) -> None:
        # A preemption notice: this node leaves; the others carry on without it.
        store.set(f"dead/{rank}", "preempted (SIGTERM)")
        os._exit(128 + signum)

    signal.signal(signal.SIGTERM, leave)
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    worker = Worker(job, rank, store, faults)
    try:
        worker.train()
    finally:
        worker.frc.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="one redundant-pipeline worker")
    parser.add_argument("--job", required=True, help="job JSON file")
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--faults", default="[]", help="JSON list of Fault dicts")
    args = parser.parse_args(argv)
    run_worker(Path(args.job).read_text(), args.rank, args.port, args.faults, args.host)
    return 0


if __name__ == "__main__":
    sys.exit(main())
