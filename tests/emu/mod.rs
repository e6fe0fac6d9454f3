//! A CPU emulator of the CUDA path: the CUDA C that the emitter prints for a kernel — its
//! helpers included, their inline PTX translated instruction by instruction ([`ptx`]) —
//! compiled by g++ with `prelude.h` standing in for CUDA and the PTX instructions (each GPU
//! thread a fiber, warps scheduled in a random order, asynchronous copies landing at issue or
//! as late as allowed, a shared-memory race detector), behind the same [`Device`] trait as
//! the real GPU. The whole conformance suite then runs the tensor-core lowering on a machine
//! without a GPU, fragment layouts, helper operand orders and pipeline synchronisation
//! included.
//!
//! The emulator proper (`runtime.cpp`) is compiled once per process into a shared library
//! that every kernel links against; a kernel's translation unit is `prelude.h` (declarations
//! and the pure instructions, included as a precompiled header) and the kernel. A kernel is
//! compiled once per process for each distinct preprocessed source (archs whose `#if` paths
//! print the same code share it), with at most as many g++ at a time as there are cores. The
//! emulator's state is per OS thread: devices used from different threads compile and launch
//! at once.

#![allow(dead_code)]

use sparse_mla::emit::cuda;
pub use sparse_mla::kernels::sparse_mla_decode::Fp8Values;
use sparse_mla::kernels::sparse_mla_decode::{
    lowered_kernels, DecodeConfig, DecodePlan, WholeTokens,
};
use sparse_mla::kir::Kernel;
pub use sparse_mla::kir::RowSoftmax;
use sparse_mla::mla::{CacheFormat, DecodeShape, MlaDims};
use sparse_mla::runtime::gpu::Device;
use sparse_mla::runtime::BackendKind;
use sparse_mla::{Error, Result};
use std::cell::UnsafeCell;
use std::collections::HashMap;
use std::ffi::{OsStr, OsString};
use std::hash::{Hash, Hasher};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, OnceLock};

pub mod ptx;

const PRELUDE: &str = include_str!("prelude.h");
const RUNTIME: &str = include_str!("runtime.cpp");

/// How the emulator runs a kernel.
#[derive(Clone, Copy, Debug)]
pub struct EmuConfig {
    /// `__CUDA_ARCH__` the CUDA C is compiled for (its `#if` paths): 800, 900 or 1200.
    pub arch: u32,
    /// Asynchronous copies land when issued (else as late as the PTX rules allow).
    pub land_at_issue: bool,
    /// Seed of the warp schedule.
    pub seed: u64,
    /// The decode kernel planned for: v7 (the mbarrier ring) or v6.
    pub v7: bool,
    /// v7 with a one-stage ring (the producers issue a step's own rows before its wait).
    pub one_stage: bool,
    /// With `one_stage`: this `(block_h, block_n, stages)` instead of v7's block and one
    /// stage (`DecodeConfig::tensor_core_custom`).
    pub block: Option<(u32, u32, u32)>,
    /// The multiprocessors the backend's kernel choice (`DecodeConfig::for_call`) is made
    /// for; the splits are planned for the device's own few resident workgroups either way.
    /// 6 makes every fp8_ds_mla call at H <= 16 a large batch; 96 leaves those of
    /// 16 T ceil(H/16) <= 96 on v7, bf16 takes the batch kernel from T 48 (here: the backend
    /// only where its workgroups walk 20 steps or more, `decode_plan`), and the calls of
    /// more than 16 heads with 11 T ceil(H/16) <= 96 (H 128 T 1, H 64 T 1-2) run the
    /// narrow-call kernel.
    pub choice_sms: u32,
    /// Calls of several splits and at least this many heads take the merged kernel (split
    /// and combine in one cooperative launch, its blocks run at once on OS threads) wherever
    /// it can run — the grid at most [`MERGED_BLOCKS`] blocks — not only where the backend
    /// finds it pays (`DecodePlan::merged_where_it_can`); `None`: never.
    pub merge: Option<u32>,
    /// How v7 and the large-batch kernel hold their scores for the softmax
    /// (`DecodeConfig::with_row_softmax`); `None`: as the backend plans them (v7 in rows,
    /// fp8's large-batch kernel in rows, bf16's in fragments).
    pub row_softmax: Option<RowSoftmax>,
    /// Whole tokens before the split ones (`DecodePlan::with_config_whole`): the cost model's
    /// choice, or forced wherever a call has more tokens than splits.
    pub whole: WholeTokens,
    /// Every call of more than 16 heads on warp groups of 16 heads over one ring
    /// (`GroupBy::Heads`): `Some(((block_h, block_n, stages), warps, groups))` that form
    /// (`DecodeConfig::tensor_core_heads`, mla-bench's `--variants HxNxSwWhG`; bf16's
    /// wide-call kernel, `SPARSE_MLA_DECODE_KERNEL=wide`, is `((64, 32, 2), 2, 4)`); bf16 in
    /// rows, fp8_ds_mla in fragments. None: the planned kernel (itself a head-group one on
    /// wide calls).
    pub heads: Option<HeadsForm>,
    /// How fp8_ds_mla's v7 kernels take their `P · V` values
    /// (`DecodeConfig::with_fp8_values`): widened by each warp (the planned form) or decoded
    /// once a step into a shared tile.
    pub fp8_values: Fp8Values,
}

