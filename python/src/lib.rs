//! `sparse_mla._native`: the kernels of sparse-mla on memory that PyTorch owns.
//!
//! Python hands over each tensor as a descriptor `(data_ptr, shape, strides, dtype, device
//! type, device index)` and the current stream as an integer; this module checks every
//! descriptor (errors name the argument), plans the call exactly as the CUDA backend does
//! (`DecodeConfig::tensor_core` for the head count, splits from the cost model over the
//! device's resident workgroups), compiles the kernels with NVRTC once per device (the
//! on-disk cache of the main crate), and launches them on that stream with the tensors' raw
//! pointers: no copies, no allocation, no synchronisation, so the launches can be captured in
//! a CUDA graph. Scratch (the split partials) is allocated by the caller, through PyTorch's
//! allocator, from the sizes [`decode_plan`] returns.

use pyo3::exceptions::{PyRuntimeError, PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::PyDict;
use sparse_mla::kernels::sparse_mla_decode::{launches, DecodeConfig, DecodePlan};
use sparse_mla::kernels::Launch;
use sparse_mla::mla::{
    CacheFormat, CacheGeometry, CacheStrides, CacheWriteShape, DecodeLayout, DecodeShape,
    LseLayout, MlaDims, ScaleFlavour, VbtShape,
};

mod device;
mod tensor;

use tensor::{Desc, Tensor};

fn lib_err(e: sparse_mla::Error) -> PyErr {
    match e {
        sparse_mla::Error::InvalidArgument { .. } => PyValueError::new_err(e.to_string()),
        _ => PyRuntimeError::new_err(e.to_string()),
    }
}

/// None when CUDA kernels can run here, else why not (no driver, no NVRTC, no device).
#[pyfunction]
fn unavailable() -> Option<String> {
    device::unavailable()
}

/// NVRTC's version `(major, minor)`, loading it if needed (raises when it cannot be found).
#[pyfunction]
fn nvrtc_version() -> PyResult<(i32, i32)> {
    sparse_mla::runtime::cuda::nvrtc_version().map_err(lib_err)
}

/// The checked inputs of one decode call.
struct DecodeCall {
    device: usize,
    shape: DecodeShape,
    layout: DecodeLayout,
}

/// The cache format of a `kv_cache` tensor: bf16 rows of 576 or uint8 rows of 656 bytes.
fn cache_format(op: &str, cache: &Tensor) -> PyResult<CacheFormat> {
    cache.rank(
        op,
        3,
        "[num_blocks, block_size, 576 (bf16) | 656 (uint8, fp8_ds_mla)]",
    )?;
    let row = cache.shape[2];
    match (cache.dtype.as_str(), row) {
        ("bfloat16", 576) => Ok(CacheFormat::Bf16),
        ("uint8", 656) => Ok(CacheFormat::Fp8DsMla),
        ("bfloat16", _) | ("uint8", _) => Err(PyValueError::new_err(format!(
            "{op}: `kv_cache`: expected shape [num_blocks, block_size, 576] for bfloat16 or [num_blocks, block_size, 656] for uint8 (fp8_ds_mla), got {:?} {}",
            cache.shape, cache.dtype
        ))),
        _ => Err(PyTypeError::new_err(format!(
            "{op}: `kv_cache`: expected dtype bfloat16 (bf16 rows) or uint8 (fp8_ds_mla rows), got {}",
            cache.dtype
        ))),
    }
}

/// Strides of a `[num_blocks, block_size, row]` cache in bytes: the row's elements packed, rows
/// and pages at any stride that is a multiple of 4 bytes (vLLM may pad its pages).
fn cache_strides(op: &str, cache: &Tensor) -> PyResult<CacheStrides> {
    let elem = cache.elem_bytes();
    if cache.shape[2] > 1 && cache.strides[2] != 1 {
        return Err(PyValueError::new_err(format!(
            "{op}: `kv_cache`: expected each row contiguous (stride 1 in the last dimension), got strides {:?}",
            cache.strides
        )));
    }
    if cache.strides[0] < 0 || cache.strides[1] < 0 {
        return Err(PyValueError::new_err(format!(
            "{op}: `kv_cache`: expected non-negative strides, got {:?}",
            cache.strides
        )));
    }
    Ok(CacheStrides {
        row: cache.strides[1] as u64 * elem,
        page: cache.strides[0] as u64 * elem,
    })
}

#[allow(clippy::too_many_arguments)]
fn check_decode(
    q: &Tensor,
    kv_cache: &Tensor,
    indices: &Tensor,
    topk_length: Option<&Tensor>,
    out: Option<&Tensor>,
    lse: Option<&Tensor>,
    scale: f64,
) -> PyResult<DecodeCall> {
    const OP: &str = "sparse_mla.decode";
    let dims = MlaDims::PRODUCTION;
    let device = q.cuda_device(OP)?;
    q.rank(OP, 3, "[T, H, 576]")?;
    q.dtype(OP, &["bfloat16"])?;
    q.dim(OP, 2, dims.d_qk() as i64, "[T, H, 576]")?;
    q.contiguous(OP)?;
    q.aligned(OP, 16)?;
    let (t, h) = (q.shape[0], q.shape[1]);
    kv_cache.same_device(OP, device)?;
    let format = cache_format(OP, kv_cache)?;
    let strides = cache_strides(OP, kv_cache)?;
    kv_cache.aligned(OP, 16)?;
    indices.same_device(OP, device)?;
    indices.rank(OP, 2, "[T, topk]")?;
    indices.dtype(OP, &["int32"])?;
    indices.dim(OP, 0, t, "[T, topk] with T = q.shape[0]")?;
    indices.contiguous(OP)?;
    let topk = indices.shape[1];
    if let Some(len) = topk_length {
        len.same_device(OP, device)?;
        len.rank(OP, 1, "[T]")?;
        len.dtype(OP, &["int32"])?;
        len.dim(OP, 0, t, "[T] with T = q.shape[0]")?;
        len.contiguous(OP)?;
    }
    if let Some(out) = out {
        out.same_device(OP, device)?;
        out.rank(OP, 3, "[T, H, 512]")?;
        out.dtype(OP, &["bfloat16"])?;
        out.dim(OP, 0, t, "[T, H, 512] with T = q.shape[0]")?;
        out.dim(OP, 1, h, "[T, H, 512] with H = q.shape[1]")?;
        out.dim(OP, 2, dims.d_v() as i64, "[T, H, 512]")?;
        out.contiguous(OP)?;
    }
    if let Some(lse) = lse {
        lse.same_device(OP, device)?;
        lse.rank(OP, 2, "[T, H]")?;
        lse.dtype(OP, &["float32"])?;
        lse.dim(OP, 0, t, "[T, H] with T = q.shape[0]")?;
        lse.dim(OP, 1, h, "[T, H] with H = q.shape[1]")?;
        lse.contiguous(OP)?;
    }
    let u32_of = |name: &str, v: i64| -> PyResult<u32> {
        u32::try_from(v).map_err(|_| {
            PyValueError::new_err(format!(
                "{OP}: `{name}`: expected at most {}, got {v}",
                u32::MAX
            ))
        })
    };
    let shape = DecodeShape {
        tokens: u32_of("q.shape[0]", t)?,
        heads: u32_of("q.shape[1]", h)?,
        topk: u32_of("indices.shape[1]", topk)?,
        num_pages: u32_of("kv_cache.shape[0]", kv_cache.shape[0])?,
        page_size: u32_of("kv_cache.shape[1]", kv_cache.shape[1])?,
        dims,
        format,
        scale: scale as f32,
        has_topk_length: topk_length.is_some(),
    };
    shape.validate().map_err(lib_err)?;
    // the buffer is as large as its strides say: rows past the last one are not touched
    CacheGeometry::new(format, dims, shape.num_pages, shape.page_size, strides).map_err(lib_err)?;
    Ok(DecodeCall {
        device,
        shape,
        layout: DecodeLayout {
            cache: strides,
            lse: LseLayout::TokensHeads,
        },
    })
}

fn plan_of(call: &DecodeCall, splits: Option<u32>) -> PyResult<DecodePlan> {
    // the CUDA backend's choice (fp8's large-batch kernel, v6 for a small bf16 call, v6 or
    // v7 by this GPU's occupancy of v6 above 16 heads): the residency is asked where it decides
    let (dims, heads) = (call.shape.dims, call.shape.heads);
    let sm_count = device::sm_count(call.device).map_err(lib_err)?;
    let config = DecodeConfig::for_call(&call.shape, sm_count, || -> PyResult<u32> {
        let v6 = DecodeConfig::tensor_core_v6(dims, CacheFormat::Bf16, heads);
        Ok(device::resident_workgroups(call.device, &v6).map_err(lib_err)? / sm_count.max(1))
    })?;
    let resident = device::resident_workgroups(call.device, &config).map_err(lib_err)?;
    DecodePlan::with_config(config, &call.shape, resident, sm_count, splits).map_err(lib_err)
}

/// The plan of a decode call: `{"splits", "chunk", "o_part": shape, "lse_part": shape,
/// "kernel"}`; the partial shapes are `[0]` when one split writes the output directly.
#[pyfunction]
#[pyo3(signature = (q, kv_cache, indices, topk_length=None, splits=None))]
fn decode_plan<'py>(
    py: Python<'py>,
    q: Desc,
    kv_cache: Desc,
    indices: Desc,
    topk_length: Option<Desc>,
    splits: Option<u32>,
) -> PyResult<Bound<'py, PyDict>> {
    let (q, kv, idx) = (
        Tensor::new("q", q),
        Tensor::new("kv_cache", kv_cache),
        Tensor::new("indices", indices),
    );
    let len = topk_length.map(|d| Tensor::new("topk_length", d));
    let call = check_decode(&q, &kv, &idx, len.as_ref(), None, None, 1.0)?;
    let plan = plan_of(&call, splits)?;
    let d = PyDict::new(py);
    let s = &call.shape;
    d.set_item("splits", plan.splits)?;
    d.set_item("chunk", plan.chunk)?;
    if plan.splits > 1 {
        d.set_item("o_part", vec![s.tokens, s.heads, plan.splits, s.dims.d_v()])?;
        d.set_item("lse_part", vec![s.tokens, s.heads, plan.splits])?;
    } else {
        d.set_item("o_part", vec![0u32])?;
        d.set_item("lse_part", vec![0u32])?;
    }
    d.set_item("kernel", plan.config.split_name())?;
    d.set_item("block_n", plan.config.block_n)?;
    Ok(d)
}

