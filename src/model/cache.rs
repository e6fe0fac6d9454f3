//! The paged caches of a model on a device, shared by every sequence it serves: per layer a
//! latent cache (`bf16` or `fp8_ds_mla` rows, docs/formats.md) and, for layers that run their own
//! indexer, a bf16 key cache; one pool of pages handed to sequences as they grow; and the
//! block table (vLLM's: `[sequences, max_pages]` i32, the same pages in every layer) on the
//! device, rewritten when a sequence gains or gives back pages.
//!
//! Everything is allocated once, when the cache is made: a step of the forward never
//! allocates cache memory. A sequence that would need more pages than are free is refused
//! before anything runs (and a failed step hands its pages back: see
//! [`KvCache::reserve`] / [`KvCache::rollback`]).

use super::device::{Device, RopeTableBuf};
use crate::mla::{CacheFormat, CacheWriteShape};
use crate::runtime::Buffer;
use crate::{Error, Result};

/// How a model's caches are laid out.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CacheOptions {
    pub format: CacheFormat,
    /// Tokens per page.
    pub page_size: usize,
    /// Positions one sequence may hold (prompt + generated).
    pub max_seq_len: usize,
    /// Sequences the cache serves at once (rows of the block table).
    pub max_seqs: usize,
    /// Pages in the pool; `None`: enough for `max_seqs` sequences of `max_seq_len`.
    pub num_pages: Option<usize>,
}

impl Default for CacheOptions {
    fn default() -> Self {
        CacheOptions {
            format: CacheFormat::Bf16,
            page_size: 64,
            max_seq_len: 4096,
            max_seqs: 1,
            num_pages: None,
        }
    }
}

impl CacheOptions {
    pub fn max_pages_per_seq(&self) -> usize {
        self.max_seq_len.div_ceil(self.page_size.max(1))
    }

    pub fn pages(&self) -> usize {
        self.num_pages
            .unwrap_or(self.max_seqs.saturating_mul(self.max_pages_per_seq()))
    }

    pub fn validate(&self) -> Result<()> {
        for (n, v) in [
            ("page_size", self.page_size),
            ("max_seq_len", self.max_seq_len),
            ("max_seqs", self.max_seqs),
            ("num_pages", self.pages()),
        ] {
            if v == 0 {
                return Err(Error::arg(n, "at least 1", 0));
            }
        }
        if self.max_seq_len > i32::MAX as usize {
            return Err(Error::arg(
                "max_seq_len",
                format!("at most {} (positions are i32 in the kernels)", i32::MAX),
                self.max_seq_len,
            ));
        }
        let slots = (self.pages() as u64).saturating_mul(self.page_size as u64);
        if slots > i32::MAX as u64 {
            return Err(Error::arg(
                "num_pages x page_size",
                format!("at most {} cache slots (slots are i32)", i32::MAX),
                slots,
            ));
        }
        if (self.max_seqs as u64).saturating_mul(self.max_pages_per_seq() as u64) > i32::MAX as u64
        {
            return Err(Error::arg(
                "max_seqs x pages per sequence",
                "a block table under 2^31 entries",
                self.max_seqs as u64 * self.max_pages_per_seq() as u64,
            ));
        }
        Ok(())
    }
}

/// A sequence of a [`KvCache`]: its row of the block table.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct SeqId(pub usize);

#[derive(Clone, Debug, Default)]
struct SeqState {
    len: usize,
    pages: Vec<i32>,
}

/// What [`KvCache::reserve`] changed, so that a failed step can be undone.
#[derive(Debug)]
pub struct Reservation {
    seqs: Vec<(SeqId, usize, usize)>,
}

/// Per-layer caches, the page pool and the block table.
pub struct KvCache {
    pub(crate) opts: CacheOptions,
    pub(crate) latent: Vec<Buffer>,
    pub(crate) keys: Vec<Option<Buffer>>,
    pub(crate) rope: RopeTableBuf,
    table_host: Vec<i32>,
    pub(crate) table: Buffer,
    table_dirty: bool,
    free: Vec<i32>,
    seqs: Vec<Option<SeqState>>,
}