/// A head-group form: `((block_h, block_n, stages), warps a group, groups)`.
pub type HeadsForm = ((u32, u32, u32), u32, u32);

/// The most blocks of a merged launch here: each is an OS thread of the emulator.
pub const MERGED_BLOCKS: u32 = 64;

impl EmuConfig {
    /// Both copy modes and the three helper paths, by a run index: v7 (1200, late), v7 (800,
    /// at issue), v6 (900, late).
    /// Mode 3: v7 with a one-stage ring (900, at issue); the test runs it on the decode cases.
    /// So v7's e4m3 score product runs in all three forms: native (sm_120), f16 after one
    /// `cvt` a pair (sm_90) and f16 from moved bits (sm_80).
    pub fn mode(i: u32, seed: u64) -> Self {
        EmuConfig {
            // run 0 as sm_120 (its e4m3 products native), runs 2 and 3 as sm_90, run 1 as sm_80
            arch: match i {
                0 => 1200,
                2 | 3 => 900,
                _ => 800,
            },
            land_at_issue: i % 2 == 1,
            seed,
            v7: i < 2 || i == 3,
            one_stage: i == 3,
            block: None,
            choice_sms: if i == 1 { 96 } else { 6 },
            // run 1 merges every call that can (v6's small bf16 calls, v7's); run 2 (v6)
            // merges the calls of several head blocks and keeps two launches for the others;
            // runs 0 and 3 keep v7's two launches
            merge: match i {
                1 => Some(0),
                2 => Some(17),
                _ => None,
            },
            // run 0 holds every kernel's scores in rows (bf16's two-group kernel's too, which
            // the backend keeps in fragments); run 1 holds every kernel's in fragments (v7's
            // and fp8's large-batch form under SPARSE_MLA_ROW_SOFTMAX=0); runs 2 and 3 plan as
            // the backend does
            row_softmax: match i {
                0 => Some(RowSoftmax::Rows),
                1 => Some(RowSoftmax::Off),
                _ => None,
            },
            // runs 0 and 2 run whole tokens before split ones wherever T exceeds the splits
            // (v7 and the large-batch kernels, v6): the cost model takes them only at batches
            // of several waves, which the suite's small ones rarely are
            whole: match i {
                0 | 2 => WholeTokens::Forced(u32::MAX),
                _ => WholeTokens::Model,
            },
            heads: None,
            fp8_values: Fp8Values::PerWarp,
        }
    }

