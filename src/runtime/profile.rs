//! Where a program's device time goes, op by op, on any backend: [`Profiled`] wraps a
//! [`Backend`], waits for the device before and after every operation it forwards, and adds
//! the time between the two waits to the operation's row. `mla-run --profile` prints the rows.
//!
//! What a row measures: the host's wall time from "the device is idle" to "the device is
//! idle again", so it holds the op's launches, its kernels and one wait — on CUDA ~10 µs of
//! launch and wait per op, on wgpu a submit and a poll. The kernels' own durations need a
//! vendor profiler (ncu); this is for finding which op of a step to look at, on a laptop's
//! GPU or lavapipe as well as on CUDA. Graphs are off while profiling (no capture while
//! [`Profiled`] is on), so the launches are the eager ones; switched off it forwards
//! everything untimed, capture included.

use super::gpu::Graph;
use super::op::Op;
use super::{
    Backend, BackendKind, Buffer, CacheWriteBuffers, DecodeBuffers, DecodeOptions, DecodeRun,
    GemmShape, VbtBuffers,
};
use crate::mla::{CacheWriteShape, DecodeShape, VbtShape};
use crate::{Error, Result};
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// One kind of operation's total.
#[derive(Clone, Debug, PartialEq)]
pub struct ProfileRow {
    /// The op's name (model ops: [`Op::name`]; decode: `sparse_mla_decode` and its kernels).
    pub name: String,
    pub calls: u64,
    pub total: Duration,
}

impl ProfileRow {
    /// Milliseconds a step over `steps` steps.
    pub fn ms_per_step(&self, steps: u64) -> f64 {
        self.total.as_secs_f64() * 1e3 / steps.max(1) as f64
    }

    /// Microseconds a call.
    pub fn us_per_call(&self) -> f64 {
        self.total.as_secs_f64() * 1e6 / self.calls.max(1) as f64
    }
}

/// A [`Backend`] that times every operation it forwards (see the module's doc).
pub struct Profiled {
    inner: Arc<dyn Backend>,
    rows: Mutex<HashMap<String, (u64, Duration)>>,
    on: AtomicBool,
}

impl Profiled {
    pub fn new(inner: Arc<dyn Backend>) -> Self {
        Profiled {
            inner,
            rows: Mutex::new(HashMap::new()),
            on: AtomicBool::new(true),
        }
    }

    /// Timing on (from [`Profiled::new`]) or off (everything forwarded untimed). Switch
    /// between steps, not inside a graph's recording.
    pub fn set_on(&self, on: bool) {
        self.on.store(on, Ordering::SeqCst);
    }

    /// The rows so far, the most time first.
    pub fn rows(&self) -> Vec<ProfileRow> {
        let rows = self.rows.lock().unwrap_or_else(|e| e.into_inner());
        let mut out: Vec<ProfileRow> = rows
            .iter()
            .map(|(name, (calls, total))| ProfileRow {
                name: name.clone(),
                calls: *calls,
                total: *total,
            })
            .collect();
        out.sort_by(|a, b| b.total.cmp(&a.total).then(a.name.cmp(&b.name)));
        out
    }

    /// Forget the rows so far (e.g. the prefill's, before the timed decode steps).
    pub fn reset(&self) {
        self.rows.lock().unwrap_or_else(|e| e.into_inner()).clear();
    }

    /// Runs `f` between two waits for the device and adds its time to the row `name` gives
    /// (called with `f`'s result, so a row can name what ran).
    fn timed<T>(
        &self,
        f: impl FnOnce() -> Result<T>,
        name: impl FnOnce(&T) -> String,
    ) -> Result<T> {
        if !self.on.load(Ordering::SeqCst) {
            return f();
        }
        self.inner.synchronize()?;
        let t0 = Instant::now();
        let out = f()?;
        self.inner.synchronize()?;
        let dt = t0.elapsed();
        let mut rows = self.rows.lock().map_err(|_| {
            Error::runtime(self.inner.device_name(), "the profile's lock was poisoned")
        })?;
        let row = rows.entry(name(&out)).or_default();
        row.0 += 1;
        row.1 += dt;
        Ok(out)
    }
}

