// Host emulator of the CUDA C that sparse-mla emits: enough of CUDA to run one kernel on the
// CPU, each GPU thread a fiber. The emitted helpers run as printed: tests/emu/ptx.rs
// translates every inline-PTX statement into a call of the `ptx::` function of the same
// instruction, with the operands in the order the asm string gives them, so a wrong operand
// order in an emitted helper is a wrong answer here.
//
// This header is what a kernel's translation unit includes before the emitted CUDA C (as a
// precompiled header): the CUDA names, the instrumented shared arrays, the pure PTX
// instructions (conversions, selects) inline, and declarations of the rest. The emulator
// itself — scheduler, race detector, the instructions that touch its state — is
// runtime.cpp, compiled once per process into the shared library every kernel links
// against, so that a kernel compiles in a fraction of the time the whole emulator takes.
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>

struct emu_dim3 {
    unsigned x, y, z;
};

namespace emu {

constexpr unsigned SMEM_BYTES = 1u << 18;
constexpr unsigned SMEM_WORDS = SMEM_BYTES / 4;

// The emulator's state is per OS thread (launches on different threads run at once; a
// block's fibers all run on the thread that launched it), reached through a few pointers in
// the initial-exec TLS model: one %fs-relative load each (a few bytes of the static TLS the
// loader keeps for dlopen'd libraries).
#define EMU_TLS __thread __attribute__((tls_model("initial-exec")))
// shared memory of the running block (16-byte aligned)
extern EMU_TLS unsigned char* smem;
// threadIdx of the running fiber
extern EMU_TLS emu_dim3* cur_idx;

// the race detector's view of a shared access
void sh_read(const void* p, unsigned bytes);
void sh_write(const void* p, unsigned bytes);
unsigned shared_offset(const void* p);
void bar_sync(unsigned id, unsigned n);
void syncwarp();
// a dynamic shared array's name, for error messages
void name_shared(const char* name, unsigned off);
// a static __shared__ array's offset: the first thread to reach the declaration places it
unsigned place_static(const char* name, unsigned bytes);
// run `fn(ctx)` as a grid of blocks of `threads` threads (cooperative: all blocks at once,
// each on an OS thread); the number of errors found
unsigned launch(emu_dim3 grid, unsigned threads, void (*fn)(void*), void* ctx, bool land_at_issue,
                unsigned long long seed, bool cooperative);
// the first errors of the last launch, one a line
const char* errors();

// ---- instrumented shared arrays
template <class T>
struct Ref {
    T* p;
    operator T() const {
        sh_read(p, sizeof(T));
        return *p;
    }
    Ref& operator=(T v) {
        sh_write(p, sizeof(T));
        *p = v;
        return *this;
    }
    Ref& operator=(const Ref& o) {
        T v = o;
        return *this = v;
    }
};

template <class T>
struct Sh {
    T* p;
    Ref<T> operator[](long long i) const { return Ref<T>{p + i}; }
    Ref<T> operator*() const { return Ref<T>{p}; }
    Sh operator+(long long o) const { return Sh{p + o}; }
    template <class U>
    operator U*() const {
        return (U*)p;
    }
};

template <class T>
inline Sh<T> shared_dyn(const char* name, unsigned off, unsigned len) {
    name_shared(name, off);
    (void)len;
    return Sh<T>{(T*)(smem + off)};
}
template <class T>
inline Sh<T> shared_static(const char* name, unsigned len) {
    return Sh<T>{(T*)(smem + place_static(name, len * (unsigned)sizeof(T)))};
}

}  // namespace emu

extern EMU_TLS emu_dim3 blockIdx, gridDim, blockDim;
#define threadIdx (*emu::cur_idx)

#define __global__
#define __device__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __align__(n) __attribute__((aligned(n)))

static inline void __syncthreads() { emu::bar_sync(0, blockDim.x); }
static inline void __syncwarp() { emu::syncwarp(); }
// a device trap: the emulated kernel reached code its arch must not run
static inline void __trap() { fprintf(stderr, "emu: __trap()\n"); abort(); }
static inline float __uint_as_float(unsigned u) {
    float f;
    memcpy(&f, &u, 4);
    return f;
}
static inline int __clz(int x) { return x == 0 ? 32 : __builtin_clz((unsigned)x); }
static inline unsigned __float_as_uint(float f) {
    unsigned u;
    memcpy(&u, &f, 4);
    return u;
}
static inline size_t __cvta_generic_to_shared(const void* p) { return emu::shared_offset(p); }

