//! The words of the problem, named once: MLA widths, cache row formats and the shape of a
//! sparse decode call. Conventions (docs/math.md), written here and nowhere else:
//! - an index is **invalid** when `< 0`, `>= num_slots`, or `j >= topk_length[t]`;
//!   an invalid slot is never read;
//! - `lse` is the natural-log sum of exp of the scaled scores;
//! - a row with no valid index gets `out = 0`, `lse = +inf`;
//! - inside split-K, an empty chunk carries `lse = -inf` and drops out of the combine.

use crate::{Error, Result};

/// Latent (kv_lora_rank) width of both production models.
pub const LATENT: u32 = 512;
/// RoPE (qk_rope_head_dim) width of both production models.
pub const ROPE: u32 = 64;

/// The widths of one MLA cache row: `d_qk = latent + rope`, `d_v = latent`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct MlaDims {
    pub latent: u32,
    pub rope: u32,
}

impl MlaDims {
    /// DeepSeek-V3.2 / GLM-5: 512 + 64.
    pub const PRODUCTION: MlaDims = MlaDims {
        latent: LATENT,
        rope: ROPE,
    };

    /// Width of q and of a cache key row.
    pub fn d_qk(&self) -> u32 {
        self.latent + self.rope
    }

    /// Width of the output (the value is the latent part of the row).
    pub fn d_v(&self) -> u32 {
        self.latent
    }

    pub fn validate(&self) -> Result<()> {
        if self.latent == 0 || self.latent % 8 != 0 {
            return Err(Error::arg(
                "latent",
                "a positive multiple of 8",
                self.latent,
            ));
        }
        if self.rope % 8 != 0 {
            return Err(Error::arg("rope", "a multiple of 8", self.rope));
        }
        Ok(())
    }
}

/// How the f32 per-tile scales of an `fp8_ds_mla` row were chosen when it was written.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ScaleFlavour {
    /// `amax / 448` rounded up to a power of two (UE8M0 stored as f32): DeepSeek.
    Pow2,
    /// `amax / 448` as is: GLM as written by vLLM's cache kernel.
    Arbitrary,
}

/// Row format of the KV cache (docs/formats.md).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum CacheFormat {
    /// `d_qk` × bf16: latent, then rope. 1152 bytes at production widths.
    Bf16,
    /// 512 × e4m3 latent | 4 × f32 scales (one per 128 values) | 64 × bf16 rope = 656 bytes.
    /// Production widths only. Decoding does not depend on the scale flavour.
    Fp8DsMla,
}

/// Values per fp8 scale tile in `fp8_ds_mla`.
pub const FP8_TILE: u32 = 128;

impl CacheFormat {
    /// Bytes per token row.
    pub fn row_bytes(&self, dims: MlaDims) -> u32 {
        match self {
            CacheFormat::Bf16 => dims.d_qk() * 2,
            CacheFormat::Fp8DsMla => dims.latent + 4 * (dims.latent / FP8_TILE) + 2 * dims.rope,
        }
    }

    /// The name used on command lines and in exported file names.
    pub fn name(&self) -> &'static str {
        match self {
            CacheFormat::Bf16 => "bf16",
            CacheFormat::Fp8DsMla => "fp8_ds_mla",
        }
    }

    pub fn parse(s: &str) -> Result<Self> {
        match s {
            "bf16" => Ok(CacheFormat::Bf16),
            "fp8_ds_mla" | "fp8" => Ok(CacheFormat::Fp8DsMla),
            other => Err(Error::arg("cache", "bf16 or fp8_ds_mla", other)),
        }
    }

    /// Can rows of this format hold an MLA of these widths?
    pub fn check_dims(&self, dims: MlaDims) -> Result<()> {
        dims.validate()?;
        if *self == CacheFormat::Fp8DsMla && dims != MlaDims::PRODUCTION {
            return Err(Error::arg(
                "cache",
                "fp8_ds_mla only with latent 512 + rope 64",
                format!("latent {} + rope {}", dims.latent, dims.rope),
            ));
        }
        Ok(())
    }
}