    pub fn describe(&self) -> String {
        format!(
            "{}{}{}{}{}{}, sm_{} helpers, copies land {}, schedule seed {}",
            if let (true, Some((h, n, s))) = (self.one_stage, self.block) {
                format!("v7 {h}x{n}x{s}")
            } else if self.one_stage {
                "v7 (one-stage ring)".to_string()
            } else if self.v7 {
                format!("the backend's kernel for {} SMs", self.choice_sms)
            } else {
                "v6".to_string()
            },
            match self.merge {
                Some(0) => " (merged wherever it can)".to_string(),
                Some(h) => format!(" (merged wherever it can at H >= {h})"),
                None => String::new(),
            },
            match self.row_softmax {
                None => "",
                Some(RowSoftmax::Off) => " (scores held in fragments)",
                Some(RowSoftmax::Rows) => " (scores held in rows)",
            },
            match self.whole {
                WholeTokens::Forced(_) => " (whole tokens before split ones)",
                _ => "",
            },
            match self.heads {
                None => String::new(),
                Some(((h, n, s), w, g)) => {
                    format!(" (above 16 heads: {h}x{n}x{s}w{w}h{g}, head groups over one ring)")
                }
            },
            match self.fp8_values {
                Fp8Values::PerWarp => "",
                Fp8Values::Shared => " (fp8 values decoded once a step into shared memory)",
            },
            self.arch / 10,
            if self.land_at_issue {
                "at issue"
            } else {
                "late"
            },
            self.seed
        )
    }
}

/// Is g++ here? (`None`: yes; else why not.)
pub fn gxx_unavailable() -> Option<String> {
    match Command::new("g++").arg("--version").output() {
        Ok(o) if o.status.success() => None,
        Ok(o) => Some(format!("g++ --version failed: {}", o.status)),
        Err(e) => Some(format!("g++ not found: {e}")),
    }
}

pub struct EmuDevice {
    /// Resident workgroups the split heuristic plans for (a small "GPU").
    pub resident: u32,
    pub config: EmuConfig,
    /// Decode calls planned on the narrow-call kernel (`DecodeConfig::tensor_core_narrow`),
    /// [bf16, fp8_ds_mla].
    pub narrow_plans: [AtomicU64; 2],
    /// Decode calls of the backend's choice planned on bf16 v6 in 16-head blocks above 16
    /// heads (`DecodeConfig::tensor_core_v6_narrow`).
    pub v6_narrow_plans: AtomicU64,
    /// fp8_ds_mla narrow calls planned on its 64-row large-batch kernel in 16-head blocks
    /// (`DecodeConfig::tensor_core_narrow_wide`).
    pub narrow_wide_plans: AtomicU64,
    /// Calls planned with whole tokens before the split ones (`DecodePlan::whole_tokens`),
    /// bf16 and fp8_ds_mla.
    pub whole_plans: [AtomicU64; 2],
    /// Calls planned on warp groups of 16 heads over one ring (`GroupBy::Heads`: bf16's
    /// wide-call kernel, `DecodeConfig::tensor_core_wide`, or a forced form), bf16 and
    /// fp8_ds_mla.
    pub heads_plans: [AtomicU64; 2],
}

pub struct EmuBuf(UnsafeCell<Vec<u8>>);
// A buffer is used by the device that made it, from one thread, one launch at a time.
unsafe impl Sync for EmuBuf {}
unsafe impl Send for EmuBuf {}

type LaunchFn = unsafe extern "C" fn(*const u8, *const *mut u8, u32, u32, u32, u32, u64) -> u32;
type ErrorsFn = unsafe extern "C" fn() -> *const std::ffi::c_char;

pub struct EmuModule {
    _lib: Arc<libloading::Library>,
    launch: LaunchFn,
    errors: ErrorsFn,
}

/// This process's emulator files: the runtime library, prelude.h and the kernels.
fn work_dir() -> PathBuf {
    std::env::temp_dir().join(format!("sparse-mla-emu-{}", std::process::id()))
}

