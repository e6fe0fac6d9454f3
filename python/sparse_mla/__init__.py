"""sparse_mla: sparse MLA decode (DeepSeek-V3.2 / GLM-5) on PyTorch CUDA tensors.

The kernels are sparse-mla's tensor-core CUDA kernels, compiled by NVRTC for the GPU of the
tensors on first use (cached on disk) and launched on the current stream with the tensors'
own memory: no copies. Each op is a ``torch.library`` custom op (``torch.ops.sparse_mla.*``)
with a fake implementation, so CUDA-graph capture and ``torch.compile`` work; call each op
once before capturing a graph (the first call compiles and loads the kernels).

Layouts are vLLM's (docs/vllm.md maps a sparse-MLA attention backend's tensors):

- ``q``: ``[T, H, 576]`` bfloat16, latent 512 then rope 64 (T = batch x s_q tokens);
- ``kv_cache``: ``[num_blocks, block_size, 576]`` bfloat16, or ``[num_blocks, block_size,
  656]`` uint8 rows in the ``fp8_ds_mla`` format (docs/formats.md); rows contiguous, pages
  at any stride that is a multiple of 4 bytes;
- ``indices``: ``[T, topk]`` int32 physical slots (``block * block_size + offset``), -1 or
  any out-of-range value = no entry; optional ``topk_length`` ``[T]`` int32 cuts each row;
- ``out``: ``[T, H, 512]`` bfloat16; ``lse``: ``[T, H]`` float32, natural log, ``+inf`` for a
  row with no valid entry (whose ``out`` is 0).
"""


from typing import Optional, Tuple

from . import _native, _nvrtc

__all__ = ["decode", "cache_write", "positions_to_slots", "unavailable", "device_info", "nvrtc_version"]

D_QK = _native.D_QK
D_V = _native.D_V

_nvrtc_checked = False


def _ready() -> None:
    global _nvrtc_checked
    if not _nvrtc_checked:
        _nvrtc.ensure()
        _nvrtc_checked = True


def unavailable() -> Optional[str]:
    """None when the kernels can run here; else why not (no driver, no NVRTC, no GPU)."""
    _ready()
    return _native.unavailable()


def nvrtc_version() -> Tuple[int, int]:
    """NVRTC's (major, minor); raises when no NVRTC can be found."""
    _ready()
    return _native.nvrtc_version()


def device_info(device: int = 0) -> str:
    """Name, arch and multiprocessors of a CUDA device (raises when CUDA is unavailable)."""
    _ready()
    return _native.device_info(device)


try:
    import torch
    from torch import Tensor
except ImportError:  # the package imports without PyTorch; the ops need it
    torch = None

if torch is None:

    def _no_torch(*_args, **_kwargs):
        raise ImportError("sparse_mla's ops take PyTorch tensors: install torch")

    decode = cache_write = positions_to_slots = _no_torch
