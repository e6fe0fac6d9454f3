//! The words of the problem, named once: MLA widths, cache row formats and the shape of a
//! sparse decode call. Conventions (DESIGN §3), written here and nowhere else:
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

/// Row format of the KV cache (DESIGN §4).
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
/// token `t = b · s_q + i`: `q [b, s_q, h, d]`, `indices [b, s_q, topk]` and `out [b, s_q, h, d_v]`
/// are the same bytes as FlashMLA's layouts.
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