/// Removes the emulator directories of test processes that no longer run: each holds the
/// runtime library and a ~15 MB precompiled header, and a process cannot remove its own while
/// other tests may still compile into it, so every run sweeps up after the earlier ones.
/// Only where `/proc` says which processes run (Linux); elsewhere nothing is removed.
fn sweep_stale_work_dirs() {
    if !Path::new("/proc/self").exists() {
        return;
    }
    let Ok(entries) = std::fs::read_dir(std::env::temp_dir()) else {
        return;
    };
    for entry in entries.flatten() {
        let name = entry.file_name();
        let pid = name
            .to_str()
            .and_then(|n| n.strip_prefix("sparse-mla-emu-"))
            .and_then(|p| p.parse::<u32>().ok());
        if let Some(pid) = pid {
            if pid != std::process::id() && !Path::new(&format!("/proc/{pid}")).exists() {
                let _ = std::fs::remove_dir_all(entry.path());
            }
        }
    }
}

fn os(s: &str) -> &OsStr {
    OsStr::new(s)
}

/// Runs `g++ args`, at most as many at a time as there are cores (devices on several
/// threads compile at once).
fn gxx(args: &[&OsStr]) -> std::result::Result<Vec<u8>, String> {
    static JOBS: (Mutex<usize>, Condvar) = (Mutex::new(0), Condvar::new());
    let cap = std::thread::available_parallelism().map_or(1, |n| n.get());
    let (running, freed) = &JOBS;
    {
        let mut n = running.lock().unwrap_or_else(|e| e.into_inner());
        while *n >= cap {
            n = freed.wait(n).unwrap_or_else(|e| e.into_inner());
        }
        *n += 1;
    }
    let out = Command::new("g++").args(args).output();
    *running.lock().unwrap_or_else(|e| e.into_inner()) -= 1;
    freed.notify_one();
    let out = out.map_err(|e| e.to_string())?;
    if out.status.success() {
        Ok(out.stdout)
    } else {
        Err(String::from_utf8_lossy(&out.stderr).into_owned())
    }
}

/// g++'s flags for a kernel's translation unit, and for prelude.h's precompiled header
/// (which g++ uses only where they match).
const KERNEL_FLAGS: [&str; 5] = ["-std=c++17", "-O1", "-g0", "-fPIC", "-w"];

/// The emulator's runtime library (prelude.h + runtime.cpp), and prelude.h with its
/// precompiled header beside it, built once per process.
fn runtime_library() -> std::result::Result<&'static Path, String> {
    static LIB: OnceLock<std::result::Result<PathBuf, String>> = OnceLock::new();
    let built = LIB.get_or_init(|| {
        sweep_stale_work_dirs();
        let dir = work_dir();
        std::fs::create_dir_all(&dir).map_err(|e| e.to_string())?;
        let (header, pch) = (dir.join("prelude.h"), dir.join("prelude.h.gch"));
        let (src, lib) = (dir.join("emu_runtime.cpp"), dir.join("libemu_runtime.so"));
        std::fs::write(&header, PRELUDE).map_err(|e| e.to_string())?;
        let mut args = KERNEL_FLAGS.map(os).to_vec();
        args.extend([os("-x"), os("c++-header"), os("-o"), pch.as_os_str()]);
        args.push(header.as_os_str());
        gxx(&args).map_err(|e| format!("prelude.h's precompiled header: {e}"))?;
        // prelude.h pasted, not included: its precompiled header has the kernels' flags
        std::fs::write(&src, format!("{PRELUDE}\n{RUNTIME}")).map_err(|e| e.to_string())?;
        let mut args = ["-std=c++17", "-O3", "-g0", "-fPIC", "-w", "-shared"]
            .map(os)
            .to_vec();
        args.extend([
            os("-Wl,-soname,libemu_runtime.so"),
            os("-o"),
            lib.as_os_str(),
        ]);
        args.push(src.as_os_str());
        gxx(&args).map_err(|e| format!("the emulator runtime: {e}"))?;
        Ok(lib)
    });
    built.as_deref().map_err(|e| e.clone())
}