else:

    def _desc(t: Tensor, name: str):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"sparse_mla: `{name}`: expected a torch.Tensor, got {type(t).__name__}")
        dev = t.device
        index = dev.index if dev.index is not None else (-1 if dev.type != "cuda" else torch.cuda.current_device())
        return (
            t.data_ptr() if dev.type != "meta" else 0,
            tuple(t.shape),
            tuple(t.stride()),
            str(t.dtype).replace("torch.", ""),
            dev.type,
            index,
        )

    def _stream(device: torch.device) -> int:
        return torch.cuda.current_stream(device).cuda_stream

    @torch.library.custom_op("sparse_mla::decode", mutates_args=("out", "lse"))
    def _decode_op(
        q: Tensor,
        kv_cache: Tensor,
        indices: Tensor,
        topk_length: Optional[Tensor],
        out: Tensor,
        lse: Tensor,
        scale: float,
    ) -> None:
        _ready()
        dq, dkv, didx = _desc(q, "q"), _desc(kv_cache, "kv_cache"), _desc(indices, "indices")
        dlen = None if topk_length is None else _desc(topk_length, "topk_length")
        dout, dlse = _desc(out, "out"), _desc(lse, "lse")
        if q.dim() == 3 and q.shape[0] == 0:
            return
        plan = _native.decode_plan(dq, dkv, didx, dlen)
        o_part = lse_part = None
        if plan["splits"] > 1:
            # scratch from PyTorch's allocator: under graph capture, from the graph's pool
            o_part = _desc(torch.empty(plan["o_part"], dtype=torch.float32, device=q.device), "o_part")
            lse_part = _desc(torch.empty(plan["lse_part"], dtype=torch.float32, device=q.device), "lse_part")
        _native.decode(_stream(q.device), dq, dkv, didx, dlen, dout, dlse, o_part, lse_part, float(scale))

    @_decode_op.register_fake
    def _decode_fake(q, kv_cache, indices, topk_length, out, lse, scale):
        torch._check(out.shape == (q.shape[0], q.shape[1], D_V), lambda: "sparse_mla.decode: `out`: expected [T, H, 512]")
        torch._check(lse.shape == (q.shape[0], q.shape[1]), lambda: "sparse_mla.decode: `lse`: expected [T, H]")
        return None

    def decode(
        q: Tensor,
        kv_cache: Tensor,
        indices: Tensor,
        scale: float,
        topk_length: Optional[Tensor] = None,
        out: Optional[Tensor] = None,
        lse: Optional[Tensor] = None,
    ) -> Tuple[Tensor, Tensor]:
        """Sparse MLA decode: ``out[t, h] = sum_j softmax_j(scale * q[t, h] . k_j) * k_j[:512]``
        over the valid slots ``indices[t, j]``. Returns ``(out, lse)``; ``out`` / ``lse`` given
        are written in place (vLLM passes its output buffer)."""
        if not isinstance(q, torch.Tensor):
            raise TypeError(f"sparse_mla.decode: `q`: expected a torch.Tensor, got {type(q).__name__}")
        if q.dim() != 3:
            raise ValueError(f"sparse_mla.decode: `q`: expected 3 dimensions [T, H, 576], got shape {tuple(q.shape)}")
        t, h = q.shape[0], q.shape[1]
        if out is None:
            out = torch.empty((t, h, D_V), dtype=torch.bfloat16, device=q.device)
        if lse is None:
            lse = torch.empty((t, h), dtype=torch.float32, device=q.device)
        torch.ops.sparse_mla.decode(q, kv_cache, indices, topk_length, out, lse, float(scale))
        return out, lse

    @torch.library.custom_op("sparse_mla::cache_write", mutates_args=("kv_cache",))
    def _cache_write_op(latent: Tensor, rope: Tensor, slot_mapping: Tensor, kv_cache: Tensor, pow2_scales: bool) -> None:
        _ready()
        _native.cache_write(
            _stream(kv_cache.device) if kv_cache.device.type == "cuda" else 0,
            _desc(latent, "latent"),
            _desc(rope, "rope"),
            _desc(slot_mapping, "slot_mapping"),
            _desc(kv_cache, "kv_cache"),
            bool(pow2_scales),
        )

    @_cache_write_op.register_fake
    def _cache_write_fake(latent, rope, slot_mapping, kv_cache, pow2_scales):
        return None

    def cache_write(
        latent: Tensor, rope: Tensor, slot_mapping: Tensor, kv_cache: Tensor, pow2_scales: bool = False
    ) -> Tensor:
        """Write each token's ``latent [T, 512]`` and ``rope [T, 64]`` (bfloat16; rope may be
        ``[T, 1, 64]``) as a cache row at ``slot_mapping[t]`` (int32; -1 skips the token), in the
        format of ``kv_cache`` (bf16 rows, or fp8_ds_mla with scales ``amax / 448``, rounded up
        to a power of two when ``pow2_scales``, as DeepSeek's). Returns ``kv_cache``."""
        if isinstance(rope, torch.Tensor) and rope.dim() == 3 and rope.shape[1] == 1:
            rope = rope.reshape(rope.shape[0], rope.shape[2])
        torch.ops.sparse_mla.cache_write(latent, rope, slot_mapping, kv_cache, bool(pow2_scales))
        return kv_cache

    @torch.library.custom_op("sparse_mla::positions_to_slots", mutates_args=("slots",))
    def _vbt_op(positions: Tensor, block_table: Tensor, req_of_token: Tensor, slots: Tensor, page_size: int) -> None:
        _ready()
        _native.positions_to_slots(
            _stream(positions.device) if positions.device.type == "cuda" else 0,
            _desc(positions, "positions"),
            _desc(block_table, "block_table"),
            _desc(req_of_token, "req_of_token"),
            _desc(slots, "slots"),
            int(page_size),
        )

    @_vbt_op.register_fake
    def _vbt_fake(positions, block_table, req_of_token, slots, page_size):
        return None

    def positions_to_slots(
        positions: Tensor,
        block_table: Tensor,
        req_of_token: Tensor,
        page_size: int,
        out: Optional[Tensor] = None,
    ) -> Tensor:
        """Logical top-k positions ``[T, topk]`` (int32, -1 = none) to physical slots through a
        block table ``[requests, max_blocks]`` (int32) and each token's request row
        ``req_of_token [T]``: ``block_table[r, pos // page_size] * page_size + pos % page_size``,
        -1 where the position, block or request is out of range."""
        if out is None:
            out = torch.empty_like(positions)
        torch.ops.sparse_mla.positions_to_slots(positions, block_table, req_of_token, out, int(page_size))
        return out
