//! The CUDA devices as PyTorch sees them: each device's primary context (the one PyTorch
//! uses, so pointers and streams are shared), its kernels compiled by NVRTC once (through the
//! main crate's on-disk cache) and loaded once, and launches onto a caller's stream.

use cudarc::driver::{result as drv, sys as drv_sys, CudaContext, CudaFunction, CudaModule};
use sparse_mla::emit::cuda as emit_cuda;
use sparse_mla::kernels::sparse_mla_decode::{lowered_kernels, DecodeConfig};
use sparse_mla::kernels::Launch;
use sparse_mla::kir::Kernel;
use sparse_mla::runtime::cuda::{driver_unavailable, load_module_cached, nvrtc_unavailable};
use sparse_mla::{Error, Result};
use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::{Arc, Mutex, OnceLock};

const NAME: &str = "cuda";

struct Loaded {
    _module: Arc<CudaModule>,
    function: CudaFunction,
    dynamic_smem: u32,
}

struct Dev {
    ctx: Arc<CudaContext>,
    name: String,
    arch: String,
    sms: u32,
    kernels: HashMap<String, Arc<Loaded>>,
    resident: HashMap<String, u32>,
}

// SAFETY: the CUDA driver's handles may be used from any thread; every use goes through the
// one mutex below, which binds the context to the calling thread first.
unsafe impl Send for Dev {}

fn devices() -> &'static Mutex<HashMap<usize, Dev>> {
    static D: OnceLock<Mutex<HashMap<usize, Dev>>> = OnceLock::new();
    D.get_or_init(|| Mutex::new(HashMap::new()))
}

fn drv_err(what: &str, e: impl std::fmt::Debug) -> Error {
    Error::runtime(NAME, format!("{what}: {e:?}"))
}

pub fn unavailable() -> Option<String> {
    if let Some(why) = driver_unavailable() {
        return Some(why);
    }
    if let Some(why) = nvrtc_unavailable() {
        return Some(why);
    }
    match CudaContext::device_count() {
        Ok(0) => Some("the CUDA driver reports no device".into()),
        Ok(_) => None,
        Err(e) => Some(format!("cuInit / device count failed: {e:?}")),
    }
}