type Compiled = Arc<OnceLock<std::result::Result<Arc<libloading::Library>, String>>>;

/// A kernel's translation unit compiled for `arch` and loaded: once per process for each
/// distinct preprocessed source, so that archs whose `#if` paths print the same code (and
/// devices on other threads) share it.
fn compiled(
    name: &str,
    arch: u32,
    source: &str,
) -> std::result::Result<Arc<libloading::Library>, String> {
    static CACHE: OnceLock<Mutex<HashMap<u64, Compiled>>> = OnceLock::new();
    static WRITES: AtomicU64 = AtomicU64::new(0);
    let runtime = runtime_library()?;
    let dir = work_dir();
    let define = format!("-D__CUDA_ARCH__={arch}");
    let tag = format!("{name}_{arch}_{:016x}", hash64(source.as_bytes()));
    let src = dir.join(format!("{tag}.cpp"));
    // written whole under another name first: another device may be reading the same file
    let tmp = dir.join(format!(
        "{tag}.cpp.{}",
        WRITES.fetch_add(1, Ordering::Relaxed)
    ));
    std::fs::write(&tmp, source).map_err(|e| e.to_string())?;
    std::fs::rename(&tmp, &src).map_err(|e| e.to_string())?;
    // the key: the source preprocessed for `arch`, prelude.h left as the precompiled
    // header's pragma (its macros defined all the same)
    let mut args = KERNEL_FLAGS.map(os).to_vec();
    args.extend([os("-E"), os("-P"), os("-fpch-preprocess"), os(&define)]);
    args.extend([os("-I"), dir.as_os_str(), src.as_os_str()]);
    let key = hash64(&gxx(&args)?);
    let slot = CACHE
        .get_or_init(Default::default)
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .entry(key)
        .or_default()
        .clone();
    slot.get_or_init(|| {
        let lib = dir.join(format!("lib{name}_{key:016x}.so"));
        let mut rpath = OsString::from("-Wl,-rpath,");
        rpath.push(dir.as_os_str());
        let mut args = KERNEL_FLAGS.map(os).to_vec();
        args.extend([
            os("-shared"),
            os(&define),
            os("-I"),
            dir.as_os_str(),
            os("-o"),
        ]);
        args.extend([lib.as_os_str(), src.as_os_str(), runtime.as_os_str()]);
        args.extend([rpath.as_os_str(), os("-Wl,-z,defs")]);
        gxx(&args)?;
        unsafe { libloading::Library::new(&lib) }
            .map(Arc::new)
            .map_err(|e| e.to_string())
    })
    .clone()
}

fn hash64(bytes: &[u8]) -> u64 {
    let mut h = std::collections::hash_map::DefaultHasher::new();
    bytes.hash(&mut h);
    h.finish()
}

impl EmuDevice {
    pub fn new(resident: u32) -> Self {
        Self::with(resident, EmuConfig::mode(0, 1))
    }

    pub fn with(resident: u32, config: EmuConfig) -> Self {
        EmuDevice {
            resident,
            config,
            narrow_plans: Default::default(),
            v6_narrow_plans: Default::default(),
            whole_plans: Default::default(),
            heads_plans: Default::default(),
            narrow_wide_plans: Default::default(),
        }
    }

