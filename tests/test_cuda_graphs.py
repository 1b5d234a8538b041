"""A compiled region's CUDA graphs (model/cuda_graphs.py), their bookkeeping checked on the
CPU through the emulated capture, which replays by running the captured Python again into
the first run's buffers, as a CUDA replay rewrites the captured memory: the same losses,
gradients and kept outputs as the region called as it is, over steps of accumulated
microbatches; the real capture is checked on a GPU (benchmarks/moe_graphs_gpu.py)."""
import pytest
import torch
from torch import nn

from model.cuda_graphs import CudaGraphs, Emulated, GraphedRegion


def toy(x, w1, w2, bias, scale):
    """A region: (out, aux, counts) as a MoE layer's returns its output, a loss and counts."""
    h = torch.relu(x @ w1.t())
    out = h @ w2.t() + bias
    return out, scale * out.pow(2).mean(), (h > 0).sum(0), 0  # (the last: a constant, as a dropless count)


class Layer(nn.Module):
    def __init__(self, d, f, seed):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.w1 = nn.Parameter(torch.randn(f, d, generator=g, dtype=torch.float64) / d ** 0.5)
        self.w2 = nn.Parameter(torch.randn(d, f, generator=g, dtype=torch.float64) / f ** 0.5)
        self.bias = torch.randn(d, generator=g, dtype=torch.float64)  # a buffer: no gradient
        self.site = None
        self.kept = []

    def forward(self, x):
        args = (x, self.w1, self.w2, self.bias, 0.5)
        out, aux, counts, none = self.site(toy, *args) if self.site is not None else toy(*args)
        assert none == 0
        self.kept.append((aux.detach(), counts))  # held to the step's end, as MoE's record is
        return out, aux


def train(graphed: bool, steps=4, microbatches=2, site=GraphedRegion, shapes=None, graphs=CudaGraphs):
    torch.manual_seed(0)
    layers = [Layer(6, 10, s) for s in (1, 2, 3)]
    if graphed:
        graphs = graphs(graph=Emulated, compile=lambda f: f)
        for layer in layers:
            layer.site = site(graphs, keep=(1, 2))
    params = [p for layer in layers for p in layer.parameters()]
    losses, grads, kept = [], [], []
    for step in range(steps):
        inputs = []
        for m in range(microbatches):
            rows = shapes[step] if shapes else 5
            x = torch.randn(rows, 6, dtype=torch.float64, requires_grad=True)
            inputs.append(x)  # (its gradient, read at the step's end, is the first layer's alone)
            h, total = x, 0
            for layer in layers:
                out, aux = layer(h)
                h, total = (out if layer is layers[0] else h + out), total + aux
            loss = h.pow(2).mean() + total
            loss.backward()
            losses.append(loss.item())
        grads.append([p.grad.clone() for p in params] + [x.grad for x in inputs])
        kept.append([(a.item(), c.tolist()) for layer in layers for a, c in layer.kept])
        with torch.no_grad():
            for p in params:
                p.sub_(0.1 * p.grad)  # (in place: the graphs read the weights where they lie)
                p.grad = None
            for layer in layers:
                layer.bias.mul_(0.9)
                layer.kept.clear()
    return losses, grads, kept, layers


def same(got, ref) -> bool:
    """The same losses, every weight's gradient at each step and what the layers kept of each
    microbatch, bitwise."""
    return got[0] == ref[0] and got[2] == ref[2] and all(
        torch.equal(x, y) for a, b in zip(got[1], ref[1]) for x, y in zip(a, b))


def test_graphed_sites_give_what_the_region_gives_over_steps_of_accumulated_microbatches():
    ref = train(False)
    got = train(True)
    assert same(got, ref)
    assert all(layer.site.forward is not None and layer.site.backward is not None and not layer.site.off
               for layer in got[3])


