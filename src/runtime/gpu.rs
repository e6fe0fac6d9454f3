//! The part of every GPU backend that is the same for wgpu and CUDA: choose a plan, get the
//! lowered kernels, compile each once, bind buffers by name and launch.

use super::{
    check_cache_write_buffers, check_decode_buffers, check_vbt_buffers, Backend, BackendKind,
    Buffer, CacheWriteBuffers, DecodeBuffers, DecodeOptions, DecodeRun, VbtBuffers,
};
use crate::kernels::sparse_mla_decode::{launches, DecodeConfig, DecodePlan};
use crate::kernels::{cache_write, vbt, Launch};
use crate::kir::Kernel;
use crate::mla::{CacheFormat, CacheWriteShape, DecodeShape, MlaDims, VbtShape};
use crate::{Error, Result};
use std::collections::HashMap;
use std::sync::{Arc, Mutex};

/// A recorded sequence of launches that replays as one submission (a CUDA graph).
pub trait Graph: Send + Sync {
    fn replay(&self) -> Result<()>;
}

/// What a GPU runtime provides: compile a lowered kernel, launch it, move bytes.
pub trait Device: Send + Sync + 'static {
    type Buf: Send + Sync + 'static;
    type Module: Send + Sync + 'static;
    fn kind(&self) -> BackendKind;
    fn name(&self) -> String;
    /// The decode configuration this device runs best (it must fit the device's limits).
    fn decode_config(&self, dims: MlaDims, format: CacheFormat) -> DecodeConfig;
    /// Workgroups that fill the device (the split heuristic aims for this many).
    fn target_workgroups(&self) -> u32;
    /// The most `block_n` steps one decode workgroup of `config` may loop over, if the device
    /// limits it.
    fn max_steps_per_workgroup(&self, config: &DecodeConfig) -> Option<u32> {
        let _ = config;
        None
    }
    /// The decode plan (config and splits) for `shape`; `splits` overrides the heuristic. The
    /// default uses [`Self::decode_config`] and fills [`Self::target_workgroups`].
    fn decode_plan(&self, shape: &DecodeShape, splits: Option<u32>) -> Result<DecodePlan> {
        let config = self.decode_config(shape.dims, shape.format);
        DecodePlan::new(
            config,
            shape,
            self.target_workgroups(),
            splits,
            self.max_steps_per_workgroup(&config),
        )
    }
    /// Compile a lowered kernel. Refuses kernels that exceed the device's limits.
    fn compile(&self, kernel: &Kernel) -> Result<Self::Module>;
    fn alloc(&self, len: u64) -> Result<Self::Buf>;
    /// Copy `bytes` to the start of `buf`.
    fn write(&self, buf: &Self::Buf, bytes: &[u8]) -> Result<()>;
    /// The first `len` bytes of `buf`.
    fn read(&self, buf: &Self::Buf, len: u64) -> Result<Vec<u8>>;
    /// Copy `bytes` into `buf` from byte `offset` (range checked by the caller). The default
    /// handles offset 0 only.
    fn write_at(&self, buf: &Self::Buf, offset: u64, bytes: &[u8]) -> Result<()> {
        if offset == 0 {
            return self.write(buf, bytes);
        }
        Err(Error::runtime(
            self.name(),
            "writes at an offset are not supported here",
        ))
    }
    /// `len` bytes of `buf` from byte `offset` (range checked by the caller). The default
    /// handles offset 0 only.
    fn read_at(&self, buf: &Self::Buf, offset: u64, len: u64) -> Result<Vec<u8>> {
        if offset == 0 {
            return self.read(buf, len);
        }
        Err(Error::runtime(
            self.name(),
            "reads at an offset are not supported here",
        ))
    }
    /// Waits for all submitted work.
    fn synchronize(&self) -> Result<()> {
        Ok(())
    }
    /// Device-to-device copy (false: not supported here).
    fn copy(&self, src: &Self::Buf, dst: &Self::Buf, len: u64) -> Result<bool> {
        let _ = (src, dst, len);
        Ok(false)
    }
    /// Starts recording launches instead of running them (false: not supported here).
    fn begin_capture(&self) -> Result<bool> {
        Ok(false)
    }
    /// Ends a recording; the launches become a graph to replay.
    fn end_capture(&self) -> Result<Option<Box<dyn Graph>>> {
        Ok(None)
    }
    /// Several reads with one wait (the default reads one by one).
    fn read_many(&self, reads: &[(&Self::Buf, u64)]) -> Result<Vec<Vec<u8>>> {
        reads
            .iter()
            .map(|(b, len)| self.read_at(b, 0, *len))
            .collect()
    }
    /// (free, total) device memory, where the API says.
    fn memory_info(&self) -> Option<(u64, u64)> {
        None
    }
    /// Times the host has waited for the device so far (synchronisations, reads back).
    fn host_syncs(&self) -> u64 {
        0
    }
    /// [`Backend::gemm_bf16`] on this device (false: no vendor BLAS here).
    fn gemm_bf16(
        &self,
        shape: &super::GemmShape,
        x: &Self::Buf,
        w: &Self::Buf,
        y: &Self::Buf,
    ) -> Result<bool> {
        let _ = (shape, x, w, y);
        Ok(false)
    }
    /// Whether [`Device::gemm_bf16`] runs here (`Err`: why not).
    fn gemm_available(&self) -> std::result::Result<(), String> {
        Err(format!("{} has no vendor BLAS", self.name()))
    }
    /// Launch with buffers in the kernel's declaration order.
    fn launch(
        &self,
        module: &Self::Module,
        kernel: &Kernel,
        grid: [u32; 3],
        params: &[u8],
        bufs: &[&Self::Buf],
    ) -> Result<()>;
}