    /// The C++ translation unit for `kernel`: prelude.h, the emitted CUDA C (helpers as
    /// printed, inline PTX translated, shared arrays instrumented), and a launcher.
    pub fn source(kernel: &Kernel) -> Result<String> {
        let emitted = cuda::emit(kernel)?;
        let body = ptx::translate(&emitted).map_err(|e| Error::Compile {
            kernel: kernel.name.clone(),
            target: "PTX translator (CUDA emulator)".into(),
            log: e,
        })?;
        let body = instrument_shared(&body);
        let args: Vec<String> = (0..kernel.buffers.len())
            .map(|i| format!("AnyPtr{{a->bufs[{i}]}}"))
            .collect();
        Ok(format!(
            "#include \"prelude.h\"\n{body}\n\
             namespace {{\n\
             struct AnyPtr {{ void* p; template <class T> operator T*() const {{ return (T*)p; }} }};\n\
             struct Args {{ const {name}_params* p; void** bufs; }};\n\
             void body(void* c) {{ Args* a = (Args*)c; {name}(*a->p{comma}{args}); }}\n\
             }}\n\
             extern \"C\" unsigned emu_launch(const unsigned char* params, void** bufs, unsigned gx, unsigned gy, unsigned gz, unsigned land_at_issue, unsigned long long seed) {{\n\
                 Args a{{(const {name}_params*)params, bufs}};\n\
                 return emu::launch(emu_dim3{{gx, gy, gz}}, {threads}, body, &a, land_at_issue != 0, seed, {cooperative});\n\
             }}\n\
             extern \"C\" const char* emu_errors() {{ return emu::errors(); }}\n",
            name = kernel.name,
            comma = if args.is_empty() { "" } else { ", " },
            args = args.join(", "),
            threads = kernel.workgroup_size,
            cooperative = kernel.grid_dependency.cooperative,
        ))
    }
}

impl EmuDevice {
    /// `SPARSE_MLA_EMU_DUMP=path`: every buffer read back, as its arch, length and FNV-1a
    /// hash, one line each in `path.<run>` (a file per run), so that two builds of the
    /// emulator can be shown to give the same results bit for bit.
    fn record(&self, path: &str, bytes: &[u8]) {
        use std::io::Write;
        let mut h: u64 = 0xcbf2_9ce4_8422_2325;
        for b in bytes {
            h = (h ^ *b as u64).wrapping_mul(0x100_0000_01b3);
        }
        let c = self.config;
        let path = format!(
            "{path}.sm{}{}{}{}",
            c.arch,
            if c.v7 { "v7" } else { "v6" },
            if c.one_stage { "1s" } else { "" },
            c.row_softmax.map_or("", RowSoftmax::suffix)
        );
        let line = format!("{} {} {h:016x}\n", c.arch, bytes.len());
        std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&path)
            .and_then(|mut f| f.write_all(line.as_bytes()))
            .unwrap_or_else(|e| panic!("SPARSE_MLA_EMU_DUMP: {path}: {e}"));
    }
}

impl Device for EmuDevice {
    type Buf = EmuBuf;
    type Module = EmuModule;

    fn kind(&self) -> BackendKind {
        BackendKind::Cuda
    }

    fn name(&self) -> String {
        "CUDA C emulated on the CPU (g++)".into()
    }

    fn decode_config(&self, dims: MlaDims, format: CacheFormat) -> DecodeConfig {
        DecodeConfig::tensor_core(dims, format, 1)
    }

    fn target_workgroups(&self) -> u32 {
        self.resident
    }

