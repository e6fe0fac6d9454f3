// Host emulator of the CUDA C that sparse-mla emits: enough of CUDA to run one kernel on the
// CPU, each GPU thread a fiber (ucontext) on one OS thread. The emitted helpers run as
// printed: tests/emu/ptx.rs translates every inline-PTX statement into a call of the
// `ptx::` function of the same instruction below, with the operands in the order the asm
// string gives them, so a wrong operand order in an emitted helper is a wrong answer here.
//
// - blocks run one after another; the live threads of a block are fibers run in an order
//   drawn at random each round (seeded), each until it blocks (a barrier, a warp collective,
//   an mbarrier wait) or yields at random at an asynchronous operation;
// - a warp collective: every lane deposits its operands, one warp barrier, every lane
//   computes its own results from all deposits (double-buffered, so one barrier suffices);
// - asynchronous copies (cp.async, cp.async.bulk) land either at issue or as late as the
//   PTX rules allow (at cp.async.wait_group / when an mbarrier they complete is waited on),
//   by `mode`;
// - a race detector: vector clocks per thread (and per thread's copy engine), a shadow of
//   every shared-memory word (last write, reads since), ordering only through barriers,
//   named barriers, __syncwarp, mbarrier arrive/wait and cp.async.wait_group; an access not
//   ordered after a conflicting one (read-after-write, write-after-read, write-after-write,
//   or a read of a copy's destination before the copy is known to have landed) is a race.
// Errors (races, deadlocks, misaligned copies, bad shared addresses) are collected and
// returned by the launch; nothing aborts the host process.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <string>
#include <ucontext.h>
#include <vector>

struct emu_dim3 {
    unsigned x, y, z;
};

