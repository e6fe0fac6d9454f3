//! CUDA C printer. The output is self-contained: no `#include`, so NVRTC compiles it with no
//! CUDA headers installed. bf16 rounding goes through inline PTX (`cvt.rn.bf16x2.f32`,
//! sm_80+), e4m3 decode through `cvt.rn.f16x2.e4m3x2` on sm_89+ (bit manipulation before);
//! everything else is plain C.
//!
//! Calling convention: `extern "C" __global__ void <name>(<name>_params p, buffers...)`,
//! the parameter struct by value, then one pointer per buffer in declaration order.

use super::{f32_literal, header, special_f32, Dialect, Writer};
use crate::kir::ir::*;
use crate::kir::walk::free_reads;
use crate::{Error, Result};
use std::collections::HashSet;

/// Print a lowered kernel as a CUDA C translation unit with one `extern "C"` kernel.
pub fn emit(kernel: &Kernel) -> Result<String> {
    emit_with_helpers(kernel, None)
}

/// Static shared memory is limited to 48 KiB; a kernel that needs more takes all of its
/// shared memory dynamically (opt-in attribute, up to the device's limit).
pub const STATIC_SHARED_LIMIT: u64 = 48 * 1024;

/// Bytes of dynamic shared memory the kernel must be launched with: 0 when its shared
/// arrays are static (at most [`STATIC_SHARED_LIMIT`]), else all of them, 16-byte aligned.
pub fn dynamic_shared_bytes(kernel: &Kernel) -> u32 {
    let (_, total) = crate::kir::shared_plan::shared_layout(&kernel.shared);
    if total > STATIC_SHARED_LIMIT {
        total as u32
    } else {
        0
    }
}

/// The helper functions a kernel's code calls (bf16 / e4m3 conversion, and for kernels with
/// target intrinsics the PTX wrappers), so that a host emulator can substitute its own.
/// [`emit`] adds the e4m3 pair conversion's helpers to the kernels whose body calls them.
pub fn helpers(kernel: &Kernel) -> String {
    let mut h = HELPERS.to_string();
    if kernel.uses_intrinsics() {
        h.push('\n');
        h.push_str(MMA_HELPERS);
    }
    if uses_ring_intrinsics(&kernel.body) {
        h.push('\n');
        h.push_str(RING_HELPERS);
    }
    if uses_intrinsic(&kernel.body, &|i| matches!(i, Intrinsic::StoreF32x2 { .. })) {
        h.push('\n');
        h.push_str(PAIR_STORE_HELPERS);
    }
    if uses_intrinsic(&kernel.body, &|i| matches!(i, Intrinsic::PrefetchL2 { .. })) {
        h.push('\n');
        h.push_str(PREFETCH_HELPERS);
    }
    if uses_intrinsic(&kernel.body, &|i| matches!(i, Intrinsic::GroupSync { .. })) {
        h.push('\n');
        h.push_str(GROUP_SYNC_HELPERS);
    }
    let dep = kernel.grid_dependency;
    if dep.waits_for_previous || dep.early_dependents {
        h.push('\n');
        h.push_str(GRID_DEPENDENCY_HELPERS);
    }
    h
}

