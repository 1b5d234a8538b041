"""One executor for every pipeline schedule: it runs one rank's list of actions
(`schedules.py`) for one training step.

- `RECV_F` receives the chunk's input activations from the previous stage's rank
  (blocking), `SEND_F` sends the output to the next stage's (asynchronous, so no rank
  blocks on a peer that is busy computing). The send is waited when the gradient of that
  output comes back (`RECV_B`), by then complete, so the output is freed after its
  backward; a gradient's send (`SEND_B`) is waited at the first input received that the
  previous stage sent after receiving it (`gradient_send_waits`), else at the end of the step.
- `F` runs the chunk; on the last stage it returns the microbatch's loss, scaled by 1/m
  so the gradients of the step are those of the mean over the global batch; its backward
  starts from that loss times the fp16 loss scale (the chunk's wrapper's `scale_loss`:
  Micikevicius et al. 2018), so the gradients every earlier stage receives and sends are
  scaled once, and every stage's engine divides by the same scale (one scaler per rank,
  its overflow agreed over every rank of the model: playground/data_parallel.py).
- `RECV_B` receives the gradient of the chunk's output; `B` backpropagates through the
  chunk; `SEND_B` sends the gradient of its input back.
- Split backward (zero-bubble, Qi et al. 2023): every linear layer of the chunks runs in
  split mode (`weight_grad_store.py`). `I` is a plain backward through the chunk to its
  input in which the linear layers compute their input gradients only and leave (input,
  output gradient) for W; the graph is freed when I ends, and the few parameters outside
  linear layers (norms, embedding) get their gradients there. `W` computes the deferred
  weight gradients, one GEMM per layer, and accumulates them in one autograd call. So
  I + W do the work of B once, and W holds only the layers' inputs and output gradients.

With data parallelism each chunk has its data-parallel wrapper (DDP, or ZeRO-1: anything
with `no_sync()`), and every backward of the step runs under `no_sync` except the chunk's
last one (its last B, or W): the gradients are reduced across DP once per step, as soon
as that stage has finished them, and waited for after the schedule's last action
(`finish_grad_sync`, as Megatron-LM's pipeline schedules do), not before the stage's next
action. In split backward a wrapper can hold only parameters
outside linear layers (the experts'), whose gradients all come in the I passes: the
syncing W then ends their reduction too (`synced()`).

`hidden_shape(tokens)` gives the shape of the activations a stage receives for a
microbatch of `tokens` (with sequence parallelism, the rank's slice of the sequence).

Where the rank's activations are tracked, the inputs the linear layers keep for W in split
backward count as activations until W (weight_grad_store.py), and what the executor keeps
between actions counts too (`_Kept`): a stage's output until its backward, a received
gradient until its backward, a sent tensor until its send is waited.

`schedule(m)` (optional) gives the rank's actions for a step of m microbatches: a step
may then run another number of microbatches than `actions` holds (planning's first step
runs the fewest the schedule allows: it only makes the optimizer's states).

Each compute action is a `model.regions.pipeline_action`: where the simulator charges fixed
costs per action (seconds per F, B, I, W of a whole stage, a chunk 1/v of it: the bubble
measurement), they replace the counted compute on the simulated clock.
"""
from __future__ import annotations

import contextlib

import torch

from model.regions import activation_tracker, pipeline_action

from .weight_grad_store import WeightGradStore


