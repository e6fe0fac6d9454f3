//! Cache write (docs/formats.md), described once: a token's latent and rope (bf16) become one
//! cache row at the slot its `slot_mapping` entry names, in either row format.
//!
//! - `bf16`: the row is the token's latent then rope bits, copied word by word.
//! - `fp8_ds_mla` (656 bytes): per 128-value tile, `scale = amax / 448` floored at the
//!   smallest normal f32 (and rounded up to a power of two for the pow2 flavour), then
//!   `byte = e4m3(v / scale)` rounded to nearest even, saturating at ±448; the four f32
//!   scales and the unquantised bf16 rope follow the latent bytes.
//!
//! **Bytes are identical on every backend.** WGSL promises only 2.5 ulp for f32 division
//! and may flush subnormals, so the quantisation is not written with float operations:
//! `amax` is an integer max of the bf16 magnitudes, and `amax / 448`, `v / scale` and the
//! e4m3 rounding are computed by [`crate::kir::numeric`] in u32 arithmetic, which gives the
//! correctly rounded IEEE results bit for bit (as vLLM's kernel does with CUDA's IEEE `/`
//! and `cvt.rn.satfinite`). The reference, [`crate::reference::cache::write_rows`], uses
//! Rust's IEEE f32 division, so agreement is a real check. Non-finite latents (NaN, ±inf)
//! do not count towards amax and encode as the e4m3 NaN 0x7F: the value stays non-finite
//! when read back, and the other 127 values of its tile keep the scale of the finite ones.
//! (Counting an infinity, as a plain IEEE `amax / 448` would, makes the scale infinite and
//! every value of the tile NaN on read: one overflow would silently erase 128 values.)
//!
//! One workgroup per token (a grid-stride loop over tokens when there are more than
//! 65535); 128 threads, one 32-bit output word of four e4m3 bytes each. WGSL cannot store
//! bytes, and both row sizes (1152, 656) and the strides are multiples of 4, so every store
//! is a whole word and no byte of a neighbouring row is touched. A slot outside
//! `[0, num_slots)` (−1 marks padding) writes nothing.

use super::{pack_params, Launch, ParamValue};
use crate::kir::builder::*;
use crate::kir::ir::{Access, Elem, Expr, Kernel, Ty};
use crate::kir::numeric::{div_rn, f32_to_e4m3};
use crate::mla::{CacheFormat, CacheGeometry, CacheWriteShape, MlaDims, ScaleFlavour, FP8_TILE};
use crate::Result;
use std::sync::Arc;

/// Threads per workgroup: one per four latent values of an fp8 row.
pub const THREADS: u32 = 128;

/// Compile-time knobs of the cache-write kernel.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct CacheWriteConfig {
    pub dims: MlaDims,
    pub format: CacheFormat,
}

impl CacheWriteConfig {
    pub fn name(&self) -> String {
        format!("cache_write_{}_d{}", self.format.name(), self.dims.d_qk())
    }
}

