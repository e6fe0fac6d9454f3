//! wgpu backend: WGSL through naga into whatever the adapter speaks (Vulkan, Metal, DX12,
//! and Mesa's lavapipe on the CPU). Honours `WGPU_BACKEND` (e.g. `vulkan`) and
//! `WGPU_ADAPTER_NAME` (a case-insensitive substring of the adapter name).

use super::gpu::Device;
use super::BackendKind;
use crate::emit::wgsl;
use crate::kernels::sparse_mla_decode::DecodeConfig;
use crate::kir::Kernel;
use crate::mla::{CacheFormat, MlaDims};
use crate::{Error, Result};

const NAME: &str = "wgpu";

pub struct WgpuDevice {
    device: wgpu::Device,
    queue: wgpu::Queue,
    info: wgpu::AdapterInfo,
    limits: wgpu::Limits,
    /// Host waits on the device so far.
    waits: std::sync::atomic::AtomicU64,
}

pub struct WgpuModule {
    pipeline: wgpu::ComputePipeline,
    layout: wgpu::BindGroupLayout,
}

fn err(message: impl ToString) -> Error {
    Error::runtime(NAME, message)
}

/// Mesa's Vulkan loader prints an `error: XDG_RUNTIME_DIR is invalid` line on every start when
/// the variable is unset (it wants it for window-system sockets compute never uses). Point it
/// at a private directory then, so that a user's stderr holds only our own errors.
fn quiet_mesa_runtime_dir() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        if std::env::var_os("XDG_RUNTIME_DIR").is_some() {
            return;
        }
        let dir = std::env::temp_dir().join(format!("sparse-mla-xdg-{}", std::process::id()));
        if std::fs::create_dir_all(&dir).is_ok() {
            #[cfg(unix)]
            {
                use std::os::unix::fs::PermissionsExt;
                let _ = std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o700));
            }
            // Before any other thread of ours reads the environment (wgpu is not running yet).
            std::env::set_var("XDG_RUNTIME_DIR", &dir);
        }
    });
}

impl WgpuDevice {
    /// Every adapter wgpu finds (filtered by `WGPU_BACKEND` / `WGPU_ADAPTER_NAME`), each
    /// opened or with the reason it could not be. `Err` when there is none at all.
    pub fn all() -> Result<Vec<Result<WgpuDevice>>> {
        quiet_mesa_runtime_dir();
        // GL (a secondary backend) is left out unless asked for: its compute path is slow and
        // adds nothing a primary backend does not cover.
        let backends = wgpu::Backends::from_env().unwrap_or(wgpu::Backends::PRIMARY);
        let mut desc = wgpu::InstanceDescriptor::new_without_display_handle_from_env();
        desc.backends = backends;
        let instance = wgpu::Instance::new(desc);
        let mut adapters = pollster::block_on(instance.enumerate_adapters(backends));
        if let Ok(want) = std::env::var("WGPU_ADAPTER_NAME") {
            let want = want.to_lowercase();
            adapters.retain(|a| a.get_info().name.to_lowercase().contains(&want));
            if adapters.is_empty() {
                return Err(Error::unavailable(
                    NAME,
                    format!("no adapter name contains WGPU_ADAPTER_NAME={want:?}"),
                ));
            }
        }
        if adapters.is_empty() {
            return Err(Error::unavailable(
                NAME,
                "no GPU adapter found (for a CPU adapter install Mesa's lavapipe: \
                 `apt-get install mesa-vulkan-drivers libvulkan1`)",
            ));
        }
        Ok(adapters.into_iter().map(Self::open).collect())
    }

    /// Open one adapter, asking for all of its limits (the defaults refuse large workgroups).
    pub fn open(adapter: wgpu::Adapter) -> Result<WgpuDevice> {
        let info = adapter.get_info();
        let limits = adapter.limits();
        let (device, queue) = pollster::block_on(adapter.request_device(&wgpu::DeviceDescriptor {
            label: Some("sparse-mla"),
            required_features: wgpu::Features::empty(),
            required_limits: limits.clone(),
            ..Default::default()
        }))
        .map_err(|e| {
            Error::unavailable(
                NAME,
                format!("adapter {:?} refused a device: {e}", info.name),
            )
        })?;
        Ok(WgpuDevice {
            device,
            queue,
            info,
            limits,
            waits: Default::default(),
        })
    }