/// Programmatic dependent launch ([`GridDependency`]): both are no-ops before sm_90, and on
/// sm_90+ when the kernel was launched without the stream-serialisation attribute.
const GRID_DEPENDENCY_HELPERS: &str = r#"// Wait until the previous kernel in the stream has finished and its writes are visible.
SPARSE_MLA_HELPER void grid_wait_previous() {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

// Let the next kernel in the stream launch (its workgroups wait in grid_wait_previous).
SPARSE_MLA_HELPER void grid_launch_dependents() {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}
"#;

/// [`Intrinsic::PrefetchL2`], printed only into the kernels that use it.
const PREFETCH_HELPERS: &str = r#"// Ask L2 for the 128-byte lines of [p, p + bytes) (bytes > 0): one prefetch per line, the
// last byte's too (p need not be line-aligned). A hint: no value changes. (One bulk
// prefetch per row, cp.async.bulk.prefetch.L2 on sm_90+, ran 1.02-1.2x slower on the H200:
// its operands are uniform, so a warp issues it one lane at a time.)
SPARSE_MLA_HELPER void prefetch_l2(const void* p, unsigned bytes) {
    const char* c = (const char*)p;
    for (unsigned o = 0; o < bytes; o += 128u) {
        asm volatile("prefetch.global.L2 [%0];" :: "l"(c + o));
    }
    asm volatile("prefetch.global.L2 [%0];" :: "l"(c + bytes - 1u));
}
"#;

/// [`Intrinsic::GroupSync`], printed only into the kernels that use it.
const GROUP_SYNC_HELPERS: &str = r#"// The `count` workgroups of a group meet on the two words at c: c[0] counts arrivals, c[1]
// is a generation that the last arrival advances (after putting c[0] back to 0). Thread 0
// arrives for its workgroup, after a barrier that orders the other threads' earlier global
// writes before its release fence; the others wait at the second barrier, after its acquire
// fence. The launch keeps every workgroup of the group resident (cooperative), so the wait
// ends. The generation is read before arriving: only the last arrival, which comes after
// this one, changes it.
SPARSE_MLA_HELPER void group_sync(unsigned* c, unsigned count) {
    __syncthreads();
    if (threadIdx.x == 0) {
        unsigned gen, arrived, now;
        const unsigned nap = 64;
        asm volatile("ld.relaxed.gpu.global.u32 %0, [%1];" : "=r"(gen) : "l"(c + 1) : "memory");
        asm volatile("fence.acq_rel.gpu;" ::: "memory");
        asm volatile("atom.relaxed.gpu.global.add.u32 %0, [%1], %2;" : "=r"(arrived) : "l"(c), "r"(1u) : "memory");
        if (arrived + 1u == count) {
            asm volatile("st.relaxed.gpu.global.u32 [%0], %1;" :: "l"(c), "r"(0u) : "memory");
            asm volatile("fence.acq_rel.gpu;" ::: "memory");
            asm volatile("st.relaxed.gpu.global.u32 [%0], %1;" :: "l"(c + 1), "r"(gen + 1u) : "memory");
        } else {
            do {
                asm volatile("nanosleep.u32 %0;" :: "r"(nap) : "memory");
                asm volatile("ld.relaxed.gpu.global.u32 %0, [%1];" : "=r"(now) : "l"(c + 1) : "memory");
            } while (now == gen);
        }
        asm volatile("fence.acq_rel.gpu;" ::: "memory");
    }
    __syncthreads();
}
"#;

/// [`Intrinsic::StoreF32x2`], printed only into the kernels that use it.
const PAIR_STORE_HELPERS: &str = r#"// p[0] = a, p[1] = b in one 8-byte store (st.global.v2.f32; p 8-byte aligned). Plain C++,
// not asm: the compiler keeps shared values loaded before it in registers across it.
struct __align__(8) sparse_mla_f32x2 {
    float x, y;
};
SPARSE_MLA_HELPER void store_f32x2(float* p, float a, float b) {
    sparse_mla_f32x2 v;
    v.x = a;
    v.y = b;
    *reinterpret_cast<sparse_mla_f32x2*>(p) = v;
}
"#;

/// Does any statement of `stmts` (at any depth) use an intrinsic `pick` accepts?
fn uses_intrinsic(stmts: &[Stmt], pick: &dyn Fn(&Intrinsic) -> bool) -> bool {
    stmts.iter().any(|s| match s {
        Stmt::Intrinsic(i) => pick(i),
        Stmt::If { then, els, .. } => uses_intrinsic(then, pick) || uses_intrinsic(els, pick),
        Stmt::For { body, .. } => uses_intrinsic(body, pick),
        _ => false,
    })
}

/// Does the kernel hand pipeline stages over with mbarriers (the producer/consumer form)?
fn uses_ring_intrinsics(stmts: &[Stmt]) -> bool {
    uses_intrinsic(stmts, &|i| {
        matches!(
            i,
            Intrinsic::NamedBarrier { .. }
                | Intrinsic::SyncWarp
                | Intrinsic::MbarInit { .. }
                | Intrinsic::MbarArrive { .. }
                | Intrinsic::MbarWait { .. }
                | Intrinsic::CopyAsync { .. }
                | Intrinsic::CopyArrive { .. }
                | Intrinsic::FenceProxyAsync
        )
    })
}

/// [`emit`], with `helpers` printed in place of [`helpers`] when given (for a host emulator of
/// the PTX instructions).
pub fn emit_with_helpers(kernel: &Kernel, helpers_text: Option<&str>) -> Result<String> {
    if !kernel.is_lowered() {
        return Err(Error::Kir {
            kernel: kernel.name.clone(),
            message: "CUDA emitter given a kernel with tile ops; lower it first".into(),
        });
    }
    let h = match helpers_text {
        Some(h) => h.to_string(),
        None => helpers(kernel),
    };
    // printed twice below (the helpers the body calls, then the unit): pruned once
    let pruned = Kernel {
        body: without_dead_lets(&kernel.body),
        ..kernel.clone()
    };
    let kernel = &pruned;
    let unit = Printer { kernel }.unit(&h);
    // The pair conversion's and the integer min / max helpers only where the body calls them.
    let mut called = String::new();
    let e4m3_operands = unit.contains("mma_e4m3_16832(")
        || unit.contains("pack_e4m3x4(")
        || unit.contains("E4M3_MMA_NATIVE");
    if helpers_text.is_none() && (unit.contains("e4m3x2_prep(") || e4m3_operands) {
        called.push('\n');
        called.push_str(PAIR_HELPERS);
    }
    if helpers_text.is_none() && e4m3_operands {
        called.push('\n');
        called.push_str(E4M3_OPERAND_HELPERS);
    }
    if helpers_text.is_none()
        && [
            "pack_f16x2(",
            "f16_lo(",
            "f16_hi(",
            "mul_f16x2(",
            "e4m3x2_f16(",
            "E4M3_F16_UNIT",
            "mma_f16_16816(",
        ]
        .iter()
        .any(|f| unit.contains(f))
    {
        called.push('\n');
        called.push_str(F16_HELPERS);
    }
    // exp_fast is exp2_fast of x · log2 e: the one `ex2.approx` is printed once
    let exp_fast = unit.contains("exp_fast(");
    if exp_fast || unit.contains("exp2_fast(") {
        called.push('\n');
        called.push_str(EXP2_FAST_HELPERS);
    }
    if exp_fast {
        called.push_str(EXP_FAST_HELPERS);
    }
    let min_max: Vec<_> = MIN_MAX_HELPERS
        .iter()
        .filter(|(name, _)| unit.contains(&format!("{name}(")))
        .map(|(_, def)| *def)
        .collect();
    if !min_max.is_empty() {
        called.push_str("\n// Integer min / max (u32, i32; f32 has fminf / fmaxf).\n");
        called.push_str(&min_max.join("\n"));
        called.push('\n');
    }
    if called.is_empty() {
        return Ok(unit);
    }
    Ok(Printer { kernel }.unit(&format!("{h}{called}")))
}

/// [`Func::ExpFast`], printed into the kernels that call it.
const EXP_FAST_HELPERS: &str = r#"// e^x, approximate: ex2.approx.ftz of x * log2(e) (relative error about 2^-22 plus
// |x| * 2^-24 from rounding the product; results below 2^-126 flush to 0). The online
// softmax's probabilities and rescale factors, the split merge's weights: x <= 0 there, and
// the terms with large |x| are the negligible ones.
SPARSE_MLA_HELPER float exp_fast(float x) {
    return exp2_fast(x * 1.4426950408889634f);
}
"#;

/// [`Func::Exp2Fast`], printed into the kernels that call it or `exp_fast`.
const EXP2_FAST_HELPERS: &str = r#"// 2^x, approximate: ex2.approx.ftz (relative error about 2^-22; results below 2^-126
// flush to 0, and 2^-inf is 0). The online softmax's probabilities, whose exponent
// s * log2(e) - m * log2(e) is one FMA.
SPARSE_MLA_HELPER float exp2_fast(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}
"#;

/// Integer min / max by name, printed into the kernels that call them. Macros, not functions:
/// the compiler then sees the very ternaries it was given before these names existed (the
/// operands are side-effect free, so evaluating one twice changes nothing). As inline functions
/// the fp8 scalar split kernel, which sits at its register cap, spilled 8 bytes on sm_80.
const MIN_MAX_HELPERS: [(&str, &str); 4] = [
    ("min_u32", "#define min_u32(a, b) ((a) < (b) ? (a) : (b))"),
    ("max_u32", "#define max_u32(a, b) ((a) > (b) ? (a) : (b))"),
    ("min_i32", "#define min_i32(a, b) ((a) < (b) ? (a) : (b))"),
    ("max_i32", "#define max_i32(a, b) ((a) > (b) ? (a) : (b))"),
];

/// The C declaration of a kernel's parameter struct (also used for the integrators' header).
pub fn params_struct(kernel: &Kernel) -> String {
    let mut s = format!("struct {}_params {{\n", kernel.name);
    for p in &kernel.params {
        s.push_str(&format!("    {} {}; // {}\n", c_ty(p.ty), p.name, p.doc));
    }
    if kernel.params.is_empty() {
        s.push_str("    unsigned unused;\n");
    }
    s.push_str("};\n");
    s
}

/// The C parameter list of the kernel's buffers (for documentation and headers).
pub fn buffer_params(kernel: &Kernel) -> Vec<String> {
    kernel
        .buffers
        .iter()
        .map(|b| {
            let (cst, restrict) = match b.access {
                Access::Read => ("const ", " __restrict__"),
                Access::ReadWrite => ("", " __restrict__"),
            };
            format!("{cst}{}*{restrict} {}", c_elem(b.elem), b.name)
        })
        .collect()
}

fn c_ty(t: Ty) -> &'static str {
    match t {
        Ty::F32 => "float",
        Ty::I32 => "int",
        Ty::U32 => "unsigned",
        Ty::Bool => "bool",
        Ty::Bf16 => "unsigned short",
        Ty::F8E4M3 => "unsigned char",
    }
}

