//! A CPU emulator of the CUDA path: the CUDA C that the emitter prints for a kernel — its
//! helpers included, their inline PTX translated instruction by instruction ([`ptx`]) —
//! compiled by g++ with `prelude.h` standing in for CUDA and the PTX instructions (each GPU
//! thread a fiber, warps scheduled in a random order, asynchronous copies landing at issue or
//! as late as allowed, a shared-memory race detector), behind the same [`Device`] trait as
//! the real GPU. The whole conformance suite then runs the tensor-core lowering on a machine
//! without a GPU, fragment layouts, helper operand orders and pipeline synchronisation
//! included.

#![allow(dead_code)]

use sparse_mla::emit::cuda;
use sparse_mla::kernels::sparse_mla_decode::{lowered_kernels, DecodeConfig, DecodePlan};
use sparse_mla::kir::Kernel;
use sparse_mla::mla::{CacheFormat, DecodeShape, MlaDims};
use sparse_mla::runtime::gpu::Device;
use sparse_mla::runtime::BackendKind;
use sparse_mla::{Error, Result};
use std::cell::UnsafeCell;
use std::path::PathBuf;
use std::process::Command;

pub mod ptx;

const PRELUDE: &str = include_str!("prelude.h");

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
}

impl EmuConfig {
    /// Both copy modes and both helper paths, by a run index: v7 (900, late), v7 (800, at
    /// issue), v6 (900, late).
    /// Mode 3: v7 with a one-stage ring (900, late); the test runs it on the decode cases.
    pub fn mode(i: u32, seed: u64) -> Self {
        EmuConfig {
            // run 0 as sm_120 (its e4m3 products native), run 2 as sm_90
            arch: match i {
                0 => 1200,
                2 => 900,
                _ => 800,
            },
            land_at_issue: i % 2 == 1,
            seed,
            v7: i < 2 || i == 3,
            one_stage: i == 3,
        }
    }

    pub fn describe(&self) -> String {
        format!(
            "{} kernel, sm_{} helpers, copies land {}, schedule seed {}",
            if self.one_stage {
                "v7 (one-stage ring)"
            } else if self.v7 {
                "v7"
            } else {
                "v6"
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
    dir: PathBuf,
    /// Resident workgroups the split heuristic plans for (a small "GPU").
    pub resident: u32,
    pub config: EmuConfig,
}

pub struct EmuBuf(UnsafeCell<Vec<u8>>);
// One launch at a time, from one thread (the emulator is single-threaded).
unsafe impl Sync for EmuBuf {}
unsafe impl Send for EmuBuf {}

type LaunchFn = unsafe extern "C" fn(*const u8, *const *mut u8, u32, u32, u32, u32, u64) -> u32;
type ErrorsFn = unsafe extern "C" fn() -> *const std::ffi::c_char;

pub struct EmuModule {
    _lib: libloading::Library,
    launch: LaunchFn,
    errors: ErrorsFn,
}

impl EmuDevice {
    pub fn new(resident: u32) -> Self {
        Self::with(resident, EmuConfig::mode(0, 1))
    }

    pub fn with(resident: u32, config: EmuConfig) -> Self {
        let dir = std::env::temp_dir().join(format!("sparse-mla-emu-{}", std::process::id()));
        EmuDevice {
            dir,
            resident,
            config,
        }
    }

    /// The C++ translation unit for `kernel`: prelude, the emitted CUDA C (helpers as
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
            "{PRELUDE}\n{body}\n\
             namespace {{\n\
             struct AnyPtr {{ void* p; template <class T> operator T*() const {{ return (T*)p; }} }};\n\
             struct Args {{ const {name}_params* p; void** bufs; }};\n\
             void body(void* c) {{ Args* a = (Args*)c; {name}(*a->p{comma}{args}); }}\n\
             }}\n\
             extern \"C\" unsigned emu_launch(const unsigned char* params, void** bufs, unsigned gx, unsigned gy, unsigned gz, unsigned land_at_issue, unsigned long long seed) {{\n\
                 Args a{{(const {name}_params*)params, bufs}};\n\
                 emu::st().errors.clear(); emu::st().nerrors = 0;\n\
                 emu::st().cfg.land_at_issue = land_at_issue != 0; emu::st().cfg.seed = seed;\n\
                 emu::run_grid(emu_dim3{{gx, gy, gz}}, {threads}, body, &a);\n\
                 return emu::st().nerrors;\n\
             }}\n\
             extern \"C\" const char* emu_errors() {{ return emu::st().errors.c_str(); }}\n",
            name = kernel.name,
            comma = if args.is_empty() { "" } else { ", " },
            args = args.join(", "),
            threads = kernel.workgroup_size,
        ))
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
            DecodeConfig::tensor_core_custom(v7.dims, v7.format, v7.block_h, v7.block_n, 1)
        } else if self.config.v7 {
            DecodeConfig::tensor_core_v7(shape.dims, shape.format, shape.heads)
        } else {
            DecodeConfig::tensor_core_v6(shape.dims, shape.format, shape.heads)
        };
        lowered_kernels(&config)?;
        DecodePlan::with_config(config, shape, self.resident, splits)
    }

    fn compile(&self, kernel: &Kernel) -> Result<EmuModule> {
        let fail = |log: String| Error::Compile {
            kernel: kernel.name.clone(),
            target: "g++ (CUDA emulator)".into(),
            log,
        };
        std::fs::create_dir_all(&self.dir).map_err(|e| fail(e.to_string()))?;
        let arch = self.config.arch;
        let src = self.dir.join(format!("{}_{arch}.cpp", kernel.name));
        let lib = self.dir.join(format!("lib{}_{arch}.so", kernel.name));
        std::fs::write(&src, Self::source(kernel)?).map_err(|e| fail(e.to_string()))?;
        let out = Command::new("g++")
            .args(["-std=c++17", "-O1", "-g0", "-shared", "-fPIC", "-w"])
            .arg(format!("-D__CUDA_ARCH__={arch}"))
            .arg("-o")
            .arg(&lib)
            .arg(&src)
            .output()
            .map_err(|e| fail(e.to_string()))?;
        if !out.status.success() {
            return Err(fail(String::from_utf8_lossy(&out.stderr).into_owned()));
        }
        unsafe {
            let l = libloading::Library::new(&lib).map_err(|e| fail(e.to_string()))?;
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
        Ok(unsafe { (&*buf.0.get())[..len as usize].to_vec() })
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
