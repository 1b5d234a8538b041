"""Data sources: the Markov chain's loss floor, determinism, text and token files."""
import numpy as np
import pytest
import torch

from playground.data import DataError, MarkovSource, TextSource, TokenFileSource, make_source


def test_markov_floor_is_the_chain_own_cross_entropy():
    src = MarkovSource(64, seed=1)
    batch = src.global_batch(0, 4000, 64).numpy()
    p = src.transition_prob(batch[:, :-1], batch[:, 1:])
    assert (p > 0).all()  # every sampled transition is one the chain allows
    nll = -np.log(p).mean()
    assert abs(nll - src.loss_floor) < 0.02  # the empirical rate of 256k transitions
    assert 0.5 < src.loss_floor < np.log(64)
    dense = np.zeros((64, 64))
    np.put_along_axis(dense, src.next_states, src.probs, axis=1)
    assert np.allclose(src.stationary @ dense, src.stationary, atol=1e-12)
    # the histogram of tokens in long sequences approaches the stationary distribution
    hist = np.bincount(batch.ravel(), minlength=64) / batch.size
    assert np.abs(hist - src.stationary).max() < 0.01


def test_markov_scales_to_large_vocabularies():
    src = MarkovSource(50304, seed=0)
    assert src.next_states.shape == (50304, 32)
    b = src.global_batch(0, 2, 64)
    assert b.shape == (2, 65) and int(b.max()) < 50304
    assert 0 < src.loss_floor < np.log(32)


def test_global_batch_depends_only_on_seed_and_step():
    a, b = MarkovSource(32, seed=2), MarkovSource(32, seed=2)
    assert torch.equal(a.global_batch(7, 6, 16), b.global_batch(7, 6, 16))
    assert not torch.equal(a.global_batch(7, 6, 16), a.global_batch(8, 6, 16))
    assert a.global_batch(0, 6, 16).shape == (6, 17)


def test_text_and_token_files(tmp_path):
    text = tmp_path / "t.txt"
    text.write_bytes(bytes(range(256)) * 4)
    src = make_source(str(text), 256, 0)
    assert isinstance(src, TextSource) and src.loss_floor is None
    b = src.global_batch(3, 5, 10)
    assert b.shape == (5, 11) and ((b[:, 1:] - b[:, :-1]) % 256 == 1).all()  # consecutive bytes
    ids = np.arange(1000, dtype=np.uint16) % 97
    ids.tofile(tmp_path / "t.bin")
    np.save(tmp_path / "t.npy", ids.astype(np.int64))
    for name in ("t.bin", "t.npy"):
        s = make_source(str(tmp_path / name), 128, 0)
        assert isinstance(s, TokenFileSource) and s.vocab_size == 128
        assert s.global_batch(0, 2, 8).max() < 97
    with pytest.raises(DataError, match="outside the model's vocab_size=50"):
        make_source(str(tmp_path / "t.npy"), 50, 0)
    with pytest.raises(DataError, match="the model's vocab_size=64 is smaller"):
        make_source(str(text), 64, 0)
    with pytest.raises(DataError, match="no such file"):
        make_source(str(tmp_path / "missing.txt"), 256, 0)
