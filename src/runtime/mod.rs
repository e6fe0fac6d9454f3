//! Backends behind one small trait: the CPU reference, wgpu (WGSL) and CUDA (NVRTC).
//!
//! [`Backend`] is what tests, `mla-check` and the model use: device buffers and the
//! kernel-level operations (sparse decode, cache write, block-table conversion). GPU
//! backends share one implementation ([`gpu::GpuBackend`]) over a lower-level
//! [`gpu::Device`] (compile a lowered kernel, launch it, move bytes); the CPU backend runs
//! the float64 references. Shapes and buffer sizes are checked here, at the boundary, before
//! any backend sees them; the contents of device buffers cannot be, so the kernels clamp
//! every index they read (see each `check_*` function for what that means).

pub mod cpu;
pub mod cuda;
pub mod gpu;
pub mod op;
pub mod profile;
#[cfg(feature = "wgpu")]
pub mod wgpu;

pub use op::{Binding, HostBuffers, Op};

use crate::mla::{CacheGeometry, CacheWriteShape, DecodeLayout, DecodeShape, VbtShape};
use crate::{Error, Result};
use std::any::Any;
use std::sync::atomic::{AtomicU64, Ordering};

/// Which kind of backend.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum BackendKind {
    Cpu,
    Wgpu,
    Cuda,
}

impl BackendKind {
    pub fn name(&self) -> &'static str {
        match self {
            BackendKind::Cpu => "cpu",
            BackendKind::Wgpu => "wgpu",
            BackendKind::Cuda => "cuda",
        }
    }

    pub fn parse(s: &str) -> Result<Self> {
        match s {
            "cpu" => Ok(BackendKind::Cpu),
            "wgpu" => Ok(BackendKind::Wgpu),
            "cuda" => Ok(BackendKind::Cuda),
            other => Err(Error::arg("backend", "cpu, wgpu or cuda", other)),
        }
    }
}

static NEXT_BACKEND_ID: AtomicU64 = AtomicU64::new(1);
static NEXT_BUFFER_ID: AtomicU64 = AtomicU64::new(1);

/// A fresh identifier tying buffers to the backend that made them.
pub(crate) fn next_backend_id() -> u64 {
    NEXT_BACKEND_ID.fetch_add(1, Ordering::Relaxed)
}

/// Device memory owned by one backend. Its contents are only reachable through that
/// backend's `write` / `download`.
pub struct Buffer {
    len: u64,
    owner: u64,
    id: u64,
    inner: Box<dyn Any + Send + Sync>,
}

impl Buffer {
    pub(crate) fn new(owner: u64, len: u64, inner: impl Any + Send + Sync) -> Self {
        Buffer {
            len,
            owner,
            id: NEXT_BUFFER_ID.fetch_add(1, Ordering::Relaxed),
            inner: Box::new(inner),
        }
    }

    /// A process-unique identity (two bindings of one op must not share a buffer).
    pub fn id(&self) -> u64 {
        self.id
    }

    /// Size in bytes, as requested at allocation.
    pub fn len(&self) -> u64 {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The backend-specific payload, after checking the buffer belongs to `owner`.
    pub(crate) fn get<T: 'static>(&self, owner: u64, arg: &str) -> Result<&T> {
        if self.owner != owner {
            return Err(Error::arg(
                arg,
                "a buffer made by this backend",
                "a buffer of another backend",
            ));
        }
        self.inner
            .downcast_ref::<T>()
            .ok_or_else(|| Error::arg(arg, "a buffer made by this backend", "a foreign buffer"))
    }
}

/// The buffers of one sparse decode call (shapes in [`DecodeShape`]).
pub struct DecodeBuffers<'a> {
    /// `[tokens, heads, d_qk]` bf16.
    pub q: &'a Buffer,
    /// `[num_slots, row_bytes]`.
    pub kv_cache: &'a Buffer,
    /// `[tokens, topk]` i32.
    pub indices: &'a Buffer,
    /// `[tokens]` i32, when `shape.has_topk_length`.
    pub topk_length: Option<&'a Buffer>,
    /// `[tokens, heads, d_v]` bf16, written.
    pub out: &'a Buffer,
    /// `[tokens, heads]` f32 (or `[batch, heads, s_q]`, per `layout.lse`), written.
    pub lse: &'a Buffer,
    /// Cache strides and the lse layout; the default is packed rows and `[tokens, heads]`.
    pub layout: DecodeLayout,
}

