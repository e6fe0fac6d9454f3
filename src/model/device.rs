//! The model's handle on a runtime backend: device tensors from a buffer pool, weights in
//! their checkpoint dtype, and one method per model op — each a call of
//! [`Backend::run_op`] (or of the decode / cache-write / block-table calls `mla-check` tests),
//! so the forward is written once and runs on the CPU reference, wgpu and CUDA alike.
//!
//! Activations are f32 (bf16 where a kernel takes bf16: the attention query, its output and
//! the cache rows). Every tensor is a strided [`View`] of a pooled buffer: slicing columns or
//! rows is free. Buffers come back to the pool when the last tensor of one is dropped, and
//! the pool hands them out again by (exact) size, so after the first decode step a step of
//! the same shape allocates nothing on the device ([`Device::allocations`] counts what is
//! made).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use crate::kernels::elementwise::{CastOp, EmbeddingOp, KeyWriteOp, SiluMulOp, SplitBf16Op};
use crate::kernels::expert_shard::LocalExpertsOp;
use crate::kernels::indexer::IndexerScoresOp;
use crate::kernels::linear::{DequantOp, GroupSelect, GroupedLinearOp, LinearOp, SplitReduceOp};
use crate::kernels::moe_route::MoeRouteOp;
use crate::kernels::norm::{NormKind, NormOp};
use crate::kernels::rope::{RopeLayout, RopeOp};
use crate::kernels::sampler::SampleOp;
use crate::kernels::topk::TopkOp;
use crate::kernels::view::{DType, View, WeightLayout, WeightType};
use crate::runtime::{Backend, Buffer, GemmShape, Op};
use crate::{Error, Result};

struct PoolInner {
    free: HashMap<u64, Vec<Buffer>>,
    /// Bytes held by free buffers.
    idle: u64,
}

/// A pooled device buffer: back to the pool when dropped.
pub struct PoolBuf {
    buf: Option<Buffer>,
    pool: Arc<Mutex<PoolInner>>,
    class: u64,
}

impl PoolBuf {
    pub fn buffer(&self) -> &Buffer {
        self.buf
            .as_ref()
            .expect("a pooled buffer is present until it is dropped")
    }
}

impl Drop for PoolBuf {
    fn drop(&mut self) {
        if let (Some(b), Ok(mut p)) = (self.buf.take(), self.pool.lock()) {
            p.idle += self.class;
            p.free.entry(self.class).or_default().push(b);
        }
    }
}

/// A device tensor: a strided view of a pooled buffer.
#[derive(Clone)]
pub struct Tensor {
    buf: Arc<PoolBuf>,
    pub dtype: DType,
    pub view: View,
}

impl Tensor {
    pub fn rows(&self) -> u32 {
        self.view.rows
    }

    pub fn cols(&self) -> u32 {
        self.view.cols
    }

    pub fn buffer(&self) -> &Buffer {
        self.buf.buffer()
    }

    /// Columns `start .. start + len`, no copy.
    pub fn cols_slice(&self, start: u32, len: u32) -> Result<Tensor> {
        Ok(Tensor {
            view: self.view.cols(start, len)?,
            ..self.clone()
        })
    }

    /// Rows `start .. start + len`, no copy.
    pub fn rows_slice(&self, start: u32, len: u32) -> Result<Tensor> {
        Ok(Tensor {
            view: self.view.rows(start, len)?,
            ..self.clone()
        })
    }

    /// The same (packed) elements as `[rows, cols]`.
    pub fn reshape(&self, rows: u32, cols: u32) -> Result<Tensor> {
        Ok(Tensor {
            view: self.view.reshape(rows, cols)?,
            ..self.clone()
        })
    }
}

/// A weight matrix on the device, in its checkpoint dtype.
pub struct Weight {
    pub layout: WeightLayout,
    pub values: Buffer,
    /// FP8: the f32 block scales.
    pub scales: Option<Buffer>,
}

impl Weight {
    pub fn bytes(&self) -> u64 {
        self.layout.bytes() + self.layout.scale_bytes()
    }
}

/// An f32 vector on the device (norm weights, biases).
pub struct Vector {
    pub len: u32,
    pub buf: Buffer,
}

/// A device index matrix `[rows, cols]` i32 (top-k positions, slots, expert ids).
#[derive(Clone)]
pub struct Index {
    buf: Arc<PoolBuf>,
    pub rows: u32,
    pub cols: u32,
}

impl Index {
    pub fn buffer(&self) -> &Buffer {
        self.buf.buffer()
    }
}

/// The model's device: a backend, a buffer pool and the model ops.
pub struct Device {
    backend: Arc<dyn Backend>,
    pool: Arc<Mutex<PoolInner>>,
    /// Buffers the pool had to make (a miss: no free buffer of the size).
    misses: std::sync::atomic::AtomicU64,
    /// Bytes of every buffer the pool has made (it keeps them: its footprint).
    pool_bytes: std::sync::atomic::AtomicU64,
    /// Phase timing, when on ([`Device::set_profiling`]).
    profile: Mutex<Option<Profile>>,
    /// While a graph is being recorded: the ids of the buffers handed out (and no
    /// allocation may happen).
    recording: Mutex<Option<std::collections::HashSet<u64>>>,
    /// [`DenseGemm`] as a number (see [`Device::set_dense_gemm`]).
    gemm: std::sync::atomic::AtomicU8,
    /// Whether the backend has a vendor BLAS (asked once: every linear consults it).
    vendor: bool,
    /// bf16 copies of FP8 weights for the vendor GEMM: the newest (largest) is used; older
    /// ones are kept, since a recorded graph may still point at them.
    dequant: Mutex<Vec<Buffer>>,
}

