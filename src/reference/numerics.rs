//! Bit-exact number formats: bf16 (through `half`) and fp8 e4m3 "fn" (written here: no crate
//! in our dependency set has it). e4m3fn: 1 sign, 4 exponent (bias 7), 3 mantissa bits; no
//! infinities; 0x7F / 0xFF are NaN; largest finite ±448; subnormals step 2^-9.

use half::bf16;

/// Round an f32 to the nearest bf16 (ties to even) and back.
pub fn round_bf16(x: f32) -> f32 {
    bf16::from_f32(x).to_f32()
}

pub fn bf16_bits(x: f32) -> u16 {
    bf16::from_f32(x).to_bits()
}

pub fn bf16_from_bits(b: u16) -> f32 {
    bf16::from_bits(b).to_f32()
}

/// Largest finite e4m3fn value.
pub const E4M3_MAX: f32 = 448.0;

/// Decode one e4m3fn byte.
pub fn e4m3_to_f32(b: u8) -> f32 {
    let sign = if b & 0x80 != 0 { -1.0f32 } else { 1.0 };
    let exp = (b >> 3) & 0x0F;
    let man = (b & 0x07) as f32;
    if exp == 0x0F && (b & 0x07) == 0x07 {
        return f32::NAN;
    }
    if exp == 0 {
        sign * man * (1.0 / 512.0)
    } else {
        sign * (1.0 + man / 8.0) * (2.0f32).powi(exp as i32 - 7)
    }
}

/// Encode an f32 as e4m3fn: round to nearest, ties to even, saturating at ±448.
/// NaN encodes as 0x7F; −0 keeps its sign bit (0x80).
pub fn f32_to_e4m3(x: f32) -> u8 {
    if x.is_nan() {
        return 0x7F;
    }
    let sign: u8 = if x.is_sign_negative() { 0x80 } else { 0 };
    let a = x.abs();
    if a >= E4M3_MAX {
        return sign | 0x7E;
    }
    // Below the smallest normal (2^-6) the grid is uniform with step 2^-9.
    if a < 1.0 / 64.0 {
        let q = round_half_even(a * 512.0) as u8; // 0..=8; 8 is the smallest normal, 0x08
        return sign | q;
    }
    let e = a.log2().floor() as i32; // -6..=8
                                     // Guard against log2 rounding at exact powers of two.
    let e = if (2.0f32).powi(e) > a {
        e - 1
    } else if (2.0f32).powi(e + 1) <= a {
        e + 1
    } else {
        e
    };
    let frac = a / (2.0f32).powi(e) - 1.0; // [0, 1), exact: scaling by a power of two
    let mut m = round_half_even(frac * 8.0) as u32;
    let mut e = e;
    if m == 8 {
        m = 0;
        e += 1;
    }
    if e > 8 || (e == 8 && m > 6) {
        return sign | 0x7E;
    }
    sign | (((e + 7) as u8) << 3) | m as u8
}

fn round_half_even(v: f32) -> f32 {
    v.round_ties_even()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn e4m3_roundtrips_every_finite_byte() {
        for b in 0u8..=255 {
            let v = e4m3_to_f32(b);
            if v.is_nan() {
                assert!(b & 0x7F == 0x7F, "only 0x7F/0xFF are NaN, got {b:#x}");
                continue;
            }
            assert_eq!(f32_to_e4m3(v), b, "byte {b:#04x} value {v}");
        }
    }

    #[test]
    fn e4m3_rounding_and_saturation() {
        assert_eq!(e4m3_to_f32(0x7E), 448.0);
        assert_eq!(f32_to_e4m3(1e9), 0x7E);
        assert_eq!(f32_to_e4m3(-1e9), 0xFE);
        assert_eq!(f32_to_e4m3(460.0), 0x7E);
        // 1.0625 is halfway between 1.0 (m=0) and 1.125 (m=1): ties to even → 1.0
        assert_eq!(e4m3_to_f32(f32_to_e4m3(1.0625)), 1.0);
        // 1.1875 halfway between 1.125 (m=1) and 1.25 (m=2): ties to even → 1.25
        assert_eq!(e4m3_to_f32(f32_to_e4m3(1.1875)), 1.25);
        // subnormal: 2^-9 is the smallest; half of it ties to 0
        assert_eq!(f32_to_e4m3(1.0 / 512.0), 0x01);
        assert_eq!(f32_to_e4m3(0.5 / 512.0), 0x00);
        assert_eq!(f32_to_e4m3(1.5 / 512.0), 0x02);
        assert_eq!(f32_to_e4m3(-0.0), 0x80);
        assert_eq!(f32_to_e4m3(f32::NAN), 0x7F);
    }
}
