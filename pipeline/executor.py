"""One executor for every pipeline schedule: it runs one rank's list of actions
(`schedules.py`) for one training step.

- `RECV_F` receives the chunk's input activations from the previous stage's rank
  (blocking), `SEND_F` sends the output to the next stage's (asynchronous: the send is
  waited at the end of the step, so no rank blocks on a peer that is busy computing).
- `F` runs the chunk; on the last stage it returns the microbatch's loss, scaled by 1/m
  so the gradients of the step are those of the mean over the global batch.
- `RECV_B` receives the gradient of the chunk's output; `B` backpropagates through the
  chunk; `SEND_B` sends the gradient of its input back.
- Split backward (zero-bubble): `I` computes only the input's gradient (autograd.grad,
  keeping the graph), `W` then the weights' gradients (backward with `inputs` = the
  chunk's parameters, which releases the graph). W walks the graph again, so on a real
  device it costs more than the paper's W; the schedule's order is what is exercised.

With data parallelism each chunk is wrapped in DDP, and every backward of the step runs
under `no_sync` except the chunk's last one (its last B, or W): the gradients are
all-reduced across DP once per step, as soon as that stage has finished them.

`unit_costs` (seconds per F, B, I, W of a whole stage; a chunk costs 1/v of it) replaces
the counted compute with fixed costs on the simulated clock, to measure a schedule's
bubble with equal stage costs.
"""
from __future__ import annotations

import contextlib

import torch


class PipelineExecutor:
    def __init__(self, chunks: list, group, actions: list, virtual_stages: int = 1, ddps=None, unit_costs=None,
                 hidden_shape=None, hidden_dtype=torch.float32):
        self.chunks, self.group, self.actions, self.v = chunks, group, actions, virtual_stages
        self.p, self.rank = group.size, group.rank
        self.ddps = ddps
        self.unit_costs = unit_costs
        self.hidden_dtype = hidden_dtype
        self.params = [[p for p in c.parameters() if p.requires_grad] for c in chunks]
        # the index of each chunk's last backward action: gradients are synchronised there
        self.sync_at = {}
        for k, a in enumerate(actions):
            if a.kind in ("B", "W"):
                self.sync_at[a.chunk] = k

    def _stage(self, chunk: int) -> int:
        return chunk * self.p + self.rank

    @contextlib.contextmanager
    def _compute(self, kind: str):
        model = getattr(self.group, "compute_model", None) if self.unit_costs else None
        if model is None:
            yield
            return
        with model.paused():
            yield
        self.group.clock.advance(self.unit_costs[kind] / self.v)

    def run(self, inputs: list, targets: list) -> torch.Tensor:
        """Run the step on microbatches `inputs` (token ids; targets for the last stage);
        returns the sum of the microbatch losses / m on the last stage's rank, else 0."""
        m = len(inputs)
        last_stage = self.p * self.v - 1
        x_in, out, g_out, g_in = {}, {}, {}, {}
        sends = []
        total = torch.zeros((), dtype=torch.float64, device=inputs[0].device)
        prev, nxt = (self.rank - 1) % self.p, (self.rank + 1) % self.p
        for k, a in enumerate(self.actions):
            key = (a.microbatch, a.chunk)
            s = self._stage(a.chunk)
            if a.kind == "RECV_F":
                shape = (*inputs[a.microbatch].shape, self.chunks[0].config.d_model)
                buf = torch.empty(shape, dtype=self.hidden_dtype, device=inputs[0].device)
                self.group.recv(buf, src=prev, label="pp.activations")
                x_in[key] = buf.requires_grad_()
            elif a.kind == "F":
                x = inputs[a.microbatch] if s == 0 else x_in[key]
                with self._compute("F"):
                    y = self.chunks[a.chunk](x, targets[a.microbatch] if s == last_stage else None)
                if s == last_stage:
                    y = y / m
                    total += y.detach().double()
                out[key] = y
            elif a.kind == "SEND_F":
                sends.append(self.group.isend(out[key].detach(), dst=nxt, label="pp.activations"))
            elif a.kind == "RECV_B":
                g = torch.empty_like(out[key])
                self.group.recv(g, src=nxt, label="pp.gradients")
                g_out[key] = g
            elif a.kind in ("B", "W"):
                sync = self.ddps is None or self.sync_at[a.chunk] == k
                with contextlib.nullcontext() if sync else self.ddps[a.chunk].no_sync(), self._compute(a.kind):
                    inputs_arg = {"inputs": self.params[a.chunk]} if a.kind == "W" else {}
                    torch.autograd.backward(out.pop(key), g_out.pop(key, None), **inputs_arg)
                if a.kind == "B" and s > 0:
                    g_in[key] = x_in[key].grad
                if a.kind == "W" or s == 0:
                    x_in.pop(key, None)
            elif a.kind == "I":
                if s > 0:
                    with self._compute("I"):
                        (g_in[key],) = torch.autograd.grad(out[key], x_in[key], g_out.get(key), retain_graph=True)
                elif self.unit_costs:
                    with self._compute("I"):
                        pass  # the first stage has no input gradient; its I still takes its slot
            elif a.kind == "SEND_B":
                sends.append(self.group.isend(g_in.pop(key), dst=prev, label="pp.gradients"))
                if key not in out:
                    x_in.pop(key, None)
            else:
                raise ValueError(f"unknown pipeline action {a}")
        for w in sends:
            w.wait()
        return total
