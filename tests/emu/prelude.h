// Host emulator of the CUDA C that sparse-mla emits: enough of CUDA to run one kernel on the
// CPU, each GPU thread a fiber (ucontext) on one OS thread, so that the warp-collective PTX
// helpers (ldmatrix, mma.sync, shfl, cp.async) can be emulated exactly by the rules in the PTX
// ISA: a fragment-layout or pipeline bug then shows up as a wrong answer on the CPU.
//
// - blocks run one after another; the threads of a block are fibers scheduled round-robin,
//   each running until it reaches a barrier (__syncthreads, or a warp collective);
// - a warp collective: every lane deposits its operands, one warp barrier, every lane
//   computes its own results from all deposits (double-buffered, so one barrier suffices);
// - cp.async copies are queued per thread and land only at cp_async_wait (the oldest groups
//   first), so reading a stage before waiting for it reads stale data, as it may on a GPU.
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ucontext.h>
#include <vector>

struct emu_dim3 {
    unsigned x, y, z;
};

namespace emu {

struct Copy {
    void* dst;
    const void* src;
    unsigned bytes;
    bool valid;
};

struct Thread {
    ucontext_t ctx;
    emu_dim3 idx;
    bool done;
    std::vector<Copy> open;                 // issued, not yet committed
    std::vector<std::vector<Copy>> groups;  // committed, oldest first
};

struct Barrier {
    unsigned count = 0;
    unsigned gen = 0;
};

struct WarpDeposit {
    const void* ptr[32];
    unsigned u[32][6];
    float f[32][4];
};

struct Block {
    std::vector<Thread> threads;
    std::vector<std::vector<char>> stacks;
    Barrier block_bar;
    std::vector<Barrier> warp_bar;
    std::vector<WarpDeposit> deposit[2];
    std::vector<unsigned> warp_round;  // collectives done per warp (parity picks the buffer)
    ucontext_t sched;
    Thread* cur = nullptr;
    void (*fn)(void*) = nullptr;
    void* ctx = nullptr;
};

inline Block& block() {
    static Block b;
    return b;
}

inline void yield_() {
    Block& b = block();
    swapcontext(&b.cur->ctx, &b.sched);
}

inline void wait_at(Barrier& bar, unsigned n) {
    unsigned g = bar.gen;
    if (++bar.count == n) {
        bar.count = 0;
        bar.gen++;
        return;
    }
    unsigned long spins = 0;
    while (bar.gen == g) {
        if (++spins > 100000000ul) {
            fprintf(stderr, "emu: deadlock at a barrier (divergent __syncthreads?)\n");
            abort();
        }
        yield_();
    }
}

inline unsigned tid() { return block().cur->idx.x; }
inline unsigned lane() { return tid() % 32; }
inline unsigned warp() { return tid() / 32; }

// Start of a warp collective: the deposit buffer this warp uses for it.
inline WarpDeposit& deposit_begin() {
    Block& b = block();
    unsigned round = b.warp_round[warp()];
    return b.deposit[round % 2][warp()];
}
// Every lane has deposited: wait for the warp; then each lane reads what it needs.
inline void deposit_sync() {
    Block& b = block();
    unsigned w = warp();
    unsigned n = (unsigned)std::min<size_t>(32, b.threads.size() - w * 32);
    Barrier& bar = b.warp_bar[w];
    unsigned g = bar.gen;
    wait_at(bar, n);
    (void)g;
    // one lane advances the round for the warp: the first to pass is fine, all see the
    // same gen change, so advance by comparing with the barrier generation instead
    b.warp_round[w] = bar.gen;
}

inline void trampoline() {
    Block& b = block();
    b.fn(b.ctx);
    b.cur->done = true;
    swapcontext(&b.cur->ctx, &b.sched);
}

// Run `fn(ctx)` as a grid: blocks in order, `threads` fibers each.
inline void run_grid(emu_dim3 grid, unsigned threads, void (*fn)(void*), void* ctx);

}  // namespace emu

static emu_dim3 blockIdx, gridDim, blockDim;
#define threadIdx (emu::block().cur->idx)

#define __global__
#define __device__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __shared__ static
#define __align__(n) __attribute__((aligned(n)))

alignas(16) unsigned char dyn_smem[1 << 18];

static inline void __syncthreads() {
    emu::Block& b = emu::block();
    emu::wait_at(b.block_bar, (unsigned)b.threads.size());
}
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

