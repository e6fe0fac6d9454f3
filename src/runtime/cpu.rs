//! The CPU backend: buffers in host memory, operations by the float64 references in
//! [`crate::reference`] (outputs rounded to their storage types).

use super::op::check_bindings;
use super::{
    check_cache_write_buffers, check_decode_buffers, check_vbt_buffers, Backend, BackendKind,
    Buffer, CacheWriteBuffers, DecodeBuffers, DecodeOptions, DecodeRun, HostBuffers, Op,
    VbtBuffers,
};
use crate::mla::{CacheGeometry, CacheWriteShape, DecodeShape, VbtShape};
use crate::reference::cache::write_rows;
use crate::reference::numerics::bf16_bits;
use crate::reference::sparse_mla::{decode, DecodeInputs};
use crate::reference::vbt;
use crate::{Error, Result};
use std::sync::Mutex;

pub struct CpuBackend {
    id: u64,
    allocations: std::sync::atomic::AtomicU64,
}

impl Default for CpuBackend {
    fn default() -> Self {
        Self::new()
    }
}

impl CpuBackend {
    pub fn new() -> Self {
        CpuBackend {
            id: super::next_backend_id(),
            allocations: Default::default(),
        }
    }

    fn bytes(&self, buf: &Buffer, arg: &str) -> Result<Vec<u8>> {
        let m: &Mutex<Vec<u8>> = buf.get(self.id, arg)?;
        Ok(m.lock().map_err(|_| poisoned())?.clone())
    }

    fn put(&self, buf: &Buffer, arg: &str, bytes: &[u8]) -> Result<()> {
        let m: &Mutex<Vec<u8>> = buf.get(self.id, arg)?;
        let mut v = m.lock().map_err(|_| poisoned())?;
        if bytes.len() > v.len() {
            return Err(Error::arg(
                arg,
                format!("at most {} bytes", v.len()),
                bytes.len(),
            ));
        }
        v[..bytes.len()].copy_from_slice(bytes);
        Ok(())
    }
}

/// (MemAvailable, MemTotal) from /proc/meminfo, where there is one.
pub fn host_memory() -> Option<(u64, u64)> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    let field = |name: &str| -> Option<u64> {
        let line = text.lines().find(|l| l.starts_with(name))?;
        let kb: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
        Some(kb * 1024)
    };
    Some((field("MemAvailable:")?, field("MemTotal:")?))
}

fn poisoned() -> Error {
    Error::runtime("cpu", "buffer lock poisoned by an earlier panic")
}