    pub fn info(&self) -> &wgpu::AdapterInfo {
        &self.info
    }

    pub fn limits(&self) -> &wgpu::Limits {
        &self.limits
    }

    fn scoped<T>(&self, what: &str, f: impl FnOnce() -> T) -> Result<T> {
        let scope = self.device.push_error_scope(wgpu::ErrorFilter::Validation);
        let oom = self.device.push_error_scope(wgpu::ErrorFilter::OutOfMemory);
        let v = f();
        if let Some(e) = pollster::block_on(oom.pop()) {
            return Err(err(format!("{what}: out of memory: {e}")));
        }
        if let Some(e) = pollster::block_on(scope.pop()) {
            return Err(err(format!("{what}: {e}")));
        }
        Ok(v)
    }

    fn wait(&self) -> Result<()> {
        self.waits
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        self.device
            .poll(wgpu::PollType::Wait {
                submission_index: None,
                timeout: None,
            })
            .map(|_| ())
            .map_err(|e| err(format!("waiting for the device: {e}")))
    }
}

impl WgpuDevice {
    /// Copies every range into a mappable buffer in one submission and waits once.
    fn read_ranges(&self, ranges: &[(&wgpu::Buffer, u64, u64)]) -> Result<Vec<Vec<u8>>> {
        let mut enc = self
            .device
            .create_command_encoder(&wgpu::CommandEncoderDescriptor { label: None });
        let mut staging = Vec::with_capacity(ranges.len());
        for (buf, offset, len) in ranges {
            let size = len.next_multiple_of(4).min(buf.size() - offset).max(4);
            let st = self.device.create_buffer(&wgpu::BufferDescriptor {
                label: Some("readback"),
                size,
                usage: wgpu::BufferUsages::MAP_READ | wgpu::BufferUsages::COPY_DST,
                mapped_at_creation: false,
            });
            if *len > 0 {
                enc.copy_buffer_to_buffer(buf, *offset, &st, 0, size);
            }
            staging.push(st);
        }
        self.queue.submit([enc.finish()]);
        let mut results = Vec::with_capacity(staging.len());
        for st in &staging {
            let (tx, rx) = std::sync::mpsc::channel();
            st.map_async(wgpu::MapMode::Read, .., move |r| {
                let _ = tx.send(r);
            });
            results.push(rx);
        }
        self.wait()?;
        let mut out = Vec::with_capacity(staging.len());
        for ((st, rx), (_, _, len)) in staging.iter().zip(results).zip(ranges) {
            rx.recv()
                .map_err(|_| err("readback callback never ran"))?
                .map_err(|e| err(format!("mapping the readback buffer: {e}")))?;
            let data = st
                .get_mapped_range(..)
                .map_err(|e| err(format!("reading the readback buffer: {e:?}")))?
                .to_vec();
            st.unmap();
            out.push(data[..*len as usize].to_vec());
        }
        Ok(out)
    }
}

impl Device for WgpuDevice {
    type Buf = wgpu::Buffer;
    type Module = WgpuModule;

    fn kind(&self) -> BackendKind {
        BackendKind::Wgpu
    }

    fn name(&self) -> String {
        format!("{} ({:?})", self.info.name, self.info.backend)
    }

    fn decode_config(&self, dims: MlaDims, format: CacheFormat) -> DecodeConfig {
        DecodeConfig::portable(dims, format)
    }

    fn target_workgroups(&self) -> u32 {
        // wgpu does not report a compute-unit count; a small multiple of a laptop GPU's.
        if self.info.device_type == wgpu::DeviceType::Cpu {
            8
        } else {
            128
        }
    }

    fn max_steps_per_workgroup(&self, config: &DecodeConfig) -> Option<u32> {
        // llvmpipe (lavapipe) stops every loop of an invocation once 65535 iterations have run
        // in total, over all loops: results are silently wrong past that. A bf16 decode step
        // costs about 80 iterations (failures were seen from ~800 steps), an fp8_ds_mla step
        // about 113 (its dequant loops): keep both at ~2/3 of the limit.
        let per_step = match config.format {
            CacheFormat::Bf16 => 80,
            CacheFormat::Fp8DsMla => 113,
        };
        (self.info.device_type == wgpu::DeviceType::Cpu).then_some(44_000 / per_step)
    }