/// The buffers of one cache-write call (shapes in [`CacheWriteShape`]).
pub struct CacheWriteBuffers<'a> {
    /// `[tokens, latent]` bf16.
    pub latent: &'a Buffer,
    /// `[tokens, rope]` bf16.
    pub rope: &'a Buffer,
    /// `[tokens]` i32 slots; −1 (or any slot outside the cache) writes nothing.
    pub slot_mapping: &'a Buffer,
    /// The paged cache, rows written in place; every other byte is left as it is.
    pub kv_cache: &'a Buffer,
}

/// The buffers of one virtual-block-table conversion (shapes in [`VbtShape`]).
pub struct VbtBuffers<'a> {
    /// `[tokens, topk]` i32 logical positions (−1: none).
    pub positions: &'a Buffer,
    /// `[requests, max_pages]` i32 block ids (−1: none).
    pub block_table: &'a Buffer,
    /// `[tokens]` i32: the block-table row of each token.
    pub req_of_token: &'a Buffer,
    /// `[tokens, topk]` i32 physical slots, written.
    pub slots: &'a Buffer,
}

/// Knobs of a decode call.
#[derive(Clone, Copy, Debug, Default)]
pub struct DecodeOptions {
    /// Override the split heuristic.
    pub splits: Option<u32>,
}

/// What a decode call chose.
#[derive(Clone, Debug)]
pub struct DecodeRun {
    pub splits: u32,
    /// P was rounded for P · V (to bf16, or f16 for fp8_ds_mla: tensor-core paths);
    /// otherwise everything is f32.
    pub p_rounded: bool,
    /// The kernels launched, by name.
    pub kernels: Vec<String>,
    /// Split and combine ran as one launch (the merged split kernel).
    pub merged: bool,
    /// Tokens run whole before the split ones (`DecodePlan::whole_tokens`).
    pub whole_tokens: u32,
}