/// A [`Backend`] over any [`Device`].
pub struct GpuBackend<D: Device> {
    dev: D,
    id: u64,
    allocations: std::sync::atomic::AtomicU64,
    modules: Mutex<HashMap<String, Arc<D::Module>>>,
    /// Split-K partials, grown as needed: (o_part, lse_part).
    workspace: Mutex<Option<(Buffer, Buffer)>>,
    /// Workspaces outgrown: kept, since a recorded graph may still point at them.
    retired: Mutex<Vec<(Buffer, Buffer)>>,
    /// The merged decode kernel's meeting counters ([`SYNC_WORDS`] u32, zeroed once; each
    /// launch leaves them zero): made at the first merged call, never resized, so a recorded
    /// graph's pointer stays valid.
    sync: Mutex<Option<Buffer>>,
}

/// Words of the merged decode kernel's counters: two per token, for the most tokens a call
/// takes (65535, the grid's z limit).
pub const SYNC_WORDS: u64 = 2 * 65536;

impl<D: Device> GpuBackend<D> {
    pub fn new(dev: D) -> Self {
        GpuBackend {
            dev,
            id: super::next_backend_id(),
            allocations: Default::default(),
            modules: Mutex::new(HashMap::new()),
            workspace: Mutex::new(None),
            retired: Mutex::new(Vec::new()),
            sync: Mutex::new(None),
        }
    }

    pub fn device(&self) -> &D {
        &self.dev
    }

    fn module(&self, kernel: &Kernel) -> Result<Arc<D::Module>> {
        let mut m = self.modules.lock().map_err(|_| poisoned())?;
        if let Some(module) = m.get(&kernel.name) {
            return Ok(module.clone());
        }
        let module = Arc::new(self.dev.compile(kernel)?);
        m.insert(kernel.name.clone(), module.clone());
        Ok(module)
    }

    fn buf<'a>(&self, b: &'a Buffer, arg: &str) -> Result<&'a D::Buf> {
        b.get::<D::Buf>(self.id, arg)
    }

    /// Run `launch`, binding the kernel's buffers by name from `named`.
    fn run(&self, launch: &Launch, named: &[(&str, &D::Buf)]) -> Result<()> {
        let module = self.module(&launch.kernel)?;
        let mut bufs = Vec::with_capacity(launch.kernel.buffers.len());
        for decl in &launch.kernel.buffers {
            let b = named
                .iter()
                .find(|(n, _)| *n == decl.name)
                .map(|(_, b)| *b)
                .ok_or_else(|| Error::Kir {
                    kernel: launch.kernel.name.clone(),
                    message: format!("no buffer bound for `{}`", decl.name),
                })?;
            bufs.push(b);
        }
        self.dev
            .launch(&module, &launch.kernel, launch.grid, &launch.params, &bufs)
    }

    /// The decode plan this backend would use for `shape`.
    pub fn decode_plan(&self, shape: &DecodeShape, opts: &DecodeOptions) -> Result<DecodePlan> {
        self.dev.decode_plan(shape, opts.splits)
    }
}