/// The shape of one sparse MLA decode call. Buffers (row-major):
/// - `q`: `[tokens, heads, d_qk]` bf16 (latent | rope);
/// - `cache`: `[num_pages, page_size, row_bytes]` bytes, slot = page × page_size + offset;
/// - `indices`: `[tokens, topk]` i32 physical slots;
/// - `topk_length` (optional): `[tokens]` i32, entries `j >= topk_length[t]` are invalid;
/// - `out`: `[tokens, heads, d_v]` bf16;
/// - `lse`: `[tokens, heads]` f32.
///
/// Multi-token decode (batch × s_q, MTP / speculative) is `tokens = batch · s_q` with
/// token `t = b · s_q + i`, each token with its own indices (and `topk_length`):
/// `q [b, s_q, h, d]`, `indices [b, s_q, topk]`, `topk_length [b, s_q]` and
/// `out [b, s_q, h, d_v]` are the same bytes as FlashMLA's layouts, zero-copy. `lse` is
/// `[tokens, heads] = [b, s_q, h]` by default; [`LseLayout::BatchHeadsSq`] (in the call's
/// [`DecodeLayout`]) writes FlashMLA's `[b, h, s_q]` directly. Cache strides other than
/// packed rows go in the layout too ([`CacheStrides`]).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct DecodeShape {
    pub tokens: u32,
    pub heads: u32,
    pub topk: u32,
    pub num_pages: u32,
    pub page_size: u32,
    pub dims: MlaDims,
    pub format: CacheFormat,
    pub scale: f32,
    pub has_topk_length: bool,
}

impl DecodeShape {
    pub fn num_slots(&self) -> u64 {
        self.num_pages as u64 * self.page_size as u64
    }

    pub fn row_bytes(&self) -> u32 {
        self.format.row_bytes(self.dims)
    }

    pub fn q_elems(&self) -> u64 {
        self.tokens as u64 * self.heads as u64 * self.dims.d_qk() as u64
    }

    pub fn out_elems(&self) -> u64 {
        self.tokens as u64 * self.heads as u64 * self.dims.d_v() as u64
    }

    pub fn cache_bytes(&self) -> u64 {
        self.num_slots() * self.row_bytes() as u64
    }

    /// Checks everything that does not need the buffers. Errors name the argument.
    pub fn validate(&self) -> Result<()> {
        self.format.check_dims(self.dims)?;
        for (name, v) in [
            ("tokens", self.tokens),
            ("heads", self.heads),
            ("topk", self.topk),
            ("page_size", self.page_size),
            ("num_pages", self.num_pages),
        ] {
            if v == 0 {
                return Err(Error::arg(name, "at least 1", 0));
            }
        }
        if !self.scale.is_finite() || self.scale <= 0.0 {
            return Err(Error::arg("scale", "a finite positive f32", self.scale));
        }
        // Indices are i32: a top-k list longer than i32::MAX cannot be addressed (and its
        // chunk arithmetic would overflow u32).
        if self.topk > i32::MAX as u32 {
            return Err(Error::arg(
                "topk",
                format!("at most {} (indices are i32)", i32::MAX),
                self.topk,
            ));
        }
        if self.num_slots() > i32::MAX as u64 {
            return Err(Error::arg(
                "num_pages × page_size",
                format!("at most {} slots (indices are i32)", i32::MAX),
                self.num_slots(),
            ));
        }
        Ok(())
    }

    /// Bytes a perfect kernel moves: every referenced row once per token, q in, out and lse out.
    pub fn min_bytes(&self) -> u64 {
        self.tokens as u64 * self.topk as u64 * self.row_bytes() as u64
            + self.q_elems() * 2
            + self.out_elems() * 2
            + self.tokens as u64 * self.heads as u64 * 4
            + self.tokens as u64 * self.topk as u64 * 4
    }

    /// 2·T·H·K·(d_qk + d_v).
    pub fn flops(&self) -> u64 {
        2 * self.tokens as u64
            * self.heads as u64
            * self.topk as u64
            * (self.dims.d_qk() + self.dims.d_v()) as u64
    }
}

/// Where each slot's row lives in a cache buffer: slot `s = page · page_size + offset` starts
/// at byte `page · page + offset · row`. Zero means packed (`row = row_bytes`,
/// `page = page_size · row`). vLLM may pad its pages (a page stride larger than
/// `page_size · row_bytes`); FlashMLA takes the page stride of its `k_cache` the same way.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct CacheStrides {
    /// Bytes from one row to the next within a page (0: `row_bytes`).
    pub row: u64,
    /// Bytes from one page to the next (0: `page_size · row`).
    pub page: u64,
}

/// The byte geometry of one paged cache buffer, with strides resolved and checked.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CacheGeometry {
    pub num_pages: u32,
    pub page_size: u32,
    pub row_bytes: u32,
    pub row_stride: u64,
    pub page_stride: u64,
}