/// Wall time per (layer, phase) of the steps run while profiling: each mark waits for the
/// device, so the phases add up to the step (slower than an unprofiled step by the waits).
#[derive(Clone, Debug, Default)]
pub struct Profile {
    last: Option<std::time::Instant>,
    /// ((layer or none), phase) → (seconds, marks).
    pub phases: std::collections::BTreeMap<(Option<usize>, &'static str), (f64, u64)>,
}

fn poisoned() -> Error {
    Error::runtime("model", "buffer pool lock poisoned by an earlier panic")
}

/// Which code runs the dense `x · Wᵀ` of bf16 weights (`mla-run --gemm`, `mla-model-bench
/// --gemm`). FP8 weights, per-head and expert linears always run the project's kernels.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DenseGemm {
    /// The project's linear kernel at every batch.
    Kernels,
    /// The vendor BLAS (cuBLAS) at every batch; an error where the backend has none.
    Vendor,
    /// cuBLAS from [`VENDOR_MIN_TOKENS`] tokens ([`VENDOR_MIN_TOKENS_FP8`] for FP8 weights)
    /// where the backend has it, the project's kernel below that and elsewhere (the faster
    /// of the two on the H200, benches/NOTES.md).
    Auto,
}

impl DenseGemm {
    pub fn parse(arg: &str, s: &str) -> Result<Self> {
        match s {
            "kernels" => Ok(DenseGemm::Kernels),
            "cublas" => Ok(DenseGemm::Vendor),
            "auto" => Ok(DenseGemm::Auto),
            other => Err(Error::arg(arg, "auto, kernels or cublas", other)),
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            DenseGemm::Kernels => "kernels",
            DenseGemm::Vendor => "cublas",
            DenseGemm::Auto => "auto",
        }
    }
}

/// Tokens in a step from which [`DenseGemm::Auto`] hands bf16 linears to cuBLAS. Measured on
/// the H200 (GLM-5 stack, 4 K context, `mla-model-bench --batch 1,2,4,8,16,32`): cuBLAS won
/// from 2 tokens (4.19 → 3.71 ms a step at 2, 39.1 → 23.3 at 32) and lost at 1 (3.15 vs 3.19).
pub const VENDOR_MIN_TOKENS: u32 = 2;

/// The same for FP8 weights, which the vendor path first dequantises (reading 1 and writing 4
/// bytes per weight): the GEMV on FP8 won up to 4 tokens (5.97 vs 6.05 ms), cuBLAS from 8
/// (10.96 → 8.64 ms at 8, 38.0 → 23.7 at 32).
pub const VENDOR_MIN_TOKENS_FP8: u32 = 8;

impl Device {
    pub fn new(backend: Arc<dyn Backend>) -> Self {
        let vendor = backend.gemm_available().is_ok();
        Device {
            backend,
            pool: Arc::new(Mutex::new(PoolInner {
                free: HashMap::new(),
                idle: 0,
            })),
            misses: Default::default(),
            pool_bytes: Default::default(),
            profile: Mutex::new(None),
            recording: Mutex::new(None),
            gemm: std::sync::atomic::AtomicU8::new(DenseGemm::Auto as u8),
            vendor,
            dequant: Mutex::new(Vec::new()),
        }
    }

    /// Chooses who runs the dense bf16 linears from now on. [`DenseGemm::Vendor`] is refused
    /// (with why) where the backend has no vendor BLAS.
    pub fn set_dense_gemm(&self, g: DenseGemm) -> Result<()> {
        if g == DenseGemm::Vendor {
            if let Err(why) = self.backend.gemm_available() {
                return Err(Error::arg(
                    "--gemm",
                    format!("a backend with cuBLAS for `cublas` ({why})"),
                    "cublas",
                ));
            }
        }
        self.gemm
            .store(g as u8, std::sync::atomic::Ordering::Relaxed);
        Ok(())
    }

    pub fn dense_gemm(&self) -> DenseGemm {
        match self.gemm.load(std::sync::atomic::Ordering::Relaxed) {
            x if x == DenseGemm::Kernels as u8 => DenseGemm::Kernels,
            x if x == DenseGemm::Vendor as u8 => DenseGemm::Vendor,
            _ => DenseGemm::Auto,
        }
    }

    /// Whether `x · Wᵀ` of `tokens` rows goes to the vendor BLAS under the current policy.
    fn vendor_linear(&self, tokens: u32, w: &Weight) -> bool {
        if matches!(w.layout.wtype, WeightType::F32) {
            return false;
        }
        match self.dense_gemm() {
            DenseGemm::Kernels => false,
            DenseGemm::Vendor => true,
            DenseGemm::Auto => {
                let min = match w.layout.wtype {
                    WeightType::Bf16 => VENDOR_MIN_TOKENS,
                    _ => VENDOR_MIN_TOKENS_FP8,
                };
                tokens >= min && self.vendor
            }
        }
    }

    pub fn backend(&self) -> &dyn Backend {
        self.backend.as_ref()
    }

    pub fn backend_arc(&self) -> Arc<dyn Backend> {
        self.backend.clone()
    }