fn poisoned() -> Error {
    Error::runtime("gpu", "lock poisoned by an earlier panic")
}

impl<D: Device> Backend for GpuBackend<D> {
    fn kind(&self) -> BackendKind {
        self.dev.kind()
    }

    fn device_name(&self) -> String {
        self.dev.name()
    }

    fn upload(&self, bytes: &[u8]) -> Result<Buffer> {
        let b = self.alloc(bytes.len() as u64)?;
        self.dev.write_at(self.buf(&b, "buf")?, 0, bytes)?;
        Ok(b)
    }

    fn alloc(&self, len: u64) -> Result<Buffer> {
        self.allocations
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        Ok(Buffer::new(self.id, len, self.dev.alloc(len)?))
    }

    fn write_at(&self, buf: &Buffer, offset: u64, bytes: &[u8]) -> Result<()> {
        super::check_range("bytes", buf.len(), offset, bytes.len() as u64, true)?;
        if bytes.is_empty() {
            return Ok(());
        }
        self.dev.write_at(self.buf(buf, "buf")?, offset, bytes)
    }

    fn download_range(&self, buf: &Buffer, offset: u64, len: u64) -> Result<Vec<u8>> {
        super::check_range("range", buf.len(), offset, len, true)?;
        if len == 0 {
            return Ok(Vec::new());
        }
        self.dev.read_at(self.buf(buf, "buf")?, offset, len)
    }

    fn synchronize(&self) -> Result<()> {
        self.dev.synchronize()
    }

    fn download_many(&self, bufs: &[&Buffer]) -> Result<Vec<Vec<u8>>> {
        let mut reads = Vec::with_capacity(bufs.len());
        for b in bufs {
            reads.push((self.buf(b, "buf")?, b.len()));
        }
        self.dev.read_many(&reads)
    }

    fn memory_info(&self) -> Option<(u64, u64)> {
        self.dev.memory_info()
    }

    fn allocations(&self) -> u64 {
        self.allocations.load(std::sync::atomic::Ordering::Relaxed)
    }

    fn parallelism(&self) -> u32 {
        self.dev.target_workgroups()
    }

    fn host_syncs(&self) -> u64 {
        self.dev.host_syncs()
    }

    fn device_copy(&self, src: &Buffer, dst: &Buffer, len: u64) -> Result<bool> {
        super::check_range("src", src.len(), 0, len, false)?;
        super::check_range("dst", dst.len(), 0, len, false)?;
        self.dev
            .copy(self.buf(src, "src")?, self.buf(dst, "dst")?, len)
    }

    fn begin_capture(&self) -> Result<bool> {
        self.dev.begin_capture()
    }

    fn end_capture(&self) -> Result<Option<Box<dyn Graph>>> {
        self.dev.end_capture()
    }

    fn gemm_bf16(
        &self,
        shape: &super::GemmShape,
        x: &Buffer,
        w: &Buffer,
        y: &Buffer,
    ) -> Result<bool> {
        shape.check(x, w, y)?;
        self.dev.gemm_bf16(
            shape,
            self.buf(x, "x")?,
            self.buf(w, "w")?,
            self.buf(y, "y")?,
        )
    }

    fn gemm_available(&self) -> std::result::Result<(), String> {
        self.dev.gemm_available()
    }

    fn run_op(&self, op: &dyn super::Op, bufs: &[(&str, &Buffer)]) -> Result<()> {
        super::op::check_bindings(op, &super::binding_info(bufs))?;
        let mut named: Vec<(&str, &D::Buf)> = Vec::with_capacity(bufs.len());
        for (n, b) in bufs {
            named.push((n, self.buf(b, n)?));
        }
        for l in op.launches()? {
            if l.grid.contains(&0) {
                continue;
            }
            self.run(&l, &named)?;
        }
        Ok(())
    }