impl CacheGeometry {
    /// Resolve and check `strides` for rows of `format` at `dims`. Rows are read and written
    /// as 32-bit words (WGSL has nothing narrower), so both strides must be multiples of 4
    /// bytes, and rows must not overlap.
    pub fn new(
        format: CacheFormat,
        dims: MlaDims,
        num_pages: u32,
        page_size: u32,
        strides: CacheStrides,
    ) -> Result<Self> {
        format.check_dims(dims)?;
        if page_size == 0 {
            return Err(Error::arg("page_size", "at least 1", 0));
        }
        if num_pages == 0 {
            return Err(Error::arg("num_pages", "at least 1", 0));
        }
        let row_bytes = format.row_bytes(dims);
        let row_stride = if strides.row == 0 {
            row_bytes as u64
        } else {
            strides.row
        };
        if row_stride % 4 != 0 || row_stride < row_bytes as u64 {
            return Err(Error::arg(
                "row stride",
                format!(
                    "a multiple of 4 bytes, at least the {row_bytes}-byte {} row (rows are moved as 32-bit words)",
                    format.name()
                ),
                format!("{row_stride} bytes"),
            ));
        }
        // Strides come from the caller: every product is checked (a stride near u64::MAX
        // must be refused, not wrapped into a small one).
        let too_big = |what: &str, v: u64| {
            Error::arg(
                what,
                "a cache whose byte offsets fit 64 bits",
                format!("{v} bytes"),
            )
        };
        let packed_page = row_stride
            .checked_mul(page_size as u64)
            .ok_or_else(|| too_big("row stride", row_stride))?;
        let page_stride = if strides.page == 0 {
            packed_page
        } else {
            strides.page
        };
        if page_stride % 4 != 0 || page_stride < packed_page {
            return Err(Error::arg(
                "page stride",
                format!("a multiple of 4 bytes, at least page_size x row stride = {packed_page}"),
                format!("{page_stride} bytes"),
            ));
        }
        (num_pages as u64 - 1)
            .checked_mul(page_stride)
            .and_then(|x| x.checked_add(packed_page))
            .ok_or_else(|| too_big("page stride", page_stride))?;
        let g = CacheGeometry {
            num_pages,
            page_size,
            row_bytes,
            row_stride,
            page_stride,
        };
        if g.num_slots() > i32::MAX as u64 {
            return Err(Error::arg(
                "num_pages × page_size",
                format!("at most {} slots (slots are i32)", i32::MAX),
                g.num_slots(),
            ));
        }
        // Kernels address the cache in 32-bit words with 32-bit integers.
        if g.min_bytes() / 4 >= i32::MAX as u64 {
            return Err(Error::arg(
                "kv_cache",
                "fewer than 2^31 32-bit words per cache buffer (8 GiB); split the cache per layer",
                format!("{} bytes", g.min_bytes()),
            ));
        }
        Ok(g)
    }

    pub fn num_slots(&self) -> u64 {
        self.num_pages as u64 * self.page_size as u64
    }

    /// Byte offset of a slot's row.
    pub fn row_offset(&self, slot: u64) -> u64 {
        let (page, offset) = (slot / self.page_size as u64, slot % self.page_size as u64);
        page * self.page_stride + offset * self.row_stride
    }

    /// The smallest buffer that holds every row: up to the end of the last slot's row.
    pub fn min_bytes(&self) -> u64 {
        self.row_offset(self.num_slots() - 1) + self.row_bytes as u64
    }

    pub fn is_packed(&self) -> bool {
        self.row_stride == self.row_bytes as u64
            && self.page_stride == self.row_stride * self.page_size as u64
    }

    /// Strides in 32-bit words, as the kernels take them.
    pub fn row_stride_words(&self) -> u32 {
        (self.row_stride / 4) as u32
    }

    pub fn page_stride_words(&self) -> u32 {
        (self.page_stride / 4) as u32
    }
}

/// Where `lse[t, h]` is written.
///
/// Multi-token decode (MTP / speculative, `s_q` query tokens per request) runs as
/// `tokens = batch · s_q` with token `t = b · s_q + i`. Then `q [b, s_q, h, d_qk]`,
/// `indices [b, s_q, topk]`, `topk_length [b, s_q]` and `out [b, s_q, h, d_v]` are already
/// FlashMLA's layouts, byte for byte; only lse differs: ours is `[tokens, heads]` =
/// `[b, s_q, h]`, FlashMLA's is `[b, h, s_q]`. [`LseLayout::BatchHeadsSq`] writes the latter
/// directly, so no transpose is needed.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum LseLayout {
    /// `lse [tokens, heads]` f32.
    #[default]
    TokensHeads,
    /// `lse [batch, heads, s_q]` f32 with `tokens = batch · s_q` (FlashMLA's layout).
    BatchHeadsSq { s_q: u32 },
}

