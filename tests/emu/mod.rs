//! A CPU emulator of the CUDA path: the CUDA C that the emitter prints for a kernel, compiled
//! by g++ with `prelude.h` standing in for CUDA (each GPU thread a fiber; `ldmatrix`,
//! `mma.sync`, `shfl` and `cp.async` emulated by the PTX rules), behind the same
//! [`Device`] trait as the real GPU. The whole conformance suite then runs the tensor-core
//! lowering on a machine without a GPU, fragment layouts and pipeline order included.

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

const PRELUDE: &str = include_str!("prelude.h");

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
}

pub struct EmuBuf(UnsafeCell<Vec<u8>>);
// One launch at a time, from one thread (the emulator is single-threaded).
unsafe impl Sync for EmuBuf {}
unsafe impl Send for EmuBuf {}

type LaunchFn = unsafe extern "C" fn(*const u8, *const *mut u8, u32, u32, u32);

pub struct EmuModule {
    _lib: libloading::Library,
    launch: LaunchFn,
}

impl EmuDevice {
    pub fn new(resident: u32) -> Self {
        let dir = std::env::temp_dir().join(format!("sparse-mla-emu-{}", std::process::id()));
        EmuDevice { dir, resident }
    }

    /// The C++ translation unit for `kernel`: prelude, the emitted CUDA C with the emulated
    /// helpers, and a launcher.
    pub fn source(kernel: &Kernel) -> Result<String> {
        let body = cuda::emit_with_helpers(kernel, Some(""))?;
        let body = body.replace("extern __shared__", "extern");
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
             extern \"C\" void emu_launch(const unsigned char* params, void** bufs, unsigned gx, unsigned gy, unsigned gz) {{\n\
                 Args a{{(const {name}_params*)params, bufs}};\n\
                 emu::run_grid(emu_dim3{{gx, gy, gz}}, {threads}, body, &a);\n\
             }}\n",
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
        let config = DecodeConfig::tensor_core(shape.dims, shape.format, shape.heads);
        lowered_kernels(&config)?;
        DecodePlan::tensor_core(shape, self.resident, splits)
    }

    fn compile(&self, kernel: &Kernel) -> Result<EmuModule> {
        let fail = |log: String| Error::Compile {
            kernel: kernel.name.clone(),
            target: "g++ (CUDA emulator)".into(),
            log,
        };
        std::fs::create_dir_all(&self.dir).map_err(|e| fail(e.to_string()))?;
        let src = self.dir.join(format!("{}.cpp", kernel.name));
        let lib = self.dir.join(format!("lib{}.so", kernel.name));
        std::fs::write(&src, Self::source(kernel)?).map_err(|e| fail(e.to_string()))?;
        let out = Command::new("g++")
            .args(["-std=c++17", "-O1", "-g0", "-shared", "-fPIC", "-w", "-o"])
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
            Ok(EmuModule { _lib: l, launch: f })
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
        unsafe { (module.launch)(block.as_ptr(), ptrs.as_ptr(), grid[0], grid[1], grid[2]) };
        Ok(())
    }
}