impl KvCache {
    /// Allocates every cache of `layers` layers (`has_keys[l]`: layer l runs an indexer) on
    /// the device, and uploads the RoPE table for `max_seq_len` positions.
    pub(crate) fn new(
        device: &Device,
        opts: CacheOptions,
        latent_row_bytes: usize,
        key_dim: usize,
        has_keys: &[bool],
        rope_table: Vec<f32>,
        rope_half: usize,
    ) -> Result<Self> {
        opts.validate()?;
        let b = device.backend();
        let slots = opts.pages() as u64 * opts.page_size as u64;
        let mut latent = Vec::with_capacity(has_keys.len());
        let mut keys = Vec::with_capacity(has_keys.len());
        for &k in has_keys {
            latent.push(b.alloc(slots * latent_row_bytes as u64)?);
            keys.push(if k {
                Some(b.alloc(slots * key_dim as u64 * 2)?)
            } else {
                None
            });
        }
        let table_host = try_filled(
            opts.max_seqs * opts.max_pages_per_seq(),
            -1i32,
            "block table",
        )?;
        let table = b.upload(&i32_bytes(&table_host))?;
        let rows = rope_table.len() / (2 * rope_half.max(1));
        let rope = RopeTableBuf {
            rows: rows as u32,
            buf: b.upload(&{
                let mut bytes = try_filled(rope_table.len() * 4, 0u8, "RoPE table")?;
                for (d, v) in bytes.chunks_exact_mut(4).zip(&rope_table) {
                    d.copy_from_slice(&v.to_le_bytes());
                }
                bytes
            })?,
        };
        Ok(KvCache {
            opts,
            latent,
            keys,
            rope,
            table_host,
            table,
            table_dirty: false,
            // Handed out from the end, so the logical → physical map is not the identity.
            free: (0..opts.pages() as i32).collect(),
            seqs: vec![None; opts.max_seqs],
        })
    }

    /// The shape of a cache-write call of `tokens` rows into one of this cache's layers.
    pub fn write_shape(&self, config: &super::ModelConfig, tokens: u32) -> CacheWriteShape {
        CacheWriteShape {
            tokens,
            num_pages: self.opts.pages() as u32,
            page_size: self.opts.page_size as u32,
            dims: config.mla_dims(),
            format: self.opts.format,
            flavour: config.cache_scale_flavour(),
            strides: Default::default(),
        }
    }

    pub fn options(&self) -> CacheOptions {
        self.opts
    }

    /// A new, empty sequence; an error when `max_seqs` are in use.
    pub fn add_sequence(&mut self) -> Result<SeqId> {
        let i = self.seqs.iter().position(|s| s.is_none()).ok_or_else(|| {
            Error::arg(
                "sequences",
                format!("at most max_seqs = {} at once", self.opts.max_seqs),
                self.opts.max_seqs + 1,
            )
        })?;
        self.seqs[i] = Some(SeqState::default());
        Ok(SeqId(i))
    }

    /// Ends a sequence: its pages go back to the pool.
    pub fn remove_sequence(&mut self, id: SeqId) -> Result<()> {
        let s = self.state(id)?.clone();
        self.free.extend(s.pages.iter().rev());
        let row = id.0 * self.opts.max_pages_per_seq();
        for e in &mut self.table_host[row..row + s.pages.len()] {
            *e = -1;
        }
        self.table_dirty = true;
        self.seqs[id.0] = None;
        Ok(())
    }

    fn state(&self, id: SeqId) -> Result<&SeqState> {
        self.seqs
            .get(id.0)
            .and_then(|s| s.as_ref())
            .ok_or_else(|| Error::arg("sequence", "a live sequence of this cache", id.0))
    }

    /// Positions a sequence holds.
    pub fn len(&self, id: SeqId) -> Result<usize> {
        Ok(self.state(id)?.len)
    }

    /// Pages not held by any sequence.
    pub fn free_pages(&self) -> usize {
        self.free.len()
    }

    /// The physical page of each logical page of a sequence.
    pub fn pages(&self, id: SeqId) -> Result<&[i32]> {
        Ok(&self.state(id)?.pages)
    }

    /// The slot of a sequence's position (its page must be assigned).
    pub fn slot(&self, id: SeqId, pos: usize) -> Result<i32> {
        let ps = self.opts.page_size;
        let page = *self
            .state(id)?
            .pages
            .get(pos / ps)
            .ok_or_else(|| Error::arg("position", "a position with an assigned page", pos))?;
        Ok(page * ps as i32 + (pos % ps) as i32)
    }