fn c_elem(e: Elem) -> &'static str {
    match e {
        Elem::F32 => "float",
        Elem::I32 => "int",
        Elem::U32 => "unsigned",
        Elem::Bf16 => "unsigned short",
        Elem::U8 => "unsigned char",
    }
}

const HELPERS: &str = r#"// Every helper is a static inline device function; `unused`: a kernel that does not call
// one compiles without a warning about it.
#define SPARSE_MLA_HELPER static __device__ __forceinline__ __attribute__((unused))

// bf16 bits -> f32: bf16 is the top half of an f32.
SPARSE_MLA_HELPER float bf16_to_f32(unsigned short bits) {
    return __uint_as_float(((unsigned)bits) << 16);
}

// Two f32 -> two bf16 in one word (round to nearest even), `lo` in the low half.
SPARSE_MLA_HELPER unsigned pack_bf16x2(float lo, float hi) {
    unsigned r;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}

// e4m3 "fn" bits -> f32: no infinities, 0x7f / 0xff are NaN, max 448. sm_89 and later
// convert in hardware (e4m3 -> f16 is exact, as is f16 -> f32); older archs by bits.
SPARSE_MLA_HELPER float e4m3_to_f32(unsigned char bits) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
    unsigned halves;
    asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(halves) : "h"((unsigned short)bits));
    float v;
    asm("cvt.f32.f16 %0, %1;" : "=f"(v) : "h"((unsigned short)(halves & 0xffffu)));
    return v;
#else
    const unsigned b = bits;
    if ((b & 0x7fu) == 0x7fu) {
        return __uint_as_float(0x7fc00000u | ((b & 0x80u) << 24));
    }
    const unsigned e = (b >> 3) & 0xfu;
    const unsigned m = b & 7u;
    // normal: exponent rebias 7 -> 127 and mantissa into place; subnormal: m * 2^-9
    const float mag = e == 0u ? (float)m * (1.0f / 512.0f)
                              : __uint_as_float(((e + 120u) << 23) | (m << 20));
    return (b & 0x80u) ? -mag : mag;
#endif
}
"#;

/// e4m3 tensor-core operands ([`Intrinsic::MmaE4m3`], [`Func::PackE4m3x4`]), printed (after
/// [`PAIR_HELPERS`]) only into the kernels that use them.
const E4M3_OPERAND_HELPERS: &str = r#"// 1 where mma.sync m16n8k32 e4m3 is one instruction (sm_89, sm_120): sm_90's ptxas turns it
// into e4m3 -> f16 conversions and two f16 products, so the kernel takes its bf16 form there.
#if defined(__CUDA_ARCH__) && (__CUDA_ARCH__ == 890 || __CUDA_ARCH__ >= 1200)
#define E4M3_MMA_NATIVE 1
#else
#define E4M3_MMA_NATIVE 0
#endif

// Four f32 -> four e4m3 bytes (a in the low byte): two conversions. Called only where
// E4M3_MMA_NATIVE holds (sm_89, sm_120+); anywhere else it traps.
SPARSE_MLA_HELPER unsigned pack_e4m3x4(float a, float b, float c, float d) {
#if E4M3_MMA_NATIVE
    unsigned short lo, hi;
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(lo) : "f"(b), "f"(a));
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(hi) : "f"(d), "f"(c));
    return (unsigned)lo | ((unsigned)hi << 16);
#else
    (void)a; (void)b; (void)c; (void)d;
    __trap();
    return 0u;
#endif
}

// c[0..4] += a[0..4] . b[0..2]: one m16n8k32 tile, e4m3 in (four per register), f32
// accumulate. Called only where E4M3_MMA_NATIVE holds; anywhere else it traps.
SPARSE_MLA_HELPER void mma_e4m3_16832(float* c, const unsigned* a, const unsigned* b) {
#if E4M3_MMA_NATIVE
    asm("mma.sync.aligned.m16n8k32.row.col.f32.e4m3.e4m3.f32 "
        "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
#else
    (void)c; (void)a; (void)b;
    __trap();
#endif
}
"#;

/// The e4m3 pair conversion ([`crate::kir::ir::Func::E4m3x2Prep`]), printed only into the
/// kernels that call it.
const PAIR_HELPERS: &str = r#"// Two e4m3 values (bits 0..16) converted as a pair: e4m3x2_prep once, then _lo and _hi of
// its result. sm_89 and later convert the pair to two f16 in one instruction (exact, as is
// f16 -> f32); older archs move the bits into f16 places (the values times 2^-8, undone
// after f16 -> f32): a few logic instructions a pair, where decoding each byte took
// branches.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
SPARSE_MLA_HELPER unsigned e4m3x2_prep(unsigned pair) {
    unsigned halves;
    asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(halves) : "h"((unsigned short)pair));
    return halves;
}
SPARSE_MLA_HELPER float e4m3x2_lo(unsigned halves) {
    float v;
    asm("cvt.f32.f16 %0, %1;" : "=f"(v) : "h"((unsigned short)(halves & 0xffffu)));
    return v;
}
SPARSE_MLA_HELPER float e4m3x2_hi(unsigned halves) {
    float v;
    asm("cvt.f32.f16 %0, %1;" : "=f"(v) : "h"((unsigned short)(halves >> 16)));
    return v;
}
#else
SPARSE_MLA_HELPER unsigned e4m3x2_prep(unsigned pair) {
    // s eeee mmm -> s 0 eeee mmm 0000000 (bias 7 read as 15: the value times 2^-8, exact,
    // subnormals included; the NaN codes read as +-480)
    return ((pair & 0x7fu) << 7) | ((pair & 0x80u) << 8) | ((pair & 0x7f00u) << 15)
        | ((pair & 0x8000u) << 16);
}
SPARSE_MLA_HELPER float e4m3x2_lo(unsigned halves) {
    float v;
    asm("cvt.f32.f16 %0, %1;" : "=f"(v) : "h"((unsigned short)(halves & 0xffffu)));
    return v * 256.0f;
}
SPARSE_MLA_HELPER float e4m3x2_hi(unsigned halves) {
    float v;
    asm("cvt.f32.f16 %0, %1;" : "=f"(v) : "h"((unsigned short)(halves >> 16)));
    return v * 256.0f;
}
#endif
"#;