inline void emu::run_grid(emu_dim3 grid, unsigned threads, void (*fn)(void*), void* ctx) {
    Block& b = block();
    const size_t stack = 256 * 1024;
    gridDim = grid;
    blockDim = {threads, 1, 1};
    unsigned warps = (threads + 31) / 32;
    b.stacks.resize(threads);
    for (auto& s : b.stacks) s.resize(stack);
    b.warp_bar.assign(warps, Barrier{});
    b.deposit[0].assign(warps, WarpDeposit{});
    b.deposit[1].assign(warps, WarpDeposit{});
    b.fn = fn;
    b.ctx = ctx;
    for (unsigned z = 0; z < grid.z; z++)
        for (unsigned y = 0; y < grid.y; y++)
            for (unsigned x = 0; x < grid.x; x++) {
                blockIdx = {x, y, z};
                b.threads.assign(threads, Thread{});
                b.block_bar = Barrier{};
                for (auto& wb : b.warp_bar) wb = Barrier{};
                b.warp_round.assign(warps, 0);
                for (unsigned t = 0; t < threads; t++) {
                    Thread& th = b.threads[t];
                    th.idx = {t, 0, 0};
                    th.done = false;
                    getcontext(&th.ctx);
                    th.ctx.uc_stack.ss_sp = b.stacks[t].data();
                    th.ctx.uc_stack.ss_size = stack;
                    th.ctx.uc_link = nullptr;
                    makecontext(&th.ctx, (void (*)())trampoline, 0);
                }
                unsigned live = threads;
                while (live > 0) {
                    live = 0;
                    for (auto& th : b.threads) {
                        if (th.done) continue;
                        b.cur = &th;
                        swapcontext(&b.sched, &th.ctx);
                        if (!th.done) live++;
                    }
                }
            }
}

// ---- the helpers of the emitted code, emulated

static inline float bf16_to_f32(unsigned short bits) { return __uint_as_float(((unsigned)bits) << 16); }

static inline unsigned emu_f32_to_bf16(float x) {
    unsigned u = __float_as_uint(x);
    if ((u & 0x7fffffffu) > 0x7f800000u) return ((u >> 16) | 0x40u) & 0xffffu;  // NaN stays NaN
    u += 0x7fffu + ((u >> 16) & 1u);  // round to nearest even
    return u >> 16;
}

static inline unsigned pack_bf16x2(float lo, float hi) {
    return emu_f32_to_bf16(lo) | (emu_f32_to_bf16(hi) << 16);
}

static inline float e4m3_to_f32(unsigned char bits) {
    const unsigned b = bits;
    if ((b & 0x7fu) == 0x7fu) return __uint_as_float(0x7fc00000u | ((b & 0x80u) << 24));
    const unsigned e = (b >> 3) & 0xfu;
    const unsigned m = b & 7u;
    const float mag = e == 0u ? (float)m * (1.0f / 512.0f) : __uint_as_float(((e + 120u) << 23) | (m << 20));
    return (b & 0x80u) ? -mag : mag;
}

static inline void emu_cp_async(void* dst, const void* src, unsigned bytes, bool valid) {
    if (((uintptr_t)dst % bytes) != 0 || (valid && ((uintptr_t)src % bytes) != 0)) {
        fprintf(stderr, "emu: misaligned cp.async of %u bytes (dst %p src %p)\n", bytes, dst, src);
        abort();
    }
    emu::block().cur->open.push_back({dst, src, bytes, valid});
}
static inline void cp_async_16(void* dst, const void* src, bool valid) { emu_cp_async(dst, src, 16, valid); }
static inline void cp_async_4(void* dst, const void* src, bool valid) { emu_cp_async(dst, src, 4, valid); }
static inline void cp_async_commit() {
    emu::Thread* t = emu::block().cur;
    t->groups.push_back(std::move(t->open));
    t->open.clear();
}
template <int N>
static inline void cp_async_wait() {
    emu::Thread* t = emu::block().cur;
    while (t->groups.size() > (size_t)N) {
        for (const emu::Copy& c : t->groups.front()) {
            if (c.valid) memcpy(c.dst, c.src, c.bytes);
            else memset(c.dst, 0, c.bytes);
        }
        t->groups.erase(t->groups.begin());
    }
}