/// A place kernels run.
pub trait Backend: Send + Sync {
    fn kind(&self) -> BackendKind;
    /// Human-readable device name (adapter, GPU, or "CPU reference").
    fn device_name(&self) -> String;
    /// A new buffer holding `bytes`.
    fn upload(&self, bytes: &[u8]) -> Result<Buffer>;
    /// A new buffer of `len` bytes with unspecified contents.
    fn alloc(&self, len: u64) -> Result<Buffer>;
    /// Overwrite the start of `buf` with `bytes`.
    fn write(&self, buf: &Buffer, bytes: &[u8]) -> Result<()> {
        self.write_at(buf, 0, bytes)
    }
    /// Overwrite `bytes.len()` bytes of `buf` from byte `offset`; the rest is left as it is.
    /// GPU buffers are written in whole 32-bit words: `offset` must be a multiple of 4, and so
    /// must the length unless the write reaches the end of the buffer.
    fn write_at(&self, buf: &Buffer, offset: u64, bytes: &[u8]) -> Result<()>;
    /// The whole contents of `buf` (waits for pending work).
    fn download(&self, buf: &Buffer) -> Result<Vec<u8>> {
        self.download_range(buf, 0, buf.len())
    }
    /// `len` bytes of `buf` from byte `offset` (waits for pending work); both multiples of 4
    /// on GPU backends unless the range ends at the buffer's end.
    fn download_range(&self, buf: &Buffer, offset: u64, len: u64) -> Result<Vec<u8>>;
    /// Several whole buffers at once, with one wait for the device (a decode step's results).
    fn download_many(&self, bufs: &[&Buffer]) -> Result<Vec<Vec<u8>>> {
        bufs.iter().map(|b| self.download(b)).collect()
    }
    /// Waits until all work submitted so far has finished.
    fn synchronize(&self) -> Result<()> {
        Ok(())
    }
    /// (free, total) bytes of the memory buffers come from, where the device says.
    fn memory_info(&self) -> Option<(u64, u64)> {
        None
    }
    /// Times the host has waited for the device so far (synchronisations and reads back; 0
    /// where the backend does not count them): a decode step should add one, the read of the
    /// sampled id.
    fn host_syncs(&self) -> u64 {
        0
    }
    /// Workgroups that fill the device (what kernels that split their work aim for); 1 on the
    /// CPU reference.
    fn parallelism(&self) -> u32 {
        1
    }
    /// Device allocations made so far (buffers created), for checks that a steady-state
    /// decode step allocates nothing.
    fn allocations(&self) -> u64 {
        0
    }
    /// `len` bytes from `src` to `dst` by the device's own copy engine, where it has one
    /// exposed (false: not done). Benchmarks measure the memory bandwidth with it.
    fn device_copy(&self, src: &Buffer, dst: &Buffer, len: u64) -> Result<bool> {
        let _ = (src, dst, len);
        Ok(false)
    }
    /// Starts recording the launches that follow into a graph instead of running them; false
    /// where the backend has no graphs (then nothing changes).
    fn begin_capture(&self) -> Result<bool> {
        Ok(false)
    }
    /// Ends a recording started by [`Backend::begin_capture`].
    fn end_capture(&self) -> Result<Option<Box<dyn gpu::Graph>>> {
        Ok(None)
    }
    /// `y (+)= x · Wᵀ` through the device vendor's BLAS (cuBLAS on CUDA) for bf16 `x` and a
    /// packed bf16 `W`, into f32 `y` ([`GemmShape`]). `Ok(false)`: this backend has no such
    /// library (the caller runs the project's own linear kernel instead).
    fn gemm_bf16(&self, shape: &GemmShape, x: &Buffer, w: &Buffer, y: &Buffer) -> Result<bool> {
        let _ = (shape, x, w, y);
        Ok(false)
    }
    /// Whether [`Backend::gemm_bf16`] runs here (`Err`: why not).
    fn gemm_available(&self) -> std::result::Result<(), String> {
        Err(format!("{} has no vendor BLAS", self.device_name()))
    }
    /// Runs a model operation ([`Op`]): its kernels on a GPU, its reference on the CPU.
    /// `bufs` binds every buffer the op names; sizes are checked first.
    fn run_op(&self, op: &dyn Op, bufs: &[(&str, &Buffer)]) -> Result<()>;
    /// Sparse MLA decode (docs/math.md).
    fn sparse_mla_decode(
        &self,
        shape: &DecodeShape,
        bufs: &DecodeBuffers<'_>,
        opts: &DecodeOptions,
    ) -> Result<DecodeRun>;
    /// Write cache rows (docs/formats.md): each token's latent and rope at its slot, bf16 or
    /// `fp8_ds_mla` (quantised per the shape's scale flavour). Bytes are identical on every
    /// backend.
    fn cache_write(&self, shape: &CacheWriteShape, bufs: &CacheWriteBuffers<'_>) -> Result<()>;
    /// Logical top-k positions → physical slots through a block table (docs/math.md).
    fn positions_to_slots(&self, shape: &VbtShape, bufs: &VbtBuffers<'_>) -> Result<()>;
}

/// A dense `y[m, n] (+)= x[m, k] · W[n, k]ᵀ` for [`Backend::gemm_bf16`]: `x` bf16 rows of
/// `x_stride` elements from element `x_off`, `W` bf16 packed `[n, k]` from element `w_off`,
/// `y` f32 rows of `y_stride` elements from element `y_off`. With `batch > 1`, `batch` such
/// products, the `b`-th with each operand's start moved by `b` times its `*_batch` elements
/// (the per-head linears: one small GEMM per head, all in one call).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GemmShape {
    pub m: u32,
    pub n: u32,
    pub k: u32,
    pub x_off: u64,
    pub x_stride: u32,
    pub w_off: u64,
    pub y_off: u64,
    pub y_stride: u32,
    /// Add into `y` (beta = 1) instead of overwriting it.
    pub accumulate: bool,
    pub batch: u32,
    pub x_batch: u64,
    pub w_batch: u64,
    pub y_batch: u64,
}

impl GemmShape {
    /// Checks the shape against the three buffers (bytes needed by the last row of each).
    pub fn check(&self, x: &Buffer, w: &Buffer, y: &Buffer) -> Result<()> {
        if self.m == 0 || self.n == 0 || self.k == 0 || self.batch == 0 {
            return Err(Error::arg(
                "gemm shape",
                "m, n, k and batch all at least 1",
                format!(
                    "m {} n {} k {} batch {}",
                    self.m, self.n, self.k, self.batch
                ),
            ));
        }
        if self.x_stride < self.k || self.y_stride < self.n {
            return Err(Error::arg(
                "gemm strides",
                format!("x stride >= k ({}) and y stride >= n ({})", self.k, self.n),
                format!("x {} y {}", self.x_stride, self.y_stride),
            ));
        }
        let b = self.batch as u64 - 1;
        let last = |off: u64, stride: u32, cols: u32| {
            off + (self.m as u64 - 1) * stride as u64 + cols as u64
        };
        let need = [
            (
                "x",
                x,
                (last(self.x_off, self.x_stride, self.k) + b * self.x_batch) * 2,
            ),
            (
                "w",
                w,
                (self.w_off + b * self.w_batch + self.n as u64 * self.k as u64) * 2,
            ),
            (
                "y",
                y,
                (last(self.y_off, self.y_stride, self.n) + b * self.y_batch) * 4,
            ),
        ];
        for (arg, buf, bytes) in need {
            if buf.len() < bytes {
                return Err(Error::arg(
                    arg,
                    format!("at least {bytes} bytes for the gemm {self:?}"),
                    format!("{} bytes", buf.len()),
                ));
            }
        }
        Ok(())
    }
}

/// Checks a write or read of `len` bytes at `offset` against a buffer of `size` bytes, and
/// (for GPU backends, `words`) the 32-bit alignment the copies need.
pub(crate) fn check_range(arg: &str, size: u64, offset: u64, len: u64, words: bool) -> Result<()> {
    let end = offset.saturating_add(len);
    if end > size {
        return Err(Error::arg(
            arg,
            format!("a range within the buffer's {size} bytes"),
            format!("bytes {offset}..{end}"),
        ));
    }
    if words && (offset % 4 != 0 || (len % 4 != 0 && end != size)) {
        return Err(Error::arg(
            arg,
            "an offset and length in whole 32-bit words (or a range ending at the buffer's end)",
            format!("bytes {offset}..{end}"),
        ));
    }
    Ok(())
}

/// The `(name, (identity, length))` pairs [`op::check_bindings`] takes.
pub(crate) fn binding_info<'a>(bufs: &[(&'a str, &Buffer)]) -> Vec<(&'a str, (usize, u64))> {
    bufs.iter()
        .map(|(n, b)| (*n, (b.id() as usize, b.len())))
        .collect()
}

