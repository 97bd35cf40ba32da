"""Keyed randomness: exact 64-bit arithmetic, independence from batch layout, stream separation, uniformity."""

from __future__ import annotations

import pytest
import scipy.stats
import torch

from deepinfer_sampling import RandomStream, random_bits, request_seed, uniforms
from deepinfer_sampling.seeds import mix64, seed_to_int64

MASK = (1 << 64) - 1


def python_mix64(z: int) -> int:
    """SplitMix64's finaliser on Python ints, from its published definition."""
    z &= MASK
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK
    return z ^ (z >> 31)


def test_mix64_matches_unsigned_64_bit_arithmetic():
    values = [0, 1, 2**63 - 1, 2**63, 2**64 - 1, 0x0123456789ABCDEF, 0xFEDCBA9876543210]
    gen = torch.Generator().manual_seed(0)
    values += [int(v) % 2**64 for v in torch.randint(-(2**63), 2**63 - 1, (200,), generator=gen, dtype=torch.int64)]
    tensor = torch.tensor([seed_to_int64(v) for v in values], dtype=torch.int64)
    got = [int(v) & MASK for v in mix64(tensor)]
    assert got == [python_mix64(v) for v in values]
    assert python_mix64(0x0123456789ABCDEF) != 0x0123456789ABCDEF


def test_seed_to_int64_round_trips_and_rejects_out_of_range():
    assert seed_to_int64(2**64 - 1) == -1 and seed_to_int64(5) == 5
    with pytest.raises(ValueError, match="seed"):
        seed_to_int64(2**64)


def test_request_seed_semantics():
    # A fixed seq_seed reproduces; a shared params object still gives each request its own stream.
    same = request_seed(42, index_in_call=3, engine_seed=0, request_counter=9)
    assert same == request_seed(42, index_in_call=3, engine_seed=123, request_counter=77)
    shared = {request_seed(42, index_in_call=i, engine_seed=0, request_counter=i) for i in range(100)}
    assert len(shared) == 100
    # Without seq_seed: engine seed + global counter; reproducible per engine seed, distinct per request.
    engine = [request_seed(None, index_in_call=0, engine_seed=7, request_counter=c) for c in range(100)]
    assert len(set(engine)) == 100
    assert engine[5] == request_seed(None, index_in_call=9, engine_seed=7, request_counter=5)
    assert engine[5] != request_seed(None, index_in_call=0, engine_seed=8, request_counter=5)
    # User seeds and engine seeds live in different domains.
    assert request_seed(7, index_in_call=5, engine_seed=7, request_counter=5) != engine[5]
    assert all(0 <= s < 2**64 for s in engine)
    with pytest.raises(ValueError, match="index_in_call"):
        request_seed(1, index_in_call=-1, engine_seed=0, request_counter=0)


def _keys(num: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    seeds = torch.randint(-(2**63), 2**63 - 1, (num,), generator=gen, dtype=torch.int64)
    positions = torch.randint(0, 1 << 20, (num,), generator=gen, dtype=torch.int64)
    return seeds, positions


def test_draws_do_not_depend_on_batch_layout_or_count():
    seeds, positions = _keys(64)
    full = random_bits(seeds, positions, RandomStream.SAMPLE, 8)
    perm = torch.randperm(64, generator=torch.Generator().manual_seed(1))
    assert torch.equal(random_bits(seeds[perm], positions[perm], RandomStream.SAMPLE, 8), full[perm])
    for i in (0, 17, 63):
        alone = random_bits(seeds[i : i + 1], positions[i : i + 1], RandomStream.SAMPLE, 3)
        assert torch.equal(alone, full[i : i + 1, :3])


def test_streams_positions_and_seeds_are_separated():
    seeds, positions = _keys(256)
    draws = {stream: random_bits(seeds, positions, stream, 1) for stream in RandomStream}
    for a in RandomStream:
        for b in RandomStream:
            if a < b:
                assert not torch.equal(draws[a], draws[b])
    per_row_stream = torch.tensor([int(RandomStream.ACCEPT)] * 256)
    assert torch.equal(random_bits(seeds, positions, per_row_stream, 1), draws[RandomStream.ACCEPT])
    next_position = random_bits(seeds, positions + 1, RandomStream.SAMPLE, 1)
    assert (next_position != draws[RandomStream.SAMPLE]).all()


def test_bits_and_uniforms_are_uniform():
    seeds, positions = _keys(4096, seed=3)
    bits = random_bits(seeds, positions, RandomStream.SAMPLE, 4)
    assert bits.min() >= 0
    u = uniforms(seeds, positions, RandomStream.ACCEPT, 4)
    assert u.dtype == torch.float32 and u.min() >= 0.0 and u.max() < 1.0
    assert scipy.stats.kstest(u.flatten().double().numpy(), "uniform").pvalue > 1e-3
    # Every bit of the 63-bit draws is fair.
    ones = torch.stack([((bits >> b) & 1).float().mean() for b in range(63)])
    assert (ones - 0.5).abs().max() < 0.02
    # Consecutive positions of one seed are uncorrelated.
    walk = uniforms(seeds[:1].expand(4096), torch.arange(4096), RandomStream.SAMPLE, 1)[:, 0].double()
    assert abs(float(torch.corrcoef(torch.stack([walk[:-1], walk[1:]]))[0, 1])) < 0.05


@pytest.mark.parametrize(
    ("seeds", "positions", "error"),
    [
        (torch.zeros(3, dtype=torch.int32), torch.zeros(3, dtype=torch.int64), TypeError),
        (torch.zeros(3, dtype=torch.int64), torch.zeros(4, dtype=torch.int64), ValueError),
    ],
)
def test_bad_key_tensors_raise(seeds, positions, error):
    with pytest.raises(error, match="seeds"):
        random_bits(seeds, positions, RandomStream.SAMPLE, 1)


def test_num_must_be_positive():
    seeds, positions = _keys(2)
    with pytest.raises(ValueError, match="num"):
        uniforms(seeds, positions, RandomStream.SAMPLE, 0)


@pytest.mark.gpu
def test_gpu_draws_equal_cpu_draws(cuda_device):
    seeds, positions = _keys(128)
    cpu = random_bits(seeds, positions, RandomStream.RECOVERED, 5)
    gpu = random_bits(seeds.to(cuda_device), positions.to(cuda_device), RandomStream.RECOVERED, 5)
    assert torch.equal(gpu.cpu(), cpu)
