//! Workgroup-wide building blocks the model kernels share, written in plain kir so that every
//! target runs them: sums, maxima, argmax with ties to the lower index, exclusive prefix
//! sums. Each is a collective: every thread of the workgroup reaches it, with the same
//! `threads` the kernel was built with, and gets the result.

use crate::kir::builder::*;
use crate::kir::ir::{Expr, Ty};

/// Workgroup memory a reduction over `threads` values needs (f32 or u32 entries).
pub fn scratch_len(threads: u32) -> u32 {
    threads
}

/// `Σ value` over the workgroup (f32), by a tree in `red` (`threads` f32). Returns a variable
/// holding the sum in every thread. `red` may be reused after the call.
pub fn block_sum(b: &mut KernelBuilder, red: &Shared, threads: u32, value: Expr) -> Expr {
    block_reduce(b, red, threads, value, |a, c| a + c)
}

/// `max value` over the workgroup (f32; NaN-free inputs).
pub fn block_max(b: &mut KernelBuilder, red: &Shared, threads: u32, value: Expr) -> Expr {
    block_reduce(b, red, threads, value, |a, c| {
        select(c.clone().gt(a.clone()), c, a)
    })
}

/// `Σ value` over the workgroup for u32 counts.
pub fn block_sum_u32(b: &mut KernelBuilder, red: &Shared, threads: u32, value: Expr) -> Expr {
    block_reduce(b, red, threads, value, |a, c| a + c)
}

fn block_reduce(
    b: &mut KernelBuilder,
    red: &Shared,
    threads: u32,
    value: Expr,
    op: impl Fn(Expr, Expr) -> Expr,
) -> Expr {
    debug_assert!(threads.is_power_of_two());
    b.barrier();
    b.shared_store(red, local_id(), value);
    b.barrier();
    let mut s = threads / 2;
    while s > 0 {
        b.if_(local_id().lt(u(s)), |b| {
            let v = op(red.at(local_id()), red.at(local_id() + u(s)));
            b.shared_store(red, local_id(), v);
        });
        b.barrier();
        s /= 2;
    }
    let out = b.let_("reduced", red.at(u(0)));
    b.barrier();
    out
}

/// The largest `key` over the workgroup with its `index` (u32); ties go to the lower index.
/// `keys`, `idx`: `threads` u32 entries each. Returns (key, index) variables in every thread.
pub fn block_argmax_u32(
    b: &mut KernelBuilder,
    keys: &Shared,
    idx: &Shared,
    threads: u32,
    key: Expr,
    index: Expr,
) -> (Expr, Expr) {
    b.barrier();
    b.shared_store(keys, local_id(), key);
    b.shared_store(idx, local_id(), index);
    b.barrier();
    let mut s = threads / 2;
    while s > 0 {
        b.if_(local_id().lt(u(s)), |b| {
            let (ka, kb) = (keys.at(local_id()), keys.at(local_id() + u(s)));
            let (ia, ib) = (idx.at(local_id()), idx.at(local_id() + u(s)));
            let take_b = b.let_(
                "take_b",
                kb.clone()
                    .gt(ka.clone())
                    .or(kb.clone().eq_(ka.clone()).and(ib.clone().lt(ia.clone()))),
            );
            b.shared_store(keys, local_id(), select(take_b.clone(), kb, ka));
            b.shared_store(idx, local_id(), select(take_b, ib, ia));
        });
        b.barrier();
        s /= 2;
    }
    let k = b.let_("best_key", keys.at(u(0)));
    let i_ = b.let_("best_index", idx.at(u(0)));
    b.barrier();
    (k, i_)
}

/// The exclusive prefix sum of `value` (u32) in thread order: thread `t` gets
/// `Σ_{s < t} value_s`; also returns the total. `scan`: `threads` u32 entries.
pub fn block_exclusive_scan_u32(
    b: &mut KernelBuilder,
    scan: &Shared,
    threads: u32,
    value: Expr,
) -> (Expr, Expr) {
    let mine = b.let_("scan_in", value);
    b.barrier();
    b.shared_store(scan, local_id(), mine.clone());
    b.barrier();
    // Hillis-Steele: after round d every entry holds the sum of the 2^(d+1) entries ending at it.
    let mut d = 1;
    while d < threads {
        let v = b.var("scan_v", scan.at(local_id()));
        b.if_(local_id().ge(u(d)), |b| {
            b.set(&v, v.clone() + scan.at(local_id() - u(d)));
        });
        b.barrier();
        b.shared_store(scan, local_id(), v);
        b.barrier();
        d *= 2;
    }
    let inclusive = b.let_("scan_incl", scan.at(local_id()));
    let total = b.let_("scan_total", scan.at(u(threads - 1)));
    b.barrier();
    (inclusive - mine, total)
}

/// The order-preserving u32 key of an f32: `a < b ⇔ key(a) < key(b)` for non-NaN values;
/// −0 and +0 map to neighbouring keys (−0 below +0). NaN maps to 0, below every number.
pub fn f32_order_key(b: &mut KernelBuilder, x: Expr) -> Expr {
    let bits = b.let_("bits", f32_bits(x));
    let nan = (bits.clone() & u(0x7fff_ffff)).gt(u(0x7f80_0000));
    let neg = (bits.clone() >> u(31)).eq_(u(1));
    let key = select(neg, bits.clone() ^ u(0xffff_ffff), bits | u(0x8000_0000));
    b.let_("key", select(nan, u(0), key))
}