class NoReclaim(CudaGraphs):
    """Sabotage: a weight's gradient autograd took as a backward's buffer itself is not
    copied out before the next replay, which then rewrites the first microbatch's gradient."""

    def reclaim(self):
        self.lent.clear()


class NoKeep(GraphedRegion):
    """Sabotage: the outputs the caller keeps are handed out as the graph's buffers."""

    def __init__(self, graphs, keep=()):
        super().__init__(graphs, ())


class ActivationGradLent(GraphedRegion):
    """Sabotage: an activation's gradient is handed out as the backward's buffer, which the
    next forward replay rewrites (the step's input keeps it as its .grad)."""

    def run_backward(self, grads):
        got = super().run_backward(grads)
        out = dict(zip(self.wanted, self.grad_inputs))
        return [out[i].detach() if g is not None and not isinstance(self.base[i], nn.Parameter) else g
                for i, g in zip(self.tensor_index, got)]


@pytest.mark.parametrize("sabotage", [{"graphs": NoReclaim}, {"site": NoKeep}, {"site": ActivationGradLent}],
                         ids=["no-reclaim", "no-keep", "activation-grad-lent"])
def test_a_sabotaged_site_differs(sabotage):
    ref = train(False)
    got = train(True, **sabotage)
    assert not same(got, ref)


def test_one_microbatch_a_step_and_a_changed_shape_falls_back_to_the_region():
    ref = train(False, microbatches=1, shapes=[5, 5, 7, 5])
    got = train(True, microbatches=1, shapes=[5, 5, 7, 5])
    assert same(got, ref)
    assert all(layer.site.off for layer in got[3])  # (the shape changed after the capture)


def test_no_grad_calls_run_the_region_as_it_is():
    graphs = CudaGraphs(graph=Emulated, compile=lambda f: f)
    layer = Layer(6, 10, 1)
    layer.site = graphs.site(keep=(1, 2))
    with torch.no_grad():
        for _ in range(3):
            layer(torch.randn(5, 6, dtype=torch.float64))
    assert layer.site.forward is None and layer.site.calls == 0


MOE = dict(n_experts=4, top_k=2)


@pytest.mark.parametrize("kwargs,layout,message", [
    ({"backend": "gloo"}, {}, "use it with --backend torch, not gloo"),
    ({"moe": False}, {}, "the model has no experts"),
    ({"dtype": "float32"}, {}, "give --dtype bfloat16, not float32"),
    ({"compile": True}, {}, "with --compile the region is traced"),
    ({}, {"ac": "full"}, "--ac full runs a block's forward again"),
    ({}, {"pp": 2, "microbatches": 2}, "a pipeline (pp 2) interleaves"),
    ({}, {"dp": 2, "zero": 3}, "ZeRO-3 gathers them anew"),
    ({}, {"dp": 2, "ep": 2}, "under ep 2 the layer does"),
    ({}, {"tp": 2}, "under tp 2 the layer does"),
])
def test_runs_cuda_graphs_cannot_hold_for_are_refused_in_one_line(kwargs, layout, message):
    from model import preset
    from playground.layout import Layout
    from playground.run_config import RunConfig
    moe = kwargs.pop("moe", True)
    model = preset("tiny", **(MOE if moe else {}))
    args = {"backend": "torch", "dtype": "bfloat16", **kwargs}
    with pytest.raises(ValueError) as e:
        RunConfig(model=model, layout=Layout(**layout), cuda_graphs=True, **args)
    assert message in str(e.value) and "\n" not in str(e.value)
    RunConfig(model=model if moe else preset("tiny", **MOE), layout=Layout(), cuda_graphs=True,
              backend="torch", dtype="bfloat16")  # (the same run without what is refused: accepted)


def test_cuda_graphs_on_the_simulator_exit_2_with_a_message(cli):
    status, _, err = cli("train", "--model", "tiny-moe", "--cuda-graphs", "--dtype", "bfloat16")
    assert status == 2 and err.count("\n") == 1 and "use it with --backend torch, not sim" in err, err