/// Launch a decode call on `stream` (a `cudaStream_t` as an integer). `o_part` / `lse_part`:
/// float32 scratch of the shapes `decode_plan` gave (ignored with one split); `splits` must
/// be the one given to `decode_plan`.
#[pyfunction]
#[pyo3(signature = (stream, q, kv_cache, indices, topk_length, out, lse, o_part, lse_part, scale, splits=None))]
#[allow(clippy::too_many_arguments)]
fn decode(
    stream: u64,
    q: Desc,
    kv_cache: Desc,
    indices: Desc,
    topk_length: Option<Desc>,
    out: Desc,
    lse: Desc,
    o_part: Option<Desc>,
    lse_part: Option<Desc>,
    scale: f64,
    splits: Option<u32>,
) -> PyResult<()> {
    const OP: &str = "sparse_mla.decode";
    let (q, kv, idx, out, lse) = (
        Tensor::new("q", q),
        Tensor::new("kv_cache", kv_cache),
        Tensor::new("indices", indices),
        Tensor::new("out", out),
        Tensor::new("lse", lse),
    );
    let len = topk_length.map(|d| Tensor::new("topk_length", d));
    let call = check_decode(&q, &kv, &idx, len.as_ref(), Some(&out), Some(&lse), scale)?;
    let plan = plan_of(&call, splits)?;
    let s = &call.shape;
    let mut bufs: Vec<(&str, u64)> = vec![
        ("q", q.ptr),
        ("kv_cache", kv.ptr),
        ("indices", idx.ptr),
        // absent: the kernel reads one word of any buffer (has_topk_length = 0)
        ("topk_length", len.as_ref().map_or(idx.ptr, |l| l.ptr)),
        ("out", out.ptr),
        ("lse", lse.ptr),
    ];
    if plan.splits > 1 {
        let (Some(o), Some(l)) = (o_part, lse_part) else {
            return Err(PyValueError::new_err(format!(
                "{OP}: `o_part`, `lse_part`: expected float32 scratch of the shapes decode_plan gives ({} splits)",
                plan.splits
            )));
        };
        let (o, l) = (Tensor::new("o_part", o), Tensor::new("lse_part", l));
        for (t, want) in [
            (&o, vec![s.tokens, s.heads, plan.splits, s.dims.d_v()]),
            (&l, vec![s.tokens, s.heads, plan.splits]),
        ] {
            t.same_device(OP, call.device)?;
            t.dtype(OP, &["float32"])?;
            let want: Vec<i64> = want.into_iter().map(i64::from).collect();
            if t.shape != want {
                return Err(PyValueError::new_err(format!(
                    "{OP}: `{}`: expected shape {want:?} (decode_plan's), got {:?}",
                    t.name, t.shape
                )));
            }
            t.contiguous(OP)?;
        }
        // the split kernels write o_part's element pairs as 8-byte stores
        o.aligned(OP, 8)?;
        bufs.push(("o_part", o.ptr));
        bufs.push(("lse_part", l.ptr));
    } else {
        // one split: the kernel writes out and lse and never touches its partials' buffers
        bufs.push(("o_part", out.ptr));
        bufs.push(("lse_part", lse.ptr));
    }
    let ls = launches(s, &call.layout, &plan).map_err(lib_err)?;
    run(call.device, stream, &ls, &bufs)
}