/// f16 values and products ([`Func::PackF16x2`], [`Func::MulF16x2`], [`Func::E4m3x2F16`],
/// [`Intrinsic::MmaF16`], ...), printed only into the kernels that use them.
const F16_HELPERS: &str = r#"// f16 pairs: the operands of fp8_ds_mla's P . V (P in f16, the e4m3 rows as f16 times
// their scales). Every e4m3 value is exact in f16: sm_89 and later convert a pair in one
// instruction; before, its bits are moved into place, which is the value times 2^-8
// (E4M3_F16_UNIT says which).
SPARSE_MLA_HELPER unsigned pack_f16x2(float lo, float hi) {
    unsigned h;
    asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(h) : "f"(hi), "f"(lo));
    return h;
}
SPARSE_MLA_HELPER float f16_lo(unsigned h) {
    float v;
    asm("cvt.f32.f16 %0, %1;" : "=f"(v) : "h"((unsigned short)(h & 0xffffu)));
    return v;
}
SPARSE_MLA_HELPER float f16_hi(unsigned h) {
    float v;
    asm("cvt.f32.f16 %0, %1;" : "=f"(v) : "h"((unsigned short)(h >> 16)));
    return v;
}
SPARSE_MLA_HELPER unsigned mul_f16x2(unsigned a, unsigned b) {
    unsigned r;
    asm("mul.rn.f16x2 %0, %1, %2;" : "=r"(r) : "r"(a), "r"(b));
    return r;
}
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
#define E4M3_F16_UNIT 1.0f
SPARSE_MLA_HELPER unsigned e4m3x2_f16(unsigned pair) {
    unsigned halves;
    asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(halves) : "h"((unsigned short)pair));
    return halves;
}
#else
#define E4M3_F16_UNIT 256.0f
SPARSE_MLA_HELPER unsigned e4m3x2_f16(unsigned pair) {
    // s eeee mmm -> s 0 eeee mmm 0000000 (bias 7 read as 15: the value times 2^-8, exact,
    // subnormals included)
    return ((pair & 0x7fu) << 7) | ((pair & 0x80u) << 8) | ((pair & 0x7f00u) << 15)
        | ((pair & 0x8000u) << 16);
}
#endif
// c[0..4] += a[0..4] . b[0..2]: one m16n8k16 tile, f16 in, f32 accumulate.
SPARSE_MLA_HELPER void mma_f16_16816(float* c, const unsigned* a, const unsigned* b) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
        "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}
"#;

const MMA_HELPERS: &str = r#"// Tensor-core lowering helpers: one PTX instruction each (sm_80 and later; the SM120
// common set: no wgmma, tcgen05 or clusters).

// Generic -> shared-window address, as the PTX shared-memory instructions take it (a
// builtin, not asm, so that constant offsets fold into the instructions' immediates).
SPARSE_MLA_HELPER unsigned smem_addr(const void* p) {
    return (unsigned)__cvta_generic_to_shared(p);
}

// 16-byte async copy global -> shared; when !valid nothing is read and 16 zero bytes land.
SPARSE_MLA_HELPER void cp_async_16(void* dst, const void* src, bool valid) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;"
                 :: "r"(smem_addr(dst)), "l"(src), "r"(valid ? 16 : 0) : "memory");
}

// 4-byte async copy (rows that are not 16-byte aligned), zero-filled when !valid.
SPARSE_MLA_HELPER void cp_async_4(void* dst, const void* src, bool valid) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;"
                 :: "r"(smem_addr(dst)), "l"(src), "r"(valid ? 4 : 0) : "memory");
}

SPARSE_MLA_HELPER void cp_async_commit() {
    asm volatile("cp.async.commit_group;" ::: "memory");
}

// Wait until at most N of this thread's copy groups are in flight.
template <int N>
SPARSE_MLA_HELPER void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;" :: "n"(N) : "memory");
}

// Four / two 8x8 b16 matrices from shared memory; lane l gives the address of row l % 8 of
// matrix l / 8.
SPARSE_MLA_HELPER void ldmatrix_x4(unsigned* r, const void* p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(smem_addr(p)));
}
SPARSE_MLA_HELPER void ldmatrix_x4_trans(unsigned* r, const void* p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(smem_addr(p)));
}
SPARSE_MLA_HELPER void ldmatrix_x2(unsigned* r, const void* p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0, %1}, [%2];"
                 : "=r"(r[0]), "=r"(r[1]) : "r"(smem_addr(p)));
}
SPARSE_MLA_HELPER void ldmatrix_x2_trans(unsigned* r, const void* p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x2.trans.shared.b16 {%0, %1}, [%2];"
                 : "=r"(r[0]), "=r"(r[1]) : "r"(smem_addr(p)));
}
SPARSE_MLA_HELPER void ldmatrix_x1(unsigned* r, const void* p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x1.shared.b16 {%0}, [%1];"
                 : "=r"(r[0]) : "r"(smem_addr(p)));
}
SPARSE_MLA_HELPER void ldmatrix_x1_trans(unsigned* r, const void* p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x1.trans.shared.b16 {%0}, [%1];"
                 : "=r"(r[0]) : "r"(smem_addr(p)));
}