// ---- the PTX instructions the emitted helpers use (names: the mnemonic, '.' -> '_', '::' -> '__')
namespace ptx {

struct Mem {
    unsigned long long a;
};

inline float bf16_lo(unsigned w) { return __uint_as_float(w << 16); }
inline float bf16_hi(unsigned w) { return __uint_as_float(w & 0xffff0000u); }

inline unsigned f32_to_bf16(float x) {
    unsigned u = __float_as_uint(x);
    if ((u & 0x7fffffffu) > 0x7f800000u) return ((u >> 16) | 0x40u) & 0xffffu;  // NaN stays NaN
    u += 0x7fffu + ((u >> 16) & 1u);  // round to nearest even
    return u >> 16;
}

// d = {bf16(a) upper half, bf16(b) lower half}
inline void cvt_rn_bf16x2_f32(unsigned& d, float a, float b) { d = f32_to_bf16(b) | (f32_to_bf16(a) << 16); }

inline float e4m3_value(unsigned b) {
    b &= 0xffu;
    if ((b & 0x7fu) == 0x7fu) return __uint_as_float(0x7fc00000u | ((b & 0x80u) << 24));
    const unsigned e = (b >> 3) & 0xfu, m = b & 7u;
    const float mag = e == 0u ? (float)m * (1.0f / 512.0f) : __uint_as_float(((e + 120u) << 23) | (m << 20));
    return (b & 0x80u) ? -mag : mag;
}
// f32 -> f16 bits, round to nearest even (subnormals too; past f16's range: infinity)
inline unsigned f32_to_f16(float f) {
    unsigned u = __float_as_uint(f);
    unsigned sign = (u >> 16) & 0x8000u;
    if ((u & 0x7fffffffu) > 0x7f800000u) return sign | 0x7e00u;
    int e = (int)((u >> 23) & 0xff) - 127 + 15;
    unsigned m = u & 0x7fffffu;
    if ((u & 0x7fffffffu) == 0) return sign;
    if (e >= 31) return sign | 0x7c00u;
    if (e <= 0) {
        if (e < -10) return sign;
        m |= 0x800000u;
        unsigned shift = (unsigned)(14 - e);
        unsigned r = m >> shift, rem = m & ((1u << shift) - 1), half = 1u << (shift - 1);
        if (rem > half || (rem == half && (r & 1))) r++;
        return sign | r;
    }
    unsigned r = ((unsigned)e << 10) | (m >> 13), rem = m & 0x1fffu;
    if (rem > 0x1000u || (rem == 0x1000u && (r & 1))) r++;
    return sign | r;
}
inline float f16_to_f32(unsigned h) {
    unsigned sign = (h & 0x8000u) << 16, e = (h >> 10) & 0x1f, m = h & 0x3ff;
    if (e == 31) return __uint_as_float(sign | 0x7f800000u | (m << 13));
    if (e == 0) {
        float v = (float)m * (1.0f / 16777216.0f);
        return sign ? -v : v;
    }
    return __uint_as_float(sign | ((e + 112) << 23) | (m << 13));
}
// two e4m3 (upper byte -> upper half) to two f16
inline void cvt_rn_f16x2_e4m3x2(unsigned& d, unsigned short a) {
    d = f32_to_f16(e4m3_value(a & 0xff)) | (f32_to_f16(e4m3_value(a >> 8)) << 16);
}
inline void cvt_f32_f16(float& d, unsigned short a) { d = f16_to_f32(a); }
// d = 2^a, to the float nearest (the hardware's is within about 2^-22 of it); subnormal
// inputs and results flushed to zero, as .ftz does
inline void ex2_approx_ftz_f32(float& d, float a) {
    if (std::fpclassify(a) == FP_SUBNORMAL) a = 0.0f;
    d = std::exp2(a);
    if (std::fpclassify(d) == FP_SUBNORMAL) d = std::signbit(d) ? -0.0f : 0.0f;
}
// d = {f16(a) upper half, f16(b) lower half}
inline void cvt_rn_f16x2_f32(unsigned& d, float a, float b) { d = f32_to_f16(b) | (f32_to_f16(a) << 16); }
// d = a * b per f16 half, round to nearest even (the f32 product of two f16 is exact)
inline void mul_rn_f16x2(unsigned& d, unsigned a, unsigned b) {
    d = f32_to_f16(f16_to_f32(a & 0xffffu) * f16_to_f32(b & 0xffffu)) |
        (f32_to_f16(f16_to_f32(a >> 16) * f16_to_f32(b >> 16)) << 16);
}
// f32 -> e4m3 "fn" by search (runtime.cpp)
unsigned f32_to_e4m3_ref(float f);
// d = {e4m3(a) upper byte, e4m3(b) lower byte}
inline void cvt_rn_satfinite_e4m3x2_f32(unsigned short& d, float a, float b) {
    d = (unsigned short)(f32_to_e4m3_ref(b) | (f32_to_e4m3_ref(a) << 8));
}

// d = {a.hi * b.hi + c.hi, a.lo * b.lo + c.lo} in bf16, round to nearest even
inline void fma_rn_bf16x2(unsigned& d, unsigned a, unsigned b, unsigned c) {
    float lo = (float)((double)bf16_lo(a) * (double)bf16_lo(b) + (double)bf16_lo(c));
    float hi = (float)((double)bf16_hi(a) * (double)bf16_hi(b) + (double)bf16_hi(c));
    d = f32_to_bf16(lo) | (f32_to_bf16(hi) << 16);
}

// byte permute: bytes 0-3 of a, 4-7 of b; selector nibble i picks byte i of d
inline void prmt_b32(unsigned& d, unsigned a, unsigned b, unsigned c) {
    unsigned long long x = (unsigned long long)a | ((unsigned long long)b << 32);
    unsigned r = 0;
    for (int i = 0; i < 4; i++) {
        unsigned s = (c >> (4 * i)) & 7u;
        r |= (unsigned)((x >> (8 * s)) & 0xff) << (8 * i);
    }
    d = r;
}

inline void selp_u32(unsigned& d, unsigned a, unsigned b, bool p) { d = p ? a : b; }
inline void selp_b32(unsigned& d, unsigned a, unsigned b, bool p) { d = p ? a : b; }

inline unsigned char* gptr(unsigned long long a) { return (unsigned char*)(uintptr_t)a; }

// ---- cp.async (16 / 4 bytes, zero-fill past src-size)
void cp_async_cg_shared_global(Mem dst, Mem src, unsigned cp, unsigned src_size);
void cp_async_ca_shared_global(Mem dst, Mem src, unsigned cp, unsigned src_size);
void cp_async_commit_group();
void cp_async_wait_group(unsigned n);
void cp_async_wait_all();

// ---- ldmatrix: lane l gives the address of row l % 8 of matrix l / 8
void ldmatrix_sync_aligned_m8n8_x4_shared_b16(unsigned& a, unsigned& b, unsigned& c, unsigned& d, Mem m);
void ldmatrix_sync_aligned_m8n8_x4_trans_shared_b16(unsigned& a, unsigned& b, unsigned& c, unsigned& d, Mem m);
void ldmatrix_sync_aligned_m8n8_x2_shared_b16(unsigned& a, unsigned& b, Mem m);
void ldmatrix_sync_aligned_m8n8_x2_trans_shared_b16(unsigned& a, unsigned& b, Mem m);
void ldmatrix_sync_aligned_m8n8_x1_shared_b16(unsigned& a, Mem m);
void ldmatrix_sync_aligned_m8n8_x1_trans_shared_b16(unsigned& a, Mem m);

// ---- mma.sync
void mma_sync_aligned_m16n8k16_row_col_f32_bf16_bf16_f32(float& d0, float& d1, float& d2, float& d3, unsigned a0,
                                                        unsigned a1, unsigned a2, unsigned a3, unsigned b0, unsigned b1,
                                                        float c0, float c1, float c2, float c3);
void mma_sync_aligned_m16n8k16_row_col_f32_f16_f16_f32(float& d0, float& d1, float& d2, float& d3, unsigned a0,
                                                      unsigned a1, unsigned a2, unsigned a3, unsigned b0, unsigned b1,
                                                      float c0, float c1, float c2, float c3);
void mma_sync_aligned_m16n8k32_row_col_f32_e4m3_e4m3_f32(float& d0, float& d1, float& d2, float& d3, unsigned a0,
                                                        unsigned a1, unsigned a2, unsigned a3, unsigned b0, unsigned b1,
                                                        float c0, float c1, float c2, float c3);

// ---- shfl.sync.bfly: d = a of lane (lane ^ b)
void shfl_sync_bfly_b32(float& d, float a, unsigned b, unsigned c, unsigned mask);
void shfl_sync_bfly_b32(unsigned& d, unsigned a, unsigned b, unsigned c, unsigned mask);

// ---- named barriers
inline void bar_sync(unsigned id, unsigned n) { emu::bar_sync(id, n); }
inline void barrier_sync(unsigned id, unsigned n) { emu::bar_sync(id, n); }

// ---- mbarrier
void mbarrier_init_shared_b64(Mem m, unsigned count);
void mbarrier_init_shared__cta_b64(Mem m, unsigned count);
void mbarrier_arrive_shared_b64(unsigned long long& state, Mem m);
void mbarrier_arrive_shared__cta_b64(unsigned long long& state, Mem m);
void mbarrier_expect_tx_shared__cta_b64(Mem m, unsigned tx);
void mbarrier_expect_tx_relaxed_cta_shared__cta_b64(Mem m, unsigned tx);
void mbarrier_arrive_expect_tx_shared__cta_b64(unsigned long long& state, Mem m, unsigned tx);
void cp_async_mbarrier_arrive_shared_b64(Mem m);
void cp_async_mbarrier_arrive_shared__cta_b64(Mem m);
void mbarrier_try_wait_parity_shared__cta_b64(bool& p, Mem m, unsigned parity);
void mbarrier_try_wait_parity_shared_b64(bool& p, Mem m, unsigned parity);
void mbarrier_test_wait_parity_shared_b64(bool& p, Mem m, unsigned parity);
void mbarrier_test_wait_parity_shared__cta_b64(bool& p, Mem m, unsigned parity);

// ---- cp.async.bulk global -> shared, completing `size` bytes of tx on an mbarrier
void cp_async_bulk_shared__cluster_global_mbarrier__complete_tx__bytes(Mem dst, Mem src, unsigned size, Mem bar);
void cp_async_bulk_shared__cta_global_mbarrier__complete_tx__bytes(Mem dst, Mem src, unsigned size, Mem bar);

// an L2 prefetch changes no value: the byte is read (so an address outside the host's memory
// faults here) and nothing else happens
inline void prefetch_global_L2(Mem m) {
    volatile unsigned char b = *gptr(m.a);
    (void)b;
}


// proxy fences: recorded for the bulk copies' proxy check (runtime.cpp)
void fence_proxy_async_shared__cta();
void fence_mbarrier_init_release_cluster();

// programmatic dependent launch: grids run one after another here, so nothing to wait for
inline void griddepcontrol_wait() {}
inline void griddepcontrol_launch_dependents() {}

// ---- global memory fences and atomics. Blocks run one after another, except in a
// cooperative launch (each block on its own OS thread, runtime.cpp): these are real atomics
// and fences, so the group meeting of group_sync works across those threads.
inline void fence_acq_rel_gpu() { __atomic_thread_fence(__ATOMIC_SEQ_CST); }
inline void membar_gl() { __atomic_thread_fence(__ATOMIC_SEQ_CST); }
inline void atom_global_add_u32(unsigned& d, Mem m, unsigned v) {
    d = __atomic_fetch_add((unsigned*)gptr(m.a), v, __ATOMIC_RELAXED);
}
inline void atom_relaxed_gpu_global_add_u32(unsigned& d, Mem m, unsigned v) {
    d = __atomic_fetch_add((unsigned*)gptr(m.a), v, __ATOMIC_RELAXED);
}
inline void st_global_u32(Mem m, unsigned v) { __atomic_store_n((unsigned*)gptr(m.a), v, __ATOMIC_RELAXED); }
inline void st_relaxed_gpu_global_u32(Mem m, unsigned v) {
    __atomic_store_n((unsigned*)gptr(m.a), v, __ATOMIC_RELAXED);
}
inline void ld_relaxed_gpu_global_u32(unsigned& d, Mem m) {
    d = __atomic_load_n((const unsigned*)gptr(m.a), __ATOMIC_RELAXED);
}
// a thread that polls lets the other OS threads (blocks) run; one that polls for minutes is
// waiting for a block that never arrives
void nanosleep_u32(unsigned ns);

}  // namespace ptx

// CUDA's warp vote over the full warp (runtime.cpp)
bool __any_sync(unsigned mask, bool pred);
