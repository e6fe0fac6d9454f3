//! CUDA backend: NVRTC compiles the emitted CUDA C for the GPU that is present (cached on
//! disk by source hash + arch), the driver API runs it. Both libraries are loaded at run time;
//! when either is missing this module returns an [`Error::Unavailable`] that says what to
//! install, never a panic.

use super::gpu::Device;
use super::BackendKind;
use crate::emit::cuda as emit_cuda;
use crate::kernels::sparse_mla_decode::{
    lowered_kernels, lowered_merged, DecodeConfig, DecodePlan, MergePolicy,
};
use crate::kir::Kernel;
use crate::mla::{CacheFormat, DecodeShape, MlaDims};
use crate::{Error, Result};
use cudarc::driver::{result as drv, sys as drv_sys, CudaContext, CudaSlice, CudaStream};
use cudarc::nvrtc::{result as nvrtc, sys as nvrtc_sys};
use std::collections::HashMap;
use std::ffi::{c_void, CStr, CString};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, OnceLock};

const NAME: &str = "cuda";

/// Why NVRTC cannot be used here, if it cannot.
pub fn nvrtc_unavailable() -> Option<String> {
    static PRESENT: OnceLock<bool> = OnceLock::new();
    let present = *PRESENT.get_or_init(|| unsafe { nvrtc_sys::is_culib_present() });
    if present {
        None
    } else {
        Some(
            "NVRTC (libnvrtc.so) not found: install it, e.g. \
             `pip install --target DIR nvidia-cuda-nvrtc-cu12==12.8.*`, and add \
             DIR/nvidia/cuda_nvrtc/lib to LD_LIBRARY_PATH"
                .into(),
        )
    }
}

/// Why the CUDA driver cannot be used here, if it cannot.
pub fn driver_unavailable() -> Option<String> {
    static PRESENT: OnceLock<bool> = OnceLock::new();
    let present = *PRESENT.get_or_init(|| unsafe { drv_sys::is_culib_present() });
    if present {
        None
    } else {
        Some(
            "the CUDA driver (libcuda.so) is not installed: no NVIDIA GPU driver on this machine"
                .into(),
        )
    }
}

/// NVRTC's version, e.g. (12, 8).
pub fn nvrtc_version() -> Result<(i32, i32)> {
    if let Some(why) = nvrtc_unavailable() {
        return Err(Error::unavailable("nvrtc", why));
    }
    let (mut major, mut minor) = (0, 0);
    unsafe { nvrtc_sys::nvrtcVersion(&mut major, &mut minor) }
        .result()
        .map_err(|e| Error::runtime("nvrtc", format!("nvrtcVersion: {e:?}")))?;
    Ok((major, minor))
}

/// The output of one NVRTC compilation.
#[derive(Clone, Debug)]
pub struct Compiled {
    pub ptx: String,
    /// Machine code for the real arch asked for.
    pub cubin: Vec<u8>,
    /// NVRTC's log, including ptxas's resource report when asked for.
    pub log: String,
}

/// Compile CUDA C with NVRTC for `arch` (e.g. "sm_120"), all the way to machine code, so
/// that inline PTX is checked by ptxas too. `ptxas_verbose` adds the register / shared
/// memory / spill report to the log.
pub fn compile(name: &str, source: &str, arch: &str, ptxas_verbose: bool) -> Result<Compiled> {
    if let Some(why) = nvrtc_unavailable() {
        return Err(Error::unavailable("nvrtc", why));
    }
    let fail = |log: String| Error::Compile {
        kernel: name.into(),
        target: format!("CUDA {arch} (NVRTC)"),
        log,
    };
    let src = CString::new(source).map_err(|_| fail("source contains a NUL byte".into()))?;
    let cname = CString::new(format!("{name}.cu")).map_err(|_| fail("bad kernel name".into()))?;
    let prog = nvrtc::create_program(&src, Some(&cname))
        .map_err(|e| fail(format!("nvrtcCreateProgram: {e:?}")))?;
    let mut opts = nvrtc_options(arch);
    if ptxas_verbose {
        opts.push("--ptxas-options=-v".into());
    }
    let compiled = unsafe { nvrtc::compile_program(prog, &opts) };
    let log = unsafe { nvrtc::get_program_log(prog) }
        .map(|raw| {
            unsafe { CStr::from_ptr(raw.as_ptr()) }
                .to_string_lossy()
                .into_owned()
        })
        .unwrap_or_default();
    let result = match compiled {
        Err(e) => Err(fail(format!("{e:?}\n{log}"))),
        Ok(()) => {
            let ptx = unsafe { nvrtc::get_ptx(prog) }
                .map(|raw| {
                    unsafe { CStr::from_ptr(raw.as_ptr()) }
                        .to_string_lossy()
                        .into_owned()
                })
                .map_err(|e| fail(format!("nvrtcGetPTX: {e:?}")))?;
            let mut size = 0usize;
            let mut cubin = Vec::new();
            unsafe {
                nvrtc_sys::nvrtcGetCUBINSize(prog, &mut size)
                    .result()
                    .map_err(|e| fail(format!("nvrtcGetCUBINSize: {e:?}")))?;
                cubin.resize(size, 0u8);
                nvrtc_sys::nvrtcGetCUBIN(prog, cubin.as_mut_ptr() as *mut _)
                    .result()
                    .map_err(|e| fail(format!("nvrtcGetCUBIN: {e:?}")))?;
            }
            Ok(Compiled { ptx, cubin, log })
        }
    };
    unsafe {
        let _ = nvrtc::destroy_program(prog);
    }
    result
}