// c[0..4] += a[0..4] . b[0..2]: one m16n8k16 tile, bf16 in, f32 accumulate.
SPARSE_MLA_HELPER void mma_bf16_16816(float* c, const unsigned* a, const unsigned* b) {
    // not volatile: a pure function of its registers, which the compiler may schedule
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
                 "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

// The value of lane (lane ^ mask) of this warp.
SPARSE_MLA_HELPER float shfl_xor_f32(float v, int mask) {
    float r;
    asm volatile("shfl.sync.bfly.b32 %0, %1, %2, 0x1f, 0xffffffff;" : "=f"(r) : "f"(v), "r"(mask));
    return r;
}
"#;

const RING_HELPERS: &str = r#"// Producer/consumer helpers: mbarriers (sm_80 and later), bulk copies with a transaction
// count (sm_90 and later, cp.async before), named barriers.

// A barrier among `threads` threads (whole warps) of the block, id 1..15. Both are immediates
// in the instruction, so every tool that reads the machine code (compute-sanitizer's racecheck
// among them) sees which barrier a thread takes and how many threads it waits for.
template <unsigned ID, unsigned THREADS>
SPARSE_MLA_HELPER void named_barrier_sync() {
    asm volatile("bar.sync %0, %1;" :: "n"(ID), "n"(THREADS) : "memory");
}

SPARSE_MLA_HELPER void mbar_init(void* bar, unsigned count) {
    asm volatile("mbarrier.init.shared.b64 [%0], %1;" :: "r"(smem_addr(bar)), "r"(count) : "memory");
}

// Arrive (release): this thread's earlier shared-memory writes are visible to the waiters.
SPARSE_MLA_HELPER void mbar_arrive(void* bar) {
    unsigned long long state __attribute__((unused)); // the arrival's phase, not needed
    asm volatile("mbarrier.arrive.shared.b64 %0, [%1];" : "=l"(state) : "r"(smem_addr(bar)) : "memory");
}

// Has the phase of this parity completed? (acquire)
SPARSE_MLA_HELPER bool mbar_test(void* bar, unsigned parity) {
    unsigned done;
#if __CUDA_ARCH__ >= 900
    asm volatile("{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2; selp.u32 %0, 1, 0, p; }"
                 : "=r"(done) : "r"(smem_addr(bar)), "r"(parity) : "memory");
#else
    asm volatile("{ .reg .pred p; mbarrier.test_wait.parity.shared.b64 p, [%1], %2; selp.u32 %0, 1, 0, p; }"
                 : "=r"(done) : "r"(smem_addr(bar)), "r"(parity) : "memory");
#endif
    return done != 0;
}

SPARSE_MLA_HELPER void mbar_wait(void* bar, unsigned parity) {
    while (!mbar_test(bar, parity)) {
    }
}

// `bytes` from global to shared memory, completing on `bar` (see copy_arrive). sm_90 and
// later: one bulk copy with a transaction count when both ends and the size are 16-byte
// aligned, else plain loads and stores (made visible by copy_arrive's release); before
// sm_90: cp.async copies of 16 or 4 bytes, which copy_arrive ties to the mbarrier.
SPARSE_MLA_HELPER void copy_async(void* dst, const void* src, unsigned bytes, void* bar) {
    const unsigned align = smem_addr(dst) | (unsigned)(unsigned long long)src;
#if __CUDA_ARCH__ >= 900
    if (((align | bytes) & 15u) == 0) {
        asm volatile("mbarrier.expect_tx.relaxed.cta.shared::cta.b64 [%0], %1;"
                     :: "r"(smem_addr(bar)), "r"(bytes) : "memory");
        asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
                     :: "r"(smem_addr(dst)), "l"(src), "r"(bytes), "r"(smem_addr(bar)) : "memory");
    } else {
        #pragma unroll 1
        for (unsigned o = 0; o < bytes; o += 4) {
            ((unsigned*)dst)[o / 4] = ((const unsigned*)src)[o / 4];
        }
    }
#else
    if (((align | bytes) & 15u) == 0) {
        for (unsigned o = 0; o < bytes; o += 16) {
            cp_async_16((char*)dst + o, (const char*)src + o, true);
        }
    } else {
        #pragma unroll 1
        for (unsigned o = 0; o < bytes; o += 4) {
            cp_async_4((char*)dst + o, (const char*)src + o, true);
        }
    }
    (void)bar;
#endif
}

// One arrival on `bar` once this thread's earlier copies have landed: bulk copies complete
// through their transaction count (sm_90 and later), cp.async through the mbarrier's
// arrive-on (before); the arrival releases this thread's plain shared-memory writes.
SPARSE_MLA_HELPER void copy_arrive(void* bar) {
#if __CUDA_ARCH__ < 900
    asm volatile("cp.async.mbarrier.arrive.shared.b64 [%0];" :: "r"(smem_addr(bar)) : "memory");
#endif
    mbar_arrive(bar);
}

// Generic-proxy shared-memory writes before async-proxy (bulk copy) writes to it.
SPARSE_MLA_HELPER void fence_proxy_async() {
#if __CUDA_ARCH__ >= 900
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
#endif
}
"#;

struct Printer<'k> {
    kernel: &'k Kernel,
}

