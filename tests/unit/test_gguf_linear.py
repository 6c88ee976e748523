"""GGUF blocks through the parallel linears' own weight loaders (quantization/gguf.py): a fused
qkv layer whose parts are of different types (as K-quant files mix Q4_K and Q6_K) becomes one
segment per type run; a row-parallel shard on whole blocks stays quantized, one that splits a
block is dequantized; every product equals dequantize-then-matmul (of the activations as the
int8 product quantizes them, for Q4_0 / Q4_1 / Q8_0)."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from pagedllm.distributed import ParallelState
from pagedllm.kernels import gguf_kernels
from pagedllm.model.layers.linear import QKVParallelLinear, RowParallelLinear
from pagedllm.model.layers.quantization.gguf import INT8_PREFILL_ROWS, PREFILL_ROWS, GGUFLinearMethod, GGUFTensor
from test_gguf_kernels import random_blocks

pytestmark = pytest.mark.skipif(not gguf_kernels.available(), reason="no C compiler for the GGUF kernels")


def gguf_tensor(qtype: str, rows: int, k: int, seed: int) -> GGUFTensor:
    return GGUFTensor(f"t{seed}", qtype, random_blocks(qtype, rows, k, seed).numpy(), k)


def int8_activations(x: torch.Tensor) -> torch.Tensor:
    """x as the default product (two-pass int8) sees it: its codes times their block scales."""
    q, r, d, _ = gguf_kernels.kernels().quantize_activations(x, passes=2)
    codes = 254 * q.double() + r.double()
    return (codes.reshape(x.shape[0], -1, 32) * d.double()[..., None]).reshape(x.shape).float()


def quantized(layer) -> GGUFLinearMethod:
    layer.quant_method = GGUFLinearMethod()
    layer.quant_method.create_weights(layer)
    return layer.quant_method


@pytest.mark.parametrize("rows", [3, PREFILL_ROWS + 5])
def test_mixed_types_in_one_fused_layer(rows):
    k, d = 512, 64
    layer = QKVParallelLinear(k, d, num_heads=4, num_kv_heads=2)
    method = quantized(layer)
    q, kk = gguf_tensor("Q4_K", 4 * d, k, 1), gguf_tensor("Q4_K", 2 * d, k, 2)
    v = torch.randn(2 * d, k)  # an F32 tensor of the file: a plain tensor
    for part, shard in ((v, "v"), (q, "q"), (kk, "k")):  # any order
        layer.weight.weight_loader(layer.weight, part, shard)
    method.process_weights_after_loading(layer)
    assert method.segments == [(0, 6 * d, "Q4_K"), (6 * d, 2 * d, "F32")]
    assert layer.weight.dtype == torch.uint8 and layer.weight_1.dtype == torch.float32
    ref = torch.cat([q.load(), kk.load(), v])
    x = torch.randn(rows, k)
    torch.testing.assert_close(layer(x), F.linear(x, ref), rtol=1e-4, atol=2e-3)


def test_row_parallel_shards_keep_whole_blocks_or_dequantize():
    out = 40
    full = gguf_tensor("Q4_1", out, 96, 3)  # K = 96: 3 blocks of 32
    ref = full.load()
    # tp=3: 32 columns a rank, one whole block each: kept quantized
    layer = RowParallelLinear(96, out, ps=ParallelState(tp_rank=2, tp_size=3))
    method = quantized(layer)
    layer.weight.weight_loader(layer.weight, full)
    method.process_weights_after_loading(layer)
    assert method.segments == [(0, out, "Q4_1")]
    x = torch.randn(5, 32)
    torch.testing.assert_close(method.apply(layer, x, None), F.linear(int8_activations(x), ref[:, 64:]), rtol=1e-4,
                               atol=1e-5)
    # tp=2: 48 columns a rank split the second block: that shard is dequantized
    layer = RowParallelLinear(96, out, ps=ParallelState(tp_rank=1, tp_size=2))
    method = quantized(layer)
    layer.weight.weight_loader(layer.weight, full)
    method.process_weights_after_loading(layer)
    assert method.segments == [(0, out, "F32")]
    x = torch.randn(5, 48)
    torch.testing.assert_close(method.apply(layer, x, None), F.linear(x, ref[:, 48:]), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("rows", [5, PREFILL_ROWS + 5, INT8_PREFILL_ROWS + 5])
def test_q4_1_products_by_row_count(rows):
    """Up to INT8_PREFILL_ROWS rows a Q4_1 layer runs the (two-pass) int8 product, past it
    dequantize + MKL on the float32 activations (PAGEDLLM_GGUF_INT8 unset)."""
    k, out = 256, 48
    layer = RowParallelLinear(k, out)
    method = quantized(layer)
    t = gguf_tensor("Q4_1", out, k, 7)
    layer.weight.weight_loader(layer.weight, t)
    method.process_weights_after_loading(layer)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
    y = method.apply(layer, x, None)
    if gguf_kernels.int8_mode() == 2 and rows <= INT8_PREFILL_ROWS:
        torch.testing.assert_close(y, F.linear(int8_activations(x), t.load()), rtol=1e-4, atol=1e-5)
        assert not torch.equal(y, F.linear(x, t.load()))
    else:
        torch.testing.assert_close(y, F.linear(x, t.load()), rtol=1e-4, atol=1e-4)


def test_rows_not_loaded_are_an_error():
    layer = QKVParallelLinear(64, 32, num_heads=2, num_kv_heads=1)
    method = quantized(layer)
    layer.weight.weight_loader(layer.weight, gguf_tensor("Q8_0", 64, 64, 4), "q")
    layer.weight.weight_loader(layer.weight, gguf_tensor("Q8_0", 32, 64, 5), "v")
    with pytest.raises(ValueError, match=r"rows \[64, 96\) were not loaded"):
        method.process_weights_after_loading(layer)


def test_permuted_rows_are_the_permuted_dequantized_rows():
    t = gguf_tensor("Q6_K", 8, 256, 6)
    index = np.array([3, 1, 0, 2, 7, 6, 5, 4])
    torch.testing.assert_close(t.permute_rows(index).load(), t.load()[index], rtol=0, atol=0)