/// The cache-write kernel of a config.
pub fn kernel(cfg: &CacheWriteConfig) -> Result<Kernel> {
    cfg.format.check_dims(cfg.dims)?;
    let (latent_n, rope_n) = (cfg.dims.latent, cfg.dims.rope);
    let row_bytes = cfg.format.row_bytes(cfg.dims);
    let mut b = KernelBuilder::new(cfg.name(), THREADS);
    b.doc(format!(
        "Cache write: latent [tokens, {latent_n}] + rope [tokens, {rope_n}] (bf16) -> one {} row ({row_bytes} B) per token at slot_mapping[t].",
        cfg.format.name()
    ));
    b.doc(
        "Grid: x = min(tokens, 65535); each workgroup takes tokens x, x + grid_x, ...".to_string(),
    );
    b.doc("A slot outside [0, num_slots) (-1 = padding) writes nothing; no other row's bytes are touched.".to_string());
    b.doc(
        "Row of slot s at word (s / page_size) * page_stride_w + (s % page_size) * row_stride_w."
            .to_string(),
    );
    match cfg.format {
        CacheFormat::Bf16 => {
            b.doc(format!(
                "bf16 row: {} x bf16, latent then rope, little-endian.",
                cfg.dims.d_qk()
            ));
        }
        CacheFormat::Fp8DsMla => {
            b.doc("fp8_ds_mla row, 656 bytes: [0,512) 512 x e4m3fn latent | [512,528) 4 x f32 scales, one per 128 values | [528,656) 64 x bf16 rope, unquantised.".to_string());
            b.doc("Dequant: c[i] = e4m3(byte[i]) * scale[i / 128]. Quantisation: scale = max(amax / 448, 2^-126), rounded up to a power of two when pow2_scales = 1; byte = e4m3(v / scale), nearest even, saturating at +-448.".to_string());
            b.doc("Bit-exact on every target: the divisions and the rounding are integer code (kir::numeric), equal to IEEE f32 division.".to_string());
        }
    }

    let tokens = b.param("tokens", Ty::U32, "T, tokens to write");
    let num_slots = b.param("num_slots", Ty::U32, "num_pages x page_size");
    let page_size = b.param("page_size", Ty::U32, "slots per page");
    let row_stride = b.param(
        "row_stride_w",
        Ty::U32,
        "32-bit words from one row to the next",
    );
    let page_stride = b.param(
        "page_stride_w",
        Ty::U32,
        "32-bit words from one page to the next",
    );
    let pow2 = (cfg.format == CacheFormat::Fp8DsMla).then(|| {
        b.param(
            "pow2_scales",
            Ty::U32,
            "1: scales rounded up to a power of two (DeepSeek), 0: amax / 448 as is (GLM)",
        )
    });

    let latent = b.buffer(
        "latent",
        Elem::Bf16,
        Access::Read,
        &format!("[tokens, {latent_n}] bf16"),
    );
    let rope = b.buffer(
        "rope",
        Elem::Bf16,
        Access::Read,
        &format!("[tokens, {rope_n}] bf16"),
    );
    let slot_mapping = b.buffer(
        "slot_mapping",
        Elem::I32,
        Access::Read,
        "[tokens] i32 slots (-1: skip)",
    );
    let cache_elem = match cfg.format {
        CacheFormat::Bf16 => Elem::Bf16,
        CacheFormat::Fp8DsMla => Elem::U8,
    };
    let cache = b.buffer(
        "kv_cache",
        cache_elem,
        Access::ReadWrite,
        &format!(
            "[num_pages, page_size, {row_bytes}] {} rows (strided)",
            cfg.format.name()
        ),
    );

    let (lat_words, rope_words) = (latent_n / 2, rope_n / 2);
    let tiles = latent_n / FP8_TILE;
    let threads_per_tile = FP8_TILE / 4;
    let (amax_part, scales) = match cfg.format {
        CacheFormat::Fp8DsMla => (
            Some(b.shared("amax_part", Ty::U32, THREADS)),
            Some(b.shared("tile_scale", Ty::U32, tiles)),
        ),
        CacheFormat::Bf16 => (None, None),
    };

    b.for_("tok", workgroup_id(0), tokens, num_workgroups(0), |b, tok| {
        b.comment("this token's slot, and where its row starts (in 32-bit words)");
        let slot_raw = b.let_("slot_raw", slot_mapping.at(tok.clone()));
        let valid = b.let_(
            "valid",
            slot_raw
                .clone()
                .ge(i(0))
                .and(slot_raw.clone().as_u32().lt(num_slots.clone())),
        );
        let slot = b.let_("slot", select(valid.clone(), slot_raw.as_u32(), u(0)));
        let base = b.let_(
            "row_base",
            slot.clone() / page_size.clone() * page_stride.clone()
                + slot % page_size.clone() * row_stride.clone(),
        );
        match (cfg.format, &amax_part, &scales, &pow2) {
            (CacheFormat::Fp8DsMla, Some(amax_part), Some(scales), Some(pow2)) => {
                b.comment("four latent values per thread; amax over bf16 magnitudes as integers (NaN and inf left out)");
                let at = b.let_("lat_at", tok.clone() * u(lat_words) + local_id() * u(2));
                let w = [
                    b.let_("lat_w0", latent.word(at.clone())),
                    b.let_("lat_w1", latent.word(at + u(1))),
                ];
                let bits: Vec<Expr> = (0..4)
                    .map(|k| {
                        let word = w[k / 2].clone();
                        let half = if k % 2 == 0 {
                            word & u(0xFFFF)
                        } else {
                            word >> u(16)
                        };
                        b.let_(&format!("v{k}"), half)
                    })
                    .collect();
                let magnitude = |v: &Expr| {
                    let m = v.clone() & u(0x7FFF);
                    select(m.clone().ge(u(0x7F80)), u(0), m)
                };
                // from the first value, not from 0u: `max(0u, x)` is a pointless unsigned
                // comparison to nvcc (warning #186)
                let local = bits[1..]
                    .iter()
                    .fold(magnitude(&bits[0]), |acc, v| acc.max(magnitude(v)));
                b.shared_store(amax_part, local_id(), local);
                b.barrier();
                b.comment("one thread per 128-value tile: scale = max(amax / 448, 2^-126), pow2: rounded up");
                b.if_(local_id().lt(u(tiles)), |b| {
                    let amax = b.var("amax", u(0));
                    b.for_("p", u(0), u(threads_per_tile), u(1), |b, p| {
                        let v = amax_part.at(local_id() * u(threads_per_tile) + p);
                        b.set(&amax, amax.clone().max(v));
                    });
                    let q = div_rn(b, amax.clone() << u(16), u(448.0f32.to_bits()));
                    let s = b.let_("scale_bits", q.max(u(f32::MIN_POSITIVE.to_bits())));
                    let up = b.let_(
                        "scale_pow2",
                        select(
                            (s.clone() & u(0x007F_FFFF)).ne_(u(0)),
                            (s.clone() & u(0x7F80_0000)) + u(0x0080_0000),
                            s.clone(),
                        ),
                    );
                    let s = select(pow2.clone().ne_(u(0)), up, s);
                    b.shared_store(scales, local_id(), s);
                });
                b.barrier();
                b.comment("quantise: byte = e4m3(v / scale), integer code bit-identical to IEEE");
                let s = b.let_("scale", scales.at(local_id() / u(threads_per_tile)));
                let mut word = u(0);
                for (k, v) in bits.iter().enumerate() {
                    let q = div_rn(b, v.clone() << u(16), s.clone());
                    let e = f32_to_e4m3(b, q);
                    let mag = v.clone() & u(0x7FFF);
                    // NaN and ±inf: the e4m3 NaN (the scale is finite: amax left them out)
                    let byte = select(mag.ge(u(0x7F80)), u(0x7F), e);
                    let byte = b.let_(&format!("byte{k}"), byte);
                    word = if k == 0 {
                        byte
                    } else {
                        word | (byte << u(8 * k as u32))
                    };
                }
                let word = b.let_("packed", word);
                b.if_(valid.clone(), |b| {
                    b.store_word(&cache, base.clone() + local_id(), word);
                    b.if_(local_id().lt(u(tiles)), |b| {
                        b.store_word(
                            &cache,
                            base.clone() + u(latent_n / 4) + local_id(),
                            scales.at(local_id()),
                        );
                    });
                    b.comment("rope: bf16 words copied unchanged");
                    b.for_threads("w", u(rope_words), |b, w| {
                        b.store_word(
                            &cache,
                            base.clone() + u(latent_n / 4 + tiles) + w.clone(),
                            rope.word(tok.clone() * u(rope_words) + w),
                        );
                    });
                });
                b.comment("the next token reuses amax_part and tile_scale");
                b.barrier();
            }
            _ => {
                b.comment("bf16 row: latent then rope words, copied");
                b.if_(valid.clone(), |b| {
                    b.for_threads("w", u(lat_words), |b, w| {
                        b.store_word(
                            &cache,
                            base.clone() + w.clone(),
                            latent.word(tok.clone() * u(lat_words) + w),
                        );
                    });
                    b.for_threads("w", u(rope_words), |b, w| {
                        b.store_word(
                            &cache,
                            base.clone() + u(lat_words) + w.clone(),
                            rope.word(tok.clone() * u(rope_words) + w),
                        );
                    });
                });
            }
        }
    });
    b.finish()
}