impl LseLayout {
    /// The `s_q` of the layout `[tokens / s_q, heads, s_q]`; `TokensHeads` is the case `s_q = 1`.
    pub fn s_q(&self) -> u32 {
        match self {
            LseLayout::TokensHeads => 1,
            LseLayout::BatchHeadsSq { s_q } => *s_q,
        }
    }

    /// Element index of `lse[t, h]`.
    pub fn index(&self, t: u64, h: u64, heads: u64) -> u64 {
        let s_q = self.s_q() as u64;
        ((t / s_q) * heads + h) * s_q + t % s_q
    }

    pub fn check(&self, tokens: u32) -> Result<()> {
        let s_q = self.s_q();
        if s_q == 0 || tokens % s_q != 0 {
            return Err(Error::arg(
                "lse layout s_q",
                format!("a divisor of tokens = {tokens} (tokens = batch x s_q)"),
                s_q,
            ));
        }
        Ok(())
    }
}

/// How the buffers of a decode call are laid out beyond [`DecodeShape`]'s packed defaults.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct DecodeLayout {
    /// Row and page strides of `kv_cache`.
    pub cache: CacheStrides,
    pub lse: LseLayout,
}

/// One cache-write call: `latent [tokens, latent]` and `rope [tokens, rope]` (bf16) are
/// written as rows of `format` at `slot_mapping [tokens]` (i32) into a cache of
/// `num_pages × page_size` slots. A slot outside `[0, num_slots)` (−1 marks padding) is
/// skipped: nothing is written for that token. Slots must be distinct among the tokens
/// of one call (two tokens writing one slot leave either row).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct CacheWriteShape {
    pub tokens: u32,
    pub num_pages: u32,
    pub page_size: u32,
    pub dims: MlaDims,
    pub format: CacheFormat,
    /// How fp8 scales are chosen (ignored for bf16 rows).
    pub flavour: ScaleFlavour,
    pub strides: CacheStrides,
}

impl CacheWriteShape {
    pub fn geometry(&self) -> Result<CacheGeometry> {
        CacheGeometry::new(
            self.format,
            self.dims,
            self.num_pages,
            self.page_size,
            self.strides,
        )
    }

    pub fn validate(&self) -> Result<CacheGeometry> {
        if self.tokens == 0 {
            return Err(Error::arg("tokens", "at least 1", 0));
        }
        self.geometry()
    }
}

/// One logical → physical conversion (docs/math.md, vLLM's block table): for token `t` of
/// request `r = req_of_token[t]` and logical position `pos = positions[t, j]`,
/// `slots[t, j] = block_table[r, pos / page_size] · page_size + pos % page_size`; −1 when
/// `pos < 0`, `pos / page_size >= max_pages`, the block id is negative, `r` is outside
/// `[0, requests)`, or the slot would not fit in an i32.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct VbtShape {
    pub tokens: u32,
    pub topk: u32,
    /// Rows of `block_table` (R).
    pub requests: u32,
    pub max_pages: u32,
    pub page_size: u32,
}

impl VbtShape {
    pub fn validate(&self) -> Result<()> {
        for (name, v) in [
            ("tokens", self.tokens),
            ("topk", self.topk),
            ("requests", self.requests),
            ("max_pages", self.max_pages),
            ("page_size", self.page_size),
        ] {
            if v == 0 {
                return Err(Error::arg(name, "at least 1", 0));
            }
        }
        let elems = self.tokens as u64 * self.topk as u64;
        if elems > i32::MAX as u64 {
            return Err(Error::arg(
                "tokens × topk",
                format!("at most {} entries per call", i32::MAX),
                elems,
            ));
        }
        let table = self.requests as u64 * self.max_pages as u64;
        if table > i32::MAX as u64 {
            return Err(Error::arg(
                "requests × max_pages",
                format!("at most {} block-table entries", i32::MAX),
                table,
            ));
        }
        Ok(())
    }

    /// The largest block id whose slots all fit in an i32.
    pub fn max_block(&self) -> u32 {
        (i32::MAX as u32 - (self.page_size - 1)) / self.page_size
    }
}