/// The rows as a plain-text table: op, calls, total ms, µs a call, share of the total.
pub fn format_rows(rows: &[ProfileRow], steps: u64) -> String {
    let total: f64 = rows.iter().map(|r| r.total.as_secs_f64()).sum();
    let width = rows.iter().map(|r| r.name.len()).max().unwrap_or(2).max(2);
    let mut s = format!(
        "{:<width$}  {:>7}  {:>11}  {:>10}  {:>6}\n",
        "op", "calls", "ms / step", "µs / call", "share"
    );
    for r in rows {
        let t = r.total.as_secs_f64();
        s += &format!(
            "{:<width$}  {:>7}  {:>11.3}  {:>10.1}  {:>5.1}%\n",
            r.name,
            r.calls,
            r.ms_per_step(steps),
            r.us_per_call(),
            if total > 0.0 { 100.0 * t / total } else { 0.0 }
        );
    }
    s += &format!(
        "{:<width$}  {:>7}  {:>11.3}\n",
        "all",
        "",
        total * 1e3 / steps.max(1) as f64
    );
    s
}

impl Backend for Profiled {
    fn kind(&self) -> BackendKind {
        self.inner.kind()
    }
    fn device_name(&self) -> String {
        self.inner.device_name()
    }
    fn upload(&self, bytes: &[u8]) -> Result<Buffer> {
        self.inner.upload(bytes)
    }
    fn alloc(&self, len: u64) -> Result<Buffer> {
        self.inner.alloc(len)
    }
    fn write(&self, buf: &Buffer, bytes: &[u8]) -> Result<()> {
        self.inner.write(buf, bytes)
    }
    fn write_at(&self, buf: &Buffer, offset: u64, bytes: &[u8]) -> Result<()> {
        self.inner.write_at(buf, offset, bytes)
    }
    fn download(&self, buf: &Buffer) -> Result<Vec<u8>> {
        self.inner.download(buf)
    }
    fn download_range(&self, buf: &Buffer, offset: u64, len: u64) -> Result<Vec<u8>> {
        self.inner.download_range(buf, offset, len)
    }
    fn download_many(&self, bufs: &[&Buffer]) -> Result<Vec<Vec<u8>>> {
        self.inner.download_many(bufs)
    }
    fn synchronize(&self) -> Result<()> {
        self.inner.synchronize()
    }
    fn memory_info(&self) -> Option<(u64, u64)> {
        self.inner.memory_info()
    }
    fn host_syncs(&self) -> u64 {
        self.inner.host_syncs()
    }
    fn parallelism(&self) -> u32 {
        self.inner.parallelism()
    }
    fn allocations(&self) -> u64 {
        self.inner.allocations()
    }
    fn device_copy(&self, src: &Buffer, dst: &Buffer, len: u64) -> Result<bool> {
        self.timed(
            || self.inner.device_copy(src, dst, len),
            |_| "device_copy".into(),
        )
    }
    // No graphs while on: a replay would run launches this wrapper never sees.
    fn begin_capture(&self) -> Result<bool> {
        if self.on.load(Ordering::SeqCst) {
            return Ok(false);
        }
        self.inner.begin_capture()
    }
    fn end_capture(&self) -> Result<Option<Box<dyn Graph>>> {
        self.inner.end_capture()
    }
    fn gemm_bf16(&self, shape: &GemmShape, x: &Buffer, w: &Buffer, y: &Buffer) -> Result<bool> {
        let (m, n, k, batch) = (shape.m, shape.n, shape.k, shape.batch);
        self.timed(
            || self.inner.gemm_bf16(shape, x, w, y),
            |_| {
                if batch > 1 {
                    format!("gemm_bf16 (vendor BLAS) {batch}x[{m}x{n}x{k}]")
                } else {
                    format!("gemm_bf16 (vendor BLAS) {m}x{n}x{k}")
                }
            },
        )
    }
    fn gemm_available(&self) -> std::result::Result<(), String> {
        self.inner.gemm_available()
    }
    fn run_op(&self, op: &dyn Op, bufs: &[(&str, &Buffer)]) -> Result<()> {
        self.timed(|| self.inner.run_op(op, bufs), |_| op.name())
    }
    fn sparse_mla_decode(
        &self,
        shape: &DecodeShape,
        bufs: &DecodeBuffers<'_>,
        opts: &DecodeOptions,
    ) -> Result<DecodeRun> {
        self.timed(
            || self.inner.sparse_mla_decode(shape, bufs, opts),
            |run| {
                if run.kernels.is_empty() {
                    "sparse_mla_decode".into()
                } else {
                    format!("sparse_mla_decode: {}", run.kernels.join(" + "))
                }
            },
        )
    }
    fn cache_write(&self, shape: &CacheWriteShape, bufs: &CacheWriteBuffers<'_>) -> Result<()> {
        self.timed(
            || self.inner.cache_write(shape, bufs),
            |_| "cache_write".into(),
        )
    }
    fn positions_to_slots(&self, shape: &VbtShape, bufs: &VbtBuffers<'_>) -> Result<()> {
        self.timed(
            || self.inner.positions_to_slots(shape, bufs),
            |_| "positions_to_slots".into(),
        )
    }
}