impl Printer<'_> {
    fn unit(&self, helpers: &str) -> String {
        let mut w = Writer::new(self.kernel);
        let k = self.kernel;
        for l in header(k, "CUDA C", "kernel arguments after the parameter struct") {
            if l.is_empty() {
                w.line("//");
            } else {
                w.line(&format!("// {l}"));
            }
        }
        let dynamic = dynamic_shared_bytes(k);
        if dynamic > 0 {
            w.line(&format!(
                "// Launch: blockDim = ({}, 1, 1), gridDim = workgroup counts above, dynamic shared memory {dynamic} bytes",
                k.workgroup_size
            ));
            w.line("// (set CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES to it first: above the 48 KB default).");
        } else {
            w.line(&format!(
                "// Launch: blockDim = ({}, 1, 1), gridDim = workgroup counts above, dynamic shared memory 0.",
                k.workgroup_size
            ));
        }
        if k.grid_dependency.waits_for_previous {
            w.line("// sm_90 and later: may be launched with CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION (cuLaunchKernelEx):");
            w.line("// it waits for the previous kernel in the stream before touching memory (griddepcontrol.wait).");
        }
        w.line("// Self-contained: compiles with NVRTC and no CUDA headers (sm_80 and later).");
        w.line("");
        w.out.push_str(&params_struct(k));
        w.line("");
        w.out.push_str(helpers);
        w.line("");
        let args = buffer_params(k).join(", ");
        w.line(&format!(
            "extern \"C\" __global__ void __launch_bounds__({}) {}(const {}_params p, {args}) {{",
            if k.min_workgroups > 0 {
                format!("{}, {}", k.workgroup_size, k.min_workgroups)
            } else {
                k.workgroup_size.to_string()
            },
            k.name,
            k.name
        ));
        w.indent += 1;
        if dynamic > 0 {
            w.line("extern __shared__ __align__(16) unsigned char dyn_smem[];");
            let (offsets, _) = crate::kir::shared_plan::shared_layout(&k.shared);
            for (s, off) in k.shared.iter().zip(offsets) {
                let t = c_ty(s.ty);
                let l = format!(
                    "{t}* const {} = ({t}*)(dyn_smem + {off}); // [{}]",
                    s.name, s.len
                );
                w.line(&l);
            }
        } else {
            for s in &k.shared {
                let l = match &s.alias {
                    Some((parent, off)) => format!(
                        "{t}* const {} = ({t}*)((unsigned char*){parent} + {off}); // [{}]",
                        s.name,
                        s.len,
                        t = c_ty(s.ty)
                    ),
                    None => format!(
                        "__shared__ __align__(16) {} {}[{}];",
                        c_ty(s.ty),
                        s.name,
                        s.len
                    ),
                };
                w.line(&l);
            }
        }
        for pv in &k.privates {
            let l = format!("{} {}[{}];", c_ty(pv.ty), pv.name, pv.len);
            w.line(&l);
        }
        if k.grid_dependency.waits_for_previous {
            w.line("grid_wait_previous(); // before any read or write of global memory");
        }
        if k.grid_dependency.early_dependents {
            w.line("grid_launch_dependents(); // the next kernel may launch now (it waits for this one)");
        }
        for s in &k.body {
            w.stmt(self, s);
        }
        w.indent -= 1;
        w.line("}");
        without_unused_arrays(w.out, k)
    }

    fn intrinsic_line(&self, i: &Intrinsic) -> String {
        match i {
            Intrinsic::CpAsync {
                bytes,
                dst,
                dst_word,
                src,
                src_word,
                valid,
            } => format!(
                "cp_async_{bytes}({dst}{}, (const unsigned*){src}{}, {});",
                self.pointer_terms(dst_word),
                self.pointer_terms(src_word),
                self.expr(valid)
            ),
            Intrinsic::CpAsyncCommit => "cp_async_commit();".into(),
            Intrinsic::CpAsyncWait { pending } => format!("cp_async_wait<{pending}>();"),
            Intrinsic::LdMatrix {
                count,
                trans,
                arr,
                word,
                dst,
                dst0,
            } => format!(
                "ldmatrix_x{count}{}(&{dst}[{}], {arr}{});",
                if *trans { "_trans" } else { "" },
                self.expr(dst0),
                self.pointer_terms(word)
            ),
            Intrinsic::MmaBf16 {
                c,
                c0,
                a,
                a0,
                b,
                b0,
            } => format!(
                "mma_bf16_16816(&{c}[{}], &{a}[{}], &{b}[{}]);",
                self.expr(c0),
                self.expr(a0),
                self.expr(b0)
            ),
            Intrinsic::MmaE4m3 {
                c,
                c0,
                a,
                a0,
                b,
                b0,
            } => format!(
                "mma_e4m3_16832(&{c}[{}], &{a}[{}], &{b}[{}]);",
                self.expr(c0),
                self.expr(a0),
                self.expr(b0)
            ),
            Intrinsic::MmaF16 {
                c,
                c0,
                a,
                a0,
                b,
                b0,
            } => format!(
                "mma_f16_16816(&{c}[{}], &{a}[{}], &{b}[{}]);",
                self.expr(c0),
                self.expr(a0),
                self.expr(b0)
            ),
            Intrinsic::ShflXor {
                dst,
                value,
                lane_mask,
            } => format!(
                "const float {dst} = shfl_xor_f32({}, {lane_mask});",
                self.expr(value)
            ),
            Intrinsic::VoteAny { dst, pred } => format!(
                "const bool {dst} = __any_sync(0xffffffffu, {});",
                self.expr(pred)
            ),
            Intrinsic::NamedBarrier { id, threads } => {
                format!("named_barrier_sync<{id}u, {threads}u>();")
            }
            Intrinsic::SyncWarp => "__syncwarp();".into(),
            Intrinsic::MbarInit { bars, index, count } => format!(
                "mbar_init({bars}{}, {count});",
                self.pointer_terms(&mbar_word(index))
            ),
            Intrinsic::MbarArrive { bars, index } => {
                format!(
                    "mbar_arrive({bars}{});",
                    self.pointer_terms(&mbar_word(index))
                )
            }
            Intrinsic::MbarWait {
                bars,
                index,
                parity,
            } => format!(
                "mbar_wait({bars}{}, {});",
                self.pointer_terms(&mbar_word(index)),
                self.expr(parity)
            ),
            Intrinsic::CopyAsync {
                bytes,
                dst,
                dst_word,
                src,
                src_word,
                bars,
                index,
            } => format!(
                "copy_async({dst}{}, (const unsigned*){src}{}, {bytes}u, {bars}{});",
                self.pointer_terms(dst_word),
                self.pointer_terms(src_word),
                self.pointer_terms(&mbar_word(index))
            ),
            Intrinsic::CopyArrive { bars, index } => {
                format!(
                    "copy_arrive({bars}{});",
                    self.pointer_terms(&mbar_word(index))
                )
            }
            Intrinsic::FenceProxyAsync => "fence_proxy_async();".into(),
            Intrinsic::PrefetchL2 { buf, word, bytes } => format!(
                "prefetch_l2((const unsigned*){buf}{}, {bytes}u);",
                self.pointer_terms(word)
            ),
            Intrinsic::StoreF32x2 { buf, index, v0, v1 } => format!(
                "store_f32x2({buf}{}, {}, {});",
                self.pointer_terms(index),
                self.expr(v0),
                self.expr(v1)
            ),
            Intrinsic::GroupSync {
                counters,
                group,
                count,
            } => format!(
                "group_sync({counters} + 2u * ({}), {});",
                self.expr(group),
                self.expr(count)
            ),
        }
    }

    /// ` + (a) + (b)...` for the terms of an index (see [`index_terms`]): added to a pointer
    /// one by one, so that 32-bit wrap-around of the sum does not stop the compiler from
    /// folding constant terms into the instruction's immediate offset.
    fn pointer_terms(&self, index: &Expr) -> String {
        self.terms_text(&index_terms(index, self.kernel.index_terms))
    }

    fn terms_text(&self, terms: &[Expr]) -> String {
        terms
            .iter()
            .map(|e| format!(" + {}", self.operand(e)))
            .collect()
    }

    /// Element `index` of shared array `arr`: where the kernel asks for it
    /// ([`Kernel::index_terms`]) and the index has several terms, `*(arr + t0 + t1 ...)`,
    /// each term added to the pointer on its own; else `arr[index]`.
    fn shared_ref(&self, arr: &str, index: &Expr) -> String {
        if self.kernel.index_terms {
            let terms = index_terms(index, true);
            if terms.len() > 1 {
                return format!("*({arr}{})", self.terms_text(&terms));
            }
        }
        format!("{arr}[{}]", self.expr(index))
    }

    fn operand(&self, e: &Expr) -> String {
        let s = self.expr(e);
        match e {
            // min / max print as calls: no parentheses needed
            Expr::Bin(BinOp::Min | BinOp::Max, ..) => s,
            Expr::Bin(..) | Expr::Un(..) | Expr::Select(..) => format!("({s})"),
            Expr::F32(v) if *v < 0.0 => format!("({s})"),
            Expr::I32(v) if *v < 0 => format!("({s})"),
            _ => s,
        }
    }

    fn expr(&self, e: &Expr) -> String {
        match e {
            Expr::F32(v) => match special_f32(*v) {
                Some(bits) => format!("__uint_as_float({bits:#010x}u)"),
                None => format!("{}f", f32_literal(*v)),
            },
            Expr::I32(v) => {
                if *v == i32::MIN {
                    "(-2147483647 - 1)".into()
                } else {
                    v.to_string()
                }
            }
            Expr::U32(v) => format!("{v}u"),
            Expr::Bool(v) => v.to_string(),
            Expr::Var(n, _) => n.clone(),
            Expr::Param(n, _) => format!("p.{n}"),
            Expr::Builtin(b) => match b {
                Builtin::LocalId => "threadIdx.x".into(),
                Builtin::WorkgroupId(a) => format!("blockIdx.{}", axis(*a)),
                Builtin::NumWorkgroups(a) => format!("gridDim.{}", axis(*a)),
            },
            Expr::Un(op, a) => {
                let a = self.operand(a);
                match op {
                    UnOp::Neg => format!("-{a}"),
                    UnOp::Not => format!("!{a}"),
                    UnOp::BitNot => format!("~{a}"),
                }
            }
            Expr::Bin(op, a, b) => {
                let (x, y) = (self.operand(a), self.operand(b));
                let sym = match op {
                    BinOp::Min | BinOp::Max => {
                        let f = match (op, a.ty()) {
                            (BinOp::Min, Ty::F32) => "fminf",
                            (BinOp::Max, Ty::F32) => "fmaxf",
                            (BinOp::Min, Ty::I32) => "min_i32",
                            (BinOp::Max, Ty::I32) => "max_i32",
                            (BinOp::Min, _) => "min_u32",
                            _ => "max_u32",
                        };
                        return format!("{f}({}, {})", self.expr(a), self.expr(b));
                    }
                    BinOp::Add => "+",
                    BinOp::Sub => "-",
                    BinOp::Mul => "*",
                    BinOp::Div => "/",
                    BinOp::Rem => "%",
                    BinOp::Lt => "<",
                    BinOp::Le => "<=",
                    BinOp::Gt => ">",
                    BinOp::Ge => ">=",
                    BinOp::Eq => "==",
                    BinOp::Ne => "!=",
                    BinOp::And => "&&",
                    BinOp::Or => "||",
                    BinOp::BitAnd => "&",
                    BinOp::BitOr => "|",
                    BinOp::BitXor => "^",
                    BinOp::Shl => "<<",
                    BinOp::Shr => ">>",
                };
                format!("{x} {sym} {y}")
            }
            Expr::Select(c, a, b) => format!(
                "{} ? {} : {}",
                self.operand(c),
                self.operand(a),
                self.operand(b)
            ),
            Expr::Cvt(t, a) => {
                let from = a.ty();
                let x = self.expr(a);
                match (from, t) {
                    (Ty::Bf16, Ty::F32) => format!("bf16_to_f32({x})"),
                    (Ty::F8E4M3, Ty::F32) => format!("e4m3_to_f32({x})"),
                    (f, t) if f == *t => x,
                    (_, t) => format!("(({}){})", c_ty(*t), self.operand(a)),
                }
            }
            Expr::Call(func, args) => {
                let a: Vec<String> = args.iter().map(|x| self.expr(x)).collect();
                match func {
                    Func::Exp => format!("expf({})", a[0]),
                    Func::ExpFast => format!("exp_fast({})", a[0]),
                    Func::Exp2Fast => format!("exp2_fast({})", a[0]),
                    Func::Log => format!("logf({})", a[0]),
                    Func::Sqrt => format!("sqrtf({})", a[0]),
                    Func::Abs => format!("fabsf({})", a[0]),
                    Func::Fma => format!("fmaf({}, {}, {})", a[0], a[1], a[2]),
                    Func::PackBf16x2 => format!("pack_bf16x2({}, {})", a[0], a[1]),
                    Func::F32Bits => format!("__float_as_uint({})", a[0]),
                    Func::F32FromBits => format!("__uint_as_float({})", a[0]),
                    Func::Clz => format!("((unsigned)__clz((int)({})))", a[0]),
                    Func::E4m3x2Prep => format!("e4m3x2_prep({})", a[0]),
                    Func::E4m3x2Lo => format!("e4m3x2_lo({})", a[0]),
                    Func::E4m3x2Hi => format!("e4m3x2_hi({})", a[0]),
                    Func::PackE4m3x4 => format!("pack_e4m3x4({})", a.join(", ")),
                    Func::E4m3MmaNative => "E4M3_MMA_NATIVE".to_string(),
                    Func::PackF16x2 => format!("pack_f16x2({}, {})", a[0], a[1]),
                    Func::F16Lo => format!("f16_lo({})", a[0]),
                    Func::F16Hi => format!("f16_hi({})", a[0]),
                    Func::MulF16x2 => format!("mul_f16x2({}, {})", a[0], a[1]),
                    Func::E4m3x2F16 => format!("e4m3x2_f16({})", a[0]),
                    Func::E4m3F16Unit => "E4M3_F16_UNIT".to_string(),
                }
            }
            Expr::Load { buf, elem, index } => {
                let i = self.expr(index);
                match elem {
                    Elem::U8 => format!("((unsigned){buf}[{i}])"),
                    _ => format!("{buf}[{i}]"),
                }
            }
            Expr::LoadWord { buf, index } => {
                format!("((const unsigned*){buf})[{}]", self.expr(index))
            }
            Expr::SharedLoad { arr, index, .. } => self.shared_ref(arr, index),
            Expr::PrivateLoad { arr, index, .. } => {
                format!("{arr}[{}]", self.expr(index))
            }
            Expr::TileLoad { tile, .. } => format!("/* unlowered tile load {tile} */ 0.0f"),
            Expr::TileWord { tile, .. } => format!("/* unlowered tile word {tile} */ 0u"),
        }
    }
}