/// 64-bit FNV-1a: a stable hash for the on-disk cache key (std's hasher is not stable).
fn fnv1a(bytes: &[u8]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in bytes {
        h ^= *b as u64;
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    h
}

/// Where compiled kernels are cached: `$SPARSE_MLA_CACHE_DIR`, else
/// `$XDG_CACHE_HOME/sparse-mla/nvrtc`, else `~/.cache/sparse-mla/nvrtc`.
pub fn cache_dir() -> Option<PathBuf> {
    if let Some(d) = std::env::var_os("SPARSE_MLA_CACHE_DIR") {
        return Some(PathBuf::from(d));
    }
    let base = std::env::var_os("XDG_CACHE_HOME")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache")))?;
    Some(base.join("sparse-mla").join("nvrtc"))
}

/// The options every cached kernel is compiled with (part of the cache key).
fn nvrtc_options(arch: &str) -> Vec<String> {
    vec![
        format!("--gpu-architecture={arch}"),
        "--std=c++17".to_string(),
        "-lineinfo".to_string(),
    ]
}

/// First bytes of a cache entry (the format's version is the last byte).
const CACHE_MAGIC: &[u8; 8] = b"SMLACUB\x01";

/// Everything that decides a kernel's machine code: its name, the target, the compiler and
/// its options, this crate's version and the whole source (hashed, with its length).
fn cache_identity(name: &str, source: &str, arch: &str, nvrtc: (i32, i32)) -> String {
    format!(
        "{name}|{arch}|nvrtc {}.{}|{}|sparse-mla {}|source {} bytes fnv1a {:016x}",
        nvrtc.0,
        nvrtc.1,
        nvrtc_options(arch).join(" "),
        env!("CARGO_PKG_VERSION"),
        source.len(),
        fnv1a(source.as_bytes())
    )
}

/// A cache entry: magic, identity length (u32 LE), identity, payload length (u64 LE),
/// payload FNV-1a (u64 LE), payload.
fn cache_entry(identity: &str, cubin: &[u8]) -> Vec<u8> {
    let mut v = Vec::with_capacity(32 + identity.len() + cubin.len());
    v.extend_from_slice(CACHE_MAGIC);
    v.extend_from_slice(&(identity.len() as u32).to_le_bytes());
    v.extend_from_slice(identity.as_bytes());
    v.extend_from_slice(&(cubin.len() as u64).to_le_bytes());
    v.extend_from_slice(&fnv1a(cubin).to_le_bytes());
    v.extend_from_slice(cubin);
    v
}

/// The payload of a cache entry when it is whole and made for `identity`; otherwise why not.
pub fn read_cache_entry(bytes: &[u8], identity: &str) -> std::result::Result<Vec<u8>, String> {
    let take = |at: &mut usize, n: usize| -> std::result::Result<&[u8], String> {
        let end = at
            .checked_add(n)
            .filter(|&e| e <= bytes.len())
            .ok_or_else(|| format!("truncated ({} bytes)", bytes.len()))?;
        let s = &bytes[*at..end];
        *at = end;
        Ok(s)
    };
    let mut at = 0;
    if take(&mut at, 8)? != CACHE_MAGIC {
        return Err("not a sparse-mla kernel cache entry (bad magic)".into());
    }
    let id_len = u32::from_le_bytes(take(&mut at, 4)?.try_into().unwrap()) as usize;
    if take(&mut at, id_len)? != identity.as_bytes() {
        return Err("made for another source, compiler or version".into());
    }
    let len = u64::from_le_bytes(take(&mut at, 8)?.try_into().unwrap());
    let sum = u64::from_le_bytes(take(&mut at, 8)?.try_into().unwrap());
    let payload = take(&mut at, usize::try_from(len).map_err(|_| "bad length")?)?;
    if at != bytes.len() {
        return Err(format!("{} bytes past the payload", bytes.len() - at));
    }
    if payload.is_empty() {
        return Err("empty payload".into());
    }
    if fnv1a(payload) != sum {
        return Err("checksum mismatch (corrupt)".into());
    }
    Ok(payload.to_vec())
}

/// Where the cache entry of a kernel lives.
fn cache_path(name: &str, identity: &str, arch: &str) -> Option<PathBuf> {
    cache_dir().map(|d| {
        d.join(format!(
            "{name}-{arch}-{:016x}.cubin",
            fnv1a(identity.as_bytes())
        ))
    })
}

/// A compiled kernel and where its cache entry is (to drop it if the driver refuses it).
pub struct CachedCubin {
    pub cubin: Vec<u8>,
    pub from_cache: Option<PathBuf>,
}

/// Compile through the on-disk cache. An entry is used only when its header matches (magic,
/// identity: source, arch, NVRTC version and options, crate version) and its payload has the
/// recorded length and checksum; anything else is recompiled and rewritten, with a warning
/// naming the file.
pub fn compile_cached(name: &str, source: &str, arch: &str) -> Result<CachedCubin> {
    let (major, minor) = nvrtc_version()?;
    let identity = cache_identity(name, source, arch, (major, minor));
    let path = cache_path(name, &identity, arch);
    if let Some(p) = &path {
        match std::fs::read(p) {
            Ok(bytes) => match read_cache_entry(&bytes, &identity) {
                Ok(cubin) => {
                    log::info!("kernel {name}: NVRTC cache hit ({})", p.display());
                    return Ok(CachedCubin {
                        cubin,
                        from_cache: Some(p.clone()),
                    });
                }
                Err(why) => log::warn!(
                    "kernel cache entry {} is unusable ({why}); recompiling",
                    p.display()
                ),
            },
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => log::warn!("cannot read the kernel cache entry {}: {e}", p.display()),
        }
    }
    let cubin = compile_fresh(name, source, arch, path.as_deref())?;
    Ok(CachedCubin {
        cubin,
        from_cache: None,
    })
}

/// Compiles `source` through the on-disk cache and loads it into `ctx`. A cached entry the
/// driver refuses (whole and checksummed, yet unloadable: made by a driver-incompatible
/// toolchain, say) is removed and compiled afresh, once.
pub fn load_module_cached(
    ctx: &Arc<CudaContext>,
    name: &str,
    source: &str,
    arch: &str,
) -> Result<Arc<cudarc::driver::CudaModule>> {
    let cached = compile_cached(name, source, arch)?;
    let module = match ctx.load_module(cudarc::nvrtc::Ptx::from_binary(cached.cubin)) {
        Ok(m) => m,
        Err(e) if cached.from_cache.is_some() => {
            let p = cached.from_cache.unwrap();
            log::warn!(
                "the driver refused the cached {} ({e:?}); removing {} and recompiling",
                name,
                p.display()
            );
            let _ = std::fs::remove_file(&p);
            let cubin = compile_fresh(name, source, arch, Some(&p))?;
            ctx.load_module(cudarc::nvrtc::Ptx::from_binary(cubin))
                .map_err(|e| {
                    drv_err(
                        &format!("loading {} (freshly compiled, cache {})", name, p.display()),
                        e,
                    )
                })?
        }
        Err(e) => return Err(drv_err(&format!("loading {}", name), e)),
    };
    Ok(module)
}

/// Compiles and (when a cache directory exists) stores the entry at `path`.
pub fn compile_fresh(name: &str, source: &str, arch: &str, path: Option<&Path>) -> Result<Vec<u8>> {
    let (major, minor) = nvrtc_version()?;
    let t0 = std::time::Instant::now();
    let compiled = compile(name, source, arch, false)?;
    log::info!(
        "kernel {name}: compiled for {arch} by NVRTC {major}.{minor} in {:.0} ms",
        t0.elapsed().as_secs_f64() * 1e3
    );
    if let Some(p) = path {
        let identity = cache_identity(name, source, arch, (major, minor));
        let written = p
            .parent()
            .map(std::fs::create_dir_all)
            .transpose()
            .and_then(|_| {
                // write then rename, so a concurrent reader never sees half a file
                let tmp = p.with_extension(format!("tmp{}", std::process::id()));
                std::fs::write(&tmp, cache_entry(&identity, &compiled.cubin))?;
                std::fs::rename(&tmp, p)
            });
        if let Err(e) = written {
            log::warn!(
                "could not write the kernel cache entry {}: {e}",
                p.display()
            );
        }
    }
    Ok(compiled.cubin)
}

/// One CUDA device with its primary context and a stream.
pub struct CudaDevice {
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    name: String,
    arch: String,
    sm_count: u32,
    /// Workgroups of a kernel resident per multiprocessor (occupancy), by kernel name.
    occupancy: Mutex<HashMap<String, u32>>,
    /// Host waits on the stream so far.
    syncs: std::sync::atomic::AtomicU64,
    /// cuBLAS on this device's stream, made at the first bf16 GEMM (`Err`: why it cannot be).
    blas: Mutex<Option<std::result::Result<Blas, String>>>,
    /// Kernels that wait for their predecessor themselves (all of ours) are launched with
    /// programmatic stream serialisation ([`dependent_launch_enabled`]).
    dependent_launch: bool,
}

/// Programmatic dependent launch is used on sm_90 and later with a driver of CUDA 12.3 or
/// later (the first to keep it in captured graphs), unless `SPARSE_MLA_PDL=0`.
fn dependent_launch_enabled(major: i32) -> bool {
    if std::env::var("SPARSE_MLA_PDL").is_ok_and(|v| v.trim() == "0") {
        return false;
    }
    let mut version = 0;
    let ok =
        unsafe { drv_sys::cuDriverGetVersion(&mut version) } == drv_sys::CUresult::CUDA_SUCCESS;
    major >= 9 && ok && version >= 12030
}

/// A cuBLAS handle bound to the device's stream, with a workspace of its own: cuBLAS then
/// allocates nothing while a CUDA graph is being captured.
struct Blas {
    handle: cudarc::cublas::CudaBlas,
    _workspace: CudaSlice<u8>,
}

/// cuBLAS workspace: NVIDIA recommends 32 MiB on Hopper and Blackwell for the split-K kernels.
const BLAS_WORKSPACE: usize = 32 << 20;

/// Why cuBLAS cannot be used here, if it cannot (checked before the first call, since cudarc
/// panics on a missing library).
pub fn cublas_unavailable() -> Option<String> {
    static WHY: OnceLock<Option<String>> = OnceLock::new();
    WHY.get_or_init(|| {
        if unsafe { cudarc::cublas::sys::is_culib_present() } {
            None
        } else {
            Some(
                "libcublas was not found (install the CUDA toolkit's cuBLAS, or pip's \
                 nvidia-cublas-cu12, and put its lib directory on LD_LIBRARY_PATH)"
                    .into(),
            )
        }
    })
    .clone()
}

pub struct CudaModule {
    _module: Arc<cudarc::driver::CudaModule>,
    function: cudarc::driver::CudaFunction,
    /// Dynamic shared memory to launch with (0: the kernel's arrays are static).
    dynamic_shared: u32,
}

fn drv_err(what: &str, e: impl std::fmt::Debug) -> Error {
    Error::runtime(NAME, format!("{what}: {e:?}"))
}

impl CudaDevice {
    /// Every CUDA device, each opened or with its reason; `Err` when CUDA cannot run at all
    /// (no driver, no device, or no NVRTC).
    pub fn all() -> Result<Vec<Result<CudaDevice>>> {
        if let Some(why) = driver_unavailable() {
            return Err(Error::unavailable(NAME, why));
        }
        if let Some(why) = nvrtc_unavailable() {
            return Err(Error::unavailable(NAME, why));
        }
        let n = CudaContext::device_count().map_err(|e| {
            Error::unavailable(NAME, format!("cuInit / device count failed: {e:?}"))
        })?;
        if n == 0 {
            return Err(Error::unavailable(
                NAME,
                "the driver reports no CUDA device",
            ));
        }
        Ok((0..n as usize).map(Self::open).collect())
    }

    pub fn open(ordinal: usize) -> Result<CudaDevice> {
        // cudarc panics when the libraries are missing: check before the first call.
        if let Some(why) = driver_unavailable() {
            return Err(Error::unavailable(NAME, why));
        }
        if let Some(why) = nvrtc_unavailable() {
            return Err(Error::unavailable(NAME, why));
        }
        let ctx = CudaContext::new(ordinal)
            .map_err(|e| Error::unavailable(NAME, format!("device {ordinal}: {e:?}")))?;
        // One stream, ordered: no need for cudarc's per-buffer event tracking.
        unsafe { ctx.disable_event_tracking() };
        // A stream of our own (not the legacy default stream): CUDA graphs capture only
        // from a created stream.
        let stream = ctx.new_stream().map_err(|e| {
            Error::unavailable(NAME, format!("device {ordinal}: creating a stream: {e:?}"))
        })?;
        let name = ctx.name().map_err(|e| drv_err("device name", e))?;
        let (major, minor) = ctx
            .compute_capability()
            .map_err(|e| drv_err("compute capability", e))?;
        let sm_count = ctx
            .attribute(drv_sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
            .map_err(|e| drv_err("SM count", e))? as u32;
        Ok(CudaDevice {
            ctx,
            stream,
            name,
            arch: format!("sm_{major}{minor}"),
            sm_count,
            occupancy: Mutex::new(HashMap::new()),
            syncs: Default::default(),
            blas: Mutex::new(None),
            dependent_launch: dependent_launch_enabled(major),
        })
    }

    /// Are kernels launched so that each launch overlaps the kernel before it (programmatic
    /// dependent launch; every kernel waits for its predecessor itself)?
    pub fn dependent_launch(&self) -> bool {
        self.dependent_launch
    }

    pub fn arch(&self) -> &str {
        &self.arch
    }

    pub fn sm_count(&self) -> u32 {
        self.sm_count
    }

    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }

    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    /// How many workgroups of `kernel` the whole device runs at once (multiprocessors x
    /// occupancy, from the driver's occupancy calculator on the compiled kernel).
    pub fn resident_workgroups(&self, kernel: &Kernel) -> Result<u32> {
        if let Some(n) = self
            .occupancy
            .lock()
            .map_err(|_| Error::runtime(NAME, "occupancy cache lock poisoned"))?
            .get(&kernel.name)
        {
            return Ok(n * self.sm_count);
        }
        let module = self.compile(kernel)?;
        let per_sm = unsafe {
            drv::occupancy::max_active_block_per_multiprocessor(
                module.function.cu_function(),
                kernel.workgroup_size as i32,
                module.dynamic_shared as usize,
            )
        }
        .map_err(|e| drv_err(&format!("occupancy of {}", kernel.name), e))?
        .max(1) as u32;
        self.occupancy
            .lock()
            .map_err(|_| Error::runtime(NAME, "occupancy cache lock poisoned"))?
            .insert(kernel.name.clone(), per_sm);
        Ok(per_sm * self.sm_count)
    }

    /// The merged form of `config`'s split kernel and how many of its workgroups the device
    /// runs at once (what a merged grid must fit, [`DecodePlan::merged_where_it_pays`]);
    /// `None` where the config has no merged form.
    pub fn resident_merged(&self, config: &DecodeConfig) -> Result<Option<(Arc<Kernel>, u32)>> {
        if !config.has_merged_form() {
            return Ok(None);
        }
        // The merge adds 4 KB of shared memory: a configuration with no room left for it
        // within SM120's budget (a custom `mla-bench --variants` shape; every production one
        // has room, tests/compile_check.rs) has no merged form, and its calls take the two
        // launches, as fp8_ds_mla's v6 kernels do. The lowering refuses such a kernel
        // (`shared_plan::check_fits`); until this caught it, `mla-bench` refused the whole
        // variant, rows of one split included.
        let kernel = match lowered_merged(config) {
            Ok(kernel) => kernel,
            Err(Error::ResourceLimit { .. }) => return Ok(None),
            Err(e) => return Err(e),
        };
        let resident = self.resident_workgroups(&kernel)?;
        Ok(Some((kernel, resident)))
    }

    /// Decode-kernel tuning (mla-bench `--sm120-occupancy`): the preferred shared-memory
    /// carve-out of a compiled kernel, in percent of the multiprocessor's unified L1 /
    /// shared memory (`CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT`; -1 restores the
    /// driver's default). On an H200, 44 leaves 100 KB of shared memory per multiprocessor:
    /// SM120's budget, so one 99 KB workgroup per multiprocessor.
    pub fn set_shared_carveout(&self, module: &CudaModule, percent: i32) -> Result<()> {
        self.ctx.bind_to_thread().map_err(|e| drv_err("bind", e))?;
        unsafe {
            drv::function::set_function_attribute(
                module.function.cu_function(),
                drv_sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT,
                percent,
            )
        }
        .map_err(|e| drv_err(&format!("shared-memory carve-out {percent}%"), e))
    }

    /// Makes the cuBLAS handle (once) and runs `f` with it.
    fn with_blas<T>(&self, f: impl FnOnce(&Blas) -> Result<T>) -> Result<T> {
        let mut slot = self
            .blas
            .lock()
            .map_err(|_| Error::runtime(NAME, "cuBLAS lock poisoned"))?;
        if slot.is_none() {
            *slot = Some(self.make_blas());
        }
        match slot.as_ref() {
            Some(Ok(b)) => f(b),
            Some(Err(why)) => Err(Error::unavailable("cublas", why.clone())),
            None => unreachable!("set above"),
        }
    }

    fn make_blas(&self) -> std::result::Result<Blas, String> {
        if let Some(why) = cublas_unavailable() {
            return Err(why);
        }
        self.ctx
            .bind_to_thread()
            .map_err(|e| format!("bind: {e:?}"))?;
        let handle = cudarc::cublas::CudaBlas::new(self.stream.clone())
            .map_err(|e| format!("cublasCreate: {e:?}"))?;
        let workspace = self
            .stream
            .alloc_zeros::<u8>(BLAS_WORKSPACE)
            .map_err(|e| format!("cuBLAS workspace of {BLAS_WORKSPACE} B: {e:?}"))?;
        let ptr = raw_ptr(&workspace, &self.stream);
        unsafe {
            cudarc::cublas::sys::cublasSetWorkspace_v2(
                *handle.handle(),
                ptr as *mut c_void,
                BLAS_WORKSPACE,
            )
            .result()
        }
        .map_err(|e| format!("cublasSetWorkspace: {e:?}"))?;
        log::info!(
            "cuBLAS ready on {} (workspace {BLAS_WORKSPACE} B)",
            self.name
        );
        Ok(Blas {
            handle,
            _workspace: workspace,
        })
    }

    pub fn synchronize(&self) -> Result<()> {
        self.syncs
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        self.stream
            .synchronize()
            .map_err(|e| drv_err("synchronize", e))
    }

    /// Times the host has waited for the GPU (synchronisations, reads).
    pub fn host_syncs(&self) -> u64 {
        self.syncs.load(std::sync::atomic::Ordering::Relaxed)
    }
}

/// The decode kernel the CUDA backend runs for `shape`: [`DecodeConfig::for_call_from_env`]
/// with this GPU's multiprocessors and its occupancy of the bf16 v6 split kernel.
fn decode_kernel_choice(dev: &CudaDevice, shape: &DecodeShape) -> Result<DecodeConfig> {
    DecodeConfig::for_call_from_env(shape, dev.sm_count, || {
        let v6 = DecodeConfig::tensor_core_v6(shape.dims, CacheFormat::Bf16, shape.heads);
        let (split, _) = lowered_kernels(&v6)?;
        Ok(dev.resident_workgroups(&split)? / dev.sm_count.max(1))
    })
}

/// The parameter block as a kernel argument: the driver copies as many bytes as the
/// kernel's parameter struct has.
#[repr(C, align(16))]
struct ParamBlock([u8; 256]);

impl Device for CudaDevice {
    type Buf = CudaSlice<u8>;
    type Module = CudaModule;

    fn kind(&self) -> BackendKind {
        BackendKind::Cuda
    }

    fn name(&self) -> String {
        format!("{} ({}, {} SMs)", self.name, self.arch, self.sm_count)
    }

    /// The tensor-core configuration (of the smaller head range; [`Self::decode_plan`]
    /// picks the one for the call's head count).
    fn decode_config(&self, dims: MlaDims, format: CacheFormat) -> DecodeConfig {
        DecodeConfig::tensor_core(dims, format, 1)
    }

    /// Tensor-core config for the head count, splits from the cost model over the
    /// workgroups this GPU runs at once.
    fn decode_plan(&self, shape: &DecodeShape, splits: Option<u32>) -> Result<DecodePlan> {
        let config = decode_kernel_choice(self, shape)?;
        let (split, _) = lowered_kernels(&config)?;
        let resident = self.resident_workgroups(&split)?;
        let plan = DecodePlan::with_config(config, shape, resident, self.sm_count, splits)?;
        // SPARSE_MLA_MERGE: 0 two launches, all merged wherever the form can run
        let policy = MergePolicy::from_env()?;
        if plan.splits < 2 || policy == MergePolicy::Off {
            return Ok(plan);
        }
        Ok(match self.resident_merged(&config)? {
            Some((_, resident)) => plan.merged_by(policy, shape, resident),
            None => plan,
        })
    }

    fn target_workgroups(&self) -> u32 {
        self.sm_count * 2
    }

    fn compile(&self, kernel: &Kernel) -> Result<CudaModule> {
        // SM120's per-block limit, enforced on every GPU so that what passes here runs there.
        crate::kir::shared_plan::check_fits(kernel)?;
        let dynamic_shared = emit_cuda::dynamic_shared_bytes(kernel);
        let source = emit_cuda::emit(kernel)?;
        let module = load_module_cached(&self.ctx, &kernel.name, &source, &self.arch)?;
        let function = module
            .load_function(&kernel.name)
            .map_err(|e| drv_err(&format!("finding {}", kernel.name), e))?;
        if dynamic_shared > 0 {
            // Above 48 KB a kernel must opt in to its dynamic shared memory.
            unsafe {
                drv::function::set_function_attribute(
                    function.cu_function(),
                    drv_sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                    dynamic_shared as i32,
                )
            }
            .map_err(|e| {
                drv_err(
                    &format!(
                        "allowing {} {dynamic_shared} bytes of dynamic shared memory",
                        kernel.name
                    ),
                    e,
                )
            })?;
        }
        Ok(CudaModule {
            _module: module,
            function,
            dynamic_shared,
        })
    }

    fn alloc(&self, len: u64) -> Result<CudaSlice<u8>> {
        self.stream
            .alloc_zeros::<u8>(len.max(4) as usize)
            .map_err(|e| drv_err(&format!("allocating {len} bytes"), e))
    }

    fn write(&self, buf: &CudaSlice<u8>, bytes: &[u8]) -> Result<()> {
        self.write_at(buf, 0, bytes)
    }

    fn read(&self, buf: &CudaSlice<u8>, len: u64) -> Result<Vec<u8>> {
        self.read_at(buf, 0, len)
    }

    /// Ordered on the stream after the work before it, and no host synchronisation: from
    /// pageable memory the driver stages `bytes` before returning (so the caller may drop
    /// them), the DMA runs when the stream reaches it.
    fn write_at(&self, buf: &CudaSlice<u8>, offset: u64, bytes: &[u8]) -> Result<()> {
        let ptr = raw_ptr(buf, &self.stream) + offset;
        self.ctx.bind_to_thread().map_err(|e| drv_err("bind", e))?;
        unsafe { drv::memcpy_htod_async(ptr, bytes, self.stream.cu_stream()) }
            .map_err(|e| drv_err("copy to device", e))
    }

    fn read_at(&self, buf: &CudaSlice<u8>, offset: u64, len: u64) -> Result<Vec<u8>> {
        CudaDevice::synchronize(self)?;
        let ptr = raw_ptr(buf, &self.stream) + offset;
        let mut out = vec![0u8; len as usize];
        self.ctx.bind_to_thread().map_err(|e| drv_err("bind", e))?;
        unsafe { drv::memcpy_dtoh_sync(&mut out, ptr) }.map_err(|e| drv_err("copy to host", e))?;
        Ok(out)
    }

    fn synchronize(&self) -> Result<()> {
        CudaDevice::synchronize(self)
    }

    fn host_syncs(&self) -> u64 {
        CudaDevice::host_syncs(self)
    }

    fn copy(&self, src: &CudaSlice<u8>, dst: &CudaSlice<u8>, len: u64) -> Result<bool> {
        self.ctx.bind_to_thread().map_err(|e| drv_err("bind", e))?;
        let (s, d) = (raw_ptr(src, &self.stream), raw_ptr(dst, &self.stream));
        unsafe { drv::memcpy_dtod_async(d, s, len as usize, self.stream.cu_stream()) }
            .map_err(|e| drv_err("device copy", e))?;
        Ok(true)
    }

    fn begin_capture(&self) -> Result<bool> {
        self.stream
            .begin_capture(drv_sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
            .map_err(|e| drv_err("beginning a graph capture", e))?;
        Ok(true)
    }

    fn end_capture(&self) -> Result<Option<Box<dyn super::gpu::Graph>>> {
        let g = self
            .stream
            .end_capture(drv_sys::CUgraphInstantiate_flags(0))
            .map_err(|e| drv_err("ending a graph capture", e))?;
        Ok(g.map(|g| Box::new(CudaGraphExec(g)) as Box<dyn super::gpu::Graph>))
    }

    fn read_many(&self, reads: &[(&CudaSlice<u8>, u64)]) -> Result<Vec<Vec<u8>>> {
        CudaDevice::synchronize(self)?;
        self.ctx.bind_to_thread().map_err(|e| drv_err("bind", e))?;
        let mut out = Vec::with_capacity(reads.len());
        for (buf, len) in reads {
            let mut v = vec![0u8; *len as usize];
            // The stream is idle: these copies wait for nothing.
            unsafe { drv::memcpy_dtoh_sync(&mut v, raw_ptr(buf, &self.stream)) }
                .map_err(|e| drv_err("copy to host", e))?;
            out.push(v);
        }
        Ok(out)
    }

    fn gemm_available(&self) -> std::result::Result<(), String> {
        match cublas_unavailable() {
            Some(why) => Err(why),
            None => Ok(()),
        }
    }

    fn gemm_bf16(
        &self,
        g: &super::GemmShape,
        x: &CudaSlice<u8>,
        w: &CudaSlice<u8>,
        y: &CudaSlice<u8>,
    ) -> Result<bool> {
        use cudarc::cublas::sys as bs;
        let int = |v: u64, what: &str| {
            i32::try_from(v).map_err(|_| Error::arg(what, "below 2^31 for cuBLAS", v))
        };
        let (m, n, k) = (
            int(g.n as u64, "n")?,
            int(g.m as u64, "m")?,
            int(g.k as u64, "k")?,
        );
        let (ldx, ldy) = (
            int(g.x_stride as u64, "x stride")?,
            int(g.y_stride as u64, "y stride")?,
        );
        self.with_blas(|b| {
            self.ctx.bind_to_thread().map_err(|e| drv_err("bind", e))?;
            let xp = raw_ptr(x, &self.stream) + g.x_off * 2;
            let wp = raw_ptr(w, &self.stream) + g.w_off * 2;
            let yp = raw_ptr(y, &self.stream) + g.y_off * 4;
            let alpha = 1.0f32;
            let beta = if g.accumulate { 1.0f32 } else { 0.0 };
            // Row-major y[T, N] is column-major yᵀ[N, T] = W · xᵀ: W (row-major [N, K], so a
            // column-major [K, N] with ld K) transposed, xᵀ as it lies (ld = x's row stride).
            let (op_t, op_n) = (
                bs::cublasOperation_t::CUBLAS_OP_T,
                bs::cublasOperation_t::CUBLAS_OP_N,
            );
            let (bf, f) = (bs::cudaDataType::CUDA_R_16BF, bs::cudaDataType::CUDA_R_32F);
            let (compute, algo) = (
                bs::cublasComputeType_t::CUBLAS_COMPUTE_32F,
                bs::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
            );
            let (a, pb, pc) = (
                &alpha as *const f32 as *const c_void,
                &beta as *const f32 as *const c_void,
                yp as *mut c_void,
            );
            let status = if g.batch == 1 {
                unsafe {
                    cudarc::cublas::result::gemm_ex(
                        *b.handle.handle(),
                        op_t,
                        op_n,
                        m,
                        n,
                        k,
                        a,
                        wp as *const c_void,
                        bf,
                        k,
                        xp as *const c_void,
                        bf,
                        ldx,
                        pb,
                        pc,
                        f,
                        ldy,
                        compute,
                        algo,
                    )
                }
            } else {
                let long = |v: u64, what: &str| {
                    i64::try_from(v).map_err(|_| Error::arg(what, "below 2^63", v))
                };
                let (sw, sx, sy) = (
                    long(g.w_batch, "w batch stride")?,
                    long(g.x_batch, "x batch stride")?,
                    long(g.y_batch, "y batch stride")?,
                );
                unsafe {
                    cudarc::cublas::result::gemm_strided_batched_ex(
                        *b.handle.handle(),
                        op_t,
                        op_n,
                        m,
                        n,
                        k,
                        a,
                        wp as *const c_void,
                        bf,
                        k,
                        sw,
                        xp as *const c_void,
                        bf,
                        ldx,
                        sx,
                        pb,
                        pc,
                        f,
                        ldy,
                        sy,
                        int(g.batch as u64, "batch")?,
                        compute,
                        algo,
                    )
                }
            };
            status.map_err(|e| drv_err(&format!("cublasGemmEx {g:?}"), e))?;
            if std::env::var_os("SPARSE_MLA_SYNC_LAUNCH").is_some() {
                self.synchronize()
                    .map_err(|e| Error::runtime(NAME, format!("after cublasGemmEx: {e}")))?;
            }
            Ok(true)
        })
    }

    fn memory_info(&self) -> Option<(u64, u64)> {
        self.ctx.bind_to_thread().ok()?;
        drv::mem_get_info().ok().map(|(f, t)| (f as u64, t as u64))
    }

    fn launch(
        &self,
        module: &CudaModule,
        kernel: &Kernel,
        grid: [u32; 3],
        params: &[u8],
        bufs: &[&CudaSlice<u8>],
    ) -> Result<()> {
        if grid[1] > 65535 || grid[2] > 65535 {
            return Err(Error::ResourceLimit {
                kernel: kernel.name.clone(),
                resource: "grid y / z".into(),
                needed: grid[1].max(grid[2]) as u64,
                limit: 65535,
            });
        }
        if grid.contains(&0) {
            return Ok(());
        }
        if params.len() > 256 {
            return Err(Error::Kir {
                kernel: kernel.name.clone(),
                message: format!("parameter block of {} bytes (max 256)", params.len()),
            });
        }
        let mut block = ParamBlock([0u8; 256]);
        block.0[..params.len()].copy_from_slice(params);
        let mut ptrs: Vec<drv_sys::CUdeviceptr> =
            bufs.iter().map(|b| raw_ptr(b, &self.stream)).collect();
        let mut args: Vec<*mut c_void> = Vec::with_capacity(1 + ptrs.len());
        args.push(&mut block as *mut ParamBlock as *mut c_void);
        for p in ptrs.iter_mut() {
            args.push(p as *mut drv_sys::CUdeviceptr as *mut c_void);
        }
        self.ctx.bind_to_thread().map_err(|e| drv_err("bind", e))?;
        let pdl = self.dependent_launch && kernel.grid_dependency.waits_for_previous;
        let cooperative = kernel.grid_dependency.cooperative;
        if pdl || cooperative {
            // SAFETY: a zeroed attribute is valid; each `id` is set with its union field.
            let mut attrs: [drv_sys::CUlaunchAttribute; 2] = unsafe { std::mem::zeroed() };
            let mut n = 0;
            if pdl {
                // The kernel's first statement waits for the previous one
                // (griddepcontrol.wait): its launch may start while that one still runs.
                attrs[n].id = drv_sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
                attrs[n].value.programmaticStreamSerializationAllowed = 1;
                n += 1;
            }
            if cooperative {
                // Its workgroups wait for each other (group_sync): all resident at once, or
                // the driver refuses the launch (never a partial grid that hangs).
                attrs[n].id = drv_sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_COOPERATIVE;
                attrs[n].value.cooperative = 1;
                n += 1;
            }
            let config = drv_sys::CUlaunchConfig {
                gridDimX: grid[0],
                gridDimY: grid[1],
                gridDimZ: grid[2],
                blockDimX: kernel.workgroup_size,
                blockDimY: 1,
                blockDimZ: 1,
                sharedMemBytes: module.dynamic_shared,
                hStream: self.stream.cu_stream(),
                attrs: attrs.as_mut_ptr(),
                numAttrs: n as u32,
            };
            // SAFETY: `args` points at the parameter block and one device pointer per buffer,
            // all alive until the call returns (the driver copies them).
            unsafe {
                drv_sys::cuLaunchKernelEx(
                    &config,
                    module.function.cu_function(),
                    args.as_mut_ptr(),
                    std::ptr::null_mut(),
                )
            }
            .result()
        } else {
            unsafe {
                drv::launch_kernel(
                    module.function.cu_function(),
                    (grid[0], grid[1], grid[2]),
                    (kernel.workgroup_size, 1, 1),
                    module.dynamic_shared,
                    self.stream.cu_stream(),
                    &mut args,
                )
            }
        }
        .map_err(|e| drv_err(&format!("launching {}", kernel.name), e))?;
        if std::env::var_os("SPARSE_MLA_SYNC_LAUNCH").is_some() {
            self.synchronize()
                .map_err(|e| Error::runtime(NAME, format!("after {}: {e}", kernel.name)))?;
        }
        Ok(())
    }
}

/// An instantiated CUDA graph of captured launches.
struct CudaGraphExec(cudarc::driver::CudaGraph);

// SAFETY: the graph is only replayed through `&self` from the thread that drives the model,
// under the model's lock; CUDA forbids concurrent use of one graph object, which that lock
// rules out.
unsafe impl Send for CudaGraphExec {}
unsafe impl Sync for CudaGraphExec {}

impl super::gpu::Graph for CudaGraphExec {
    fn replay(&self) -> Result<()> {
        self.0
            .launch()
            .map_err(|e| drv_err("replaying a CUDA graph", e))
    }
}

fn raw_ptr(buf: &CudaSlice<u8>, stream: &CudaStream) -> drv_sys::CUdeviceptr {
    use cudarc::driver::DevicePtr;
    let (ptr, _sync) = buf.device_ptr(stream);
    ptr
}

#[cfg(test)]
mod cache_entry_tests {
    use super::*;

    /// The kernel cache uses an entry only when it is whole, uncorrupted and made for the
    /// same source / compiler / options / version; every damaged form is refused with a reason.
    #[test]
    fn damaged_or_foreign_cache_entries_are_refused() {
        let id = cache_identity("k", "extern \"C\" __global__ void k() {}", "sm_90", (12, 8));
        let cubin: Vec<u8> = (0..4096u32)
            .map(|i| (i.wrapping_mul(2654435761) >> 13) as u8)
            .collect();
        let good = cache_entry(&id, &cubin);
        assert_eq!(read_cache_entry(&good, &id).unwrap(), cubin);

        let bad = |bytes: &[u8], id: &str| read_cache_entry(bytes, id).unwrap_err();
        assert!(bad(&[], &id).contains("truncated"));
        for cut in [1, 8, 12, good.len() / 2, good.len() - 1] {
            assert!(bad(&good[..cut], &id).contains("truncated"), "cut at {cut}");
        }
        let mut flipped = good.clone();
        let at = good.len() - 100;
        flipped[at] ^= 0x10;
        assert!(bad(&flipped, &id).contains("checksum"));
        let mut magic = good.clone();
        magic[0] = b'X';
        assert!(bad(&magic, &id).contains("magic"));
        let mut longer = good.clone();
        longer.push(0);
        assert!(bad(&longer, &id).contains("past the payload"));
        assert!(bad(&cache_entry(&id, &[]), &id).contains("empty"));
        // Another source, arch, compiler or crate version: another identity.
        for other in [
            cache_identity(
                "k",
                "extern \"C\" __global__ void k() { }",
                "sm_90",
                (12, 8),
            ),
            cache_identity(
                "k",
                "extern \"C\" __global__ void k() {}",
                "sm_120",
                (12, 8),
            ),
            cache_identity("k", "extern \"C\" __global__ void k() {}", "sm_90", (12, 9)),
        ] {
            assert!(bad(&good, &other).contains("another"));
        }
        // A plain cubin (the old cache format) is not an entry.
        assert!(bad(&cubin, &id).contains("magic"));
    }
}