fn expect_len(arg: &str, buf: &Buffer, want: u64, what: &str) -> Result<()> {
    if buf.len() != want {
        return Err(Error::arg(
            arg,
            format!("{want} bytes ({what})"),
            format!("{} bytes", buf.len()),
        ));
    }
    Ok(())
}

fn expect_cache(arg: &str, buf: &Buffer, g: &CacheGeometry, what: &str) -> Result<()> {
    let need = g.min_bytes();
    if buf.len() < need {
        return Err(Error::arg(
            arg,
            format!(
                "at least {need} bytes ({} pages x {} slots of {} B {what} rows, row stride {} B, page stride {} B)",
                g.num_pages, g.page_size, g.row_bytes, g.row_stride, g.page_stride
            ),
            format!("{} bytes", buf.len()),
        ));
    }
    Ok(())
}

/// Checks every buffer of a decode call against the shape. Errors name the argument,
/// the expected and the actual size.
///
/// Only sizes can be checked here: the contents of device buffers are not seen on the
/// host. Whatever they hold, the kernels never read out of bounds: an index outside
/// `[0, num_slots)` is masked, `topk_length[t]` is clamped to `[0, topk]` (a length above
/// topk means all of the row, a negative one none of it).
pub fn check_decode_buffers(shape: &DecodeShape, b: &DecodeBuffers<'_>) -> Result<()> {
    shape.validate()?;
    b.layout.lse.check(shape.tokens)?;
    let geometry = CacheGeometry::new(
        shape.format,
        shape.dims,
        shape.num_pages,
        shape.page_size,
        b.layout.cache,
    )?;
    let (t, h, k) = (shape.tokens as u64, shape.heads as u64, shape.topk as u64);
    let (d, dv) = (shape.dims.d_qk() as u64, shape.dims.d_v() as u64);
    expect_len("q", b.q, t * h * d * 2, &format!("[{t}, {h}, {d}] bf16"))?;
    expect_len("indices", b.indices, t * k * 4, &format!("[{t}, {k}] i32"))?;
    expect_len(
        "out",
        b.out,
        t * h * dv * 2,
        &format!("[{t}, {h}, {dv}] bf16"),
    )?;
    expect_len("lse", b.lse, t * h * 4, &format!("[{t}, {h}] f32"))?;
    expect_cache("kv_cache", b.kv_cache, &geometry, shape.format.name())?;
    match (shape.has_topk_length, b.topk_length) {
        (true, Some(tl)) => expect_len("topk_length", tl, t * 4, &format!("[{t}] i32"))?,
        (true, None) => {
            return Err(Error::arg(
                "topk_length",
                "a buffer (shape.has_topk_length is set)",
                "none",
            ))
        }
        (false, Some(_)) => {
            return Err(Error::arg(
                "topk_length",
                "none (shape.has_topk_length is not set)",
                "a buffer",
            ))
        }
        (false, None) => {}
    }
    Ok(())
}