    fn decode_plan(&self, shape: &DecodeShape, splits: Option<u32>) -> Result<DecodePlan> {
        let config = if self.config.one_stage {
            let v7 = DecodeConfig::tensor_core_v7(shape.dims, shape.format, shape.heads);
            let (block_h, block_n, stages) =
                self.config.block.unwrap_or((v7.block_h, v7.block_n, 1));
            // (its L2 prefetch too, which with one stage starts past step 0)
            DecodeConfig::tensor_core_custom(v7.dims, v7.format, block_h, block_n, stages)
                .with_l2_ahead(v7.l2_ahead())
        } else if self.config.v7 {
            // the backend's choice on a GPU of `choice_sms` SMs holding one v6 workgroup per SM:
            // v7, fp8's large-batch kernel for a large batch at H <= 16, v6 for a small bf16
            // call
            let planned =
                DecodeConfig::for_call(shape, self.config.choice_sms, || Ok::<u32, Error>(1))?;
            // ... except that bf16's two-group kernel runs where the backend's rule of before
            // v36 took it (a call past the small ones whose 16-head blocks fill half the SMs):
            // the backend no longer plans it (v42), but SPARSE_MLA_DECODE_KERNEL=batch still
            // runs it, and these cases' short and odd walks (a warp group with no step) are
            // where the kernel's merge is tested
            let blocks16 = DecodeConfig::blocks16(shape);
            match DecodeConfig::tensor_core_batch(shape.dims, shape.format, shape.heads) {
                Some(batch)
                    if shape.format == CacheFormat::Bf16
                        && !DecodeConfig::is_small_call(shape, self.config.choice_sms)
                        && 2 * blocks16 >= self.config.choice_sms as u64 =>
                {
                    batch
                }
                _ => planned,
            }
        } else {
            DecodeConfig::tensor_core_v6(shape.dims, shape.format, shape.heads)
        };
        let config = match self.config.heads {
            Some((block, warps, groups)) if shape.heads > 16 => {
                DecodeConfig::tensor_core_heads(shape.dims, shape.format, block, warps, groups)
            }
            _ => config,
        };
        if config.head_groups() > 1 {
            let i = usize::from(shape.format == CacheFormat::Fp8DsMla);
            self.heads_plans[i].fetch_add(1, Ordering::Relaxed);
        }
        lowered_kernels(&config)?;
        if Some(config) == DecodeConfig::tensor_core_narrow(shape.dims, shape.format, shape.heads) {
            let i = usize::from(shape.format == CacheFormat::Fp8DsMla);
            self.narrow_plans[i].fetch_add(1, Ordering::Relaxed);
        }
        if self.config.v7
            && Some(config)
                == DecodeConfig::tensor_core_v6_narrow(shape.dims, shape.format, shape.heads)
        {
            self.v6_narrow_plans.fetch_add(1, Ordering::Relaxed);
        }
        if self.config.v7
            && Some(config)
                == DecodeConfig::tensor_core_narrow_wide(shape.dims, shape.format, shape.heads)
        {
            self.narrow_wide_plans.fetch_add(1, Ordering::Relaxed);
        }
        let config = self
            .config
            .row_softmax
            .map_or(config, |form| config.with_row_softmax(form))
            .with_fp8_values(self.config.fp8_values);
        lowered_kernels(&config)?;
        // one workgroup per multiprocessor
        let plan = DecodePlan::with_config_whole(
            config,
            shape,
            self.resident,
            self.resident,
            splits,
            self.config.whole,
        )?;
        if plan.whole_tokens > 0 {
            let i = (shape.format != sparse_mla::mla::CacheFormat::Bf16) as usize;
            self.whole_plans[i].fetch_add(1, Ordering::Relaxed);
        }
        Ok(match self.config.merge {
            Some(h) if shape.heads >= h => plan.merged_where_it_can(shape, MERGED_BLOCKS),
            _ => plan,
        })
    }

    fn compile(&self, kernel: &Kernel) -> Result<EmuModule> {
        let fail = |log: String| Error::Compile {
            kernel: kernel.name.clone(),
            target: "g++ (CUDA emulator)".into(),
            log,
        };
        let l = compiled(&kernel.name, self.config.arch, &Self::source(kernel)?).map_err(fail)?;
        unsafe {
            let f: LaunchFn = *l
                .get::<LaunchFn>(b"emu_launch")
                .map_err(|e| fail(e.to_string()))?;
            let errors: ErrorsFn = *l
                .get::<ErrorsFn>(b"emu_errors")
                .map_err(|e| fail(e.to_string()))?;
            Ok(EmuModule {
                _lib: l,
                launch: f,
                errors,
            })
        }
    }

    fn alloc(&self, len: u64) -> Result<EmuBuf> {
        // Fresh memory is garbage on a GPU: NaN bytes here, so an unwritten read shows.
        Ok(EmuBuf(UnsafeCell::new(vec![0xFF; len.max(4) as usize])))
    }