fn run(device: usize, stream: u64, ls: &[Launch], bufs: &[(&str, u64)]) -> PyResult<()> {
    for l in ls {
        device::launch(device, stream, l, bufs).map_err(lib_err)?;
    }
    Ok(())
}

/// Write cache rows: `latent [T, 512]` and `rope [T, 64]` (bfloat16) at `slot_mapping [T]`
/// (int32; -1 skips a token) into `kv_cache`, as bf16 rows or fp8_ds_mla rows (scales
/// `pow2_scales`: rounded up to a power of two as DeepSeek's; else amax / 448 as GLM's).
#[pyfunction]
#[pyo3(signature = (stream, latent, rope, slot_mapping, kv_cache, pow2_scales=false))]
fn cache_write(
    stream: u64,
    latent: Desc,
    rope: Desc,
    slot_mapping: Desc,
    kv_cache: Desc,
    pow2_scales: bool,
) -> PyResult<()> {
    const OP: &str = "sparse_mla.cache_write";
    let dims = MlaDims::PRODUCTION;
    let (latent, rope, slots, kv) = (
        Tensor::new("latent", latent),
        Tensor::new("rope", rope),
        Tensor::new("slot_mapping", slot_mapping),
        Tensor::new("kv_cache", kv_cache),
    );
    let device = kv.cuda_device(OP)?;
    let format = cache_format(OP, &kv)?;
    let strides = cache_strides(OP, &kv)?;
    slots.same_device(OP, device)?;
    slots.rank(OP, 1, "[T]")?;
    slots.dtype(OP, &["int32", "int64"])?;
    if slots.dtype != "int32" {
        return Err(PyTypeError::new_err(format!(
            "{OP}: `slot_mapping`: expected dtype int32 (call .int()), got {}",
            slots.dtype
        )));
    }
    slots.contiguous(OP)?;
    let t = slots.shape[0];
    for (x, w) in [(&latent, dims.latent), (&rope, dims.rope)] {
        x.same_device(OP, device)?;
        x.rank(OP, 2, &format!("[T, {w}]"))?;
        x.dtype(OP, &["bfloat16"])?;
        x.dim(OP, 0, t, "[T, ...] with T = slot_mapping.shape[0]")?;
        x.dim(OP, 1, w as i64, &format!("[T, {w}]"))?;
        x.contiguous(OP)?;
    }
    if t == 0 {
        return Ok(());
    }
    let shape = CacheWriteShape {
        tokens: u32::try_from(t).map_err(|_| {
            PyValueError::new_err(format!("{OP}: `slot_mapping`: too many tokens ({t})"))
        })?,
        num_pages: u32::try_from(kv.shape[0])
            .map_err(|_| PyValueError::new_err(format!("{OP}: `kv_cache`: too many blocks")))?,
        page_size: u32::try_from(kv.shape[1]).map_err(|_| {
            PyValueError::new_err(format!("{OP}: `kv_cache`: block_size too large"))
        })?,
        dims,
        format,
        flavour: if pow2_scales {
            ScaleFlavour::Pow2
        } else {
            ScaleFlavour::Arbitrary
        },
        strides,
    };
    let geometry = shape.validate().map_err(lib_err)?;
    let l = sparse_mla::kernels::cache_write::launch(&shape, &geometry).map_err(lib_err)?;
    run(
        device,
        stream,
        &[l],
        &[
            ("latent", latent.ptr),
            ("rope", rope.ptr),
            ("slot_mapping", slots.ptr),
            ("kv_cache", kv.ptr),
        ],
    )
}