namespace emu {

constexpr unsigned SMEM_BYTES = 1u << 18;
constexpr unsigned SMEM_WORDS = SMEM_BYTES / 4;

struct Config {
    bool land_at_issue = false;  // async copies land when issued (else as late as allowed)
    unsigned long long seed = 1;
};

struct Copy {
    unsigned dst;  // shared byte offset
    const void* src;
    unsigned bytes;
    bool valid;        // else zero-fill
    unsigned clk;      // the copy engine's epoch of this copy
    unsigned long long seq;  // global event number at issue
};

struct AsyncArrive {
    unsigned bar;             // mbarrier shared offset
    size_t upto;              // copies issued (count) before the arrive-on
};

struct Thread {
    ucontext_t ctx;
    emu_dim3 idx;
    bool done = false;
    std::vector<Copy> open;                 // cp.async issued, not yet committed
    std::vector<std::vector<Copy>> groups;  // committed, oldest first
    std::vector<Copy> arrive_pending;       // cp.async copies an async arrive waits for
    std::vector<AsyncArrive> async_arrives;
    unsigned copy_clk = 0;
};

struct Barrier {
    unsigned count = 0;
    unsigned gen = 0;
    unsigned expected = 0;
    std::vector<unsigned> members;
};

struct WarpDeposit {
    unsigned addr[32];
    unsigned u[32][6];
    float f[32][4];
};

struct Read {
    unsigned actor, clk;
    unsigned long long seq;
};

struct Shadow {
    unsigned w_actor = ~0u, w_clk = 0;
    unsigned long long w_seq = 0;
    std::vector<Read> reads;
    bool sync_object = false;  // an mbarrier: accessed only through mbarrier ops
};

struct Mbar {
    unsigned expected = 0, pending = 0;
    long long tx = 0;
    unsigned phase = 0;  // completed phases
    std::vector<unsigned> acc;                  // clock released into the current phase
    std::map<unsigned, std::vector<unsigned>> done;  // phase number -> clock at completion
    std::vector<Copy> bulk;                     // bulk copies not landed, completing tx here
    std::vector<unsigned> bulk_issuer;
};

struct Block {
    std::vector<Thread> threads;
    std::vector<std::vector<char>> stacks;
    Barrier named[16];
    std::vector<Barrier> warp_bar;
    std::vector<WarpDeposit> deposit[2];
    std::vector<unsigned> warp_round;
    ucontext_t sched;
    Thread* cur = nullptr;
    void (*fn)(void*) = nullptr;
    void* ctx = nullptr;
    // race detection
    unsigned nthreads = 0;
    std::vector<std::vector<unsigned>> vc;  // per thread: clock of every actor (threads, then copy engines)
    std::vector<Shadow> shadow;
    unsigned long long seq = 0;
    bool progress = false;
    std::map<unsigned, Mbar> mbars;
    std::map<std::string, unsigned> static_alloc;
    unsigned static_top = 0;
    std::vector<std::pair<unsigned, std::string>> names;  // shared offset -> array name
    unsigned long long rng = 1;
    emu_dim3 bidx{0, 0, 0};
};

struct State {
    Config cfg;
    Block b;
    std::string errors;
    unsigned nerrors = 0;
};

inline State& st() {
    static State s;
    return s;
}
inline Block& block() { return st().b; }

alignas(16) inline unsigned char smem[SMEM_BYTES];

inline void error(const std::string& msg) {
    State& s = st();
    if (s.nerrors++ < 8) {
        s.errors += msg;
        s.errors += "\n";
    }
}

inline unsigned long long rnd() {
    unsigned long long& x = block().rng;
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    return x;
}

inline unsigned tid() { return block().cur->idx.x; }
inline unsigned lane() { return tid() % 32; }
inline unsigned warp() { return tid() / 32; }

inline void yield_() {
    Block& b = block();
    swapcontext(&b.cur->ctx, &b.sched);
}
// A chance to let other fibers run at an asynchronous operation.
inline void maybe_yield() {
    if ((rnd() & 7) == 0) yield_();
}

// ---- names of shared arrays, for error messages
inline std::string where(unsigned off) {
    Block& b = block();
    std::string best = "?";
    unsigned base = 0;
    for (auto& n : b.names)
        if (n.first <= off && n.first >= base) {
            base = n.first;
            best = n.second;
        }
    char buf[160];
    snprintf(buf, sizeof buf, "%s (+%u B, shared offset %u)", best.c_str(), off - base, off);
    return buf;
}

inline std::string actor_name(unsigned a) {
    Block& b = block();
    char buf[64];
    if (a == ~0u) return "nobody";
    if (a < b.nthreads) snprintf(buf, sizeof buf, "thread %u", a);
    else snprintf(buf, sizeof buf, "async copy of thread %u", a - b.nthreads);
    return buf;
}

// ---- vector clocks
inline std::vector<unsigned>& my_vc() { return block().vc[tid()]; }
inline void join(std::vector<unsigned>& into, const std::vector<unsigned>& from) {
    for (size_t i = 0; i < into.size(); i++) into[i] = std::max(into[i], from[i]);
}
// After a release: later events of this thread are not covered by it.
inline void tick() { my_vc()[tid()]++; }
inline bool ordered(const std::vector<unsigned>& vc, unsigned me, unsigned actor, unsigned clk) {
    return actor == ~0u || actor == me || vc[actor] >= clk;
}

inline void race(const char* kind, unsigned word, unsigned other, const char* what) {
    char buf[320];
    Block& b = block();
    snprintf(buf, sizeof buf, "emu: shared-memory race (%s) at %s: thread %u %s, unordered with %s (block %u,%u,%u)",
             kind, where(word * 4).c_str(), tid(), what, actor_name(other).c_str(), b.bidx.x, b.bidx.y, b.bidx.z);
    error(buf);
}

inline unsigned shared_offset(const void* p) {
    const unsigned char* c = (const unsigned char*)p;
    if (c < smem || c >= smem + SMEM_BYTES) {
        error("emu: a shared-memory instruction got an address outside shared memory");
        return 0;
    }
    return (unsigned)(c - smem);
}

inline void check_read(unsigned word) {
    Block& b = block();
    Shadow& s = b.shadow[word];
    if (s.sync_object) return;
    unsigned me = tid();
    auto& vc = b.vc[me];
    if (!ordered(vc, me, s.w_actor, s.w_clk)) race("read after write", word, s.w_actor, "reads");
    for (auto& r : s.reads)
        if (r.actor == me) {
            r.clk = vc[me];
            r.seq = ++b.seq;
            return;
        }
    s.reads.push_back({me, vc[me], ++b.seq});
}

inline void check_write(unsigned word) {
    Block& b = block();
    Shadow& s = b.shadow[word];
    if (s.sync_object) return;
    unsigned me = tid();
    auto& vc = b.vc[me];
    if (!ordered(vc, me, s.w_actor, s.w_clk)) race("write after write", word, s.w_actor, "writes");
    for (auto& r : s.reads)
        if (!ordered(vc, me, r.actor, r.clk)) {
            race("write after read", word, r.actor, "writes");
            break;
        }
    s.reads.clear();
    s.w_actor = me;
    s.w_clk = vc[me];
    s.w_seq = ++b.seq;
}

inline void sh_read(const void* p, unsigned bytes) {
    unsigned off = shared_offset(p);
    for (unsigned w = off / 4; w < (off + bytes + 3) / 4; w++) check_read(w);
}
inline void sh_write(const void* p, unsigned bytes) {
    unsigned off = shared_offset(p);
    for (unsigned w = off / 4; w < (off + bytes + 3) / 4; w++) check_write(w);
}

// An async copy's destination, checked at issue against what the issuing thread has seen
// (the copy is ordered after it), then owned by the copy engine when it lands.
inline void copy_issue_check(unsigned dst, unsigned bytes) {
    for (unsigned w = dst / 4; w < (dst + bytes) / 4; w++) {
        Block& b = block();
        Shadow& s = b.shadow[w];
        unsigned me = tid();
        auto& vc = b.vc[me];
        if (!ordered(vc, me, s.w_actor, s.w_clk)) race("async copy over an unordered write", w, s.w_actor, "copies into it");
        for (auto& r : s.reads)
            if (!ordered(vc, me, r.actor, r.clk)) {
                race("async copy over an unordered read", w, r.actor, "copies into it");
                break;
            }
    }
}
inline void copy_land(const Copy& c, unsigned issuer) {
    Block& b = block();
    if (c.valid) memcpy(smem + c.dst, c.src, c.bytes);
    else memset(smem + c.dst, 0, c.bytes);
    for (unsigned w = c.dst / 4; w < (c.dst + c.bytes) / 4; w++) {
        Shadow& s = b.shadow[w];
        // anything that touched the words after the copy was issued raced with it
        if (s.w_seq > c.seq && s.w_actor != b.nthreads + issuer) {
            char buf[64];
            snprintf(buf, sizeof buf, "(copy of thread %u)", issuer);
            race("write while an async copy was in flight", w, s.w_actor, buf);
        }
        for (auto& r : s.reads)
            if (r.seq > c.seq) {
                Thread* saved = b.cur;
                (void)saved;
                char buf[64];
                snprintf(buf, sizeof buf, "(copy of thread %u) lands", issuer);
                race("read while an async copy was in flight", w, r.actor, buf);
                break;
            }
        s.reads.clear();
        s.w_actor = b.nthreads + issuer;
        s.w_clk = c.clk;
        s.w_seq = ++b.seq;
    }
    b.progress = true;
}

// ---- barriers
// Wait for a barrier's generation to move on (the scheduler reports a deadlock when no
// thread can make progress).
inline void wait_gen(Barrier& bar, unsigned g, const char* what) {
    (void)what;
    while (bar.gen == g) yield_();
}

// bar.sync among `n` threads (a named barrier; id 0 with all threads is __syncthreads).
inline void bar_sync(unsigned id, unsigned n) {
    Block& b = block();
    if (id >= 16) {
        error("emu: barrier id >= 16");
        return;
    }
    Barrier& bar = b.named[id];
    if (bar.count == 0) bar.expected = n;
    if (bar.expected != n) error("emu: threads disagree on a named barrier's thread count");
    bar.members.push_back(tid());
    unsigned g = bar.gen;
    if (++bar.count == n) {
        std::vector<unsigned> all(b.vc[0].size(), 0);
        for (unsigned m : bar.members) join(all, b.vc[m]);
        for (unsigned m : bar.members) {
            b.vc[m] = all;
            b.vc[m][m]++;
        }
        bar.members.clear();
        bar.count = 0;
        bar.gen++;
        b.progress = true;
        return;
    }
    wait_gen(bar, g, "a barrier (divergent __syncthreads, or a thread count that never arrives?)");
}

// ---- warp collectives
inline WarpDeposit& deposit_begin() {
    Block& b = block();
    return b.deposit[b.warp_round[warp()] % 2][warp()];
}
inline unsigned warp_size_here() {
    Block& b = block();
    return (unsigned)std::min<size_t>(32, b.threads.size() - warp() * 32);
}
inline void deposit_sync() {
    Block& b = block();
    unsigned w = warp();
    Barrier& bar = b.warp_bar[w];
    unsigned g = bar.gen;
    if (++bar.count == warp_size_here()) {
        bar.count = 0;
        bar.gen++;
        b.progress = true;
    } else {
        wait_gen(bar, g, "a warp collective (lanes of a warp diverged?)");
    }
    b.warp_round[w] = bar.gen;
}
// __syncwarp: the lanes' memory is ordered too.
inline void syncwarp() {
    Block& b = block();
    unsigned w = warp();
    WarpDeposit& d = deposit_begin();
    d.u[lane()][0] = 0;
    Barrier& bar = b.warp_bar[w];
    bar.members.push_back(tid());
    unsigned g = bar.gen;
    if (++bar.count == warp_size_here()) {
        std::vector<unsigned> all(b.vc[0].size(), 0);
        for (unsigned m : bar.members) join(all, b.vc[m]);
        for (unsigned m : bar.members) {
            b.vc[m] = all;
            b.vc[m][m]++;
        }
        bar.members.clear();
        bar.count = 0;
        bar.gen++;
        b.progress = true;
    } else {
        wait_gen(bar, g, "__syncwarp");
    }
    b.warp_round[w] = bar.gen;
}

inline void trampoline() {
    Block& b = block();
    b.fn(b.ctx);
    b.cur->done = true;
    b.progress = true;
    swapcontext(&b.cur->ctx, &b.sched);
}

inline void run_grid(emu_dim3 grid, unsigned threads, void (*fn)(void*), void* ctx);

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
    Sh operator+(long long o) const { return Sh{p + o}; }
    template <class U>
    operator U*() const {
        return (U*)p;
    }
};