/// Checks a cache-write call: the shape, the geometry of the cache and every buffer's
/// size. Slot values are not seen on the host; the kernel writes nothing for a slot
/// outside `[0, num_slots)`.
pub fn check_cache_write_buffers(
    shape: &CacheWriteShape,
    b: &CacheWriteBuffers<'_>,
) -> Result<CacheGeometry> {
    let g = shape.validate()?;
    let (t, l, r) = (
        shape.tokens as u64,
        shape.dims.latent as u64,
        shape.dims.rope as u64,
    );
    expect_len("latent", b.latent, t * l * 2, &format!("[{t}, {l}] bf16"))?;
    expect_len("rope", b.rope, t * r * 2, &format!("[{t}, {r}] bf16"))?;
    expect_len("slot_mapping", b.slot_mapping, t * 4, &format!("[{t}] i32"))?;
    expect_cache("kv_cache", b.kv_cache, &g, shape.format.name())?;
    Ok(g)
}

/// Checks a block-table conversion: the shape and every buffer's size. Table contents are
/// not seen on the host; the kernel gives −1 for anything that would address outside the
/// table (see [`VbtShape`]).
pub fn check_vbt_buffers(shape: &VbtShape, b: &VbtBuffers<'_>) -> Result<()> {
    shape.validate()?;
    let (t, k) = (shape.tokens as u64, shape.topk as u64);
    let (rq, m) = (shape.requests as u64, shape.max_pages as u64);
    expect_len(
        "positions",
        b.positions,
        t * k * 4,
        &format!("[{t}, {k}] i32"),
    )?;
    expect_len(
        "block_table",
        b.block_table,
        rq * m * 4,
        &format!("[{rq}, {m}] i32"),
    )?;
    expect_len("req_of_token", b.req_of_token, t * 4, &format!("[{t}] i32"))?;
    expect_len("slots", b.slots, t * k * 4, &format!("[{t}, {k}] i32"))?;
    Ok(())
}

/// Checks `topk_length` values held on the host (a device buffer's contents cannot be
/// checked; there the kernel clamps them to `[0, topk]`): each must be in `[0, topk]`.
pub fn check_topk_length(values: &[i32], topk: u32) -> Result<()> {
    for (t, &v) in values.iter().enumerate() {
        if v < 0 || v as u32 > topk {
            return Err(Error::arg(
                format!("topk_length[{t}]"),
                format!("in [0, topk = {topk}]"),
                v,
            ));
        }
    }
    Ok(())
}

/// Why wgpu is not there in a build without the `wgpu` feature (the Python wheel's).
#[cfg(not(feature = "wgpu"))]
pub(crate) fn no_wgpu() -> Error {
    Error::unavailable(
        "wgpu",
        "this build of sparse-mla has no wgpu backend (built without the `wgpu` feature)",
    )
}

/// Every backend present on this machine, each `Ok` or the reason it is not available:
/// the CPU reference, each wgpu adapter, each CUDA device.
pub fn discover(kinds: &[BackendKind]) -> Vec<(String, Result<Box<dyn Backend>>)> {
    let mut out: Vec<(String, Result<Box<dyn Backend>>)> = Vec::new();
    if kinds.contains(&BackendKind::Cpu) {
        out.push(("cpu".into(), Ok(Box::new(cpu::CpuBackend::new()))));
    }
    #[cfg(not(feature = "wgpu"))]
    if kinds.contains(&BackendKind::Wgpu) {
        out.push(("wgpu".into(), Err(no_wgpu())));
    }
    #[cfg(feature = "wgpu")]
    if kinds.contains(&BackendKind::Wgpu) {
        match wgpu::WgpuDevice::all() {
            Ok(devs) => {
                for d in devs {
                    match d {
                        Ok(dev) => out.push((
                            "wgpu".into(),
                            Ok(Box::new(gpu::GpuBackend::new(dev)) as Box<dyn Backend>),
                        )),
                        Err(e) => out.push(("wgpu".into(), Err(e))),
                    }
                }
            }
            Err(e) => out.push(("wgpu".into(), Err(e))),
        }
    }
    if kinds.contains(&BackendKind::Cuda) {
        match cuda::CudaDevice::all() {
            Ok(devs) => {
                for d in devs {
                    match d {
                        Ok(dev) => out.push((
                            "cuda".into(),
                            Ok(Box::new(gpu::GpuBackend::new(dev)) as Box<dyn Backend>),
                        )),
                        Err(e) => out.push(("cuda".into(), Err(e))),
                    }
                }
            }
            Err(e) => out.push(("cuda".into(), Err(e))),
        }
    }
    out
}

