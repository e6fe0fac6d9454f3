//! Bit-exact number routines written in kir's integer operations, so that every target
//! computes the same bits: WGSL promises only 2.5 ulp for f32 division and may flush
//! subnormals, so where the bits of a result are part of a data format (an fp8 cache row
//! must be byte-identical whoever wrote it) a kernel computes them here, with u32
//! arithmetic that is exact everywhere.
//!
//! - [`div_rn`]: the correctly rounded f32 quotient (IEEE round-to-nearest-even);
//! - [`f32_to_e4m3`]: f32 → e4m3fn, round to nearest even, saturating at ±448.
//!
//! Each routine states its domain; outside it the result is unspecified but never a fault.
//! Both are checked against Rust's IEEE arithmetic on a GPU backend by
//! `tests/formats_numeric.rs`.

use super::builder::*;
use super::ir::Expr;

/// Bits of 448.0, the largest finite e4m3fn value.
pub const E4M3_MAX_BITS: u32 = 0x43E0_0000;

/// `a / d` rounded to nearest even, on f32 bit patterns (u32 in, u32 out).
///
/// Domain: `a` any finite f32 (zeros and subnormals included), `d` a positive normal finite
/// f32; a non-finite `a` gives unspecified bits (callers test for NaN and infinity first).
/// The result is exact IEEE division with one exception: a quotient below the smallest
/// normal (2^-126) is flushed to a zero of `a`'s sign, where IEEE would round to a subnormal
/// or to 2^-126. Callers here only compare such quotients with thresholds far above (e4m3's
/// smallest step is 2^-9), where both agree. A quotient past f32's range gives infinity.
///
/// Method: with `a = A·2^ea`, `d = D·2^ed` and 24-bit significands `A`, `D` (a subnormal `a`
/// normalised first), long division in three 8-bit steps gives `Q = ⌊A·2^24 / D⌋` and its
/// remainder, in u32 without overflow (`A, D < 2^24`). `Q` has 24 or 25 bits; the 24-bit
/// significand is rounded with the usual round and sticky bits.
pub fn div_rn(b: &mut KernelBuilder, a: Expr, d: Expr) -> Expr {
    let a = b.let_("div_a", a);
    let d = b.let_("div_d", d);
    let sign = b.let_("div_sign", a.clone() & u(0x8000_0000));
    let mag = b.let_("div_mag", a & u(0x7FFF_FFFF));
    let ea = b.let_("div_ea", mag.clone() >> u(23));
    let fa = b.let_("div_fa", mag.clone() & u(0x007F_FFFF));
    let sub = b.let_("div_sub", ea.clone().eq_(u(0)));
    // A subnormal dividend: shift its leading one up to bit 23 (clz(0) = 32 is harmless: a
    // zero dividend is answered at the end).
    let sh = b.let_(
        "div_sh",
        select(
            sub.clone(),
            (clz(fa.clone()).max(u(8)) - u(8)).min(u(23)),
            u(0),
        ),
    );
    let sig_a = b.let_(
        "div_sig_a",
        select(sub.clone(), fa.clone() << sh.clone(), fa | u(0x0080_0000)),
    );
    let exp_a = b.let_("div_exp_a", select(sub, i(1) - sh.as_i32(), ea.as_i32()));
    let sig_d = b.let_("div_sig_d", (d.clone() & u(0x007F_FFFF)) | u(0x0080_0000));
    let exp_d = b.let_("div_exp_d", (d >> u(23)).as_i32());
    b.comment("long division, 8 quotient bits per step: Q = floor(A * 2^24 / D)");
    let mut rem = sig_a;
    let mut q = u(0);
    for step in 0..3 {
        let n = b.let_(&format!("div_n{step}"), rem << u(8));
        let qs = b.let_(&format!("div_q{step}"), n.clone() / sig_d.clone());
        rem = b.let_(&format!("div_r{step}"), n - qs.clone() * sig_d.clone());
        q = (q << u(8)) | qs;
    }
    let q = b.let_("div_q", q);
    // Q in [2^23, 2^25): 25 bits when the significand quotient is >= 1.
    let big = b.let_("div_big", q.clone().ge(u(1 << 24)));
    let sig = b.let_("div_sig", select(big.clone(), q.clone() >> u(1), q.clone()));
    let odd = b.let_("div_odd", (sig.clone() & u(1)).ne_(u(0)));
    let twice_rem = b.let_("div_2r", rem.clone() << u(1));
    let up_big = (q & u(1)).ne_(u(0)).and(rem.ne_(u(0)).or(odd.clone()));
    let up_small = twice_rem
        .clone()
        .gt(sig_d.clone())
        .or(twice_rem.eq_(sig_d).and(odd));
    let rounded = b.let_(
        "div_rounded",
        sig + select(select(big.clone(), up_big, up_small), u(1), u(0)),
    );
    let carry = b.let_("div_carry", rounded.clone().ge(u(1 << 24)));
    let exp = b.let_(
        "div_exp",
        exp_a - exp_d + i(127) + select(big, i(0), i(-1)) + select(carry.clone(), i(1), i(0)),
    );
    let sig = b.let_("div_sig24", select(carry, rounded.clone() >> u(1), rounded));
    let normal = sign.clone() | (exp.clone().max(i(0)).as_u32() << u(23)) | (sig & u(0x007F_FFFF));
    let result = select(
        mag.eq_(u(0)).or(exp.clone().le(i(0))),
        sign.clone(),
        select(exp.ge(i(255)), sign | u(0x7F80_0000), normal),
    );
    b.let_("quotient", result)
}