/// The f32 whose order key is `key` (the inverse of [`f32_order_key`] off NaN).
pub fn f32_from_order_key(key: Expr) -> Expr {
    let pos = (key.clone() >> u(31)).eq_(u(1));
    f32_from_bits(select(
        pos,
        key.clone() ^ u(0x8000_0000),
        key ^ u(0xffff_ffff),
    ))
}

/// `true` where an f32 is NaN, by its bits (WGSL may assume floats are never NaN).
pub fn is_nan(x: Expr) -> Expr {
    (f32_bits(x) & u(0x7fff_ffff)).gt(u(0x7f80_0000))
}

/// `true` where an f32 is ±inf or NaN.
pub fn not_finite(x: Expr) -> Expr {
    (f32_bits(x) & u(0x7f80_0000)).eq_(u(0x7f80_0000))
}

/// Keeps kir's type checker happy where a u32 zero of a given type is wanted.
pub fn zero(ty: Ty) -> Expr {
    match ty {
        Ty::F32 => f(0.0),
        Ty::I32 => i(0),
        _ => u(0),
    }
}

/// Several f32 sums over the workgroup at once, by one tree in `red` (at least
/// `values.len() × threads` f32): the barriers of one reduction serve them all. Returns one
/// variable per value, holding its sum in every thread.
pub fn block_sums(b: &mut KernelBuilder, red: &Shared, threads: u32, values: &[Expr]) -> Vec<Expr> {
    debug_assert!(threads.is_power_of_two() && red.len >= values.len() as u32 * threads);
    b.barrier();
    for (j, v) in values.iter().enumerate() {
        b.shared_store(red, u(j as u32 * threads) + local_id(), v.clone());
    }
    b.barrier();
    let mut s = threads / 2;
    while s > 0 {
        b.if_(local_id().lt(u(s)), |b| {
            for j in 0..values.len() as u32 {
                let at = u(j * threads) + local_id();
                let v = red.at(at.clone()) + red.at(at.clone() + u(s));
                b.shared_store(red, at, v);
            }
        });
        b.barrier();
        s /= 2;
    }
    let out = (0..values.len() as u32)
        .map(|j| b.let_("sum", red.at(u(j * threads))))
        .collect();
    b.barrier();
    out
}

/// The prefix sums of `value` (f32) in thread order, Hillis-Steele in `scan` (`threads`
/// f32). Returns (exclusive, inclusive, total). The exclusive sum of thread `t` is the
/// inclusive sum of thread `t − 1` bit for bit (0 for thread 0), so the intervals
/// `[exclusive, inclusive)` of consecutive threads meet exactly; with rounding they need not
/// be monotone, so a search over them must not assume it.
pub fn block_scan_f32(
    b: &mut KernelBuilder,
    scan: &Shared,
    threads: u32,
    value: Expr,
) -> (Expr, Expr, Expr) {
    let mine = b.let_("scan_in", value);
    b.barrier();
    b.shared_store(scan, local_id(), mine);
    b.barrier();
    let mut d = 1;
    while d < threads {
        let v = b.var("scan_v", scan.at(local_id()));
        b.if_(local_id().ge(u(d)), |b| {
            b.set(&v, v.clone() + scan.at(local_id() - u(d)));
        });
        b.barrier();
        b.shared_store(scan, local_id(), v);
        b.barrier();
        d *= 2;
    }
    let inclusive = b.let_("scan_incl", scan.at(local_id()));
    let before = b.var("scan_excl", f(0.0));
    b.if_(local_id().gt(u(0)), |b| {
        b.set(&before, scan.at(local_id() - u(1)));
    });
    let total = b.let_("scan_total", scan.at(u(threads - 1)));
    b.barrier();
    (before, inclusive, total)
}

/// [`f32_order_key`] with −0 and +0 merged into +0's key, so that an order on keys ties the
/// two zeros as `==` on floats does (the references compare values, where −0 = +0).
pub fn f32_order_key_zeros_equal(b: &mut KernelBuilder, x: Expr) -> Expr {
    let raw = b.let_("xbits", f32_bits(x));
    let bits = b.let_("bits", select(raw.clone().eq_(u(0x8000_0000)), u(0), raw));
    let nan = (bits.clone() & u(0x7fff_ffff)).gt(u(0x7f80_0000));
    let neg = (bits.clone() >> u(31)).eq_(u(1));
    let key = select(neg, bits.clone() ^ u(0xffff_ffff), bits | u(0x8000_0000));
    b.let_("key", select(nan, u(0), key))
}

/// Several u32 sums over the workgroup in one tree: `values[i]` of every thread summed, for
/// each i. `red` holds `threads · values.len()` entries. Returns one variable per sum.
pub fn block_sums_u32(
    b: &mut KernelBuilder,
    red: &Shared,
    threads: u32,
    values: &[Expr],
) -> Vec<Expr> {
    let n = values.len() as u32;
    b.barrier();
    for (i, v) in values.iter().enumerate() {
        b.shared_store(red, u(i as u32 * threads) + local_id(), v.clone());
    }
    b.barrier();
    let mut s = threads / 2;
    while s > 0 {
        b.if_(local_id().lt(u(s)), |b| {
            for i in 0..n {
                let a = u(i * threads) + local_id();
                let v = red.at(a.clone()) + red.at(a.clone() + u(s));
                b.shared_store(red, a, v);
            }
        });
        b.barrier();
        s /= 2;
    }
    let out = (0..n)
        .map(|i| b.let_(&format!("sum{i}"), red.at(u(i * threads))))
        .collect();
    b.barrier();
    out
}