    fn compile(&self, kernel: &Kernel) -> Result<WgpuModule> {
        wgsl::check_portable_limits(kernel)?;
        let limit = self.limits.max_compute_workgroup_storage_size as u64;
        if kernel.shared_bytes() > limit {
            return Err(Error::ResourceLimit {
                kernel: kernel.name.clone(),
                resource: format!("workgroup memory on {}", self.info.name),
                needed: kernel.shared_bytes(),
                limit,
            });
        }
        if kernel.workgroup_size > self.limits.max_compute_invocations_per_workgroup {
            return Err(Error::ResourceLimit {
                kernel: kernel.name.clone(),
                resource: format!("invocations per workgroup on {}", self.info.name),
                needed: kernel.workgroup_size as u64,
                limit: self.limits.max_compute_invocations_per_workgroup as u64,
            });
        }
        let t0 = std::time::Instant::now();
        let source = wgsl::emit(kernel)?;
        wgsl::validate(&kernel.name, &source)?;
        let mut entries = vec![wgpu::BindGroupLayoutEntry {
            binding: 0,
            visibility: wgpu::ShaderStages::COMPUTE,
            ty: wgpu::BindingType::Buffer {
                ty: wgpu::BufferBindingType::Uniform,
                has_dynamic_offset: false,
                min_binding_size: None,
            },
            count: None,
        }];
        for (i, b) in kernel.buffers.iter().enumerate() {
            entries.push(wgpu::BindGroupLayoutEntry {
                binding: i as u32 + 1,
                visibility: wgpu::ShaderStages::COMPUTE,
                ty: wgpu::BindingType::Buffer {
                    ty: wgpu::BufferBindingType::Storage {
                        read_only: b.access == crate::kir::ir::Access::Read,
                    },
                    has_dynamic_offset: false,
                    min_binding_size: None,
                },
                count: None,
            });
        }
        self.scoped(&format!("compiling {}", kernel.name), || {
            let desc = wgpu::ShaderModuleDescriptor {
                label: Some(&kernel.name),
                source: wgpu::ShaderSource::Wgsl(source.as_str().into()),
            };
            let module = self.device.create_shader_module(desc);
            let layout = self
                .device
                .create_bind_group_layout(&wgpu::BindGroupLayoutDescriptor {
                    label: Some(&kernel.name),
                    entries: &entries,
                });
            let pl = self
                .device
                .create_pipeline_layout(&wgpu::PipelineLayoutDescriptor {
                    label: Some(&kernel.name),
                    bind_group_layouts: &[Some(&layout)],
                    immediate_size: 0,
                });
            let pipeline = self
                .device
                .create_compute_pipeline(&wgpu::ComputePipelineDescriptor {
                    label: Some(&kernel.name),
                    layout: Some(&pl),
                    module: &module,
                    entry_point: Some(&kernel.name),
                    compilation_options: Default::default(),
                    cache: None,
                });
            WgpuModule { pipeline, layout }
        })
        .inspect(|_| {
            log::info!(
                "kernel {}: WGSL validated and compiled on {} in {:.0} ms",
                kernel.name,
                self.info.name,
                t0.elapsed().as_secs_f64() * 1e3
            )
        })
    }

    fn alloc(&self, len: u64) -> Result<wgpu::Buffer> {
        let max = self.limits.max_buffer_size;
        let size = len.max(4).next_multiple_of(4);
        if size > max {
            return Err(Error::runtime(
                "wgpu",
                format!(
                    "a buffer of {size} bytes is larger than {} allows in one buffer ({max} bytes); \
                     for a model run, a smaller --max-seq-len makes the caches smaller",
                    self.info.name
                ),
            ));
        }
        self.scoped("allocating a buffer", || {
            self.device.create_buffer(&wgpu::BufferDescriptor {
                label: None,
                size,
                usage: wgpu::BufferUsages::STORAGE
                    | wgpu::BufferUsages::COPY_SRC
                    | wgpu::BufferUsages::COPY_DST,
                mapped_at_creation: false,
            })
        })
    }

    fn write(&self, buf: &wgpu::Buffer, bytes: &[u8]) -> Result<()> {
        self.write_at(buf, 0, bytes)
    }