class PipelineExecutor:
    def __init__(self, chunks: list, group, every: list, hidden_shape, virtual_stages: int = 1, syncs=None,
                 hidden_dtype=torch.float32, schedule=None):
        """`every`: every rank's actions (`schedules.build_schedule`), this rank's run; `schedule(m)`
        gives them for a step of m microbatches."""
        self.p, self.rank = group.size, group.rank
        actions = every[self.rank]
        self.chunks, self.group, self.actions, self.v = chunks, group, actions, virtual_stages
        self.schedule = schedule
        self.m = 1 + max(a.microbatch for a in actions)
        self.hidden_shape = hidden_shape
        self.syncs = syncs
        self.hidden_dtype = hidden_dtype
        self.weight_grads = None
        if any(a.kind == "I" for a in actions):
            self.weight_grads = WeightGradStore()
            for c in chunks:
                self.weight_grads.install(c)
        self.sync_at = _last_backward(actions)
        self.gradient_waits = gradient_send_waits(every, self.rank, self.p)

    def _plan(self, m: int):
        """The actions of a step of `m` microbatches, each chunk's syncing backward, and where
        each gradient's send is waited."""
        if m == self.m:
            return self.actions, self.sync_at, self.gradient_waits
        if self.schedule is None:
            raise ValueError(f"this pipeline's schedule runs {self.m} microbatches per step, not {m}")
        every = self.schedule(m)
        actions = every[self.rank]
        return actions, _last_backward(actions), gradient_send_waits(every, self.rank, self.p)

    def _sync(self, chunk: int, sync: bool):
        """Data parallelism reduces the gradients in this backward call only when `sync` (a
        wrapper's `synced()`, where it has one, also reduces what earlier backwards gave
        parameters this one does not reach: split backward's I passes)."""
        if self.syncs is None:
            return contextlib.nullcontext()
        if not sync:
            return self.syncs[chunk].no_sync()
        synced = getattr(self.syncs[chunk], "synced", None)
        return synced() if synced is not None else contextlib.nullcontext()

    def _stage(self, chunk: int) -> int:
        return chunk * self.p + self.rank

    def _compute(self, kind: str):
        return pipeline_action(kind, self.v)

    def run(self, inputs: list, targets: list) -> torch.Tensor:
        """Run the step on microbatches `inputs` (token ids; targets for the last stage);
        returns the sum of the microbatch losses / m on the last stage's rank, else 0."""
        m = len(inputs)
        actions, sync_at, gradient_waits = self._plan(m)
        last_stage = self.p * self.v - 1
        x_in, out, g_out, g_in = {}, {}, {}, {}
        w_pending = {}  # split backward: the weight gradients I deferred, per (microbatch, chunk)
        sent_f = {}  # (microbatch, chunk) -> its output's send, until that output's gradient comes back
        sent_b = {}  # (microbatch, chunk) -> its input gradient's send, until `gradient_waits` says it arrived
        keep = _Kept(activation_tracker())
        total = torch.zeros((), dtype=torch.float64, device=inputs[0].device)
        prev, nxt = (self.rank - 1) % self.p, (self.rank + 1) % self.p
        x = y = g = None
        for k, a in enumerate(actions):
            key = (a.microbatch, a.chunk)
            s = self._stage(a.chunk)
            if a.kind == "RECV_F":
                shape = self.hidden_shape(inputs[a.microbatch])
                x = torch.empty(shape, dtype=self.hidden_dtype, device=inputs[0].device)
                self.group.recv(x, src=prev, label="pp.activations")
                x_in[key] = x.requires_grad_()
                keep(("x_in", key), x, "activations")
                for sent in gradient_waits.get(k, ()):  # (see gradient_send_waits)
                    sent_b.pop(sent).wait()
                    keep.drop(("send_b", sent))
            elif a.kind == "F":
                x = inputs[a.microbatch] if s == 0 else x_in[key]
                with self._compute("F"):
                    y = self.chunks[a.chunk](x, targets[a.microbatch] if s == last_stage else None)
                if s == last_stage:
                    y = y / m
                    total += y.detach().double()
                    y = self.syncs[a.chunk].scale_loss(y) if self.syncs is not None else y
                out[key] = y
                keep(("out", key), y, "activations")
            elif a.kind == "SEND_F":
                # (a send takes a dense tensor: a sequence-parallel stage's output is a strided view)
                y = out[key].detach().contiguous()
                sent_f[key] = self.group.isend(y, dst=nxt, label="pp.activations")
                keep(("send", key), y, "comm_buffers")
            elif a.kind == "RECV_B":
                g = torch.empty_like(out[key], memory_format=torch.contiguous_format)
                self.group.recv(g, src=nxt, label="pp.gradients")
                g_out[key] = g
                keep(("g_out", key), g, "comm_buffers")
                # the next stage ran this output forward and backward: its send has completed,
                # so waiting costs nothing and lets the output go (Megatron-LM frees a sent
                # output likewise); else every output of the step would live until its end
                sent_f.pop(key).wait()
                keep.drop(("send", key))
            elif a.kind in ("B", "W"):
                sync = self.syncs is None or sync_at[a.chunk] == k
                with self._compute(a.kind):
                    if a.kind == "B":
                        with self._sync(a.chunk, sync):
                            torch.autograd.backward(out.pop(key), g_out.pop(key, None))
                    else:  # (a chunk of the embedding alone defers nothing: its W applies nothing)
                        with self._sync(a.chunk, sync):
                            WeightGradStore.apply(w_pending.pop(key))
                keep.drop(("out", key), ("g_out", key))
                if a.kind == "B" and s > 0:
                    g_in[key] = x_in[key].grad
                    keep(("g_in", key), g_in[key], "comm_buffers")
                if a.kind == "W" or s == 0:
                    x_in.pop(key, None)
                    keep.drop(("x_in", key))
            elif a.kind == "I":
                with self._compute("I"), self._sync(a.chunk, False), self.weight_grads.collect() as deferred:
                    torch.autograd.backward(out.pop(key), g_out.pop(key, None))
                w_pending[key] = deferred
                del deferred  # (W frees what it holds)
                keep.drop(("out", key), ("g_out", key))
                if s > 0:
                    g_in[key] = x_in[key].grad
                    keep(("g_in", key), g_in[key], "comm_buffers")
            elif a.kind == "SEND_B":
                g = g_in.pop(key).contiguous()
                sent_b[key] = self.group.isend(g, dst=prev, label="pp.gradients")
                keep(("send_b", key), g, "comm_buffers")
                keep.drop(("g_in", key))
                if key not in out:
                    x_in.pop(key, None)
                    keep.drop(("x_in", key))
            else:
                raise ValueError(f"unknown pipeline action {a}")
            x = y = g = None  # (a tensor an action is done with must not live on in this frame)
        if self.syncs is not None:  # the reductions each chunk's syncing backward started
            for syncs in self.syncs:
                syncs.finish_grad_sync()
        for w in sent_b.values():  # (those no later receive proved arrived)
            w.wait()
        keep.drop(*list(keep.handles))
        return total