/// Logical top-k positions to physical slots through vLLM's block table:
/// `slots[t, j] = block_table[r, pos / page_size] * page_size + pos % page_size` with
/// `r = req_of_token[t]`, `pos = positions[t, j]`; -1 where anything is out of range.
#[pyfunction]
fn positions_to_slots(
    stream: u64,
    positions: Desc,
    block_table: Desc,
    req_of_token: Desc,
    slots: Desc,
    page_size: u32,
) -> PyResult<()> {
    const OP: &str = "sparse_mla.positions_to_slots";
    let (pos, table, req, out) = (
        Tensor::new("positions", positions),
        Tensor::new("block_table", block_table),
        Tensor::new("req_of_token", req_of_token),
        Tensor::new("slots", slots),
    );
    let device = pos.cuda_device(OP)?;
    pos.rank(OP, 2, "[T, topk]")?;
    let (t, k) = (pos.shape[0], pos.shape[1]);
    for x in [&pos, &table, &req, &out] {
        x.same_device(OP, device)?;
        x.dtype(OP, &["int32"])?;
        x.contiguous(OP)?;
    }
    table.rank(OP, 2, "[requests, max_pages]")?;
    req.rank(OP, 1, "[T]")?;
    req.dim(OP, 0, t, "[T] with T = positions.shape[0]")?;
    out.rank(OP, 2, "[T, topk]")?;
    out.dim(OP, 0, t, "[T, topk] as positions")?;
    out.dim(OP, 1, k, "[T, topk] as positions")?;
    if t == 0 || k == 0 {
        return Ok(());
    }
    let u = |name: &str, v: i64| -> PyResult<u32> {
        u32::try_from(v)
            .map_err(|_| PyValueError::new_err(format!("{OP}: `{name}`: too large ({v})")))
    };
    let shape = VbtShape {
        tokens: u("positions.shape[0]", t)?,
        topk: u("positions.shape[1]", k)?,
        requests: u("block_table.shape[0]", table.shape[0])?,
        max_pages: u("block_table.shape[1]", table.shape[1])?,
        page_size,
    };
    let l = sparse_mla::kernels::vbt::launch(&shape).map_err(lib_err)?;
    run(
        device,
        stream,
        &[l],
        &[
            ("positions", pos.ptr),
            ("block_table", table.ptr),
            ("req_of_token", req.ptr),
            ("slots", out.ptr),
        ],
    )
}

/// Device facts for logs: name, arch, multiprocessors.
#[pyfunction]
fn device_info(device: usize) -> PyResult<String> {
    device::info(device).map_err(lib_err)
}

#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(unavailable, m)?)?;
    m.add_function(wrap_pyfunction!(nvrtc_version, m)?)?;
    m.add_function(wrap_pyfunction!(decode_plan, m)?)?;
    m.add_function(wrap_pyfunction!(decode, m)?)?;
    m.add_function(wrap_pyfunction!(cache_write, m)?)?;
    m.add_function(wrap_pyfunction!(positions_to_slots, m)?)?;
    m.add_function(wrap_pyfunction!(device_info, m)?)?;
    m.add("D_QK", MlaDims::PRODUCTION.d_qk())?;
    m.add("D_V", MlaDims::PRODUCTION.d_v())?;
    Ok(())
}