template <class T>
inline Sh<T> shared_dyn(const char* name, unsigned off, unsigned len) {
    Block& b = block();
    bool known = false;
    for (auto& n : b.names) known |= n.first == off && n.second == name;
    if (!known) b.names.push_back({off, name});
    (void)len;
    return Sh<T>{(T*)(smem + off)};
}
// A static __shared__ array: the first thread to reach the declaration places it.
template <class T>
inline Sh<T> shared_static(const char* name, unsigned len) {
    Block& b = block();
    auto it = b.static_alloc.find(name);
    unsigned off;
    if (it == b.static_alloc.end()) {
        off = b.static_top;
        b.static_top += (len * (unsigned)sizeof(T) + 15) / 16 * 16;
        b.static_alloc[name] = off;
        b.names.push_back({off, name});
    } else {
        off = it->second;
    }
    return Sh<T>{(T*)(smem + off)};
}

}  // namespace emu

static emu_dim3 blockIdx, gridDim, blockDim;
#define threadIdx (emu::block().cur->idx)

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
    b.nthreads = threads;
    b.rng = st().cfg.seed * 0x9e3779b97f4a7c15ull + 1;
    std::vector<unsigned> order(threads);
    for (unsigned z = 0; z < grid.z; z++)
        for (unsigned y = 0; y < grid.y; y++)
            for (unsigned x = 0; x < grid.x; x++) {
                blockIdx = {x, y, z};
                b.bidx = blockIdx;
                b.threads.assign(threads, Thread{});
                for (auto& nb : b.named) nb = Barrier{};
                for (auto& wb : b.warp_bar) wb = Barrier{};
                b.warp_round.assign(warps, 0);
                b.vc.assign(threads, std::vector<unsigned>(2 * threads, 0));
                for (unsigned t = 0; t < threads; t++) b.vc[t][t] = 1;
                b.shadow.assign(SMEM_WORDS, Shadow{});
                b.seq = 0;
                b.mbars.clear();
                b.static_alloc.clear();
                b.static_top = 0;
                b.names.clear();
                // fresh shared memory is garbage on a GPU: NaN bytes here
                memset(smem, 0xFF, SMEM_BYTES);
                for (unsigned t = 0; t < threads; t++) {
                    Thread& th = b.threads[t];
                    th.idx = {t, 0, 0};
                    getcontext(&th.ctx);
                    th.ctx.uc_stack.ss_sp = b.stacks[t].data();
                    th.ctx.uc_stack.ss_size = stack;
                    th.ctx.uc_link = nullptr;
                    makecontext(&th.ctx, (void (*)())trampoline, 0);
                }
                for (unsigned t = 0; t < threads; t++) order[t] = t;
                unsigned live = threads;
                unsigned idle_rounds = 0;
                while (live > 0) {
                    // a random order of the threads each round
                    for (unsigned i = threads - 1; i > 0; i--) std::swap(order[i], order[rnd() % (i + 1)]);
                    live = 0;
                    b.progress = false;
                    for (unsigned t : order) {
                        Thread& th = b.threads[t];
                        if (th.done) continue;
                        b.cur = &th;
                        swapcontext(&b.sched, &th.ctx);
                        if (!th.done) live++;
                    }
                    idle_rounds = b.progress ? 0 : idle_rounds + 1;
                    if (idle_rounds > 4000) {
                        char buf[128];
                        snprintf(buf, sizeof buf, "emu: deadlock in block (%u, %u, %u): %u threads wait forever", x, y, z, live);
                        error(buf);
                        return;
                    }
                }
                for (auto& th : b.threads)
                    if (!th.open.empty() || !th.groups.empty() || !th.arrive_pending.empty())
                        error("emu: a thread ended with async copies it never waited for");
                for (auto& m : b.mbars)
                    if (!m.second.bulk.empty()) error("emu: a block ended with bulk copies in flight");
            }
}