    fn write(&self, buf: &EmuBuf, bytes: &[u8]) -> Result<()> {
        unsafe { (&mut *buf.0.get())[..bytes.len()].copy_from_slice(bytes) };
        Ok(())
    }

    fn read(&self, buf: &EmuBuf, len: u64) -> Result<Vec<u8>> {
        let bytes = unsafe { (&*buf.0.get())[..len as usize].to_vec() };
        if let Ok(path) = std::env::var("SPARSE_MLA_EMU_DUMP") {
            self.record(&path, &bytes);
        }
        Ok(bytes)
    }

    fn launch(
        &self,
        module: &EmuModule,
        kernel: &Kernel,
        grid: [u32; 3],
        params: &[u8],
        bufs: &[&EmuBuf],
    ) -> Result<()> {
        let dynamic = cuda::dynamic_shared_bytes(kernel);
        if dynamic > 1 << 18 {
            return Err(Error::runtime(
                "emu",
                "dynamic shared memory beyond the emulator's 256 KiB",
            ));
        }
        let mut block = [0u8; 256];
        block[..params.len()].copy_from_slice(params);
        let ptrs: Vec<*mut u8> = bufs
            .iter()
            .map(|b| unsafe { (&mut *b.0.get()).as_mut_ptr() })
            .collect();
        let n = unsafe {
            (module.launch)(
                block.as_ptr(),
                ptrs.as_ptr(),
                grid[0],
                grid[1],
                grid[2],
                self.config.land_at_issue as u32,
                self.config.seed,
            )
        };
        if n > 0 {
            let msg = unsafe { std::ffi::CStr::from_ptr((module.errors)()) }
                .to_string_lossy()
                .into_owned();
            return Err(Error::runtime(
                "emu",
                format!(
                    "{} ({}): {n} error(s):\n{msg}",
                    kernel.name,
                    self.config.describe()
                ),
            ));
        }
        Ok(())
    }
}

/// Shared arrays as the emulator's instrumented arrays (every access goes through the race
/// detector): the emitter's `__shared__ __align__(16) T name[N];` and
/// `T* const name = (T*)(dyn_smem + OFF); // [N]` lines.
fn instrument_shared(src: &str) -> String {
    let mut out = String::with_capacity(src.len());
    for line in src.lines() {
        let t = line.trim_start();
        let indent = &line[..line.len() - t.len()];
        if t.starts_with("extern __shared__") {
            continue;
        }
        if let Some(rest) = t.strip_prefix("__shared__ __align__(16) ") {
            // `T name[N];`, T possibly two words
            if let (Some(open), Some(close)) = (rest.rfind('['), rest.rfind("];")) {
                let head = &rest[..open];
                let len = &rest[open + 1..close];
                if let Some(sp) = head.rfind(' ') {
                    let (ty, name) = (&head[..sp], &head[sp + 1..]);
                    out.push_str(&format!(
                        "{indent}const emu::Sh<{ty}> {name} = emu::shared_static<{ty}>(\"{name}\", {len});\n"
                    ));
                    continue;
                }
            }
        }
        if let Some(pos) = t.find("* const ") {
            if t.contains("(dyn_smem + ") {
                let ty = &t[..pos];
                let rest = &t[pos + "* const ".len()..];
                if let (Some(eq), Some(plus), Some(close)) =
                    (rest.find(" = "), rest.find("(dyn_smem + "), rest.find(");"))
                {
                    let name = &rest[..eq];
                    let off = &rest[plus + "(dyn_smem + ".len()..close];
                    let len = rest
                        .rsplit_once('[')
                        .and_then(|(_, l)| l.strip_suffix(']'))
                        .unwrap_or("0");
                    out.push_str(&format!(
                        "{indent}const emu::Sh<{ty}> {name} = emu::shared_dyn<{ty}>(\"{name}\", {off}, {len});\n"
                    ));
                    continue;
                }
            }
        }
        out.push_str(line);
        out.push('\n');
    }
    out
}
