"""Sparse MLA decode with the sparse_mla PyTorch op: a paged fp8_ds_mla cache written by
cache_write, top-k logical positions mapped to slots through a block table, one decode call,
checked against a float64 dense computation over the same slots.

    pip install target/wheels/sparse_mla-*.whl     # built by: cd python && maturin build --release
    python3 examples/pytorch_decode.py
"""

import torch

import sparse_mla

dev = torch.device("cuda")
T, H, topk, block_size, num_blocks = 4, 64, 2048, 64, 256  # GLM-5 at TP 1: 64 heads
scale = 192 ** -0.5  # GLM-5's softmax scale (docs/models.md)

# A paged cache of fp8_ds_mla rows (656 bytes each), vLLM's layout.
kv_cache = torch.zeros(num_blocks, block_size, 656, dtype=torch.uint8, device=dev)
seq_len = 3000
slot_of_pos = torch.randperm(num_blocks * block_size, device=dev)[:seq_len].int()  # any paging
latent = torch.randn(seq_len, 512, device=dev).bfloat16()
rope = torch.randn(seq_len, 64, device=dev).bfloat16()
sparse_mla.cache_write(latent, rope, slot_of_pos, kv_cache)  # GLM: arbitrary f32 scales

# The indexer's top-k logical positions (-1 = none) -> physical slots. The block table here
# is the identity over pages, with the paging folded into slot_of_pos above.
positions = torch.stack([torch.randperm(seq_len, device=dev)[:topk] for _ in range(T)]).int()
positions[:, -5:] = -1
block_table = torch.arange(num_blocks, device=dev, dtype=torch.int32)[None, :]
req_of_token = torch.zeros(T, dtype=torch.int32, device=dev)
pos_slots = sparse_mla.positions_to_slots(positions, block_table, req_of_token, block_size)
indices = torch.where(positions >= 0, slot_of_pos[positions.clamp_min(0).long()], -1).int()
assert torch.equal(pos_slots, torch.where(positions >= 0, positions, -1))  # identity table

q = torch.randn(T, H, 576, device=dev).bfloat16()
out, lse = sparse_mla.decode(q, kv_cache, indices, scale)

# The same attention in float64, densely over the selected rows.
rows = torch.cat([latent, rope], dim=1).double()
k = rows[positions.clamp_min(0).long()]
k[positions < 0] = 0
# the cache holds fp8 latents: dequantise what cache_write stored
b = kv_cache.view(-1, 656)[indices.clamp_min(0).long()]
k[..., :512] = b[..., :512].contiguous().view(torch.float8_e4m3fn).double() * b[..., 512:528].contiguous().view(
    torch.float32).double().repeat_interleave(128, dim=-1)
s = torch.einsum("thd,tkd->thk", q.double(), k) * scale
s[(positions < 0)[:, None, :].expand_as(s)] = float("-inf")
ref = torch.einsum("thk,tkd->thd", torch.softmax(s, dim=-1), k[..., :512])
rel = (out.double() - ref).norm() / ref.norm()
print(f"out {tuple(out.shape)} {out.dtype}, lse {tuple(lse.shape)}; relative L2 error vs float64: {rel:.2e}")
assert rel < 1e-2
