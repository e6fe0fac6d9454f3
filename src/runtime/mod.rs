//! Backends behind one small trait: the CPU reference, wgpu (WGSL) and CUDA (NVRTC).
//!
//! [`Backend`] is what tests, `mla-check` and the model use: device buffers and the
//! kernel-level operations. GPU backends share one implementation ([`gpu::GpuBackend`]) over
//! a lower-level [`gpu::Device`] (compile a lowered kernel, launch it, move bytes); the CPU
//! backend runs the float64 references. Shapes are checked here, at the boundary, before any
//! backend sees them.

pub mod cpu;
pub mod cuda;
pub mod gpu;
pub mod wgpu;

use crate::mla::DecodeShape;
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

/// A fresh identifier tying buffers to the backend that made them.
pub(crate) fn next_backend_id() -> u64 {
    NEXT_BACKEND_ID.fetch_add(1, Ordering::Relaxed)
}

/// Device memory owned by one backend. Its contents are only reachable through that
/// backend's `write` / `download`.
pub struct Buffer {
    len: u64,
    owner: u64,
    inner: Box<dyn Any + Send + Sync>,
}

impl Buffer {
    pub(crate) fn new(owner: u64, len: u64, inner: impl Any + Send + Sync) -> Self {
        Buffer {
            len,
            owner,
            inner: Box::new(inner),
        }
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
    /// `[tokens, heads]` f32, written.
    pub lse: &'a Buffer,
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
    /// P was rounded to bf16 for P · V (tensor-core paths); otherwise everything is f32.
    pub p_bf16: bool,
    /// The kernels launched, by name.
    pub kernels: Vec<String>,
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
    fn write(&self, buf: &Buffer, bytes: &[u8]) -> Result<()>;
    /// The whole contents of `buf` (waits for pending work).
    fn download(&self, buf: &Buffer) -> Result<Vec<u8>>;
    /// Sparse MLA decode (DESIGN §3).
    fn sparse_mla_decode(
        &self,
        shape: &DecodeShape,
        bufs: &DecodeBuffers<'_>,
        opts: &DecodeOptions,
    ) -> Result<DecodeRun>;
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

/// Checks every buffer of a decode call against the shape. Errors name the argument,
/// the expected and the actual size.
pub fn check_decode_buffers(shape: &DecodeShape, b: &DecodeBuffers<'_>) -> Result<()> {
    shape.validate()?;
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
    let cache = shape.cache_bytes();
    if b.kv_cache.len() < cache {
        return Err(Error::arg(
            "kv_cache",
            format!(
                "at least {cache} bytes ({} pages x {} slots x {} B rows)",
                shape.num_pages,
                shape.page_size,
                shape.row_bytes()
            ),
            format!("{} bytes", b.kv_cache.len()),
        ));
    }
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

/// Every backend present on this machine, each `Ok` or the reason it is not available:
/// the CPU reference, each wgpu adapter, each CUDA device.
pub fn discover(kinds: &[BackendKind]) -> Vec<(String, Result<Box<dyn Backend>>)> {
    let mut out: Vec<(String, Result<Box<dyn Backend>>)> = Vec::new();
    if kinds.contains(&BackendKind::Cpu) {
        out.push(("cpu".into(), Ok(Box::new(cpu::CpuBackend::new()))));
    }
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
