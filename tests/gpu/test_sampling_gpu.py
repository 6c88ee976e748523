"""The fused Triton sampler (kernels/sampling_triton.py) on random logits (CUDA; skipped
without it): the law of its draws, greedy rows, grammar bitmasks, and the split of each row over
column chunks. The `check_*` functions take a device, so tests/unit/test_kernels_interpret.py
reuses them on the CPU under Triton's interpreter."""

from __future__ import annotations

import importlib.util

import pytest
import torch

HAS_CUDA = torch.cuda.is_available() and importlib.util.find_spec("triton") is not None
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA and triton")]


def check_sample(device, dtype, vocab, rows, temperature=0.8, seed=0):
    """The fused sampler (Gumbel-max): greedy rows give the argmax; rows drawn at a temperature
    follow softmax(x / T) (every row holds the same logits, so the rows are the draws; each
    token's frequency within 5 standard errors); a token at -inf is never drawn; the draw
    is the same for the same seed and changes with it. `dtype`: the logits' (float32, or a 16-bit
    LM head's output, which the kernel reads as it is)."""
    from pagedllm.kernels.sampling_triton import sample_triton

    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(vocab, generator=gen) * 1.5
    x[vocab // 3] = float("-inf")
    x = x.to(dtype).float()  # the values the kernel sees
    logits = x.to(dtype).repeat(rows, 1).to(device)
    greedy = torch.zeros(rows, dtype=torch.bool)
    greedy[: max(1, rows // 50)] = True
    temp = torch.full((rows,), temperature)
    args = (temp.to(device), greedy.to(device))
    seed_t = torch.tensor([1234], dtype=torch.int64, device=device)
    out = sample_triton(logits, *args, seed_t).cpu()
    assert out.dtype == torch.int64 and out.shape == (rows,)
    assert (out[greedy] == int(x.argmax())).all(), "greedy rows must take the argmax"
    drawn = out[~greedy]
    assert (drawn != vocab // 3).all(), "a token at -inf was drawn"
    assert ((drawn >= 0) & (drawn < vocab)).all()
    p = torch.softmax(x / temperature, dim=0).double()
    counts = torch.bincount(drawn, minlength=vocab).double()
    # tokens expected at least 25 times are checked one by one, the rest pooled into one bucket
    # (a rare token's count is Poisson-like, so a normal bound on it alone would be wrong)
    n = drawn.numel()
    common = p * n >= 25
    groups = [(f"token {i}", p[i], counts[i]) for i in common.nonzero().flatten().tolist()]
    groups.append(("rare tokens", p[~common].sum(), counts[~common].sum()))
    for what, pk, ck in groups:
        se = (pk * (1 - pk) / n).sqrt()
        assert abs(ck / n - pk) <= 5 * se + 1e-4, f"{what}: drawn {float(ck / n):.5f}, softmax {float(pk):.5f}"
    assert torch.equal(sample_triton(logits, *args, seed_t).cpu(), out), "same seed, other draw"
    other = sample_triton(logits, *args, torch.tensor([99], dtype=torch.int64, device=device)).cpu()
    assert not torch.equal(other[~greedy], drawn), "the seed does not change the draw"


def check_sample_bitmask(device, dtype, vocab, rows, seed=0):
    """The fused sampler with a grammar bitmask: a constrained row (greedy or drawn) only ever
    gives a token its bitmask row allows, and the greedy one the argmax among those; rows mapped
    to -1 are untouched (the argmax / any token); two rows may share a bitmask row."""
    from pagedllm.kernels.sampling_triton import sample_triton
    from pagedllm.structured_output.matcher import bitmask_width, unpack_bitmask

    gen = torch.Generator().manual_seed(seed)
    logits = (torch.randn(rows, vocab, generator=gen) * 2).to(dtype)
    g = 3
    bitmask = torch.randint(-2**31, 2**31 - 1, (g, bitmask_width(vocab)), generator=gen, dtype=torch.int64).to(torch.int32)
    bitmask[0] = 0
    bitmask[0, 1] = 1 << 5  # exactly one token: 37 (vocab > 37)
    row_map = torch.tensor([(r % (g + 1)) - 1 for r in range(rows)], dtype=torch.int32)  # -1, 0, 1, 2, -1, ...
    greedy = torch.arange(rows) % 2 == 0
    temp = torch.full((rows,), 1.5)
    seed_t = torch.tensor([77], dtype=torch.int64, device=device)
    out = sample_triton(logits.to(device), temp.to(device), greedy.to(device), seed_t, bitmask.to(device),
                        row_map.to(device)).cpu()
    allowed = unpack_bitmask(bitmask, vocab)
    for r in range(rows):
        t, m = int(out[r]), int(row_map[r])
        if m >= 0:
            assert allowed[m, t], f"row {r}: token {t} is not allowed by bitmask row {m}"
            if greedy[r]:
                assert t == int(logits[r].float().masked_fill(~allowed[m], float("-inf")).argmax()), f"row {r}"
        elif greedy[r]:
            assert t == int(logits[r].argmax()), f"row {r}: an unconstrained greedy row moved"
    assert (out[row_map == 0] == 37).all()


def check_sample_chunks(device, dtype, vocab, rows, block, seed=0):
    """The sampler split over column chunks (one program each, a second kernel picking each row's
    best) draws exactly what one program per row draws, for every chunk count: greedy rows
    (with ties, which must go to the first index), drawn rows, and rows under a bitmask."""
    from pagedllm.kernels.sampling_triton import sample_triton
    from pagedllm.structured_output.matcher import bitmask_width

    gen = torch.Generator().manual_seed(seed)
    logits = (torch.randn(rows, vocab, generator=gen) * 2).to(dtype)
    logits[0, :] = 1.0  # all tied: the first index
    logits[1, vocab - 1] = logits[1, 3] = 50.0  # tied maxima in the first and the last chunk
    greedy = torch.arange(rows) % 3 == 0
    greedy[:2] = True
    temp = torch.full((rows,), 0.7)
    bitmask = torch.randint(-2**31, 2**31 - 1, (2, bitmask_width(vocab)), generator=gen, dtype=torch.int64).to(torch.int32)
    row_map = torch.tensor([(r % 3) - 1 for r in range(rows)], dtype=torch.int32)
    seed_t = torch.tensor([4321], dtype=torch.int64, device=device)
    args = (logits.to(device), temp.to(device), greedy.to(device), seed_t)
    masked = (bitmask.to(device), row_map.to(device))
    one = sample_triton(*args, chunks=1, block=block).cpu()
    one_masked = sample_triton(*args, *masked, chunks=1, block=block).cpu()
    assert int(one[0]) == 0 and int(one[1]) == 3
    blocks = -(-vocab // block)
    for chunks in sorted({2, 3, blocks, blocks + 5}):
        assert torch.equal(sample_triton(*args, chunks=chunks, block=block).cpu(), one), f"{chunks} chunks"
        assert torch.equal(sample_triton(*args, *masked, chunks=chunks, block=block).cpu(), one_masked), \
            f"{chunks} chunks, bitmask"
    assert torch.equal(sample_triton(*args).cpu(), sample_triton(*args, chunks=1).cpu()), "the default split"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("vocab,rows,block", [(1000, 40, 64), (151936, 8, 2048), (151936, 300, 1024)])
def test_sample_chunks(vocab, rows, block, dtype):
    check_sample_chunks("cuda", dtype, vocab, rows, block)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("vocab,rows", [(100, 64), (49152, 16)])
def test_sample_bitmask(vocab, rows, dtype):
    check_sample_bitmask("cuda", dtype, vocab, rows)


@pytest.mark.parametrize("vocab,rows", [(7, 20000), (3000, 5000)])
def test_sample_bf16_logits(vocab, rows):
    check_sample("cuda", torch.bfloat16, vocab, rows)


@pytest.mark.parametrize("vocab,rows", [(7, 20000), (3000, 5000), (151936, 64)])
def test_sample(vocab, rows):
    if vocab > 10000:  # a real vocabulary: greedy and range checks only (too few draws per token)
        from pagedllm.kernels.sampling_triton import sample_triton

        logits = torch.randn(rows, vocab, device="cuda") * 3
        greedy = torch.arange(rows, device="cuda") % 2 == 0
        out = sample_triton(logits, torch.full((rows,), 0.6, device="cuda"), greedy,
                            torch.tensor([5], dtype=torch.int64, device="cuda"))
        assert torch.equal(out[greedy], logits.argmax(-1)[greedy])
        assert ((out >= 0) & (out < vocab)).all()
        return
    check_sample("cuda", torch.float32, vocab, rows)


def test_batch_sizes_compile_no_new_sampler():
    """Once the sampler has run at one batch size, no other batch size of a serving run (1-300
    rows of a 151,936-token vocabulary, Qwen3's; 128,256, Llama-3's, whose chunk counts include
    16 and 32) compiles a kernel: a compile inside a step stalls it for 30-100 ms. (A column block
    no other test uses makes the first call compile, which shows the recorder sees compiles.)"""
    from pagedllm.kernels._triton import recorded_compiles
    from pagedllm.kernels.sampling_triton import sample_triton

    seed = torch.tensor([1], dtype=torch.int64, device="cuda")
    for vocab in (151936, 128256):
        logits = torch.randn(300, vocab, device="cuda")
        temp, greedy = torch.full((300,), 0.6, device="cuda"), torch.zeros(300, dtype=torch.bool, device="cuda")
        with recorded_compiles() as first:
            sample_triton(logits[:1], temp[:1], greedy[:1], seed, block=512)
        assert first, "the first call compiled nothing the recorder saw"
        with recorded_compiles() as compiled:
            for rows in list(range(2, 40)) + list(range(40, 301, 7)):
                sample_triton(logits[:rows], temp[:rows], greedy[:rows], seed, block=512)
        assert compiled == [], compiled