fn with_device<T>(ordinal: usize, f: impl FnOnce(&mut Dev) -> Result<T>) -> Result<T> {
    if let Some(why) = unavailable() {
        return Err(Error::unavailable(NAME, why));
    }
    let mut map = devices()
        .lock()
        .map_err(|_| Error::runtime(NAME, "device table lock poisoned by an earlier panic"))?;
    let dev = match map.entry(ordinal) {
        std::collections::hash_map::Entry::Occupied(e) => e.into_mut(),
        std::collections::hash_map::Entry::Vacant(e) => {
            let ctx = CudaContext::new(ordinal)
                .map_err(|e| Error::unavailable(NAME, format!("device cuda:{ordinal}: {e:?}")))?;
            let (major, minor) = ctx
                .compute_capability()
                .map_err(|e| drv_err("compute capability", e))?;
            let sms = ctx
                .attribute(drv_sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
                .map_err(|e| drv_err("SM count", e))? as u32;
            let name = ctx.name().map_err(|e| drv_err("device name", e))?;
            e.insert(Dev {
                ctx,
                name,
                arch: format!("sm_{major}{minor}"),
                sms,
                kernels: HashMap::new(),
                resident: HashMap::new(),
            })
        }
    };
    dev.ctx
        .bind_to_thread()
        .map_err(|e| drv_err("binding the context", e))?;
    f(dev)
}

impl Dev {
    fn load(&mut self, kernel: &Kernel) -> Result<Arc<Loaded>> {
        if let Some(k) = self.kernels.get(&kernel.name) {
            return Ok(k.clone());
        }
        let dynamic_smem = emit_cuda::dynamic_shared_bytes(kernel);
        let source = emit_cuda::emit(kernel)?;
        let module = load_module_cached(&self.ctx, &kernel.name, &source, &self.arch)?;
        let function = module
            .load_function(&kernel.name)
            .map_err(|e| drv_err(&format!("finding {}", kernel.name), e))?;
        if dynamic_smem > 0 {
            // above 48 KB a kernel must opt in to its dynamic shared memory
            unsafe {
                drv::function::set_function_attribute(
                    function.cu_function(),
                    drv_sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                    dynamic_smem as i32,
                )
            }
            .map_err(|e| {
                drv_err(
                    &format!("allowing {} {dynamic_smem} B of shared memory", kernel.name),
                    e,
                )
            })?;
        }
        let loaded = Arc::new(Loaded {
            _module: module,
            function,
            dynamic_smem,
        });
        self.kernels.insert(kernel.name.clone(), loaded.clone());
        Ok(loaded)
    }
}

/// Multiprocessors of the device.
pub fn sm_count(ordinal: usize) -> Result<u32> {
    with_device(ordinal, |dev| Ok(dev.sms))
}

/// Workgroups of the split kernel of `config` the device runs at once (the driver's occupancy
/// calculator x multiprocessors), as the CUDA backend feeds its split model.
pub fn resident_workgroups(ordinal: usize, config: &DecodeConfig) -> Result<u32> {
    let (split, _) = lowered_kernels(config)?;
    with_device(ordinal, |dev| {
        if let Some(n) = dev.resident.get(&split.name) {
            return Ok(*n);
        }
        let k = dev.load(&split)?;
        let per_sm = unsafe {
            drv::occupancy::max_active_block_per_multiprocessor(
                k.function.cu_function(),
                split.workgroup_size as i32,
                k.dynamic_smem as usize,
            )
        }
        .map_err(|e| drv_err(&format!("occupancy of {}", split.name), e))?
        .max(1) as u32;
        let n = per_sm * dev.sms;
        dev.resident.insert(split.name.clone(), n);
        Ok(n)
    })
}

/// The parameter block as a kernel argument: the driver copies as many bytes as the kernel's
/// parameter struct has.
#[repr(C, align(16))]
struct ParamBlock([u8; 256]);

/// Launch `l` on `stream`, binding the kernel's buffers by name from `bufs`.
pub fn launch(ordinal: usize, stream: u64, l: &Launch, bufs: &[(&str, u64)]) -> Result<()> {
    let k = &l.kernel;
    if l.grid[1] > 65535 || l.grid[2] > 65535 {
        return Err(Error::ResourceLimit {
            kernel: k.name.clone(),
            resource: "grid y / z".into(),
            needed: l.grid[1].max(l.grid[2]) as u64,
            limit: 65535,
        });
    }
    if l.grid.contains(&0) {
        return Ok(());
    }
    if l.params.len() > 256 {
        return Err(Error::Kir {
            kernel: k.name.clone(),
            message: format!("parameter block of {} bytes (max 256)", l.params.len()),
        });
    }
    let mut ptrs: Vec<drv_sys::CUdeviceptr> = Vec::with_capacity(k.buffers.len());
    for b in &k.buffers {
        let p = bufs
            .iter()
            .find(|(n, _)| *n == b.name)
            .map(|(_, p)| *p)
            .ok_or_else(|| Error::Kir {
                kernel: k.name.clone(),
                message: format!("no pointer bound for buffer `{}`", b.name),
            })?;
        ptrs.push(p);
    }
    with_device(ordinal, |dev| {
        let loaded = dev.load(k)?;
        let mut block = ParamBlock([0u8; 256]);
        block.0[..l.params.len()].copy_from_slice(&l.params);
        let mut args: Vec<*mut c_void> = Vec::with_capacity(1 + ptrs.len());
        args.push(&mut block as *mut ParamBlock as *mut c_void);
        for p in ptrs.iter_mut() {
            args.push(p as *mut drv_sys::CUdeviceptr as *mut c_void);
        }
        unsafe {
            drv::launch_kernel(
                loaded.function.cu_function(),
                (l.grid[0], l.grid[1], l.grid[2]),
                (k.workgroup_size, 1, 1),
                loaded.dynamic_smem,
                stream as drv_sys::CUstream,
                &mut args,
            )
        }
        .map_err(|e| drv_err(&format!("launching {}", k.name), e))
    })
}

pub fn info(ordinal: usize) -> Result<String> {
    with_device(ordinal, |dev| {
        Ok(format!("{} ({}, {} SMs)", dev.name, dev.arch, dev.sms))
    })
}
