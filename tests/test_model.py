"""The reference GPT: parameter count and FLOPs formulas against counted values,
deterministic layout-independent initialisation, presets."""
import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from model import GPT, PRESETS, init_full_parameter, preset


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_parameter_count_formula(name):
    cfg = preset(name)
    model = GPT(cfg, device="meta")  # the GPU presets too, without memory
    assert sum(p.numel() for p in model.parameters()) == cfg.n_params()


@pytest.mark.parametrize("cfg", [preset("tiny"), preset("tiny", d_ff=40, n_layers=3, seq_len=24),
                                 preset("small", n_layers=1, seq_len=48)])
def test_flops_formula_matches_counted(cfg):
    model = GPT(cfg, seed=3)
    tokens = torch.randint(0, cfg.vocab_size, (2, cfg.seq_len + 1))
    # the math kernel decomposes attention into matmuls the counter sees
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        model(tokens[:, :-1], tokens[:, 1:]).backward()
    assert counter.get_total_flops() == cfg.flops_per_token(training=True) * 2 * cfg.seq_len
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter, torch.no_grad():
        model(tokens[:, :-1])
    assert counter.get_total_flops() == cfg.flops_per_token(training=False) * 2 * cfg.seq_len


def test_initialisation_depends_only_on_seed_and_name():
    cfg = preset("tiny")
    a, b = GPT(cfg, seed=5, dtype=torch.float64), GPT(cfg, seed=5, dtype=torch.float64)
    for (n, p), (_, q) in zip(a.named_parameters(), b.named_parameters()):
        assert torch.equal(p, q), n
        assert torch.equal(p, init_full_parameter(n, p.shape, cfg, 5)), n
    c = GPT(cfg, seed=6, dtype=torch.float64)
    assert not torch.equal(a.blocks["0"].attn.wq.weight, c.blocks["0"].attn.wq.weight)
    # a deeper model shares the parameters of the layers both have
    deeper = GPT(cfg.with_(n_layers=3), seed=5, dtype=torch.float64)
    assert torch.equal(deeper.blocks["1"].mlp.w_up.weight, a.blocks["1"].mlp.w_up.weight)
    # float32 is the float64 value rounded
    f32 = GPT(cfg, seed=5)
    assert torch.equal(f32.lm_head.weight, a.lm_head.weight.float())
    assert torch.equal(a.norm.weight, torch.ones_like(a.norm.weight))
    wo = a.blocks["0"].attn.wo.weight
    assert 0.5 < wo.std().item() / (cfg.init_std / (2 * cfg.n_layers) ** 0.5) < 1.5


def test_initialisation_on_threads_gives_the_serial_values():
    """init_weights fills parameters on torch's intra-op thread count, in runs bounded by a
    byte budget: the same values as one thread, whatever the order; an error in a thread
    reaches the caller."""
    from model.init import _batches, init_weights
    cfg = preset("small")
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        serial = GPT(cfg, seed=3, dtype=torch.float64)
        torch.set_num_threads(2)
        threaded = GPT(cfg, seed=3, dtype=torch.float64, device="meta")
        threaded.to_empty(device="cpu")
        init_weights(threaded, cfg, 3, budget=300_000)  # several runs of parameters
        assert len(_batches(list(threaded.named_parameters()), 300_000)) > 3
        for (n, p), (_, q) in zip(serial.named_parameters(), threaded.named_parameters()):
            assert torch.equal(p, q), n
        with pytest.raises(KeyError, match="tok_emb.weight"):
            init_weights(threaded, cfg, 3, state_dict={"norm.weight": torch.ones(cfg.d_model)})
    finally:
        torch.set_num_threads(before)


def test_causal_and_shapes():
    cfg = preset("tiny")
    model = GPT(cfg, seed=0, dtype=torch.float64)
    x = torch.randint(0, cfg.vocab_size, (3, cfg.seq_len))
    logits = model(x)
    assert logits.shape == (3, cfg.seq_len, cfg.vocab_size)
    y = x.clone()
    y[:, -1] = (y[:, -1] + 1) % cfg.vocab_size  # changing the last token changes no earlier logit
    assert torch.allclose(model(y)[:, :-1], logits[:, :-1])
    loss = model(x[:, :-1], x[:, 1:])
    assert abs(loss.item() - torch.log(torch.tensor(float(cfg.vocab_size))).item()) < 0.5


def test_config_rejects_bad_shapes():
    with pytest.raises(ValueError, match="d_model=30 is not divisible by n_heads=4"):
        preset("tiny", d_model=30)
    with pytest.raises(ValueError, match="unknown model preset 'huge'"):
        preset("huge")


@pytest.mark.parametrize("kv_heads", [0, 2])
def test_unfused_attention_computes_what_the_flash_kernel_does(kv_heads):
    """attention="unfused" (Megatron-LM's scores, fused scale-mask-softmax, probabilities
    kept) gives the loss and every gradient of the default flash kernel, in float64."""
    x = torch.randint(0, 64, (2, 33))
    got = []
    for kernel in ("flash", "unfused"):
        model = GPT(preset("tiny", n_kv_heads=kv_heads, attention=kernel), seed=1, dtype=torch.float64)
        loss = model(x[:, :-1], x[:, 1:])
        loss.backward()
        got.append((loss.detach(), [p.grad for p in model.parameters()]))
    (la, ga), (lb, gb) = got
    assert torch.allclose(la, lb, rtol=1e-12, atol=0)
    assert all(torch.allclose(a, b, rtol=1e-9, atol=1e-13) for a, b in zip(ga, gb))
    with pytest.raises(ValueError, match="attention='paged'"):
        preset("tiny", attention="paged")


def test_flashattention_1_computes_what_the_flash_kernel_does():
    """attention="flash1" is priced as FlashAttention-1 (tests/test_plan.py) and computes
    exactly the flash path: the same loss and gradients, bitwise; context parallelism, which
    runs its own flash kernel, refuses it by name."""
    from playground import Layout, LayoutError
    x = torch.randint(0, 64, (2, 33))
    got = []
    for kernel in ("flash", "flash1"):
        model = GPT(preset("tiny", attention=kernel), seed=1, dtype=torch.float64)
        loss = model(x[:, :-1], x[:, 1:])
        loss.backward()
        got.append((loss.detach(), [p.grad for p in model.parameters()]))
    (la, ga), (lb, gb) = got
    assert torch.equal(la, lb) and all(torch.equal(a, b) for a, b in zip(ga, gb))
    with pytest.raises(LayoutError, match="cp=2 needs attention='flash'.*attention='flash1'"):
        Layout(cp=2).validate(preset("tiny", attention="flash1"))