class _Kept:
    """The memory tracker's handles (simulator/memory.py, `MemoryTracker.hold`) on the tensors
    the executor keeps between actions, outside autograd: a stage's output from F to its
    backward, a received output gradient until its backward, a sent tensor until its send
    is waited (NCCL's Work holds it until then). None of them is saved for backward, so
    without these the plan would not count them (simulator/live_bytes.py finds them)."""

    def __init__(self, tracker):
        self.tracker, self.handles = tracker, {}

    def __call__(self, name, t, category: str) -> None:
        if self.tracker is not None:
            self.handles[name] = self.tracker.hold(t, category)

    def drop(self, *names) -> None:
        for name in names:
            self.handles.pop(name, None)


def gradient_send_waits(every: list, rank: int, p: int) -> dict:
    """{index of a RECV_F action of `rank`: [(microbatch, chunk) of the SEND_B actions to wait
    there]}: a gradient sent back to the previous stage's rank is waited at the first input
    received from that rank that its sender sent after receiving the gradient. That input
    proves the gradient arrived: on a GPU the sender's send ran after its receive of the
    gradient had completed (its compute stream waited for it, the send waits for its compute
    stream), so the wait costs nothing; in the simulator its end is already past. A gradient
    no later input proves arrived is waited at the end of the step. Without this a stage
    would keep every gradient it sent until the step ends: m of them (Megatron-LM waits
    each send at once, its pipelines blocking on both sides).

    Stage s = c·p + r (rank r, chunk c) receives from and sends back to stage s − 1: rank
    r − 1's chunk c, or for r = 0 rank p − 1's chunk c − 1."""
    mine, theirs = every[rank], every[(rank - 1) % p]

    def theirs_chunk(c):
        return c if rank > 0 else c - 1

    recv_b = {(a.microbatch, a.chunk): i for i, a in enumerate(theirs) if a.kind == "RECV_B"}
    send_f = {(a.microbatch, a.chunk): i for i, a in enumerate(theirs) if a.kind == "SEND_F"}
    received = [(k, send_f[(a.microbatch, theirs_chunk(a.chunk))]) for k, a in enumerate(mine) if a.kind == "RECV_F"]
    waits: dict = {}
    for k, a in enumerate(mine):
        if a.kind != "SEND_B":
            continue
        arrived = recv_b[(a.microbatch, theirs_chunk(a.chunk))]
        at = next((j for j, sent in received if j > k and sent > arrived), None)
        if at is not None:
            waits.setdefault(at, []).append((a.microbatch, a.chunk))
    return waits


def _last_backward(actions: list) -> dict:
    """{chunk: the index of its last backward action}: gradients are synchronised there."""
    return {a.chunk: k for k, a in enumerate(actions) if a.kind in ("B", "W")}