/// Where a program asks to run: `cpu`, `wgpu` (the first adapter wgpu finds; `WGPU_BACKEND`
/// and `WGPU_ADAPTER_NAME` choose), `cuda` / `cuda:N`, or `auto`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DeviceSpec {
    Auto,
    Cpu,
    Wgpu,
    Cuda(usize),
}

impl DeviceSpec {
    pub fn parse(s: &str) -> Result<Self> {
        match s {
            "auto" => Ok(DeviceSpec::Auto),
            "cpu" => Ok(DeviceSpec::Cpu),
            "wgpu" => Ok(DeviceSpec::Wgpu),
            "cuda" => Ok(DeviceSpec::Cuda(0)),
            _ => s
                .strip_prefix("cuda:")
                .and_then(|n| n.parse().ok())
                .map(DeviceSpec::Cuda)
                .ok_or_else(|| Error::arg("--device", "auto, cpu, wgpu, cuda or cuda:N", s)),
        }
    }
}

/// Opens the backend `spec` names. `Auto` takes the best present: a CUDA GPU, else a wgpu
/// adapter that is a real GPU, else the CPU reference (a CPU wgpu adapter such as lavapipe is
/// slower than the CPU backend). Returns the backend and, for `Auto`, why it was chosen.
pub fn open_device(spec: DeviceSpec) -> Result<(std::sync::Arc<dyn Backend>, String)> {
    use std::sync::Arc;
    let cuda = |n: usize| -> Result<Arc<dyn Backend>> {
        let mut devs = cuda::CudaDevice::all()?;
        let count = devs.len();
        if n >= count {
            return Err(Error::arg(
                "--device",
                format!(
                    "cuda:0 .. cuda:{} ({count} CUDA devices)",
                    count.saturating_sub(1)
                ),
                format!("cuda:{n}"),
            ));
        }
        let dev = devs.swap_remove(n)?;
        Ok(Arc::new(gpu::GpuBackend::new(dev)))
    };
    #[cfg(not(feature = "wgpu"))]
    let wgpu_first = |_gpu_only: bool| -> Result<Arc<dyn Backend>> { Err(no_wgpu()) };
    #[cfg(feature = "wgpu")]
    let wgpu_first = |gpu_only: bool| -> Result<Arc<dyn Backend>> {
        for d in wgpu::WgpuDevice::all()? {
            match d {
                Ok(dev) => {
                    if gpu_only && dev.info().device_type == ::wgpu::DeviceType::Cpu {
                        continue;
                    }
                    return Ok(Arc::new(gpu::GpuBackend::new(dev)));
                }
                Err(e) if !gpu_only => return Err(e),
                Err(_) => {}
            }
        }
        Err(Error::unavailable("wgpu", "no usable GPU adapter"))
    };
    match spec {
        DeviceSpec::Cpu => Ok((Arc::new(cpu::CpuBackend::new()), String::new())),
        DeviceSpec::Cuda(n) => Ok((cuda(n)?, String::new())),
        DeviceSpec::Wgpu => Ok((wgpu_first(false)?, String::new())),
        DeviceSpec::Auto => {
            let why_cuda = match cuda(0) {
                Ok(b) => return Ok((b, "the first CUDA GPU".into())),
                Err(e) => e.to_string(),
            };
            match wgpu_first(true) {
                Ok(b) => Ok((b, format!("a wgpu GPU adapter (no CUDA: {why_cuda})"))),
                Err(e) => Ok((
                    Arc::new(cpu::CpuBackend::new()),
                    format!("the CPU (no CUDA: {why_cuda}; no wgpu GPU: {e})"),
                )),
            }
        }
    }
}