    fn sparse_mla_decode(
        &self,
        shape: &DecodeShape,
        b: &DecodeBuffers<'_>,
        opts: &DecodeOptions,
    ) -> Result<DecodeRun> {
        check_decode_buffers(shape, b)?;
        let plan = self.decode_plan(shape, opts)?;
        let launches = launches(shape, &b.layout, &plan)?;
        // Kernels always bind a topk_length buffer; without one, the indices stand in
        // (never read: has_topk_length = 0 makes the kernel read element 0 and ignore it).
        let topk_length = b.topk_length.unwrap_or(b.indices);
        let mut named: Vec<(&str, &D::Buf)> = vec![
            ("q", self.buf(b.q, "q")?),
            ("kv_cache", self.buf(b.kv_cache, "kv_cache")?),
            ("indices", self.buf(b.indices, "indices")?),
            ("topk_length", self.buf(topk_length, "topk_length")?),
            ("out", self.buf(b.out, "out")?),
            ("lse", self.buf(b.lse, "lse")?),
        ];
        // The split kernel binds the partials' scratch in every call; with one split it does
        // not touch it (a word each is enough, and no buffer is bound twice).
        let mut ws = self.workspace.lock().map_err(|_| poisoned())?;
        let rows = plan.partial_rows(shape);
        let (o_len, l_len) = (
            (rows * shape.dims.d_v() as u64 * 4).max(4),
            (rows * 4).max(4),
        );
        let fits = matches!(&*ws, Some((o, l)) if o.len() >= o_len && l.len() >= l_len);
        if !fits {
            let new = (self.alloc(o_len)?, self.alloc(l_len)?);
            if let Some(old) = ws.replace(new) {
                self.retired.lock().map_err(|_| poisoned())?.push(old);
            }
        }
        if let Some((o, l)) = ws.as_ref() {
            named.push(("o_part", self.buf(o, "o_part")?));
            named.push(("lse_part", self.buf(l, "lse_part")?));
        }
        let mut sync = self.sync.lock().map_err(|_| poisoned())?;
        if plan.runs_merged() && sync.is_none() {
            let counters = self.alloc(SYNC_WORDS * 4)?;
            self.dev.write(
                self.buf(&counters, "sync")?,
                &vec![0u8; (SYNC_WORDS * 4) as usize],
            )?;
            *sync = Some(counters);
        }
        if let Some(counters) = sync.as_ref() {
            named.push(("sync", self.buf(counters, "sync")?));
        }
        for l in &launches {
            self.run(l, &named)?;
        }
        Ok(DecodeRun {
            splits: plan.splits,
            p_rounded: plan.config.p_elem != crate::kir::ir::TileElem::F32,
            kernels: launches.iter().map(|l| l.kernel.name.clone()).collect(),
            merged: plan.runs_merged(),
            whole_tokens: plan.whole_tokens,
        })
    }

    fn cache_write(&self, shape: &CacheWriteShape, b: &CacheWriteBuffers<'_>) -> Result<()> {
        let geometry = check_cache_write_buffers(shape, b)?;
        let launch = cache_write::launch(shape, &geometry)?;
        self.run(
            &launch,
            &[
                ("latent", self.buf(b.latent, "latent")?),
                ("rope", self.buf(b.rope, "rope")?),
                ("slot_mapping", self.buf(b.slot_mapping, "slot_mapping")?),
                ("kv_cache", self.buf(b.kv_cache, "kv_cache")?),
            ],
        )
    }

    fn positions_to_slots(&self, shape: &VbtShape, b: &VbtBuffers<'_>) -> Result<()> {
        check_vbt_buffers(shape, b)?;
        let launch = vbt::launch(shape)?;
        self.run(
            &launch,
            &[
                ("positions", self.buf(b.positions, "positions")?),
                ("block_table", self.buf(b.block_table, "block_table")?),
                ("req_of_token", self.buf(b.req_of_token, "req_of_token")?),
                ("slots", self.buf(b.slots, "slots")?),
            ],
        )
    }
}