impl Dialect for Printer<'_> {
    fn expr(&self, e: &Expr) -> String {
        Printer::expr(self, e)
    }
    fn shared_elem(&self, arr: &str, index: &Expr) -> String {
        self.shared_ref(arr, index)
    }

    fn decl(&self, name: &str, value: &Expr, mutable: bool) -> String {
        let konst = if mutable { "" } else { "const " };
        format!("{konst}{} {name} = {};", c_ty(value.ty()), self.expr(value))
    }

    fn store_word(&self, buf: &str, index: &Expr, value: &Expr) -> String {
        format!(
            "((unsigned*){buf})[{}] = {};",
            self.expr(index),
            self.expr(value)
        )
    }

    fn for_head(
        &self,
        var: &str,
        start: &Expr,
        end: &Expr,
        step: &Expr,
        body: &[Stmt],
    ) -> Vec<String> {
        let mut lines = Vec::new();
        // Small constant trip counts are unrolled so private arrays stay in registers;
        // other small loops by 4, so that the loads of 4 iterations are in flight
        // together (e.g. the combine's walk over the splits).
        let constant = match (start, end, step) {
            (Expr::U32(a), Expr::U32(b), Expr::U32(c)) => {
                Some(*c > 0 && b.saturating_sub(*a).div_ceil(*c) <= 64)
            }
            _ => None,
        };
        match constant {
            Some(true) => lines.push("#pragma unroll".to_string()),
            None if body.iter().all(straight_line) => lines.push("#pragma unroll 4".to_string()),
            _ => {}
        }
        lines.push(format!(
            "for ({} {var} = {}; {var} < {}; {var} += {}) {{",
            c_ty(start.ty()),
            self.expr(start),
            self.expr(end),
            self.expr(step)
        ));
        lines
    }

    fn barrier(&self) -> &'static str {
        "__syncthreads();"
    }

    fn intrinsic(&self, i: &Intrinsic) -> String {
        self.intrinsic_line(i)
    }
}

