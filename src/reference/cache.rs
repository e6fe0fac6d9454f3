//! Cache rows (docs/formats.md): encode a token's `[latent | rope]` into a row, and decode a row
//! back to `d_qk` f32 values.
//!
//! `fp8_ds_mla` (production widths only), 656 bytes:
//! `[0, 512)` e4m3 latent · `[512, 528)` 4 × f32 LE scales, one per 128 values ·
//! `[528, 656)` 64 × bf16 LE rope. Dequant: `c[i] = e4m3(byte[i]) × scale[i / 128]`.

use super::numerics::{bf16_bits, bf16_from_bits, e4m3_to_f32, f32_to_e4m3, E4M3_MAX};
use crate::mla::{CacheFormat, CacheWriteShape, MlaDims, ScaleFlavour, FP8_TILE};

/// Decode one row into `d_qk` values (latent then rope).
pub fn decode_row(format: CacheFormat, dims: MlaDims, row: &[u8]) -> Vec<f32> {
    let d = dims.d_qk() as usize;
    assert_eq!(row.len(), format.row_bytes(dims) as usize);
    match format {
        CacheFormat::Bf16 => (0..d)
            .map(|i| bf16_from_bits(u16::from_le_bytes([row[2 * i], row[2 * i + 1]])))
            .collect(),
        CacheFormat::Fp8DsMla => {
            let latent = dims.latent as usize;
            let tiles = latent / FP8_TILE as usize;
            let scale = |t: usize| {
                let o = latent + 4 * t;
                f32::from_le_bytes([row[o], row[o + 1], row[o + 2], row[o + 3]])
            };
            let rope_at = latent + 4 * tiles;
            let mut v = Vec::with_capacity(d);
            for (i, &b) in row.iter().take(latent).enumerate() {
                v.push(e4m3_to_f32(b) * scale(i / FP8_TILE as usize));
            }
            for i in 0..dims.rope as usize {
                let o = rope_at + 2 * i;
                v.push(bf16_from_bits(u16::from_le_bytes([row[o], row[o + 1]])));
            }
            v
        }
    }
}

/// The smallest normal f32: the floor of an fp8 tile scale (an all-zero tile must not give 0).
pub const MIN_SCALE: f32 = f32::MIN_POSITIVE;

/// The fp8 scale of one 128-value tile: `amax / 448` over its finite values, floored at the
/// smallest normal f32, rounded up to a power of two for [`ScaleFlavour::Pow2`].
pub fn fp8_tile_scale(tile: &[f32], flavour: ScaleFlavour) -> f32 {
    let amax = tile
        .iter()
        .filter(|v| v.is_finite())
        .fold(0.0f32, |m, v| m.max(v.abs()));
    let s = (amax / E4M3_MAX).max(MIN_SCALE);
    match flavour {
        ScaleFlavour::Arbitrary => s,
        ScaleFlavour::Pow2 => pow2_ceil(s),
    }
}

/// Smallest power of two ≥ `s` (s a positive normal f32): exact, by bits.
pub fn pow2_ceil(s: f32) -> f32 {
    let bits = s.to_bits();
    let exp = bits & 0x7F80_0000;
    if bits & 0x007F_FFFF == 0 {
        s
    } else {
        f32::from_bits(exp + 0x0080_0000)
    }
}

/// Encode one token. `latent` and `rope` hold bf16-representable values.
/// `flavour` only matters for `fp8_ds_mla`.
pub fn encode_row(
    format: CacheFormat,
    dims: MlaDims,
    latent: &[f32],
    rope: &[f32],
    flavour: ScaleFlavour,
) -> Vec<u8> {
    assert_eq!(latent.len(), dims.latent as usize);
    assert_eq!(rope.len(), dims.rope as usize);
    let mut row = Vec::with_capacity(format.row_bytes(dims) as usize);
    match format {
        CacheFormat::Bf16 => {
            for &v in latent.iter().chain(rope) {
                row.extend_from_slice(&bf16_bits(v).to_le_bytes());
            }
        }
        CacheFormat::Fp8DsMla => {
            let scales: Vec<f32> = latent
                .chunks(FP8_TILE as usize)
                .map(|t| fp8_tile_scale(t, flavour))
                .collect();
            for (i, &v) in latent.iter().enumerate() {
                // NaN and ±inf become the e4m3 NaN; they took no part in the scale.
                row.push(if v.is_finite() {
                    f32_to_e4m3(v / scales[i / FP8_TILE as usize])
                } else {
                    0x7F
                });
            }
            for s in &scales {
                row.extend_from_slice(&s.to_le_bytes());
            }
            for &v in rope {
                row.extend_from_slice(&bf16_bits(v).to_le_bytes());
            }
        }
    }
    debug_assert_eq!(row.len(), format.row_bytes(dims) as usize);
    row
}