    /// Grows sequences to new lengths, assigning pages: all or nothing. `grow` pairs each
    /// sequence with the number of positions it gains.
    pub fn reserve(&mut self, grow: &[(SeqId, usize)]) -> Result<Reservation> {
        let ps = self.opts.page_size;
        let mut need = 0usize;
        for &(id, n) in grow {
            let s = self.state(id)?;
            let new_len = s.len + n;
            if new_len > self.opts.max_seq_len {
                return Err(Error::arg(
                    "sequence length",
                    format!("at most max_seq_len = {}", self.opts.max_seq_len),
                    new_len,
                ));
            }
            need += new_len.div_ceil(ps).saturating_sub(s.pages.len());
        }
        if need > self.free.len() {
            return Err(Error::Model(format!(
                "out of cache pages: the step needs {need} more pages of {ps} tokens, {} are free",
                self.free.len()
            )));
        }
        let mut r = Reservation { seqs: Vec::new() };
        for &(id, n) in grow {
            let row = id.0 * self.opts.max_pages_per_seq();
            let s = self.seqs[id.0]
                .as_mut()
                .ok_or_else(|| Error::arg("sequence", "live", id.0))?;
            r.seqs.push((id, s.len, s.pages.len()));
            let new_len = s.len + n;
            while s.pages.len() < new_len.div_ceil(ps) {
                let p = self
                    .free
                    .pop()
                    .ok_or_else(|| Error::Model("out of cache pages".into()))?;
                self.table_host[row + s.pages.len()] = p;
                s.pages.push(p);
                self.table_dirty = true;
            }
            s.len = new_len;
        }
        Ok(r)
    }

    /// Undoes a reservation: lengths and pages as they were.
    pub fn rollback(&mut self, r: Reservation) {
        for (id, len, pages) in r.seqs.into_iter().rev() {
            let row = id.0 * self.opts.max_pages_per_seq();
            if let Some(s) = self.seqs[id.0].as_mut() {
                while s.pages.len() > pages {
                    if let Some(p) = s.pages.pop() {
                        self.free.push(p);
                        self.table_host[row + s.pages.len()] = -1;
                    }
                }
                s.len = len;
            }
        }
        self.table_dirty = true;
    }

    /// Sequences shorter again: positions past `len` are forgotten (their pages stay).
    pub fn truncate(&mut self, id: SeqId, len: usize) -> Result<()> {
        let s = self
            .seqs
            .get_mut(id.0)
            .and_then(|s| s.as_mut())
            .ok_or_else(|| Error::arg("sequence", "live", id.0))?;
        s.len = s.len.min(len);
        Ok(())
    }

    /// Rewrites the device's block table when pages changed.
    pub(crate) fn sync_table(&mut self, device: &Device) -> Result<()> {
        if self.table_dirty {
            device
                .backend()
                .write(&self.table, &i32_bytes(&self.table_host))?;
            self.table_dirty = false;
        }
        Ok(())
    }

    /// The latent cache of layer `l` (`[pages, page_size, row_bytes]`).
    pub fn latent_buffer(&self, l: usize) -> Option<&Buffer> {
        self.latent.get(l)
    }

    /// The indexer key cache of layer `l` (`[slots, key_dim]` bf16), if the layer has one.
    pub fn key_buffer(&self, l: usize) -> Option<&Buffer> {
        self.keys.get(l).and_then(|k| k.as_ref())
    }

    /// Device bytes the caches hold.
    pub fn bytes(&self) -> u64 {
        self.latent.iter().map(|b| b.len()).sum::<u64>()
            + self.keys.iter().flatten().map(|b| b.len()).sum::<u64>()
            + self.table.len()
            + self.rope.buf.len()
    }
}

fn i32_bytes(v: &[i32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

/// `n` copies of `v` in a vector allocated fallibly: a size past what the host can give is
/// an error naming `what` and the bytes, not an abort.
pub(crate) fn try_filled<T: Clone>(n: usize, v: T, what: &str) -> Result<Vec<T>> {
    let mut out = Vec::new();
    out.try_reserve_exact(n).map_err(|_| {
        Error::Model(format!(
            "cannot allocate the {what} ({} bytes of host memory); lower --max-seq-len or the number of sequences",
            n.saturating_mul(std::mem::size_of::<T>())
        ))
    })?;
    out.resize(n, v);
    Ok(out)
}