fn i32s(b: &[u8]) -> Vec<i32> {
    b.chunks_exact(4)
        .map(|c| i32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect()
}

impl Backend for CpuBackend {
    fn kind(&self) -> BackendKind {
        BackendKind::Cpu
    }

    fn device_name(&self) -> String {
        "CPU reference (float64)".into()
    }

    fn upload(&self, bytes: &[u8]) -> Result<Buffer> {
        self.allocations
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        Ok(Buffer::new(
            self.id,
            bytes.len() as u64,
            Mutex::new(bytes.to_vec()),
        ))
    }

    fn alloc(&self, len: u64) -> Result<Buffer> {
        let n = usize::try_from(len).map_err(|_| Error::arg("len", "a host-sized length", len))?;
        let mut v = Vec::new();
        v.try_reserve_exact(n).map_err(|_| {
            Error::runtime("cpu", format!("out of host memory allocating {len} bytes"))
        })?;
        v.resize(n, 0u8);
        self.allocations
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        Ok(Buffer::new(self.id, len, Mutex::new(v)))
    }

    fn write_at(&self, buf: &Buffer, offset: u64, bytes: &[u8]) -> Result<()> {
        super::check_range("bytes", buf.len(), offset, bytes.len() as u64, false)?;
        let m: &Mutex<Vec<u8>> = buf.get(self.id, "buf")?;
        let mut v = m.lock().map_err(|_| poisoned())?;
        let at = offset as usize;
        v[at..at + bytes.len()].copy_from_slice(bytes);
        Ok(())
    }

    fn download_range(&self, buf: &Buffer, offset: u64, len: u64) -> Result<Vec<u8>> {
        super::check_range("range", buf.len(), offset, len, false)?;
        let m: &Mutex<Vec<u8>> = buf.get(self.id, "buf")?;
        let v = m.lock().map_err(|_| poisoned())?;
        Ok(v[offset as usize..(offset + len) as usize].to_vec())
    }

    fn memory_info(&self) -> Option<(u64, u64)> {
        host_memory()
    }

    fn allocations(&self) -> u64 {
        self.allocations.load(std::sync::atomic::Ordering::Relaxed)
    }

    fn run_op(&self, op: &dyn Op, bufs: &[(&str, &Buffer)]) -> Result<()> {
        check_bindings(op, &super::binding_info(bufs))?;
        let written: Vec<bool> = bufs
            .iter()
            .map(|(n, _)| op.bindings().iter().any(|b| b.name == *n && b.written))
            .collect();
        // Distinct buffers (checked above): one lock each.
        let mut guards = Vec::with_capacity(bufs.len());
        for (n, b) in bufs {
            let m: &Mutex<Vec<u8>> = b.get(self.id, n)?;
            guards.push(m.lock().map_err(|_| poisoned())?);
        }
        let mut host = HostBuffers::new();
        for ((g, (n, _)), w) in guards.iter_mut().zip(bufs).zip(&written) {
            let name = op
                .bindings()
                .into_iter()
                .find(|b| b.name == *n)
                .map(|b| b.name)
                .unwrap_or("?");
            if *w {
                host.add_write(name, g.as_mut_slice());
            } else {
                host.add_read(name, g.as_slice());
            }
        }
        op.reference(&mut host)
    }

    fn sparse_mla_decode(
        &self,
        shape: &DecodeShape,
        bufs: &DecodeBuffers<'_>,
        _opts: &DecodeOptions,
    ) -> Result<DecodeRun> {
        check_decode_buffers(shape, bufs)?;
        let q: Vec<f32> = self
            .bytes(bufs.q, "q")?
            .chunks_exact(2)
            .map(|c| half::bf16::from_le_bytes([c[0], c[1]]).to_f32())
            .collect();
        let cache = self.bytes(bufs.kv_cache, "kv_cache")?;
        // The reference reads packed rows: repack a strided cache.
        let geometry = CacheGeometry::new(
            shape.format,
            shape.dims,
            shape.num_pages,
            shape.page_size,
            bufs.layout.cache,
        )?;
        let cache = if geometry.is_packed() {
            cache
        } else {
            let rb = geometry.row_bytes as usize;
            (0..geometry.num_slots())
                .flat_map(|s| {
                    let at = geometry.row_offset(s) as usize;
                    cache[at..at + rb].iter().copied()
                })
                .collect()
        };
        let indices = i32s(&self.bytes(bufs.indices, "indices")?);
        let topk_length = match bufs.topk_length {
            Some(b) => Some(i32s(&self.bytes(b, "topk_length")?)),
            None => None,
        };
        let r = decode(&DecodeInputs {
            shape: *shape,
            q: &q,
            cache: &cache,
            indices: &indices,
            topk_length: topk_length.as_deref(),
        });
        let out: Vec<u8> = r
            .out
            .iter()
            .flat_map(|&v| bf16_bits(v as f32).to_le_bytes())
            .collect();
        let (t_n, h_n) = (shape.tokens as u64, shape.heads as u64);
        let mut lse = vec![0u8; r.lse.len() * 4];
        for t in 0..t_n {
            for h in 0..h_n {
                let at = bufs.layout.lse.index(t, h, h_n) as usize * 4;
                let v = r.lse[(t * h_n + h) as usize] as f32;
                lse[at..at + 4].copy_from_slice(&v.to_le_bytes());
            }
        }
        self.put(bufs.out, "out", &out)?;
        self.put(bufs.lse, "lse", &lse)?;
        Ok(DecodeRun {
            splits: 1,
            p_rounded: false,
            kernels: vec!["reference::sparse_mla::decode".into()],
            merged: false,
            whole_tokens: 0,
        })
    }

    fn cache_write(&self, shape: &CacheWriteShape, bufs: &CacheWriteBuffers<'_>) -> Result<()> {
        check_cache_write_buffers(shape, bufs)?;
        let u16s = |b: Vec<u8>| -> Vec<u16> {
            b.chunks_exact(2)
                .map(|c| u16::from_le_bytes([c[0], c[1]]))
                .collect()
        };
        let latent = u16s(self.bytes(bufs.latent, "latent")?);
        let rope = u16s(self.bytes(bufs.rope, "rope")?);
        let slots = i32s(&self.bytes(bufs.slot_mapping, "slot_mapping")?);
        let m: &Mutex<Vec<u8>> = bufs.kv_cache.get(self.id, "kv_cache")?;
        let mut cache = m.lock().map_err(|_| poisoned())?;
        write_rows(shape, &latent, &rope, &slots, &mut cache)
    }

    fn positions_to_slots(&self, shape: &VbtShape, bufs: &VbtBuffers<'_>) -> Result<()> {
        check_vbt_buffers(shape, bufs)?;
        let slots = vbt::positions_to_slots(
            shape,
            &i32s(&self.bytes(bufs.positions, "positions")?),
            &i32s(&self.bytes(bufs.block_table, "block_table")?),
            &i32s(&self.bytes(bufs.req_of_token, "req_of_token")?),
        );
        let out: Vec<u8> = slots.iter().flat_map(|v| v.to_le_bytes()).collect();
        self.put(bufs.slots, "slots", &out)
    }
}