/// Word of mbarrier `index` (two words each) in its array.
fn mbar_word(index: &Expr) -> Expr {
    match index {
        Expr::U32(i) => Expr::U32(2 * i),
        other => Expr::Bin(BinOp::Mul, Box::new(other.clone()), Box::new(Expr::U32(2))),
    }
}

/// A statement with no loop, barrier or intrinsic in it (cheap to unroll).
fn straight_line(s: &Stmt) -> bool {
    match s {
        Stmt::For { .. } | Stmt::Barrier | Stmt::Intrinsic(_) | Stmt::Tile(_) => false,
        Stmt::If { then, els, .. } => {
            then.iter().all(straight_line) && els.iter().all(straight_line)
        }
        _ => true,
    }
}

fn axis(a: u8) -> &'static str {
    match a {
        0 => "x",
        1 => "y",
        _ => "z",
    }
}

/// `body` without the `let`s whose names nothing in their scope (the rest of their block)
/// reads, repeatedly (a dropped one may have been the only reader of another). Lowerings
/// leave such lets behind (an index a later fold made unnecessary), and CUDA compilers warn
/// about each; their values have no side effects.
fn without_dead_lets(body: &[Stmt]) -> Vec<Stmt> {
    fn reads(s: &Stmt, into: &mut HashSet<String>) {
        free_reads(std::slice::from_ref(s), into);
    }
    fn prune(block: Vec<Stmt>, dropped: &mut usize) -> Vec<Stmt> {
        let block: Vec<Stmt> = block
            .into_iter()
            .map(|s| s.map_blocks(&mut |b| prune(b, dropped)))
            .collect();
        // backwards: the names read by the statements kept after this one
        let mut later = HashSet::new();
        let mut kept = Vec::with_capacity(block.len());
        for s in block.into_iter().rev() {
            if let Stmt::Let { name, .. } = &s {
                if !later.contains(name) {
                    *dropped += 1;
                    continue;
                }
            }
            reads(&s, &mut later);
            kept.push(s);
        }
        kept.reverse();
        kept
    }
    let mut body = body.to_vec();
    loop {
        let mut dropped = 0;
        body = prune(body, &mut dropped);
        if dropped == 0 {
            return body;
        }
    }
}

/// `unit` without the declarations of the kernel's shared and private arrays that its code
/// never names (a lowering may keep state in registers that its description declared in
/// shared memory): CUDA compilers warn about each. The shared layout is unchanged.
fn without_unused_arrays(unit: String, k: &Kernel) -> String {
    let names: Vec<&str> = k
        .shared
        .iter()
        .map(|s| s.name.as_str())
        .chain(k.privates.iter().map(|p| p.name.as_str()))
        .collect();
    let is_ident = |c: char| c.is_ascii_alphanumeric() || c == '_';
    // occurrences of `name` as a whole identifier
    let uses = |text: &str, name: &str| {
        text.match_indices(name)
            .filter(|(at, _)| {
                let before = text[..*at].chars().next_back();
                let after = text[at + name.len()..].chars().next();
                !before.is_some_and(is_ident) && !after.is_some_and(is_ident)
            })
            .count()
    };
    let mut lines: Vec<&str> = unit.lines().collect();
    for name in names {
        let decl = lines.iter().position(|l| {
            let t = l.trim_start();
            uses(t, name) > 0
                && (t.starts_with("__shared__") || t.contains(&format!("* const {name} = (")) || {
                    // a private array: `<type> name[len];`
                    t.ends_with("];") && t.contains(&format!(" {name}["))
                })
        });
        if let Some(at) = decl {
            let elsewhere: usize = lines
                .iter()
                .enumerate()
                .filter(|(i, _)| *i != at)
                .map(|(_, l)| uses(l, name))
                .sum();
            if elsewhere == 0 {
                lines.remove(at);
            }
        }
    }
    let mut out = lines.join("\n");
    out.push('\n');
    out
}

/// The u32 terms of an element index (of a shared array, or of a buffer an intrinsic takes
/// a pointer into), each added to the pointer on its own: a sum's terms, and with
/// `distribute` (the kernel's [`Kernel::index_terms`]) a sum times a constant, `(a + b) * k`,
/// as `a * k` and `b * k`. Each pointer addition widens its own term to 64 bits, so constant
/// terms become the instruction's immediate offset and the terms that do not change in a
/// loop are added once; `p + (a + c) * k` instead makes the compiler form the 32-bit index
/// and widen it at every access, since it cannot assume the 32-bit sum does not wrap (ncu on
/// the H200: address arithmetic was about a tenth of the 32-head kernel's instructions, in
/// the chains before its `ldmatrix`). Whenever the original index does not wrap — every
/// index of an access that is in bounds — the address is the same. 1.02–1.10× on the
/// 32-head kernels (benches/NOTES.md, v29).
fn index_terms(index: &Expr, distribute: bool) -> Vec<Expr> {
    fn terms(e: &Expr, k: u32, distribute: bool, out: &mut Vec<Expr>) {
        match e {
            Expr::Bin(BinOp::Add, a, b) if e.ty() == Ty::U32 => {
                terms(a, k, distribute, out);
                terms(b, k, distribute, out);
            }
            Expr::Bin(BinOp::Mul, a, b) if distribute && e.ty() == Ty::U32 => match (&**a, &**b) {
                (x, Expr::U32(c)) | (Expr::U32(c), x)
                    if matches!(x, Expr::Bin(BinOp::Add, ..)) && k.checked_mul(*c).is_some() =>
                {
                    terms(x, k * c, distribute, out)
                }
                _ => out.push(scaled(e, k)),
            },
            other => out.push(scaled(other, k)),
        }
    }
    fn scaled(e: &Expr, k: u32) -> Expr {
        match (e, k) {
            (_, 1) => e.clone(),
            (Expr::U32(v), _) => Expr::U32(v.wrapping_mul(k)),
            _ => Expr::Bin(BinOp::Mul, Box::new(e.clone()), Box::new(Expr::U32(k))),
        }
    }
    let mut out = Vec::new();
    terms(index, 1, distribute, &mut out);
    out
}