// ---- the PTX instructions the emitted helpers use (names: the mnemonic, '.' -> '_', '::' -> '__')
namespace ptx {

using emu::Block;
using emu::block;

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
// f32 -> f16 bits, round to nearest even (every value reaching it here is exact in f16)
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
// f32 -> e4m3 "fn" by search (a reference apart from the kernel's bit path): the nearest of
// the 127 finite magnitudes, ties to the even code, beyond 448 saturated to 448
inline unsigned f32_to_e4m3_ref(float f) {
    const unsigned sign = (__float_as_uint(f) >> 24) & 0x80u;
    const double a = std::fabs((double)f);
    unsigned best = 0;
    for (unsigned c = 1; c < 0x7fu; c++) {
        const double dc = std::fabs((double)e4m3_value(c) - a), db = std::fabs((double)e4m3_value(best) - a);
        if (dc < db || (dc == db && (c & 1u) == 0)) best = c;
    }
    if (!(a <= 448.0)) best = 0x7eu;
    return sign | best;
}
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
inline void cp_async(Mem dst, Mem src, unsigned cp, unsigned src_size) {
    Block& b = block();
    unsigned d = (unsigned)dst.a;
    if (d % cp != 0 || (src_size != 0 && src.a % cp != 0)) {
        char buf[128];
        snprintf(buf, sizeof buf, "emu: misaligned cp.async of %u bytes (shared %u)", cp, d);
        emu::error(buf);
        return;
    }
    if (src_size != 0 && src_size != cp) emu::error("emu: partial cp.async src-size not modelled");
    emu::copy_issue_check(d, cp);
    emu::Thread* t = b.cur;
    emu::Copy c{d, gptr(src.a), cp, src_size != 0, ++t->copy_clk, ++b.seq};
    if (emu::st().cfg.land_at_issue) {
        emu::copy_land(c, emu::tid());
        c.bytes = 0;  // landed: the group only carries its epoch
    }
    t->open.push_back(c);
    emu::maybe_yield();
}
inline void cp_async_cg_shared_global(Mem dst, Mem src, unsigned cp, unsigned src_size) { cp_async(dst, src, cp, src_size); }
inline void cp_async_ca_shared_global(Mem dst, Mem src, unsigned cp, unsigned src_size) { cp_async(dst, src, cp, src_size); }
inline void cp_async_commit_group() {
    emu::Thread* t = block().cur;
    t->groups.push_back(std::move(t->open));
    t->open.clear();
}
inline void land_and_acquire(emu::Thread* t, const std::vector<emu::Copy>& g) {
    unsigned me = (unsigned)(t - block().threads.data());
    for (const emu::Copy& c : g) {
        if (c.bytes) emu::copy_land(c, me);
        auto& vc = block().vc[me];
        vc[block().nthreads + me] = std::max(vc[block().nthreads + me], c.clk);
    }
}
inline void cp_async_wait_group(unsigned n) {
    emu::Thread* t = block().cur;
    while (t->groups.size() > n) {
        land_and_acquire(t, t->groups.front());
        t->groups.erase(t->groups.begin());
    }
}
inline void cp_async_wait_all() {
    cp_async_commit_group();
    cp_async_wait_group(0);
}

// ---- ldmatrix: lane l gives the address of row l % 8 of matrix l / 8
inline void ldmatrix(unsigned* r, unsigned addr, int count, bool trans) {
    emu::WarpDeposit& d = emu::deposit_begin();
    unsigned l = emu::lane();
    d.addr[l] = addr;
    emu::deposit_sync();
    unsigned g = l / 4, q = l % 4;
    for (int m = 0; m < count; m++) {
        unsigned lo, hi;
        auto row = [&](unsigned src_lane) -> const unsigned short* {
            unsigned a = d.addr[src_lane];
            if (a % 16 != 0 || a + 16 > emu::SMEM_BYTES) {
                emu::error("emu: ldmatrix row address is not 16-byte aligned or outside shared memory");
                return (const unsigned short*)emu::smem;
            }
            return (const unsigned short*)(emu::smem + a);
        };
        if (!trans) {
            const unsigned short* rw = row(8 * m + g);
            emu::sh_read(rw + 2 * q, 4);
            lo = rw[2 * q];
            hi = rw[2 * q + 1];
        } else {
            const unsigned short* r0 = row(8 * m + 2 * q);
            const unsigned short* r1 = row(8 * m + 2 * q + 1);
            emu::sh_read(r0 + g, 2);
            emu::sh_read(r1 + g, 2);
            lo = r0[g];
            hi = r1[g];
        }
        r[m] = lo | (hi << 16);
    }
}
inline void ldmatrix_sync_aligned_m8n8_x4_shared_b16(unsigned& a, unsigned& b, unsigned& c, unsigned& d, Mem m) {
    unsigned r[4];
    ldmatrix(r, (unsigned)m.a, 4, false);
    a = r[0], b = r[1], c = r[2], d = r[3];
}
inline void ldmatrix_sync_aligned_m8n8_x4_trans_shared_b16(unsigned& a, unsigned& b, unsigned& c, unsigned& d, Mem m) {
    unsigned r[4];
    ldmatrix(r, (unsigned)m.a, 4, true);
    a = r[0], b = r[1], c = r[2], d = r[3];
}
inline void ldmatrix_sync_aligned_m8n8_x2_shared_b16(unsigned& a, unsigned& b, Mem m) {
    unsigned r[2];
    ldmatrix(r, (unsigned)m.a, 2, false);
    a = r[0], b = r[1];
}
inline void ldmatrix_sync_aligned_m8n8_x2_trans_shared_b16(unsigned& a, unsigned& b, Mem m) {
    unsigned r[2];
    ldmatrix(r, (unsigned)m.a, 2, true);
    a = r[0], b = r[1];
}
inline void ldmatrix_sync_aligned_m8n8_x1_shared_b16(unsigned& a, Mem m) { ldmatrix(&a, (unsigned)m.a, 1, false); }
inline void ldmatrix_sync_aligned_m8n8_x1_trans_shared_b16(unsigned& a, Mem m) { ldmatrix(&a, (unsigned)m.a, 1, true); }

// ---- mma.sync m16n8k16 row.col bf16 -> f32, by the PTX fragment layouts:
// A: a0 (g, 2q..), a1 (g+8, 2q..), a2 (g, 2q+8..), a3 (g+8, 2q+8..)
// B: b0 (k 2q.., n g), b1 (k 2q+8.., n g);  C, D: d0,d1 (g, 2q..), d2,d3 (g+8, 2q..)
inline void mma_sync_aligned_m16n8k16_row_col_f32_bf16_bf16_f32(float& d0, float& d1, float& d2, float& d3, unsigned a0,
                                                               unsigned a1, unsigned a2, unsigned a3, unsigned b0,
                                                               unsigned b1, float c0, float c1, float c2, float c3) {
    emu::WarpDeposit& d = emu::deposit_begin();
    unsigned l = emu::lane();
    unsigned in[6] = {a0, a1, a2, a3, b0, b1};
    for (int i = 0; i < 6; i++) d.u[l][i] = in[i];
    emu::deposit_sync();
    float A[16][16], B[16][8];
    for (unsigned t = 0; t < 32; t++) {
        unsigned g = t / 4, q = t % 4;
        const unsigned* u = d.u[t];
        A[g][2 * q] = bf16_lo(u[0]);
        A[g][2 * q + 1] = bf16_hi(u[0]);
        A[g + 8][2 * q] = bf16_lo(u[1]);
        A[g + 8][2 * q + 1] = bf16_hi(u[1]);
        A[g][2 * q + 8] = bf16_lo(u[2]);
        A[g][2 * q + 9] = bf16_hi(u[2]);
        A[g + 8][2 * q + 8] = bf16_lo(u[3]);
        A[g + 8][2 * q + 9] = bf16_hi(u[3]);
        B[2 * q][g] = bf16_lo(u[4]);
        B[2 * q + 1][g] = bf16_hi(u[4]);
        B[2 * q + 8][g] = bf16_lo(u[5]);
        B[2 * q + 9][g] = bf16_hi(u[5]);
    }
    unsigned g = l / 4, q = l % 4;
    float c[4] = {c0, c1, c2, c3}, out[4];
    for (int e = 0; e < 4; e++) {
        unsigned row = g + (e >= 2 ? 8 : 0), col = 2 * q + (e & 1);
        double s = c[e];
        for (int k = 0; k < 16; k++) s += (double)A[row][k] * (double)B[k][col];
        out[e] = (float)s;
    }
    d0 = out[0], d1 = out[1], d2 = out[2], d3 = out[3];
}

// ---- mma.sync m16n8k32 row.col e4m3 -> f32, by the PTX fragment layouts (4 bytes a register):
// A: a0 (g, 4q..), a1 (g+8, 4q..), a2 (g, 16+4q..), a3 (g+8, 16+4q..)
// B: b0 (k 4q.., n g), b1 (k 16+4q.., n g);  C, D as m16n8k16
inline void mma_sync_aligned_m16n8k32_row_col_f32_e4m3_e4m3_f32(float& d0, float& d1, float& d2, float& d3, unsigned a0,
                                                               unsigned a1, unsigned a2, unsigned a3, unsigned b0,
                                                               unsigned b1, float c0, float c1, float c2, float c3) {
    emu::WarpDeposit& d = emu::deposit_begin();
    unsigned l = emu::lane();
    unsigned in[6] = {a0, a1, a2, a3, b0, b1};
    for (int i = 0; i < 6; i++) d.u[l][i] = in[i];
    emu::deposit_sync();
    float A[16][32], B[32][8];
    for (unsigned t = 0; t < 32; t++) {
        unsigned g = t / 4, q = t % 4;
        const unsigned* u = d.u[t];
        for (unsigned i = 0; i < 4; i++) {
            A[g][4 * q + i] = e4m3_value(u[0] >> (8 * i));
            A[g + 8][4 * q + i] = e4m3_value(u[1] >> (8 * i));
            A[g][16 + 4 * q + i] = e4m3_value(u[2] >> (8 * i));
            A[g + 8][16 + 4 * q + i] = e4m3_value(u[3] >> (8 * i));
            B[4 * q + i][g] = e4m3_value(u[4] >> (8 * i));
            B[16 + 4 * q + i][g] = e4m3_value(u[5] >> (8 * i));
        }
    }
    unsigned g = l / 4, q = l % 4;
    float c[4] = {c0, c1, c2, c3}, out[4];
    for (int e = 0; e < 4; e++) {
        unsigned row = g + (e >= 2 ? 8 : 0), col = 2 * q + (e & 1);
        double s = c[e];
        for (int k = 0; k < 32; k++) s += (double)A[row][k] * (double)B[k][col];
        out[e] = (float)s;
    }
    d0 = out[0], d1 = out[1], d2 = out[2], d3 = out[3];
}

// ---- shfl.sync.bfly: d = a of lane (lane ^ b)
inline void shfl_sync_bfly_b32(float& d, float a, unsigned b, unsigned c, unsigned mask) {
    emu::WarpDeposit& dep = emu::deposit_begin();
    unsigned l = emu::lane();
    dep.f[l][0] = a;
    emu::deposit_sync();
    if (mask != 0xffffffffu || c != 0x1f) emu::error("emu: shfl.sync with a partial mask or clamp not modelled");
    d = dep.f[(l ^ b) & 31][0];
}
inline void shfl_sync_bfly_b32(unsigned& d, unsigned a, unsigned b, unsigned c, unsigned mask) {
    float x;
    shfl_sync_bfly_b32(x, __uint_as_float(a), b, c, mask);
    d = __float_as_uint(x);
}

// ---- named barriers
inline void bar_sync(unsigned id, unsigned n) { emu::bar_sync(id, n); }
inline void barrier_sync(unsigned id, unsigned n) { emu::bar_sync(id, n); }

// ---- mbarrier
inline emu::Mbar& mbar(Mem m, bool init = false) {
    Block& b = block();
    unsigned a = (unsigned)m.a;
    if (a % 8 != 0) emu::error("emu: mbarrier address not 8-byte aligned");
    auto it = b.mbars.find(a);
    if (it == b.mbars.end()) {
        if (!init) emu::error("emu: mbarrier used before mbarrier.init at " + emu::where(a));
        it = b.mbars.emplace(a, emu::Mbar{}).first;
    }
    return it->second;
}
inline void phase_check(emu::Mbar& mb) {
    Block& b = block();
    if (mb.pending == 0 && mb.tx == 0) {
        mb.done[mb.phase] = mb.acc;
        mb.phase++;
        mb.pending = mb.expected;
        std::fill(mb.acc.begin(), mb.acc.end(), 0u);
        b.progress = true;
        if (mb.done.size() > 8) mb.done.erase(mb.done.begin());
    }
}
inline void mbarrier_init_shared_b64(Mem m, unsigned count) {
    Block& b = block();
    emu::sh_write(emu::smem + m.a, 8);
    emu::Mbar& mb = mbar(m, true);
    mb = emu::Mbar{};
    mb.expected = mb.pending = count;
    mb.acc.assign(b.vc[0].size(), 0);
    for (unsigned w = (unsigned)m.a / 4; w < (unsigned)m.a / 4 + 2; w++) b.shadow[w].sync_object = true;
}
inline void mbarrier_init_shared__cta_b64(Mem m, unsigned count) { mbarrier_init_shared_b64(m, count); }
inline void release_into(emu::Mbar& mb) {
    emu::join(mb.acc, emu::my_vc());
    emu::tick();
}
inline void arrive(emu::Mbar& mb) {
    if (mb.pending == 0) {
        emu::error("emu: mbarrier arrive beyond its expected count");
        return;
    }
    mb.pending--;
    phase_check(mb);
}
inline void mbarrier_arrive_shared_b64(unsigned long long& state, Mem m) {
    emu::Mbar& mb = mbar(m);
    state = mb.phase;
    release_into(mb);
    arrive(mb);
    emu::maybe_yield();
}
inline void mbarrier_arrive_shared__cta_b64(unsigned long long& state, Mem m) { mbarrier_arrive_shared_b64(state, m); }
inline void mbarrier_expect_tx_shared__cta_b64(Mem m, unsigned tx) { mbar(m).tx += tx; }
inline void mbarrier_expect_tx_relaxed_cta_shared__cta_b64(Mem m, unsigned tx) { mbar(m).tx += tx; }
inline void mbarrier_arrive_expect_tx_shared__cta_b64(unsigned long long& state, Mem m, unsigned tx) {
    emu::Mbar& mb = mbar(m);
    mb.tx += tx;
    mbarrier_arrive_shared_b64(state, m);
}

// the async arrive-on of cp.async.mbarrier.arrive: once this thread's earlier cp.async land
inline void do_async_arrive(emu::Thread* t, const emu::AsyncArrive& a) {
    Block& b = block();
    unsigned me = (unsigned)(t - b.threads.data());
    for (size_t i = 0; i < a.upto && i < t->arrive_pending.size(); i++) {
        emu::Copy& c = t->arrive_pending[i];
        if (c.bytes) {
            emu::copy_land(c, me);
            c.bytes = 0;
        }
    }
    emu::Mbar& mb = b.mbars[a.bar];
    unsigned maxclk = 0;
    for (size_t i = 0; i < a.upto && i < t->arrive_pending.size(); i++) maxclk = std::max(maxclk, t->arrive_pending[i].clk);
    auto& slot = mb.acc[b.nthreads + me];
    slot = std::max(slot, maxclk);
    arrive(mb);
}
// Copies of cp.async that an arrive-on covers: every copy this thread issued so far.
inline void cp_async_mbarrier_arrive_shared_b64(Mem m) {
    Block& b = block();
    emu::Thread* t = b.cur;
    emu::Mbar& mb = mbar(m);
    // the copies this arrive tracks: the thread's open and committed ones
    for (auto& c : t->open) t->arrive_pending.push_back(c);
    for (auto& g : t->groups)
        for (auto& c : g) t->arrive_pending.push_back(c);
    t->open.clear();
    t->groups.clear();
    mb.pending++;  // no .noinc: the pending count goes up, the async arrive takes it down
    emu::AsyncArrive a{(unsigned)m.a, t->arrive_pending.size()};
    if (emu::st().cfg.land_at_issue) {
        do_async_arrive(t, a);
        t->arrive_pending.clear();
    } else {
        t->async_arrives.push_back(a);
    }
}
inline void cp_async_mbarrier_arrive_shared__cta_b64(Mem m) { cp_async_mbarrier_arrive_shared_b64(m); }

// land whatever completes this barrier (lazy mode): bulk copies and async arrivals
inline void settle(unsigned addr) {
    Block& b = block();
    emu::Mbar& mb = b.mbars[addr];
    for (size_t i = 0; i < mb.bulk.size(); i++) {
        emu::copy_land(mb.bulk[i], mb.bulk_issuer[i]);
        auto& slot = mb.acc[b.nthreads + mb.bulk_issuer[i]];
        slot = std::max(slot, mb.bulk[i].clk);
        mb.tx -= mb.bulk[i].bytes;
    }
    mb.bulk.clear();
    mb.bulk_issuer.clear();
    for (auto& t : b.threads) {
        for (size_t k = 0; k < t.async_arrives.size(); k++) {
            if (t.async_arrives[k].bar != addr) continue;
            do_async_arrive(&t, t.async_arrives[k]);
            t.async_arrives.erase(t.async_arrives.begin() + k);
            k--;
        }
        if (t.async_arrives.empty()) t.arrive_pending.clear();
    }
    phase_check(mb);
}

inline bool test_parity(Mem m, unsigned parity) {
    Block& b = block();
    emu::Mbar& mb = mbar(m);
    if (!emu::st().cfg.land_at_issue) settle((unsigned)m.a);
    // the phase of this parity has completed when the current phase's parity differs
    bool ok = (mb.phase & 1u) != (parity & 1u);
    if (ok) {
        // acquire: the clock released into the last completed phase of that parity
        for (auto it = mb.done.rbegin(); it != mb.done.rend(); ++it)
            if ((it->first & 1u) == (parity & 1u)) {
                emu::join(emu::my_vc(), it->second);
                break;
            }
    } else {
        emu::yield_();
    }
    (void)b;
    return ok;
}
inline void mbarrier_try_wait_parity_shared__cta_b64(bool& p, Mem m, unsigned parity) { p = test_parity(m, parity); }
inline void mbarrier_try_wait_parity_shared_b64(bool& p, Mem m, unsigned parity) { p = test_parity(m, parity); }
inline void mbarrier_test_wait_parity_shared_b64(bool& p, Mem m, unsigned parity) { p = test_parity(m, parity); }
inline void mbarrier_test_wait_parity_shared__cta_b64(bool& p, Mem m, unsigned parity) { p = test_parity(m, parity); }

// ---- cp.async.bulk global -> shared, completing `size` bytes of tx on an mbarrier
inline void cp_async_bulk_shared__cluster_global_mbarrier__complete_tx__bytes(Mem dst, Mem src, unsigned size, Mem bar) {
    Block& b = block();
    unsigned d = (unsigned)dst.a;
    if (d % 16 || src.a % 16 || size % 16 || size == 0) {
        char buf[128];
        snprintf(buf, sizeof buf, "emu: cp.async.bulk needs 16-byte alignment and size (shared %u, size %u)", d, size);
        emu::error(buf);
        return;
    }
    emu::copy_issue_check(d, size);
    emu::Thread* t = b.cur;
    emu::Copy c{d, gptr(src.a), size, true, ++t->copy_clk, ++b.seq};
    emu::Mbar& mb = mbar(bar);
    if (emu::st().cfg.land_at_issue) {
        emu::copy_land(c, emu::tid());
        auto& slot = mb.acc[b.nthreads + emu::tid()];
        slot = std::max(slot, c.clk);
        mb.tx -= size;
        phase_check(mb);
    } else {
        mb.bulk.push_back(c);
        mb.bulk_issuer.push_back(emu::tid());
    }
    emu::maybe_yield();
}
inline void cp_async_bulk_shared__cta_global_mbarrier__complete_tx__bytes(Mem dst, Mem src, unsigned size, Mem bar) {
    cp_async_bulk_shared__cluster_global_mbarrier__complete_tx__bytes(dst, src, size, bar);
}

// proxy fences: nothing to model (the emulator has one proxy)
inline void fence_proxy_async_shared__cta() {}
inline void fence_mbarrier_init_release_cluster() {}

// programmatic dependent launch: grids run one after another here, so nothing to wait for
inline void griddepcontrol_wait() {}
inline void griddepcontrol_launch_dependents() {}

// ---- global memory fences and atomics (one block at a time: sequentially consistent)
inline void fence_acq_rel_gpu() {}
inline void membar_gl() {}
inline void atom_global_add_u32(unsigned& d, Mem m, unsigned v) {
    unsigned* p = (unsigned*)gptr(m.a);
    d = *p;
    *p = d + v;
}
inline void st_global_u32(Mem m, unsigned v) { *(unsigned*)gptr(m.a) = v; }

}  // namespace ptx