    /// Activation buffers the pool has had to allocate so far (a step whose tensors all come
    /// back from the pool adds none). Weights and caches are allocated once, at load and cache
    /// creation; the decode kernels' split workspace belongs to the backend and only grows.
    pub fn allocations(&self) -> u64 {
        self.misses.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Turns phase timing on (an empty profile) or off; returns the profile gathered so far.
    pub fn set_profiling(&self, on: bool) -> Option<Profile> {
        let mut p = self.profile.lock().ok()?;
        std::mem::replace(&mut *p, on.then(Profile::default))
    }

    /// Starts timing a step's phases (waits for the device), when profiling.
    pub fn phase_start(&self) -> Result<()> {
        let mut p = self.profile.lock().map_err(|_| poisoned())?;
        if let Some(p) = p.as_mut() {
            self.backend.synchronize()?;
            p.last = Some(std::time::Instant::now());
        }
        Ok(())
    }

    /// Ends the phase `name` of `layer` (waits for the device), when profiling.
    pub fn phase(&self, layer: Option<usize>, name: &'static str) -> Result<()> {
        let mut p = self.profile.lock().map_err(|_| poisoned())?;
        if let Some(p) = p.as_mut() {
            self.backend.synchronize()?;
            let now = std::time::Instant::now();
            if let Some(last) = p.last {
                let e = p.phases.entry((layer, name)).or_default();
                e.0 += (now - last).as_secs_f64();
                e.1 += 1;
            }
            p.last = Some(now);
        }
        Ok(())
    }

    /// Device bytes of the activation pool (every buffer it made; it keeps them for reuse).
    pub fn pool_bytes(&self) -> u64 {
        self.pool_bytes.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Bytes held idle by the pool.
    pub fn pooled_bytes(&self) -> u64 {
        self.pool.lock().map(|p| p.idle).unwrap_or(0)
    }

    fn pooled(&self, bytes: u64) -> Result<Arc<PoolBuf>> {
        // Exact sizes: the kernels' boundary checks see the tensor's own size, and a decode step
        // asks for the same sizes as the step before it.
        let class = bytes;
        let reused = {
            let mut p = self.pool.lock().map_err(|_| poisoned())?;
            let b = p.free.get_mut(&class).and_then(|v| v.pop());
            if b.is_some() {
                p.idle -= class;
            }
            b
        };
        let mut rec = self.recording.lock().map_err(|_| poisoned())?;
        let buf = match reused {
            Some(b) => b,
            None if rec.is_some() => {
                return Err(Error::runtime(
                    "model",
                    format!("a {bytes}-byte buffer would be allocated while a graph is recorded"),
                ))
            }
            None => {
                self.misses
                    .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                self.pool_bytes
                    .fetch_add(class, std::sync::atomic::Ordering::Relaxed);
                self.backend.alloc(class)?
            }
        };
        if let Some(r) = rec.as_mut() {
            r.insert(buf.id());
        }
        drop(rec);
        Ok(Arc::new(PoolBuf {
            buf: Some(buf),
            pool: self.pool.clone(),
            class,
        }))
    }

    /// Starts noting the buffers handed out (a graph is being recorded: they must stay its
    /// own afterwards, and none may be allocated).
    pub fn begin_recording(&self) -> Result<()> {
        *self.recording.lock().map_err(|_| poisoned())? = Some(Default::default());
        Ok(())
    }

    /// Ends the noting; returns the ids of the buffers handed out since the start.
    pub fn end_recording(&self) -> Result<std::collections::HashSet<u64>> {
        Ok(self
            .recording
            .lock()
            .map_err(|_| poisoned())?
            .take()
            .unwrap_or_default())
    }

    /// Takes the buffers with these ids out of the pool (those a recorded graph reads and
    /// writes, so that nothing else is handed them while the graph lives).
    pub fn quarantine(&self, ids: &std::collections::HashSet<u64>) -> Result<Vec<(u64, Buffer)>> {
        let mut p = self.pool.lock().map_err(|_| poisoned())?;
        let mut held = Vec::new();
        for (class, list) in p.free.iter_mut() {
            let mut i = 0;
            while i < list.len() {
                if ids.contains(&list[i].id()) {
                    held.push((*class, list.swap_remove(i)));
                } else {
                    i += 1;
                }
            }
        }
        p.idle -= held.iter().map(|(c, _)| c).sum::<u64>();
        Ok(held)
    }

    /// Gives quarantined buffers back to the pool.
    pub fn release(&self, held: Vec<(u64, Buffer)>) {
        if let Ok(mut p) = self.pool.lock() {
            for (class, b) in held {
                p.idle += class;
                p.free.entry(class).or_default().push(b);
            }
        }
    }

    /// A new packed `[rows, cols]` tensor with unspecified contents.
    pub fn empty(&self, rows: u32, cols: u32, dtype: DType) -> Result<Tensor> {
        let view = View::packed(rows, cols);
        Ok(Tensor {
            buf: self.pooled(view.min_bytes(dtype))?,
            dtype,
            view,
        })
    }

    /// [`Device::empty`] in a buffer of at least `capacity_cols` columns: for tensors that grow
    /// step by step (the indexer's score rows), so that their buffer comes from the pool.
    pub fn empty_with_capacity(
        &self,
        rows: u32,
        cols: u32,
        capacity_cols: u32,
        dtype: DType,
    ) -> Result<Tensor> {
        let view = View::packed(rows, cols);
        let cap = View::packed(rows, capacity_cols.max(cols));
        Ok(Tensor {
            buf: self.pooled(cap.min_bytes(dtype))?,
            dtype,
            view,
        })
    }

    /// A new `[rows, cols]` i32 index matrix with unspecified contents.
    pub fn empty_index(&self, rows: u32, cols: u32) -> Result<Index> {
        Ok(Index {
            buf: self.pooled(rows as u64 * cols as u64 * 4)?,
            rows,
            cols,
        })
    }

    /// An index matrix holding `values` (row-major `[rows, cols]`).
    pub fn index_from(&self, rows: u32, cols: u32, values: &[i32]) -> Result<Index> {
        if values.len() != rows as usize * cols as usize {
            return Err(Error::arg(
                "index values",
                format!("{rows} x {cols}"),
                values.len(),
            ));
        }
        let idx = self.empty_index(rows, cols)?;
        let bytes: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
        self.backend.write(idx.buffer(), &bytes)?;
        Ok(idx)
    }

    /// A packed `[rows, cols]` f32 tensor of zeros (written from the host: the sharded
    /// forward's per-rank sublayer outputs, which its kernels accumulate into).
    pub fn zeros(&self, rows: u32, cols: u32) -> Result<Tensor> {
        let t = self.empty(rows, cols, DType::F32)?;
        let bytes = vec![0u8; rows as usize * cols as usize * 4];
        self.backend.write(t.buffer(), &bytes)?;
        Ok(t)
    }

    /// A packed f32 tensor holding `values`.
    pub fn tensor_from(&self, rows: u32, cols: u32, values: &[f32]) -> Result<Tensor> {
        if values.len() != rows as usize * cols as usize {
            return Err(Error::arg(
                "tensor values",
                format!("{rows} x {cols}"),
                values.len(),
            ));
        }
        let t = self.empty(rows, cols, DType::F32)?;
        let bytes: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
        self.backend.write(t.buffer(), &bytes)?;
        Ok(t)
    }

    /// The tensor's values, row by row, as f32 (waits for the device).
    pub fn download(&self, t: &Tensor) -> Result<Vec<f32>> {
        let bytes = self.backend.download(t.buffer())?;
        crate::reference::tensor::read_view(&bytes, t.dtype, &t.view, "tensor")
            .map(|v| v.into_iter().map(|x| x as f32).collect())
    }

    pub fn download_index(&self, idx: &Index) -> Result<Vec<i32>> {
        let n = idx.rows as u64 * idx.cols as u64 * 4;
        let bytes = self.backend.download_range(idx.buffer(), 0, n)?;
        Ok(crate::reference::tensor::i32s(&bytes))
    }

    fn run(&self, op: &dyn Op, bufs: &[(&str, &Buffer)]) -> Result<()> {
        self.backend.run_op(op, bufs).map_err(|e| match e {
            Error::InvalidArgument {
                arg,
                expected,
                actual,
            } => Error::InvalidArgument {
                arg: format!("{arg} (in {})", op.name()),
                expected,
                actual,
            },
            other => other,
        })
    }

    fn weight_bufs<'a>(w: &'a Weight, into: &mut Vec<(&'static str, &'a Buffer)>) {
        into.push(("w", &w.values));
        if let Some(s) = &w.scales {
            into.push(("w_scale", s));
        }
    }

    // ------------------------------------------------------------------ dense math

    /// `x · Wᵀ` into a new `[T, N]` f32 tensor.
    pub fn linear(&self, x: &Tensor, w: &Weight) -> Result<Tensor> {
        let y = self.empty(x.rows(), w.layout.rows, DType::F32)?;
        self.linear_into(x, w, &y, false)?;
        Ok(y)
    }

    /// `y (+)= x · Wᵀ` into an existing view.
    pub fn linear_into(&self, x: &Tensor, w: &Weight, y: &Tensor, accumulate: bool) -> Result<()> {
        if self.vendor_linear(x.rows(), w) {
            return self.vendor_linear_into(x, w, y, accumulate);
        }
        let splits = LinearOp::splits_for(x.rows(), &w.layout, self.backend.parallelism());
        let op = LinearOp {
            x: x.view,
            x_dtype: x.dtype,
            w: w.layout,
            y: y.view,
            accumulate,
            splits,
        };
        let partials = if splits > 1 {
            Some(self.empty(splits * x.rows(), w.layout.rows, DType::F32)?)
        } else {
            None
        };
        let mut b = vec![("x", x.buffer())];
        Self::weight_bufs(w, &mut b);
        if let Some(p) = &partials {
            b.push(("partials", p.buffer()));
        }
        b.push(("y", y.buffer()));
        self.run(&op, &b)
    }

    /// `y (+)= x · Wᵀ` by the vendor BLAS. Both sides reach its bf16 GEMM as a two-term
    /// split where they are not bf16 already — f32 `x` as hi and lo rows ([`SplitBf16Op`]),
    /// FP8 `W` dequantised to hi and lo halves ([`DequantOp`]) — so the products keep f32
    /// accuracy (2^-16 per operand) for the price of one more read of the small side; the
    /// terms land in `[terms, T, N]` partials that one reduction adds into `y`.
    fn vendor_linear_into(
        &self,
        x: &Tensor,
        w: &Weight,
        y: &Tensor,
        accumulate: bool,
    ) -> Result<()> {
        let (t, n, k) = (x.rows(), w.layout.rows, w.layout.cols);
        if x.view.cols != k || y.view.cols != n || y.rows() != t {
            return Err(Error::arg(
                "linear",
                format!("x [T, {k}] and y [T, {n}] for a [{n}, {k}] weight"),
                format!(
                    "x [{}, {}], y [{}, {}]",
                    t,
                    x.view.cols,
                    y.rows(),
                    y.view.cols
                ),
            ));
        }
        if y.dtype != DType::F32 {
            return Err(Error::arg("linear output", "f32", format!("{:?}", y.dtype)));
        }
        let xs = self.vendor_operand(x)?;
        let x_terms = xs.rows() / t;
        let w_terms: u32 = match w.layout.wtype {
            WeightType::Bf16 => 1,
            _ => 2,
        };
        let terms = x_terms * w_terms;
        let gemm = |values: &Buffer, half: u32, out: &Tensor, beta: bool| -> Result<()> {
            let shape = GemmShape {
                m: xs.rows(),
                n,
                k,
                x_off: xs.view.offset,
                x_stride: xs.view.stride,
                w_off: half as u64 * n as u64 * k as u64,
                y_off: out.view.offset + (half * xs.rows()) as u64 * out.view.stride as u64,
                y_stride: out.view.stride,
                accumulate: beta,
                batch: 1,
                x_batch: 0,
                w_batch: 0,
                y_batch: 0,
            };
            self.vendor_gemm(&shape, &xs, values, out)
        };
        if terms == 1 {
            return gemm(&w.values, 0, y, accumulate);
        }
        let partials = self.empty(terms * t, n, DType::F32)?;
        match w.layout.wtype {
            WeightType::Bf16 => gemm(&w.values, 0, &partials, false)?,
            _ => self.with_dequantized(w, |values| {
                (0..w_terms).try_for_each(|h| gemm(values, h, &partials, false))
            })?,
        }
        self.sum_terms(&partials, y, accumulate)
    }

    /// `y (+)= Σ_z partials[z]` over the `[terms · rows(y), cols(y)]` partials of a vendor
    /// GEMM's hi / lo product terms.
    fn sum_terms(&self, partials: &Tensor, y: &Tensor, accumulate: bool) -> Result<()> {
        let op = SplitReduceOp {
            tokens: y.rows(),
            n_out: y.view.cols,
            splits: partials.rows() / y.rows(),
            y: y.view,
            accumulate,
        };
        self.run(&op, &[("partials", partials.buffer()), ("y", y.buffer())])
    }

    /// A vendor-GEMM operand from `x`: bf16 as it is, f32 split into bf16 hi rows then lo
    /// rows (`[2T, K]` packed), so that the bf16 GEMM keeps f32 accuracy.
    fn vendor_operand(&self, x: &Tensor) -> Result<Tensor> {
        match x.dtype {
            DType::Bf16 => Ok(x.clone()),
            DType::F32 => {
                let s = self.empty(2 * x.rows(), x.view.cols, DType::Bf16)?;
                self.run(
                    &SplitBf16Op { x: x.view },
                    &[("x", x.buffer()), ("y", s.buffer())],
                )?;
                Ok(s)
            }
        }
    }

    /// One [`Backend::gemm_bf16`] call; a backend that declines it is an error here (the
    /// policy chose the vendor path).
    fn vendor_gemm(&self, shape: &GemmShape, x: &Tensor, w: &Buffer, y: &Tensor) -> Result<()> {
        if self.backend.gemm_bf16(shape, x.buffer(), w, y.buffer())? {
            Ok(())
        } else {
            Err(Error::runtime(
                "model",
                format!(
                    "{} has no vendor BLAS (--gemm cublas)",
                    self.backend.device_name()
                ),
            ))
        }
    }

    /// Runs `f` on a bf16 copy of FP8 weights `w`, made in the shared dequant buffer (one
    /// buffer serves every weight: the launches on the stream are ordered).
    fn with_dequantized<T>(&self, w: &Weight, f: impl FnOnce(&Buffer) -> Result<T>) -> Result<T> {
        let bytes = w.layout.rows as u64 * w.layout.cols as u64 * 4;
        let mut held = self.dequant.lock().map_err(|_| poisoned())?;
        if held.last().is_none_or(|b| b.len() < bytes) {
            if self.recording.lock().map_err(|_| poisoned())?.is_some() {
                return Err(Error::runtime(
                    "model",
                    "the FP8 dequant buffer must grow while a graph is recorded (the eager step before it should have grown it)",
                ));
            }
            log::info!(
                "bf16 dequant buffer for the vendor GEMM of FP8 weights: {:.1} MiB",
                bytes as f64 / (1u64 << 20) as f64
            );
            held.push(self.backend.alloc(bytes)?);
            self.misses
                .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            self.pool_bytes
                .fetch_add(bytes, std::sync::atomic::Ordering::Relaxed);
        }
        let buf = held.last().expect("pushed above");
        let op = DequantOp { w: w.layout };
        let mut b = Vec::new();
        Self::weight_bufs(w, &mut b);
        b.push(("y", buf));
        self.run(&op, &b)?;
        f(buf)
    }

    /// Per-head linear: row `r` of `x [T·heads, K]` times head `r % heads`'s `[N, K]` block of
    /// `w`, into `y [T·heads, N]`.
    pub fn head_linear_into(&self, x: &Tensor, w: &Weight, heads: u32, y: &Tensor) -> Result<()> {
        if self.vendor_heads(w) && heads > 0 && x.rows() % heads == 0 {
            return self.vendor_head_linear_into(x, w, heads, y);
        }
        let op = GroupedLinearOp {
            x: x.view,
            x_dtype: x.dtype,
            x_div: 1,
            w: w.layout,
            n_out: w.layout.rows / heads.max(1),
            select: GroupSelect::Heads,
            groups: heads,
            rows: x.rows(),
            combine: None,
            y: y.view,
            accumulate: false,
        };
        let mut b = vec![("x", x.buffer())];
        Self::weight_bufs(w, &mut b);
        b.push(("y", y.buffer()));
        self.run(&op, &b)
    }

    /// Whether the per-head linears go to the vendor's batched GEMM: bf16 weights, under
    /// `cublas` always and under `auto` at every batch — on the H200 our grouped kernel
    /// re-read each head's block for every token, 8 of a 30.6 ms batch-32 step
    /// (tools/gpu-profile-step.sh; benches/NOTES.md).
    fn vendor_heads(&self, w: &Weight) -> bool {
        w.layout.wtype == WeightType::Bf16
            && match self.dense_gemm() {
                DenseGemm::Kernels => false,
                DenseGemm::Vendor => true,
                DenseGemm::Auto => self.vendor,
            }
    }

    /// [`Device::head_linear_into`] as one strided-batched GEMM over the heads: row
    /// `t · heads + h` of `x` times head `h`'s `[N, K]` block, f32 `x` split into bf16 hi / lo
    /// rows as in [`Device::linear_into`].
    fn vendor_head_linear_into(
        &self,
        x: &Tensor,
        w: &Weight,
        heads: u32,
        y: &Tensor,
    ) -> Result<()> {
        let (rows, k) = (x.rows(), w.layout.cols);
        let n = w.layout.rows / heads;
        if x.view.cols != k || y.view.cols != n || y.rows() != rows || y.dtype != DType::F32 {
            return Err(Error::arg(
                "per-head linear",
                format!("x [T·{heads}, {k}] and f32 y [T·{heads}, {n}]"),
                format!(
                    "x [{rows}, {}], y [{}, {}] {:?}",
                    x.view.cols,
                    y.rows(),
                    y.view.cols,
                    y.dtype
                ),
            ));
        }
        let tokens = rows / heads;
        let xs = self.vendor_operand(x)?;
        let terms = xs.rows() / rows;
        let run = |out: &Tensor| -> Result<()> {
            let shape = GemmShape {
                m: terms * tokens,
                n,
                k,
                x_off: xs.view.offset,
                x_stride: heads * xs.view.stride,
                w_off: 0,
                y_off: out.view.offset,
                y_stride: heads * out.view.stride,
                accumulate: false,
                batch: heads,
                x_batch: xs.view.stride as u64,
                w_batch: n as u64 * k as u64,
                y_batch: out.view.stride as u64,
            };
            self.vendor_gemm(&shape, &xs, &w.values, out)
        };
        if terms == 1 {
            return run(y);
        }
        let partials = self.empty(terms * rows, n, DType::F32)?;
        run(&partials)?;
        self.sum_terms(&partials, y, false)
    }

    /// Routed experts, first half: `z[t·k + j] = x[t] · W[ids[t, j]]ᵀ` → `[T·k, N]`.
    pub fn expert_linear(
        &self,
        x: &Tensor,
        w: &Weight,
        experts: u32,
        ids: &Index,
    ) -> Result<Tensor> {
        let k = ids.cols;
        let n = w.layout.rows / experts.max(1);
        let y = self.empty(x.rows() * k, n, DType::F32)?;
        let op = GroupedLinearOp {
            x: x.view,
            x_dtype: x.dtype,
            x_div: k,
            w: w.layout,
            n_out: n,
            select: GroupSelect::Experts,
            groups: experts,
            rows: x.rows() * k,
            combine: None,
            y: y.view,
            accumulate: false,
        };
        let mut b = vec![("x", x.buffer())];
        Self::weight_bufs(w, &mut b);
        b.push(("ids", ids.buffer()));
        b.push(("y", y.buffer()));
        self.run(&op, &b)?;
        Ok(y)
    }

    /// Routed experts, second half: `y[t] += Σ_j weights[t, j] · (x[t·k + j] · W[ids[t, j]]ᵀ)`.
    pub fn expert_linear_combine(
        &self,
        x: &Tensor,
        w: &Weight,
        experts: u32,
        ids: &Index,
        weights: &Tensor,
        y: &Tensor,
    ) -> Result<()> {
        let op = GroupedLinearOp {
            x: x.view,
            x_dtype: x.dtype,
            x_div: 1,
            w: w.layout,
            n_out: w.layout.rows / experts.max(1),
            select: GroupSelect::Experts,
            groups: experts,
            rows: x.rows(),
            combine: Some(ids.cols),
            y: y.view,
            accumulate: true,
        };
        if weights.view.offset != 0 || weights.view.stride != weights.view.cols {
            return Err(Error::arg(
                "routing weights",
                "a packed tensor",
                "a strided view",
            ));
        }
        let mut b = vec![("x", x.buffer())];
        Self::weight_bufs(w, &mut b);
        b.push(("ids", ids.buffer()));
        b.push(("route_w", weights.buffer()));
        b.push(("y", y.buffer()));
        self.run(&op, &b)
    }

    fn norm(
        &self,
        kind: NormKind,
        x: &Tensor,
        w: &Vector,
        b: Option<&Vector>,
        eps: f32,
        y: &Tensor,
    ) -> Result<()> {
        let op = NormOp {
            kind,
            x: x.view,
            y: y.view,
            eps,
        };
        let mut bufs = vec![("x", x.buffer()), ("w", &w.buf)];
        if let Some(b) = b {
            bufs.push(("bias", &b.buf));
        }
        bufs.push(("y", y.buffer()));
        self.run(&op, &bufs)
    }

    pub fn rms_norm(&self, x: &Tensor, w: &Vector, eps: f32) -> Result<Tensor> {
        let y = self.empty(x.rows(), x.cols(), DType::F32)?;
        self.norm(NormKind::Rms, x, w, None, eps, &y)?;
        Ok(y)
    }

    pub fn layer_norm(&self, x: &Tensor, w: &Vector, b: &Vector, eps: f32) -> Result<Tensor> {
        let y = self.empty(x.rows(), x.cols(), DType::F32)?;
        self.norm(NormKind::Layer, x, w, Some(b), eps, &y)?;
        Ok(y)
    }

    /// RoPE of `x` into `y` (another buffer); row `r` at `positions[r / group]`.
    pub fn rope_into(
        &self,
        x: &Tensor,
        y: &Tensor,
        group: u32,
        positions: &Index,
        table: &RopeTableBuf,
        layout: RopeLayout,
    ) -> Result<()> {
        let op = RopeOp {
            layout,
            x: x.view,
            y: y.view,
            group,
            table_rows: table.rows,
            in_place: false,
        };
        self.run(
            &op,
            &[
                ("x", x.buffer()),
                ("positions", positions.buffer()),
                ("table", &table.buf),
                ("y", y.buffer()),
            ],
        )
    }

    /// RoPE of `x` where it is.
    pub fn rope_in_place(
        &self,
        x: &Tensor,
        group: u32,
        positions: &Index,
        table: &RopeTableBuf,
        layout: RopeLayout,
    ) -> Result<()> {
        let op = RopeOp {
            layout,
            x: x.view,
            y: x.view,
            group,
            table_rows: table.rows,
            in_place: true,
        };
        self.run(
            &op,
            &[
                ("positions", positions.buffer()),
                ("table", &table.buf),
                ("y", x.buffer()),
            ],
        )
    }

    /// `silu(g) ⊙ u` for `g`, `u` two views of one tensor's buffer.
    pub fn silu_mul(&self, g: &Tensor, up: &Tensor) -> Result<Tensor> {
        if !Arc::ptr_eq(&g.buf, &up.buf) {
            return Err(Error::arg(
                "silu_mul",
                "gate and up as views of one buffer",
                "two buffers",
            ));
        }
        let y = self.empty(g.rows(), g.cols(), DType::F32)?;
        let op = SiluMulOp {
            g: g.view,
            u: up.view,
            y: y.view,
        };
        self.run(&op, &[("x", g.buffer()), ("y", y.buffer())])?;
        Ok(y)
    }

    /// `x` as `to`, into `y`.
    pub fn cast_into(&self, x: &Tensor, y: &Tensor) -> Result<()> {
        let op = CastOp {
            x: x.view,
            y: y.view,
            to: y.dtype,
        };
        if x.dtype == y.dtype {
            return Err(Error::arg("cast", "two different dtypes", x.dtype.name()));
        }
        self.run(&op, &[("x", x.buffer()), ("y", y.buffer())])
    }

    pub fn cast(&self, x: &Tensor, to: DType) -> Result<Tensor> {
        let y = self.empty(x.rows(), x.cols(), to)?;
        self.cast_into(x, &y)?;
        Ok(y)
    }

    /// Rows of `table` (an embedding table, or any packed matrix) picked by `ids`.
    pub fn gather_rows(&self, table: &Weight, ids: &Index) -> Result<Tensor> {
        let y = self.empty(ids.rows * ids.cols, table.layout.cols, DType::F32)?;
        let op = EmbeddingOp {
            table: table.layout,
            tokens: ids.rows * ids.cols,
            y: y.view,
        };
        self.run(
            &op,
            &[
                ("table", &table.values),
                ("ids", ids.buffer()),
                ("y", y.buffer()),
            ],
        )?;
        Ok(y)
    }

    /// Rows of a packed f32 tensor picked by `ids` (the last token of each sequence).
    pub fn select_rows(&self, x: &Tensor, ids: &Index) -> Result<Tensor> {
        if x.dtype != DType::F32 || x.view.offset != 0 || x.view.stride != x.view.cols {
            return Err(Error::arg(
                "select_rows",
                "a packed f32 tensor",
                "a strided view",
            ));
        }
        let y = self.empty(ids.rows * ids.cols, x.cols(), DType::F32)?;
        let op = EmbeddingOp {
            table: WeightLayout::new(WeightType::F32, x.rows(), x.cols()),
            tokens: ids.rows * ids.cols,
            y: y.view,
        };
        self.run(
            &op,
            &[
                ("table", x.buffer()),
                ("ids", ids.buffer()),
                ("y", y.buffer()),
            ],
        )?;
        Ok(y)
    }

    /// Stores `x [T, width]` as bf16 rows of `cache` at `slots`.
    pub fn write_keys(
        &self,
        x: &Tensor,
        slots: &Index,
        cache: &Buffer,
        num_slots: u32,
    ) -> Result<()> {
        let op = KeyWriteOp {
            x: x.view,
            num_slots,
        };
        self.run(
            &op,
            &[
                ("x", x.buffer()),
                ("slot_mapping", slots.buffer()),
                ("cache", cache),
            ],
        )
    }

    /// Indexer scores `[T, columns]`.
    #[allow(clippy::too_many_arguments)]
    pub fn indexer_scores(
        &self,
        q: &Tensor,
        w: &Tensor,
        heads: u32,
        keys: &Buffer,
        num_slots: u32,
        table: &BlockTables,
        columns: u32,
        scale: f32,
        weight_scale: f32,
    ) -> Result<Tensor> {
        let tokens = w.rows();
        let scores =
            self.empty_with_capacity(tokens, columns, score_capacity(columns), DType::F32)?;
        let op = IndexerScoresOp {
            tokens,
            heads,
            head_dim: q.cols(),
            q: q.view,
            w: w.view,
            columns,
            num_slots,
            page_size: table.page_size,
            requests: table.requests,
            max_pages: table.max_pages,
            scale,
            weight_scale,
        };
        self.run(
            &op,
            &[
                ("q", q.buffer()),
                ("w", w.buffer()),
                ("keys", keys),
                ("block_table", table.buf),
                ("req_of_token", table.req_of_token.buffer()),
                ("positions", table.positions.buffer()),
                ("scores", scores.buffer()),
            ],
        )?;
        Ok(scores)
    }

    /// The exact top-k positions of each score row (`scores` may be unread when every row
    /// holds at most `topk` positions).
    pub fn topk(&self, scores: &Tensor, positions: &Index, topk: u32) -> Result<Index> {
        let out = self.empty_index(scores.rows(), topk)?;
        let op = TopkOp {
            tokens: scores.rows(),
            columns: scores.cols(),
            topk,
        };
        self.run(
            &op,
            &[
                ("scores", scores.buffer()),
                ("positions", positions.buffer()),
                ("indices", out.buffer()),
            ],
        )?;
        Ok(out)
    }

    pub fn run_op(&self, op: &dyn Op, bufs: &[(&str, &Buffer)]) -> Result<()> {
        self.run(op, bufs)
    }

    /// noaux_tc routing of `logits [T, experts]` with `bias [experts]`: (`ids [T, top_k]`,
    /// `weights [T, top_k]`).
    pub fn moe_route(
        &self,
        logits: &Tensor,
        bias: &Vector,
        c: &crate::model::ModelConfig,
    ) -> Result<(Index, Tensor)> {
        let k = u32::try_from(c.num_experts_per_tok)
            .map_err(|_| Error::arg("num_experts_per_tok", "a u32", c.num_experts_per_tok))?;
        let op = MoeRouteOp {
            logits: logits.view,
            n_group: c.n_group as u32,
            topk_group: c.topk_group as u32,
            top_k: k,
            norm_topk_prob: c.norm_topk_prob,
            routed_scaling_factor: c.routed_scaling_factor,
        };
        let ids = self.empty_index(logits.rows(), k)?;
        let weights = self.empty(logits.rows(), k, DType::F32)?;
        self.run(
            &op,
            &[
                ("logits", logits.buffer()),
                ("bias", &bias.buf),
                ("ids", ids.buffer()),
                ("weights", weights.buffer()),
            ],
        )?;
        Ok((ids, weights))
    }

    /// Expert ids `[T, k]` as the rank holding experts `[base, base + count)` sees them:
    /// `id − base` for its own, −1 (skipped by [`Device::expert_linear`]) for the others.
    pub fn local_experts(&self, ids: &Index, base: u32, count: u32) -> Result<Index> {
        let out = self.empty_index(ids.rows, ids.cols)?;
        let op = LocalExpertsOp {
            n: ids.rows * ids.cols,
            base,
            count,
        };
        self.run(&op, &[("ids", ids.buffer()), ("local", out.buffer())])?;
        Ok(out)
    }

    /// Samples one token per row of `logits [R, V]` with `uniforms [R]` (host-drawn, in
    /// [0, 1)): (`ids [R]`, `logprobs [R]`, `bad [R]` — the count of non-finite logits of the
    /// row, whose id is then −1). Only these cross to the host.
    pub fn sample(
        &self,
        logits: &Tensor,
        uniforms: &[f32],
        temperature: f32,
        top_k: u32,
        top_p: f32,
    ) -> Result<Vec<(i32, f32, u32)>> {
        let r = logits.rows();
        if uniforms.len() != r as usize {
            return Err(Error::arg(
                "uniforms",
                format!("{r} values"),
                uniforms.len(),
            ));
        }
        let op = SampleOp {
            logits: logits.view,
            temperature,
            top_k,
            top_p,
        };
        let u = self.tensor_from(r, 1, uniforms)?;
        let ids = self.empty_index(r, 1)?;
        let lp = self.empty(r, 1, DType::F32)?;
        let bad = self.empty_index(r, 1)?;
        self.run(
            &op,
            &[
                ("logits", logits.buffer()),
                ("uniforms", u.buffer()),
                ("ids", ids.buffer()),
                ("logprobs", lp.buffer()),
                ("bad", bad.buffer()),
            ],
        )?;
        // One wait for the device: the only one of a decode step.
        let got = self
            .backend
            .download_many(&[ids.buffer(), lp.buffer(), bad.buffer()])?;
        let ids = crate::reference::tensor::i32s(&got[0]);
        let lps = crate::reference::tensor::f32s(&got[1]);
        let bads = crate::reference::tensor::i32s(&got[2]);
        Ok((0..r as usize)
            .map(|i| (ids[i], lps[i], bads[i] as u32))
            .collect())
    }
}

/// Columns of score buffer kept for a row of `columns` positions: the next multiple of 1024
/// up to 8 K, then of 8 K — so that a growing context reuses one buffer for many steps.
pub fn score_capacity(columns: u32) -> u32 {
    let grain = if columns <= 8192 { 1024 } else { 8192 };
    columns.div_ceil(grain).saturating_mul(grain)
}

/// A RoPE cos / sin table on the device: `[rows, 2, half]` f32.
pub struct RopeTableBuf {
    pub rows: u32,
    pub buf: Buffer,
}

/// The per-step block-table inputs of the kernels: the table of every sequence slot
/// (`[requests, max_pages]` i32), and for the step's tokens their table row and position.
pub struct BlockTables<'a> {
    pub buf: &'a Buffer,
    pub requests: u32,
    pub max_pages: u32,
    pub page_size: u32,
    pub req_of_token: &'a Index,
    pub positions: &'a Index,
}