static inline void emu_check_row(const void* p) {
    if (((uintptr_t)p % 16) != 0) {
        fprintf(stderr, "emu: ldmatrix row address %p is not 16-byte aligned\n", p);
        abort();
    }
}

// ldmatrix: matrix m's rows come from lanes 8m .. 8m+7.
static inline void emu_ldmatrix(unsigned* r, const void* p, int count, bool trans) {
    emu::WarpDeposit& d = emu::deposit_begin();
    unsigned l = emu::lane();
    d.ptr[l] = p;
    emu::deposit_sync();
    unsigned g = l / 4, q = l % 4;
    for (int m = 0; m < count; m++) {
        unsigned lo, hi;
        if (!trans) {
            const unsigned short* row = (const unsigned short*)d.ptr[8 * m + g];
            emu_check_row(row);
            lo = row[2 * q];
            hi = row[2 * q + 1];
        } else {
            const unsigned short* r0 = (const unsigned short*)d.ptr[8 * m + 2 * q];
            const unsigned short* r1 = (const unsigned short*)d.ptr[8 * m + 2 * q + 1];
            emu_check_row(r0);
            emu_check_row(r1);
            lo = r0[g];
            hi = r1[g];
        }
        r[m] = lo | (hi << 16);
    }
}
static inline void ldmatrix_x4(unsigned* r, const void* p) { emu_ldmatrix(r, p, 4, false); }
static inline void ldmatrix_x4_trans(unsigned* r, const void* p) { emu_ldmatrix(r, p, 4, true); }
static inline void ldmatrix_x2(unsigned* r, const void* p) { emu_ldmatrix(r, p, 2, false); }
static inline void ldmatrix_x2_trans(unsigned* r, const void* p) { emu_ldmatrix(r, p, 2, true); }

static inline float emu_bf16_lo(unsigned w) { return __uint_as_float(w << 16); }
static inline float emu_bf16_hi(unsigned w) { return __uint_as_float(w & 0xffff0000u); }

// mma.sync m16n8k16 row.col bf16 -> f32, by the PTX fragment layouts:
// A: a0 (g, 2q..), a1 (g+8, 2q..), a2 (g, 2q+8..), a3 (g+8, 2q+8..)
// B: b0 (k 2q.., n g), b1 (k 2q+8.., n g);  C: c0,c1 (g, 2q..), c2,c3 (g+8, 2q..)
static inline void mma_bf16_16816(float* c, const unsigned* a, const unsigned* b) {
    emu::WarpDeposit& d = emu::deposit_begin();
    unsigned l = emu::lane();
    for (int i = 0; i < 4; i++) d.u[l][i] = a[i];
    d.u[l][4] = b[0];
    d.u[l][5] = b[1];
    emu::deposit_sync();
    float A[16][16], B[16][8];
    for (unsigned t = 0; t < 32; t++) {
        unsigned g = t / 4, q = t % 4;
        const unsigned* u = d.u[t];
        A[g][2 * q] = emu_bf16_lo(u[0]);
        A[g][2 * q + 1] = emu_bf16_hi(u[0]);
        A[g + 8][2 * q] = emu_bf16_lo(u[1]);
        A[g + 8][2 * q + 1] = emu_bf16_hi(u[1]);
        A[g][2 * q + 8] = emu_bf16_lo(u[2]);
        A[g][2 * q + 9] = emu_bf16_hi(u[2]);
        A[g + 8][2 * q + 8] = emu_bf16_lo(u[3]);
        A[g + 8][2 * q + 9] = emu_bf16_hi(u[3]);
        B[2 * q][g] = emu_bf16_lo(u[4]);
        B[2 * q + 1][g] = emu_bf16_hi(u[4]);
        B[2 * q + 8][g] = emu_bf16_lo(u[5]);
        B[2 * q + 9][g] = emu_bf16_hi(u[5]);
    }
    unsigned g = l / 4, q = l % 4;
    for (int e = 0; e < 4; e++) {
        unsigned row = g + (e >= 2 ? 8 : 0), col = 2 * q + (e & 1);
        double s = c[e];
        for (int k = 0; k < 16; k++) s += (double)A[row][k] * (double)B[k][col];
        c[e] = (float)s;
    }
}

static inline float shfl_xor_f32(float v, int mask) {
    emu::WarpDeposit& d = emu::deposit_begin();
    unsigned l = emu::lane();
    d.f[l][0] = v;
    emu::deposit_sync();
    return d.f[l ^ (unsigned)mask][0];
}