/// Round a u32 right by `shift` bits (1..=31), to nearest, ties to even.
fn shr_rne(b: &mut KernelBuilder, x: Expr, shift: Expr) -> Expr {
    let x = b.let_("rne_x", x);
    let s = b.let_("rne_s", shift);
    let q = b.let_("rne_q", x.clone() >> s.clone());
    let rest = b.let_("rne_rest", x & ((u(1) << s.clone()) - u(1)));
    let half = b.let_("rne_half", u(1) << (s - u(1)));
    let up = rest
        .clone()
        .gt(half.clone())
        .or(rest.eq_(half).and((q.clone() & u(1)).ne_(u(0))));
    b.let_("rne", q + select(up, u(1), u(0)))
}

/// f32 bits → e4m3fn byte (in the low 8 bits of a u32): round to nearest even, saturating
/// at ±448 (infinities too), NaN → 0x7F, −0 → 0x80. Same as `cvt.rn.satfinite.e4m3x2.f32`
/// and [`crate::reference::numerics::f32_to_e4m3`].
///
/// Normal e4m3 values have 3 fraction bits, so a normal f32 significand is rounded right
/// by 20 bits; below 2^-6 the grid is uniform (step 2^-9) and the shift grows by one per
/// binade. Writing the code as `((E + 7) << 3) + q − 8`, a rounding carry into the next
/// binade (q = 16) lands in the exponent field by itself.
pub fn f32_to_e4m3(b: &mut KernelBuilder, x: Expr) -> Expr {
    let x = b.let_("e4m3_in", x);
    let sign = b.let_("e4m3_sign", (x.clone() >> u(24)) & u(0x80));
    let mag = b.let_("e4m3_mag", x & u(0x7FFF_FFFF));
    let e = b.let_("e4m3_e", (mag.clone() >> u(23)).as_i32() - i(127));
    let e_eff = b.let_("e4m3_e_eff", e.clone().max(i(-6)));
    let shift = b.let_(
        "e4m3_shift",
        (i(20) + e_eff.clone() - e).as_u32().min(u(31)),
    );
    let sig = (mag.clone() & u(0x007F_FFFF)) | u(0x0080_0000);
    let q = shr_rne(b, sig, shift);
    let code = b.let_("e4m3_code", ((e_eff + i(7)).as_u32() << u(3)) + q - u(8));
    let code = select(
        mag.clone().ge(u(E4M3_MAX_BITS)),
        u(0x7E),
        select(mag.clone().lt(u(0x0080_0000)), u(0), code),
    );
    b.let_("e4m3", select(mag.gt(u(0x7F80_0000)), u(0x7F), sign | code))
}
