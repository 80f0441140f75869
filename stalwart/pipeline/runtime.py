"""The worker: interprets its instruction list, keeps replicas fresh, survives lost peers.

One process per node. Each worker owns one or more stages and holds replicas of its ring
successor's stages. Per step it runs its program (see :mod:`stalwart.pipeline.schedule`), sends
each owned stage's gradient to the replica holder, commits the step through the store, and
then both owner and shadow apply the optimizer — so the replica equals the owner bit for bit.

On a lost peer (a send/recv raises, or the agent reports a death) the worker reports it in the
store, drops its process group — closing its sockets wakes every rank blocked on it — and joins
the rendezvous of the next generation on a fresh ``PrefixStore``. The survivors agree on the
membership, compute the same new :class:`~stalwart.pipeline.placement.Placement`, and re-run
the interrupted step (communication comes before computation, so the step is re-runnable):
the shadow now also runs the victim's merged stream, reusing the eager-FRC outputs and saved
intermediates of that step for the victim's forward and backward (lazy BRC). When some stage
has no live copy left, the survivors load the last complete checkpoint instead.

Run as ``python -m stalwart.pipeline.runtime --job JOB.json --rank R --port PORT``; the
launcher (:mod:`stalwart.pipeline.launch`) does that.
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
from pathlib import Path

import torch
from torch import nn
from torch.distributed import PrefixStore, ProcessGroupGloo, TCPStore

from stalwart.pipeline.faults import Fault, FaultInjector
from stalwart.pipeline.job import PipelineJob, optimizer_spec
from stalwart.pipeline.placement import Placement, plan_recovery
from stalwart.pipeline.redundancy import EagerFRC
from stalwart.pipeline.schedule import SCHEDULES, Instruction, Op, add_eager_frc, merge_streams
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
        h.update(p.detach().contiguous().numpy().tobytes())
        state = optimizer.state.get(p, {}) if optimizer is not None else {}
        for key in sorted(state):
            value = state[key]
            data = value if torch.is_tensor(value) else torch.tensor(value)
            h.update(key.encode())
            h.update(data.detach().contiguous().numpy().tobytes())
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
        self.P, self.M = job.num_stages, job.num_microbatches
        self.last = self.P - 1
        self.workload = load_workload(job.workload, job.workload_kwargs)
        self.ckpt_dir = Path(job.checkpoint_dir) if job.checkpoint_dir else None
        self.base = SCHEDULES[job.schedule](self.P, self.M)
        self.gen = 0
        self.members = list(range(job.num_nodes))
        self.placement = Placement.initial(self.P, self.members)
        if job.redundancy == "none":
            self.placement = Placement(self.placement.owner, (None,) * self.P)
        self.modules: dict[int, nn.Module] = {}
        self.optimizers: dict[int, torch.optim.Optimizer | None] = {}
        self._build(self._held_stages(), checkpoint=None)
        self._meta: dict[tuple, dict[int, tuple[torch.Size, torch.dtype]]] = {}
        self._shape_model: list[nn.Module] | None = None
        self._batches: dict[int, tuple] = {}
        self.frc = EagerFRC(self.modules, self._frc_input)
        self._waiter = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="recv-wait")
        self._step = 0
        self._op_label = ""
        self.pg: ProcessGroupGloo | None = None
        self.pending: list = []
        self.clock: dict[str, list] = {}
        self._program: tuple[object, list[Instruction]] = (None, [])
        self._timer_start = (time.perf_counter(), time.thread_time())

    # ----------------------------------------------------------------- model state
    def _held_stages(self) -> list[int]:
        return self.placement.stages_of(self.rank) + self.placement.replicas_of(self.rank)

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
            module = self._stage_module(layers, s)
            opt = self._make_optimizer(module)
            if checkpoint is not None and self.ckpt_dir is not None:
                state = torch.load(
                    self.ckpt_dir / f"step-{checkpoint:06d}" / f"stage-{s}.pt", weights_only=True
                )
                module.load_state_dict(state["module"])
                if opt is not None:
                    opt.load_state_dict(state["optimizer"])
            self.modules[s], self.optimizers[s] = module, opt

    def _boundary_meta(self, step: int, mb: int) -> dict[int, tuple[torch.Size, torch.dtype]]:
        """Shape and dtype of every stage's output for micro-batch ``mb`` of ``step``, from one
        no-grad pass of a full model copy, cached per input shape (the last batch of an epoch
        may be smaller)."""
        x = self._microbatch(step, mb)[0]
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
            return self.workload.microbatch(step, mb, self.M, self.job.batch_size)
        if step not in self._batches:
            raw = self.store.get(self._key("batch", step))
            x, y = torch.load(io.BytesIO(raw), weights_only=True)[:2]
            self._batches = {step: (x.tensor_split(self.M), y.tensor_split(self.M))}
        xs, ys = self._batches[step]
        return xs[mb], ys[mb]

    # ----------------------------------------------------------------- program
    def program(self) -> list[Instruction]:
        """This rank's instruction list for the current placement (built once per generation:
        a merged stream costs a symbolic run of the whole schedule)."""
        key = (self.gen, self.placement)
        if self._program[0] != key:
            self._program = (key, self._build_program())
        return self._program[1]

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
        """Blocking receive; while it is outstanding, queued FRC runs layer by layer (the
        bubble). A gloo receive only reports completion through ``wait()``, so a helper
        thread waits (without the GIL) and this thread polls it between layers."""
        error = None
        try:
            work = self.pg.recv([t], self._grank(src), tg)
            if not self.frc.pending:
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

    def _connect(self) -> None:
        timeout = datetime.timedelta(seconds=self.job.failure_timeout)
        prefix = PrefixStore(f"gen{self.gen}", self.store)
        try:
            self.pg = ProcessGroupGloo(prefix, self._grank(self.rank), len(self.members), timeout)
        except RuntimeError as exc:
            raise PeerFailure(f"forming generation {self.gen}: {exc}") from None

    # ----------------------------------------------------------------- one step
    def _frc_input(self, stage: int, mb: int) -> torch.Tensor:
        if stage != 0:
            raise RuntimeError(f"FRC of stage {stage} has no input (its predecessor's is gone)")
        return self._microbatch(self._step, mb)[0]

    def run_step(self, step: int) -> float | None:
        """Execute this rank's program for ``step``; returns the step loss on the last stage."""
        owner = self.placement.owner
        ins_buf: dict[tuple[int, int], torch.Tensor] = {}
        outs: dict[tuple[int, int], torch.Tensor] = {}
        grads: dict[tuple[int, int], torch.Tensor] = {}
        labels: dict[int, torch.Tensor] = {}
        losses: dict[int, float] = {}
        self._step = step
        self.injector.check(step, None)
        self._timer_start = (time.perf_counter(), time.thread_time())
        for ins in self.program():
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
                t = torch.empty(shape, dtype=dtype)
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
                    out = self.workload.loss(out, labels.pop(k)) / self.M
                    losses[k] = out.item() * self.M
                outs[(s, k)] = out
            elif ins.op is Op.SEND_ACT:
                self._isend(outs[(s, k)].detach(), owner[s + 1], tag(ACT, s + 1, k))
            elif ins.op is Op.RECV_GRAD:
                shape, dtype = self._boundary_meta(step, k)[s]
                t = torch.empty(shape, dtype=dtype)
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
                # Posted, not run: it runs while this node waits (see EagerFRC).
                self.frc.post(s, k, outs.get((s - 1, k)))
            self._tick(ins.op.value)
        self._op_label = "ReplicaGrads"
        self._exchange_replica_grads()
        self._tick("ReplicaGrads")
        if self.job.frc_policy == "complete":
            self.frc.finish()  # what did not fit into this step's waits, before "done"
            self._tick(Op.FRC.value)
        self._wait_sends()
        self._tick("WaitSends")
        if losses:
            return sum(losses[k] for k in sorted(losses)) / len(losses)
        return None

    def _tick(self, name: str) -> None:
        """Charge the CPU and wall time since the last tick to ``name`` (the op breakdown that
        ``PipelineJob.profile`` publishes; the wall-minus-CPU part of a receive is waiting)."""
        wall0, cpu0 = self._timer_start
        now, cpu = time.perf_counter(), time.thread_time()
        entry = self.clock.setdefault(name, [0.0, 0.0, 0])
        entry[0] += cpu - cpu0
        entry[1] += now - wall0
        entry[2] += 1
        self._timer_start = (now, cpu)

    def _exchange_replica_grads(self) -> None:
        """Owners send their stage gradient to the replica holder, which applies the same
        optimizer step (cheaper than shipping weights and optimizer state; see the report)."""
        for s in self.placement.stages_of(self.rank):
            holder = self.placement.replica[s]
            if holder is not None and self.optimizers[s] is not None:
                flat = torch.cat([p.grad.reshape(-1) for p in self.modules[s].parameters()])
                self._isend(flat, holder, tag(REPLICA, s, 0))
        for s in self.placement.replicas_of(self.rank):
            params = list(self.modules[s].parameters())
            if not params:
                continue
            flat = torch.empty(sum(p.numel() for p in params))
            self._recv(flat, self.placement.owner[s], tag(REPLICA, s, 0))
            offset = 0
            for p in params:
                p.grad = flat[offset : offset + p.numel()].view_as(p).clone()
                offset += p.numel()

    # ----------------------------------------------------------------- store protocol
    def _key(self, *parts: object) -> str:
        return "/".join(str(p) for p in parts)

    def _commit(self, step: int) -> None:
        """All members finished the step, or the step is aborted (raise PeerFailure)."""
        self.store.set(self._key("done", self.gen, step, self.rank), "1")
        deadline = time.monotonic() + self.job.failure_timeout
        while True:
            if self.store.check([self._key("abort", self.gen)]):
                raise PeerFailure(f"generation {self.gen} aborted by a peer")
            # Read deaths before completions: a dead rank cannot finish later, so "dead and
            # not done" is final and every survivor reaches the same verdict.
            dead = [m for m in self.members if self.store.check([self._key("dead", m)])]
            done = [
                m for m in self.members if self.store.check([self._key("done", self.gen, step, m)])
            ]
            if len(done) == len(self.members):
                return
            if any(m not in done for m in dead):
                raise PeerFailure(f"rank(s) {dead} died before finishing step {step}")
            if time.monotonic() > deadline:
                raise PeerFailure(f"step {step} not finished by all within the failure timeout")
            if self.frc.pending:
                # Waiting for the slowest stage is bubble too. FRC still queued once every
                # stage is done is dropped: after the commit no failure can need it.
                self._tick("Commit")
                self.frc.advance()
                self._tick(Op.FRC.value)
            else:
                time.sleep(0.002)

    def _rendezvous(self, step: int, reason: str) -> int:
        """Form the next generation; returns the step to (re-)run."""
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
        recovery = plan_recovery(self.placement, joined)
        resume = step
        if recovery.kind == "fallback":
            ckpt = latest_checkpoint(self.ckpt_dir, self.P) if self.ckpt_dir else None
            if ckpt is None:
                recovery = type(recovery)("suspend", None, recovery.lost, "no checkpoint")
            else:
                resume = ckpt
        proposal = json.dumps(
            {"members": joined, "kind": recovery.kind, "resume": resume, "step": step,
             "lost": list(recovery.lost), "reason": recovery.reason}
        )  # fmt: skip
        decision = json.loads(self.store.compare_set(self._key("members", self.gen), "", proposal))
        if self.rank not in decision["members"] or decision["kind"] == "suspend":
            self.store.set(self._key("left", self.rank), decision["kind"])
            sys.exit(3 if decision["kind"] == "suspend" else 0)
        recovery = plan_recovery(self.placement, decision["members"])
        self.members = decision["members"]
        if decision["kind"] == "fallback":
            self.placement = recovery.placement
            if self.job.redundancy == "none":
                self.placement = Placement(self.placement.owner, (None,) * self.P)
            self._build(self._held_stages(), checkpoint=decision["resume"])
            self.frc = EagerFRC(self.modules, self._frc_input)
        else:
            keep = set(recovery.placement.stages_of(self.rank))
            keep |= set(recovery.placement.replicas_of(self.rank))
            self.placement = recovery.placement
            for s in list(self.modules):
                if s not in keep:
                    del self.modules[s], self.optimizers[s]
            # The victim's stages are ours now: finish their queued FRC (that forward is needed
            # for the re-run anyway) and keep the FRC cached for stages still held.
            self.frc.forget(keep)
            self.frc.finish(self.placement.stages_of(self.rank))
        for module in self.modules.values():
            module.zero_grad(set_to_none=True)
        if self.rank == min(self.members):
            event = dict(decision, gen=self.gen, seconds=round(time.monotonic() - started, 4))
            n = self.store.add("events", 1)
            self.store.set(self._key("event", n), json.dumps(event))
        return decision["resume"]

    # ----------------------------------------------------------------- main loop
    def _checkpoint(self, step: int) -> None:
        if self.ckpt_dir is None:
            return
        for s in self.placement.stages_of(self.rank):
            state = {
                "module": self.modules[s].state_dict(),
                "optimizer": opt.state_dict() if (opt := self.optimizers[s]) else {},
            }
            atomic_save(state, self.ckpt_dir / f"step-{step:06d}" / f"stage-{s}.pt")

    def _publish_digests(self, step: int) -> None:
        for s in self.placement.stages_of(self.rank):
            if self.placement.replica[s] is not None:
                digest = state_digest(self.modules[s], self.optimizers[s])
                self.store.set(self._key("digest", step, s, "owner"), digest)
        for s in self.placement.replicas_of(self.rank):
            digest = state_digest(self.modules[s], self.optimizers[s])
            self.store.set(self._key("digest", step, s, "replica"), digest)

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
        over or falling back whenever a peer is lost."""
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
                loss = self.run_step(step)
                self._commit(step)
                self._tick("Commit")
            except PeerFailure as exc:
                reason = str(exc)
            else:
                for s, opt in self.optimizers.items():
                    if opt is not None:
                        opt.step()
                    self.modules[s].zero_grad(set_to_none=True)
                self.frc.forget()
                self._tick("OptimizerStep")
                if self.job.profile:
                    self.clock["frc_tasks"] = [self.frc.completed, self.frc.posted, 0]
                    self.store.set(self._key("profile", step, self.rank), json.dumps(self.clock))
                if loss is not None:
                    self.store.set(self._key("time", step), repr(time.perf_counter() - started))
                    self.store.set(self._key("loss", step), repr(loss))
                if self.job.verify_replicas:
                    self._publish_digests(step)
                step += 1
                if self.job.checkpoint_every and step % self.job.checkpoint_every == 0:
                    self._checkpoint(step)
                continue
            # Drop every reference to the broken group: its destructor closes the sockets,
            # which wakes any peer still blocked on this rank ("Connection closed by peer").
            self.pending = []
            self.pg = None
            step = self._rendezvous(step, reason)
        if not driven and (self.job.checkpoint_every == 0 or step % self.job.checkpoint_every):
            self._checkpoint(step)  # the final weights, for whoever launched us
        self.store.set(self._key("finished", self.rank), "1")


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
    Worker(job, rank, store, faults).train()


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