    fn read(&self, buf: &wgpu::Buffer, len: u64) -> Result<Vec<u8>> {
        self.read_at(buf, 0, len)
    }

    fn write_at(&self, buf: &wgpu::Buffer, offset: u64, bytes: &[u8]) -> Result<()> {
        // Copies are whole words. A write that ends at the buffer's end may have an unaligned
        // tail (the buffer is allocated in whole words): pad it with zeros, past the end.
        if bytes.len() % 4 == 0 {
            self.queue.write_buffer(buf, offset, bytes);
        } else {
            let mut v = bytes.to_vec();
            v.resize(bytes.len().next_multiple_of(4), 0);
            self.queue.write_buffer(buf, offset, &v);
        }
        self.queue.submit([]);
        Ok(())
    }

    fn synchronize(&self) -> Result<()> {
        self.wait()
    }

    fn host_syncs(&self) -> u64 {
        self.waits.load(std::sync::atomic::Ordering::Relaxed)
    }

    fn read_at(&self, buf: &wgpu::Buffer, offset: u64, len: u64) -> Result<Vec<u8>> {
        let mut v = self.read_ranges(&[(buf, offset, len)])?;
        Ok(v.pop().unwrap_or_default())
    }

    fn read_many(&self, reads: &[(&wgpu::Buffer, u64)]) -> Result<Vec<Vec<u8>>> {
        let ranges: Vec<(&wgpu::Buffer, u64, u64)> =
            reads.iter().map(|(b, l)| (*b, 0, *l)).collect();
        self.read_ranges(&ranges)
    }

    fn launch(
        &self,
        module: &WgpuModule,
        kernel: &Kernel,
        grid: [u32; 3],
        params: &[u8],
        bufs: &[&wgpu::Buffer],
    ) -> Result<()> {
        let max_dim = self.limits.max_compute_workgroups_per_dimension;
        if grid.iter().any(|&g| g > max_dim) {
            return Err(Error::ResourceLimit {
                kernel: kernel.name.clone(),
                resource: "workgroups per grid dimension".into(),
                needed: *grid.iter().max().unwrap_or(&0) as u64,
                limit: max_dim as u64,
            });
        }
        if grid.contains(&0) {
            return Ok(());
        }
        let binding_max = self.limits.max_storage_buffer_binding_size;
        for (decl, b) in kernel.buffers.iter().zip(bufs) {
            if b.size() > binding_max {
                return Err(Error::arg(
                    decl.name.as_str(),
                    format!(
                        "at most {binding_max} bytes (max storage binding on {})",
                        self.info.name
                    ),
                    format!("{} bytes", b.size()),
                ));
            }
        }
        let mut block = params.to_vec();
        block.resize(params.len().div_ceil(16).max(1) * 16, 0);
        self.scoped(&format!("launching {}", kernel.name), || {
            let ubuf = self.device.create_buffer(&wgpu::BufferDescriptor {
                label: Some("params"),
                size: block.len() as u64,
                usage: wgpu::BufferUsages::UNIFORM | wgpu::BufferUsages::COPY_DST,
                mapped_at_creation: false,
            });
            self.queue.write_buffer(&ubuf, 0, &block);
            let mut entries = vec![wgpu::BindGroupEntry {
                binding: 0,
                resource: ubuf.as_entire_binding(),
            }];
            for (i, b) in bufs.iter().enumerate() {
                entries.push(wgpu::BindGroupEntry {
                    binding: i as u32 + 1,
                    resource: b.as_entire_binding(),
                });
            }
            let group = self.device.create_bind_group(&wgpu::BindGroupDescriptor {
                label: Some(&kernel.name),
                layout: &module.layout,
                entries: &entries,
            });
            let mut enc = self
                .device
                .create_command_encoder(&wgpu::CommandEncoderDescriptor {
                    label: Some(&kernel.name),
                });
            {
                let mut pass = enc.begin_compute_pass(&wgpu::ComputePassDescriptor {
                    label: Some(&kernel.name),
                    timestamp_writes: None,
                });
                pass.set_pipeline(&module.pipeline);
                pass.set_bind_group(0, &group, &[]);
                pass.dispatch_workgroups(grid[0], grid[1], grid[2]);
            }
            self.queue.submit([enc.finish()]);
        })
    }
}