/// The cache-write kernel's reference: for every token `t` whose `slot_mapping[t]` is in
/// `[0, num_slots)`, encode `latent [t, :]` and `rope [t, :]` (bf16 bits) with
/// [`encode_row`] and store the row at the slot's offset in `cache`; every other byte of
/// `cache` is left as it is. `cache` must hold at least the geometry's `min_bytes`.
pub fn write_rows(
    shape: &CacheWriteShape,
    latent: &[u16],
    rope: &[u16],
    slot_mapping: &[i32],
    cache: &mut [u8],
) -> crate::Result<()> {
    let g = shape.validate()?;
    let (t_n, l, r) = (
        shape.tokens as usize,
        shape.dims.latent as usize,
        shape.dims.rope as usize,
    );
    for (arg, len, want) in [
        ("latent", latent.len(), t_n * l),
        ("rope", rope.len(), t_n * r),
        ("slot_mapping", slot_mapping.len(), t_n),
    ] {
        if len != want {
            return Err(crate::Error::arg(arg, format!("{want} elements"), len));
        }
    }
    if (cache.len() as u64) < g.min_bytes() {
        return Err(crate::Error::arg(
            "kv_cache",
            format!("at least {} bytes", g.min_bytes()),
            cache.len(),
        ));
    }
    for t in 0..t_n {
        let slot = slot_mapping[t];
        if slot < 0 || slot as u64 >= g.num_slots() {
            continue;
        }
        let rope_bits: Vec<u8> = rope[t * r..(t + 1) * r]
            .iter()
            .flat_map(|b| b.to_le_bytes())
            .collect();
        let row = match shape.format {
            // The bits are copied: a NaN payload survives (an f32 round trip may change it).
            CacheFormat::Bf16 => latent[t * l..(t + 1) * l]
                .iter()
                .flat_map(|b| b.to_le_bytes())
                .chain(rope_bits)
                .collect(),
            CacheFormat::Fp8DsMla => {
                let lat: Vec<f32> = latent[t * l..(t + 1) * l]
                    .iter()
                    .map(|&b| bf16_from_bits(b))
                    .collect();
                let rp: Vec<f32> = rope[t * r..(t + 1) * r]
                    .iter()
                    .map(|&b| bf16_from_bits(b))
                    .collect();
                let mut row = encode_row(shape.format, shape.dims, &lat, &rp, shape.flavour);
                let tail = row.len() - rope_bits.len();
                row[tail..].copy_from_slice(&rope_bits);
                row
            }
        };
        let at = g.row_offset(slot as u64) as usize;
        cache[at..at + row.len()].copy_from_slice(&row);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::reference::numerics::round_bf16;
    use crate::util::Rng;

    /// An overflow upstream (one ±inf or NaN in a tile) must not erase the tile: the other
    /// values decode as if it were absent, and the bad value stays non-finite.
    #[test]
    fn a_non_finite_value_spoils_only_itself() {
        let dims = MlaDims::PRODUCTION;
        let mut rng = Rng::new(0x1f);
        for flavour in [ScaleFlavour::Pow2, ScaleFlavour::Arbitrary] {
            for bad in [f32::INFINITY, f32::NEG_INFINITY, f32::NAN] {
                let latent: Vec<f32> = (0..dims.latent)
                    .map(|_| round_bf16(rng.normal() * 3.0))
                    .collect();
                let rope: Vec<f32> = (0..dims.rope).map(|_| round_bf16(rng.normal())).collect();
                let mut spoiled = latent.clone();
                let at = 130; // tile 1
                spoiled[at] = bad;
                let clean = decode_row(
                    CacheFormat::Fp8DsMla,
                    dims,
                    &encode_row(CacheFormat::Fp8DsMla, dims, &latent, &rope, flavour),
                );
                let got = decode_row(
                    CacheFormat::Fp8DsMla,
                    dims,
                    &encode_row(CacheFormat::Fp8DsMla, dims, &spoiled, &rope, flavour),
                );
                assert!(got[at].is_nan(), "{bad} decoded as {}", got[at]);
                // The tile's scale is that of its other values: at most the clean scale.
                for (i, (&g, &c)) in got.iter().zip(&clean).enumerate() {
                    if i == at {
                        continue;
                    }
                    assert!(g.is_finite(), "value {i} became {g} ({bad} at {at})");
                    if i / FP8_TILE as usize != at / FP8_TILE as usize {
                        assert_eq!(g, c, "value {i} outside the tile changed");
                    } else {
                        let tile = &latent[128..256];
                        let amax = tile
                            .iter()
                            .enumerate()
                            .filter(|(j, _)| 128 + j != at)
                            .fold(0.0f32, |m, (_, v)| m.max(v.abs()));
                        // e4m3 has 3 mantissa bits: half an ulp is 1/16 of the value, and
                        // the subnormal floor is amax/448 · 2^-9 · 2^6.
                        let tol = latent[i].abs() / 16.0 + amax / 448.0 * 2.0f32.powi(-3);
                        assert!(
                            (g - latent[i]).abs()
                                <= tol
                                    * if flavour == ScaleFlavour::Pow2 {
                                        2.0
                                    } else {
                                        1.0
                                    },
                            "value {i}: {g} for {} ({bad} at {at})",
                            latent[i]
                        );
                    }
                }
            }
        }
    }
}