/// The lowered kernel of a config, built once per process.
pub fn lowered_kernel(cfg: &CacheWriteConfig) -> Result<Arc<Kernel>> {
    use std::collections::HashMap;
    use std::sync::{Mutex, OnceLock};
    static CACHE: OnceLock<Mutex<HashMap<CacheWriteConfig, Arc<Kernel>>>> = OnceLock::new();
    let cache = CACHE.get_or_init(|| Mutex::new(HashMap::new()));
    let poisoned =
        || crate::Error::runtime("kernels", "kernel cache lock poisoned by an earlier panic");
    if let Some(k) = cache.lock().map_err(|_| poisoned())?.get(cfg) {
        return Ok(k.clone());
    }
    let k = Arc::new(crate::kir::lower(
        &kernel(cfg)?,
        crate::kir::Lowering::Scalar,
    )?);
    cache
        .lock()
        .map_err(|_| poisoned())?
        .insert(*cfg, k.clone());
    Ok(k)
}

/// The launch of one cache-write call. Buffers are bound by name: `latent`, `rope`,
/// `slot_mapping`, `kv_cache`.
pub fn launch(shape: &CacheWriteShape, geometry: &CacheGeometry) -> Result<Launch> {
    let cfg = CacheWriteConfig {
        dims: shape.dims,
        format: shape.format,
    };
    let k = lowered_kernel(&cfg)?;
    let mut values = vec![
        ("tokens", ParamValue::U32(shape.tokens)),
        ("num_slots", ParamValue::U32(geometry.num_slots() as u32)),
        ("page_size", ParamValue::U32(geometry.page_size)),
        ("row_stride_w", ParamValue::U32(geometry.row_stride_words())),
        (
            "page_stride_w",
            ParamValue::U32(geometry.page_stride_words()),
        ),
    ];
    if shape.format == CacheFormat::Fp8DsMla {
        values.push((
            "pow2_scales",
            ParamValue::U32((shape.flavour == ScaleFlavour::Pow2) as u32),
        ));
    }
    let params = pack_params(&k, &values)?;
    Ok(Launch {
        kernel: k,
        grid: [shape.tokens.min(65535), 1, 1],
        params,
    })
}
