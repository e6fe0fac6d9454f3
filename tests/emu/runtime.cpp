// Host emulator of the CUDA C that sparse-mla emits: enough of CUDA to run one kernel on the
// CPU, each GPU thread a fiber on the OS thread that launched it. The emitted helpers run as
// printed: tests/emu/ptx.rs translates every inline-PTX statement into a call of the
// `ptx::` function of the same instruction (prelude.h declares them; those that touch the
// emulator's state are below), with the operands in the order the asm string gives them, so
// a wrong operand order in an emitted helper is a wrong answer here.
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
//   or a read of a copy's destination before the copy is known to have landed) is a race;
// - the proxies of a bulk copy: its writes, and its complete_tx on an mbarrier, must come
//   after a proxy fence of the thread whose plain store or mbarrier.init was there before
//   (`proxy_copy_check`, `proxy_mbar_check`).
// Errors (races, deadlocks, misaligned copies, bad shared addresses) are collected and
// returned by the launch; nothing aborts the host process.
//
// Compiled once per process, after prelude.h, into the shared library every kernel links
// against. The state is per OS thread: launches from different threads run at once.
#include <algorithm>
#include <map>
#include <memory>
#include <chrono>
#include <string>
#include <thread>
#include <ucontext.h>
#include <vector>

namespace emu {

// ---- fibers: a GPU thread's stack and registers. On x86-64 a switch saves and loads the
// callee-saved registers and the stack pointer only (swapcontext also saves the signal mask
// — a system call — and the floating-point environment, which the emulator never changes);
// elsewhere ucontext.
#if defined(__x86_64__)
struct Fiber {
    void* sp = nullptr;
};
extern "C" void emu_fiber_switch(void** save_sp, void* load_sp);
asm(R"(
    .pushsection .text
    .globl emu_fiber_switch
    .hidden emu_fiber_switch
    .type emu_fiber_switch, @function
emu_fiber_switch:
    pushq %rbp
    pushq %rbx
    pushq %r12
    pushq %r13
    pushq %r14
    pushq %r15
    movq %rsp, (%rdi)
    movq %rsi, %rsp
    popq %r15
    popq %r14
    popq %r13
    popq %r12
    popq %rbx
    popq %rbp
    ret
    .size emu_fiber_switch, .-emu_fiber_switch
    .popsection
)");
// A fiber that starts in `entry` (which never returns): six zero registers, then `entry` as
// the address the switch returns to, and below the 16-byte aligned top a slot where a call's
// return address would be (the ABI's stack alignment at a function's entry).
inline void fiber_start(Fiber& f, char* stack, size_t size, void (*entry)()) {
    uintptr_t top = ((uintptr_t)stack + size) & ~(uintptr_t)15;
    void** sp = (void**)top - 8;
    for (int i = 0; i < 6; i++) sp[i] = nullptr;
    sp[6] = (void*)entry;
    sp[7] = nullptr;
    f.sp = sp;
}
inline void fiber_switch(Fiber& from, Fiber& to) { emu_fiber_switch(&from.sp, to.sp); }
#else
struct Fiber {
    ucontext_t ctx;
};
inline void fiber_start(Fiber& f, char* stack, size_t size, void (*entry)()) {
    getcontext(&f.ctx);
    f.ctx.uc_stack.ss_sp = stack;
    f.ctx.uc_stack.ss_size = size;
    f.ctx.uc_link = nullptr;
    makecontext(&f.ctx, entry, 0);
}
inline void fiber_switch(Fiber& from, Fiber& to) { swapcontext(&from.ctx, &to.ctx); }
#endif

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
    Fiber ctx;
    emu_dim3 idx;
    bool done = false;
    std::vector<Copy> open;                 // cp.async issued, not yet committed
    std::vector<std::vector<Copy>> groups;  // committed, oldest first
    std::vector<Copy> arrive_pending;       // cp.async copies an async arrive waits for
    std::vector<AsyncArrive> async_arrives;
    unsigned copy_clk = 0;
    // the thread's clock at each of its proxy fences, oldest first: fence.proxy.async, and
    // (for mbarrier inits only) fence.mbarrier_init
    std::vector<unsigned> proxy_fences, init_fences;
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
    unsigned w_fences = 0;  // the writing thread's proxy fences before the write
    std::vector<Read> reads;
    bool sync_object = false;  // an mbarrier: accessed only through mbarrier ops
};

struct Mbar {
    unsigned expected = 0, pending = 0;
    long long tx = 0;
    unsigned phase = 0;  // completed phases
    std::vector<unsigned> acc;                  // clock released into the current phase
    unsigned init_actor = ~0u;                  // the thread whose mbarrier.init made it
    unsigned init_fences[2] = {0, 0};           // its proxy and init fences before the init
    std::map<unsigned, std::vector<unsigned>> done;  // phase number -> clock at completion
    std::vector<Copy> bulk;                     // bulk copies not landed, completing tx here
    std::vector<unsigned> bulk_issuer;
};

struct Block {
    std::vector<Thread> threads;
    std::vector<std::unique_ptr<char[]>> stacks;
    Barrier named[16];
    std::vector<Barrier> warp_bar;
    std::vector<WarpDeposit> deposit[2];
    std::vector<unsigned> warp_round;
    Fiber sched;
    Thread* cur = nullptr;
    void (*fn)(void*) = nullptr;
    void* ctx = nullptr;
    // race detection
    unsigned nthreads = 0;
    std::vector<std::vector<unsigned>> vc;  // per thread: clock of every actor (threads, then copy engines)
    std::vector<Shadow> shadow;
    unsigned shadow_hi = 0;  // words below it may differ from a fresh Shadow
    // per word, a bit per thread: the thread has an entry in the word's `reads`
    std::vector<uint64_t> readers;
    unsigned reader_words = 0;  // u64 per shadow word
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
    alignas(16) unsigned char shared[SMEM_BYTES];
};

// this thread's state, made at its first launch
EMU_TLS State* state = nullptr;
EMU_TLS unsigned char* smem = nullptr;
EMU_TLS emu_dim3* cur_idx = nullptr;
__attribute__((noinline)) State& new_state() {
    static thread_local std::unique_ptr<State> owner;
    owner.reset(new State);
    state = owner.get();
    smem = state->shared;
    return *state;
}
inline State& st() { return state ? *state : new_state(); }
inline Block& block() { return st().b; }


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
    fiber_switch(b.cur->ctx, b.sched);
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

unsigned shared_offset(const void* p) {
    const unsigned char* c = (const unsigned char*)p;
    if (c < smem || c >= smem + SMEM_BYTES) {
        error("emu: a shared-memory instruction got an address outside shared memory");
        return 0;
    }
    return (unsigned)(c - smem);
}

inline Shadow& shadow_at(Block& b, unsigned word) {
    if (word >= b.shadow_hi) b.shadow_hi = word + 1;
    return b.shadow[word];
}
inline void clear_reads(Block& b, Shadow& s, unsigned word) {
    s.reads.clear();
    memset(&b.readers[(size_t)word * b.reader_words], 0, b.reader_words * sizeof(uint64_t));
}

inline void check_read(unsigned word) {
    Block& b = block();
    Shadow& s = shadow_at(b, word);
    if (s.sync_object) return;
    unsigned me = tid();
    auto& vc = b.vc[me];
    if (!ordered(vc, me, s.w_actor, s.w_clk)) race("read after write", word, s.w_actor, "reads");
    uint64_t& mine = b.readers[(size_t)word * b.reader_words + me / 64];
    const uint64_t bit = 1ull << (me % 64);
    if (mine & bit) {
        // this thread's entry (one a thread): most often the last
        Read* r = &s.reads.back();
        while (r->actor != me) r--;
        r->clk = vc[me];
        r->seq = ++b.seq;
        return;
    }
    mine |= bit;
    s.reads.push_back({me, vc[me], ++b.seq});
}

inline void check_write(unsigned word) {
    Block& b = block();
    Shadow& s = shadow_at(b, word);
    if (s.sync_object) return;
    unsigned me = tid();
    auto& vc = b.vc[me];
    if (!ordered(vc, me, s.w_actor, s.w_clk)) race("write after write", word, s.w_actor, "writes");
    for (auto& r : s.reads)
        if (!ordered(vc, me, r.actor, r.clk)) {
            race("write after read", word, r.actor, "writes");
            break;
        }
    clear_reads(b, s, word);
    s.w_actor = me;
    s.w_clk = vc[me];
    s.w_seq = ++b.seq;
    s.w_fences = (unsigned)b.threads[me].proxy_fences.size();
}

void sh_read(const void* p, unsigned bytes) {
    unsigned off = shared_offset(p);
    for (unsigned w = off / 4; w < (off + bytes + 3) / 4; w++) check_read(w);
}
void sh_write(const void* p, unsigned bytes) {
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
// Proxies. A thread's plain stores to shared memory are in the generic proxy, a bulk copy's
// writes (cp.async.bulk) in the async proxy, and an mbarrier's complete_tx by a bulk copy is
// an async-proxy access of it. A generic write and a later async-proxy access of the same
// memory are ordered only through a proxy fence of the writing thread after the write that
// is itself ordered before the access (`fence.proxy.async`; for an mbarrier's init also
// `fence.mbarrier_init`). Not modelled, as the hardware needs none in practice: generic
// reads before an async write (ordered by the mbarrier hand-off) and the copies of the
// non-bulk cp.async.
//
// The first of `fences` (a thread's fence clocks) after the `before`-th, if any, ordered
// before this thread's next event.
inline bool fenced_for_me(const std::vector<unsigned>& fences, unsigned before, unsigned actor) {
    if (before >= fences.size()) return false;
    return ordered(my_vc(), tid(), actor, fences[before]);
}
inline void proxy_error(const char* what, unsigned byte_off, unsigned writer) {
    char buf[320];
    Block& b = block();
    snprintf(buf, sizeof buf,
             "emu: async-proxy access without a proxy fence at %s: thread %u's bulk copy %s of %s, and no proxy "
             "fence of that thread after it is ordered before the copy (block %u,%u,%u)",
             where(byte_off).c_str(), tid(), what, actor_name(writer).c_str(), b.bidx.x, b.bidx.y, b.bidx.z);
    error(buf);
}
// a bulk copy into [dst, dst + bytes), issued by this thread
inline void proxy_copy_check(unsigned dst, unsigned bytes) {
    Block& b = block();
    for (unsigned w = dst / 4; w < (dst + bytes) / 4; w++) {
        Shadow& s = b.shadow[w];
        if (s.w_actor >= b.nthreads) continue;  // nobody, or a copy
        if (!fenced_for_me(b.threads[s.w_actor].proxy_fences, s.w_fences, s.w_actor)) {
            proxy_error("writes over a plain store", w * 4, s.w_actor);
            return;
        }
    }
}
// an mbarrier (at byte `at`) that a bulk copy completes tx on, from this thread's issue
inline void proxy_mbar_check(const Mbar& mb, unsigned at) {
    Block& b = block();
    if (mb.init_actor >= b.nthreads) return;
    const Thread& t = b.threads[mb.init_actor];
    if (!fenced_for_me(t.proxy_fences, mb.init_fences[0], mb.init_actor) &&
        !fenced_for_me(t.init_fences, mb.init_fences[1], mb.init_actor))
        proxy_error("completes tx on the mbarrier.init", at, mb.init_actor);
}

inline void copy_land(const Copy& c, unsigned issuer) {
    Block& b = block();
    if (c.valid) memcpy(smem + c.dst, c.src, c.bytes);
    else memset(smem + c.dst, 0, c.bytes);
    for (unsigned w = c.dst / 4; w < (c.dst + c.bytes) / 4; w++) {
        Shadow& s = shadow_at(b, w);
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
        clear_reads(b, s, w);
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
void bar_sync(unsigned id, unsigned n) {
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
void syncwarp() {
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
    fiber_switch(b.cur->ctx, b.sched);
}


// Run the blocks of `grid` one after another (`only`: that block alone).
void run_grid(emu_dim3 grid, unsigned threads, void (*fn)(void*), void* ctx, const emu_dim3* only) {
    Block& b = block();
    const size_t stack = 256 * 1024;
    gridDim = grid;
    blockDim = {threads, 1, 1};
    unsigned warps = (threads + 31) / 32;
    b.stacks.resize(threads);
    for (auto& s : b.stacks)
        if (!s) s.reset(new char[stack]);
    b.warp_bar.assign(warps, Barrier{});
    b.deposit[0].assign(warps, WarpDeposit{});
    b.deposit[1].assign(warps, WarpDeposit{});
    b.fn = fn;
    b.ctx = ctx;
    b.nthreads = threads;
    b.rng = st().cfg.seed * 0x9e3779b97f4a7c15ull + 1;
    if (b.shadow.size() != SMEM_WORDS) {
        b.shadow.assign(SMEM_WORDS, Shadow{});
        b.shadow_hi = 0;
    }
    if (b.reader_words != (threads + 63) / 64) {
        b.reader_words = (threads + 63) / 64;
        b.readers.assign((size_t)SMEM_WORDS * b.reader_words, 0);
    }
    std::vector<unsigned> order(threads);
    for (unsigned z = 0; z < grid.z; z++)
        for (unsigned y = 0; y < grid.y; y++)
            for (unsigned x = 0; x < grid.x; x++) {
                if (only && (only->x != x || only->y != y || only->z != z)) continue;
                blockIdx = {x, y, z};
                b.bidx = blockIdx;
                b.threads.assign(threads, Thread{});
                for (auto& nb : b.named) nb = Barrier{};
                for (auto& wb : b.warp_bar) wb = Barrier{};
                b.warp_round.assign(warps, 0);
                b.vc.assign(threads, std::vector<unsigned>(2 * threads, 0));
                for (unsigned t = 0; t < threads; t++) b.vc[t][t] = 1;
                // the shadow as fresh: the words touched since the last block
                for (unsigned w = 0; w < b.shadow_hi; w++) {
                    Shadow& s = b.shadow[w];
                    s.w_actor = ~0u, s.w_clk = 0, s.w_seq = 0, s.sync_object = false;
                    s.reads.clear();
                }
                memset(b.readers.data(), 0, (size_t)b.shadow_hi * b.reader_words * sizeof(uint64_t));
                b.shadow_hi = 0;
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
                    // the stacks' tops staggered (17 cache lines a thread, within 64 KiB), else
                    // every fiber's top frames fall in the same cache sets
                    fiber_start(th.ctx, b.stacks[t].get(), stack - t * 1088 % 65536, trampoline);
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
                        cur_idx = &th.idx;
                        fiber_switch(b.sched, th.ctx);
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

void name_shared(const char* name, unsigned off) {
    Block& b = block();
    bool known = false;
    for (auto& n : b.names) known |= n.first == off && n.second == name;
    if (!known) b.names.push_back({off, name});
}
unsigned place_static(const char* name, unsigned bytes) {
    Block& b = block();
    auto it = b.static_alloc.find(name);
    if (it != b.static_alloc.end()) return it->second;
    unsigned off = b.static_top;
    b.static_top += (bytes + 15) / 16 * 16;
    b.static_alloc[name] = off;
    b.names.push_back({off, name});
    return off;
}

unsigned launch(emu_dim3 grid, unsigned threads, void (*fn)(void*), void* ctx, bool land_at_issue,
                unsigned long long seed, bool cooperative) {
    State& s = st();
    s.errors.clear();
    s.nerrors = 0;
    s.cfg.land_at_issue = land_at_issue;
    s.cfg.seed = seed;
    if (!cooperative) {
        run_grid(grid, threads, fn, ctx, nullptr);
        return s.nerrors;
    }
    // A cooperative launch: every block resident at once, as the GPU keeps them, so that
    // blocks that wait for each other (group_sync) meet. Each block runs on its own OS thread
    // (with its own emulator state), started after a delay drawn from the seed, so that the
    // blocks arrive in a different order each run.
    const unsigned blocks = grid.x * grid.y * grid.z;
    std::vector<std::string> errs(blocks);
    std::vector<unsigned> counts(blocks, 0);
    std::vector<std::thread> workers;
    workers.reserve(blocks);
    unsigned long long r = seed * 0x9e3779b97f4a7c15ull + 7;
    for (unsigned i = 0; i < blocks; i++) {
        r = r * 6364136223846793005ull + 1442695040888963407ull;
        const unsigned delay_us = (unsigned)(r >> 33) % 2000;
        const emu_dim3 b{i % grid.x, i / grid.x % grid.y, i / (grid.x * grid.y)};
        workers.emplace_back([=, &errs, &counts] {
            std::this_thread::sleep_for(std::chrono::microseconds(delay_us));
            State& w = st();
            w.errors.clear();
            w.nerrors = 0;
            w.cfg.land_at_issue = land_at_issue;
            w.cfg.seed = seed + i;
            run_grid(grid, threads, fn, ctx, &b);
            errs[i] = w.errors;
            counts[i] = w.nerrors;
        });
    }
    for (auto& w : workers) w.join();
    for (unsigned i = 0; i < blocks; i++) {
        if (counts[i] == 0) continue;
        if (s.nerrors < 8) s.errors += errs[i];
        s.nerrors += counts[i];
    }
    return s.nerrors;
}
const char* errors() { return st().errors.c_str(); }
}  // namespace emu

EMU_TLS emu_dim3 blockIdx, gridDim, blockDim;

// ---- the PTX instructions that touch the emulator's state (prelude.h declares them)
namespace ptx {

// A polling thread yields its OS thread to the other blocks. Polls that go on for a minute
// wait for a block that never arrives: a hang on a GPU, reported and ended here.
void nanosleep_u32(unsigned) {
    using clock = std::chrono::steady_clock;
    static thread_local clock::time_point since;
    static thread_local unsigned long long polls = 0;
    if (polls++ % 4096 == 0) {
        if (polls == 1) since = clock::now();
        else if (clock::now() - since > std::chrono::seconds(60)) {
            fprintf(stderr, "emu: a block polled for 60 s (block %u,%u,%u): a group meeting that never completes\n",
                    blockIdx.x, blockIdx.y, blockIdx.z);
            abort();
        }
    }
    std::this_thread::yield();
}

using emu::Block;
using emu::block;

// f32 -> e4m3 "fn" by search (a reference apart from the kernel's bit path): the nearest of
// the 127 finite magnitudes (a table, ascending with the code, built once from e4m3_value),
// ties to the even code, beyond 448 (and NaN) saturated to 448
unsigned f32_to_e4m3_ref(float f) {
    static const std::vector<double> mags = [] {
        std::vector<double> v(0x7f);
        for (unsigned c = 0; c < 0x7fu; c++) v[c] = (double)e4m3_value(c);
        return v;
    }();
    const unsigned sign = (__float_as_uint(f) >> 24) & 0x80u;
    const double a = std::fabs((double)f);
    if (!(a <= 448.0)) return sign | 0x7eu;
    // the first magnitude >= a, and the one below it: the nearest is one of the two
    const unsigned hi = (unsigned)(std::lower_bound(mags.begin(), mags.end(), a) - mags.begin());
    if (hi == 0) return sign;
    const unsigned lo = hi - 1;
    const double dlo = a - mags[lo], dhi = mags[hi] - a;
    return sign | (dlo < dhi ? lo : dhi < dlo ? hi : (lo & 1u) ? hi : lo);
}

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
void cp_async_cg_shared_global(Mem dst, Mem src, unsigned cp, unsigned src_size) { cp_async(dst, src, cp, src_size); }
void cp_async_ca_shared_global(Mem dst, Mem src, unsigned cp, unsigned src_size) { cp_async(dst, src, cp, src_size); }
void cp_async_commit_group() {
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
void cp_async_wait_group(unsigned n) {
    emu::Thread* t = block().cur;
    while (t->groups.size() > n) {
        land_and_acquire(t, t->groups.front());
        t->groups.erase(t->groups.begin());
    }
}
void cp_async_wait_all() {
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
void ldmatrix_sync_aligned_m8n8_x4_shared_b16(unsigned& a, unsigned& b, unsigned& c, unsigned& d, Mem m) {
    unsigned r[4];
    ldmatrix(r, (unsigned)m.a, 4, false);
    a = r[0], b = r[1], c = r[2], d = r[3];
}
void ldmatrix_sync_aligned_m8n8_x4_trans_shared_b16(unsigned& a, unsigned& b, unsigned& c, unsigned& d, Mem m) {
    unsigned r[4];
    ldmatrix(r, (unsigned)m.a, 4, true);
    a = r[0], b = r[1], c = r[2], d = r[3];
}
void ldmatrix_sync_aligned_m8n8_x2_shared_b16(unsigned& a, unsigned& b, Mem m) {
    unsigned r[2];
    ldmatrix(r, (unsigned)m.a, 2, false);
    a = r[0], b = r[1];
}
void ldmatrix_sync_aligned_m8n8_x2_trans_shared_b16(unsigned& a, unsigned& b, Mem m) {
    unsigned r[2];
    ldmatrix(r, (unsigned)m.a, 2, true);
    a = r[0], b = r[1];
}
void ldmatrix_sync_aligned_m8n8_x1_shared_b16(unsigned& a, Mem m) { ldmatrix(&a, (unsigned)m.a, 1, false); }
void ldmatrix_sync_aligned_m8n8_x1_trans_shared_b16(unsigned& a, Mem m) { ldmatrix(&a, (unsigned)m.a, 1, true); }

// c + a[0] b[0] + a[1] b[1] + ... in double, k ascending, where the sum came out NaN: which NaN
// (its sign, its payload) depends on the operands' order in each instruction (x86 keeps the
// first one's), so the order is explicit here (a product keeps a's NaN, a sum the running
// sum's) rather than the compiler's choice.
inline double dot_nan(double c, const float* a, const float* b, int n) {
    double s = c;
    for (int k = 0; k < n; k++) {
        const double x = a[k], y = b[k];
        const double p = x != x ? x : x * y;
        s = s != s ? s : s + p;
    }
    return s;
}

// An m16n8 mma's four outputs from this lane's rows of A and columns of B (K deep):
// d0..d3: (g, 2q), (g, 2q+1), (g+8, 2q), (g+8, 2q+1); each a sum from c over k ascending
// (the four chains side by side).
template <int K>
inline void mma_sums(const float (&A)[2][K], const float (&B)[2][K], float c0, float c1, float c2, float c3,
                     float& d0, float& d1, float& d2, float& d3) {
    double s0 = c0, s1 = c1, s2 = c2, s3 = c3;
    for (int k = 0; k < K; k++) {
        const double a0k = A[0][k], a1k = A[1][k], b0k = B[0][k], b1k = B[1][k];
        s0 += a0k * b0k;
        s1 += a0k * b1k;
        s2 += a1k * b0k;
        s3 += a1k * b1k;
    }
    // a NaN stays NaN: a sum that is not NaN met none, and its operands' order did not matter
    if (s0 != s0) s0 = dot_nan(c0, A[0], B[0], K);
    if (s1 != s1) s1 = dot_nan(c1, A[0], B[1], K);
    if (s2 != s2) s2 = dot_nan(c2, A[1], B[0], K);
    if (s3 != s3) s3 = dot_nan(c3, A[1], B[1], K);
    d0 = (float)s0, d1 = (float)s1, d2 = (float)s2, d3 = (float)s3;
}

// ---- mma.sync m16n8k16 row.col bf16 / f16 -> f32, by the PTX fragment layouts:
// A: a0 (g, 2q..), a1 (g+8, 2q..), a2 (g, 2q+8..), a3 (g+8, 2q+8..)
// B: b0 (k 2q.., n g), b1 (k 2q+8.., n g);  C, D: d0,d1 (g, 2q..), d2,d3 (g+8, 2q..)
// `lo` / `hi` read the low / high 16-bit value of a register.
static void mma_m16n8k16(float (*lo)(unsigned), float (*hi)(unsigned), float& d0, float& d1, float& d2,
                         float& d3, unsigned a0, unsigned a1, unsigned a2, unsigned a3, unsigned b0, unsigned b1,
                         float c0, float c1, float c2, float c3) {
    emu::WarpDeposit& d = emu::deposit_begin();
    unsigned l = emu::lane();
    unsigned in[6] = {a0, a1, a2, a3, b0, b1};
    for (int i = 0; i < 6; i++) d.u[l][i] = in[i];
    emu::deposit_sync();
    // this lane's rows g and g+8 of A (from lanes 4g..4g+3) and columns 2q, 2q+1 of B (from
    // lanes 4(2q)+.. and 4(2q+1)+..): what its four outputs read
    unsigned g = l / 4, q = l % 4;
    float A[2][16], B[2][16];
    for (unsigned j = 0; j < 4; j++) {
        const unsigned* u = d.u[4 * g + j];
        for (unsigned h = 0; h < 2; h++) {
            A[h][2 * j] = lo(u[h]);
            A[h][2 * j + 1] = hi(u[h]);
            A[h][2 * j + 8] = lo(u[2 + h]);
            A[h][2 * j + 9] = hi(u[2 + h]);
            const unsigned* v = d.u[4 * (2 * q + h) + j];
            B[h][2 * j] = lo(v[4]);
            B[h][2 * j + 1] = hi(v[4]);
            B[h][2 * j + 8] = lo(v[5]);
            B[h][2 * j + 9] = hi(v[5]);
        }
    }
    mma_sums(A, B, c0, c1, c2, c3, d0, d1, d2, d3);
}

static float f16_lo_value(unsigned r) { return f16_to_f32(r & 0xffffu); }
static float f16_hi_value(unsigned r) { return f16_to_f32(r >> 16); }

void mma_sync_aligned_m16n8k16_row_col_f32_bf16_bf16_f32(float& d0, float& d1, float& d2, float& d3, unsigned a0,
                                                        unsigned a1, unsigned a2, unsigned a3, unsigned b0,
                                                        unsigned b1, float c0, float c1, float c2, float c3) {
    mma_m16n8k16(bf16_lo, bf16_hi, d0, d1, d2, d3, a0, a1, a2, a3, b0, b1, c0, c1, c2, c3);
}

void mma_sync_aligned_m16n8k16_row_col_f32_f16_f16_f32(float& d0, float& d1, float& d2, float& d3, unsigned a0,
                                                      unsigned a1, unsigned a2, unsigned a3, unsigned b0,
                                                      unsigned b1, float c0, float c1, float c2, float c3) {
    mma_m16n8k16(f16_lo_value, f16_hi_value, d0, d1, d2, d3, a0, a1, a2, a3, b0, b1, c0, c1, c2, c3);
}

// ---- mma.sync m16n8k32 row.col e4m3 -> f32, by the PTX fragment layouts (4 bytes a register):
// A: a0 (g, 4q..), a1 (g+8, 4q..), a2 (g, 16+4q..), a3 (g+8, 16+4q..)
// B: b0 (k 4q.., n g), b1 (k 16+4q.., n g);  C, D as m16n8k16
void mma_sync_aligned_m16n8k32_row_col_f32_e4m3_e4m3_f32(float& d0, float& d1, float& d2, float& d3, unsigned a0,
                                                        unsigned a1, unsigned a2, unsigned a3, unsigned b0,
                                                        unsigned b1, float c0, float c1, float c2, float c3) {
    emu::WarpDeposit& d = emu::deposit_begin();
    unsigned l = emu::lane();
    unsigned in[6] = {a0, a1, a2, a3, b0, b1};
    for (int i = 0; i < 6; i++) d.u[l][i] = in[i];
    emu::deposit_sync();
    // this lane's rows g and g+8 of A (from lanes 4g..4g+3) and columns 2q, 2q+1 of B (from
    // lanes 4(2q)+.. and 4(2q+1)+..): what its four outputs read, decoded by a table
    static const std::vector<float> value = [] {
        std::vector<float> v(256);
        for (unsigned b = 0; b < 256; b++) v[b] = e4m3_value(b);
        return v;
    }();
    unsigned g = l / 4, q = l % 4;
    float A[2][32], B[2][32];
    for (unsigned j = 0; j < 4; j++) {
        const unsigned* u = d.u[4 * g + j];
        for (unsigned h = 0; h < 2; h++) {
            const unsigned* v = d.u[4 * (2 * q + h) + j];
            for (unsigned i = 0; i < 4; i++) {
                A[h][4 * j + i] = value[(u[h] >> (8 * i)) & 0xffu];
                A[h][16 + 4 * j + i] = value[(u[2 + h] >> (8 * i)) & 0xffu];
                B[h][4 * j + i] = value[(v[4] >> (8 * i)) & 0xffu];
                B[h][16 + 4 * j + i] = value[(v[5] >> (8 * i)) & 0xffu];
            }
        }
    }
    mma_sums(A, B, c0, c1, c2, c3, d0, d1, d2, d3);
}

// ---- shfl.sync.bfly: d = a of lane (lane ^ b)
void shfl_sync_bfly_b32(float& d, float a, unsigned b, unsigned c, unsigned mask) {
    emu::WarpDeposit& dep = emu::deposit_begin();
    unsigned l = emu::lane();
    dep.f[l][0] = a;
    emu::deposit_sync();
    if (mask != 0xffffffffu || c != 0x1f) emu::error("emu: shfl.sync with a partial mask or clamp not modelled");
    d = dep.f[(l ^ b) & 31][0];
}
void shfl_sync_bfly_b32(unsigned& d, unsigned a, unsigned b, unsigned c, unsigned mask) {
    float x;
    shfl_sync_bfly_b32(x, __uint_as_float(a), b, c, mask);
    d = __float_as_uint(x);
}

}  // namespace ptx

// ---- vote.sync.any over the full warp (CUDA's __any_sync)
bool __any_sync(unsigned mask, bool pred) {
    emu::WarpDeposit& dep = emu::deposit_begin();
    unsigned l = emu::lane();
    dep.u[l][0] = pred ? 1u : 0u;
    emu::deposit_sync();
    if (mask != 0xffffffffu) emu::error("emu: __any_sync with a partial mask not modelled");
    bool any = false;
    for (unsigned i = 0; i < 32; i++) any = any || dep.u[i][0] != 0u;
    return any;
}

namespace ptx {
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
void mbarrier_init_shared_b64(Mem m, unsigned count) {
    Block& b = block();
    emu::sh_write(emu::smem + m.a, 8);
    emu::Mbar& mb = mbar(m, true);
    mb = emu::Mbar{};
    mb.expected = mb.pending = count;
    mb.init_actor = emu::tid();
    mb.init_fences[0] = (unsigned)b.threads[emu::tid()].proxy_fences.size();
    mb.init_fences[1] = (unsigned)b.threads[emu::tid()].init_fences.size();
    mb.acc.assign(b.vc[0].size(), 0);
    for (unsigned w = (unsigned)m.a / 4; w < (unsigned)m.a / 4 + 2; w++) emu::shadow_at(b, w).sync_object = true;
}
void mbarrier_init_shared__cta_b64(Mem m, unsigned count) { mbarrier_init_shared_b64(m, count); }
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
void mbarrier_arrive_shared_b64(unsigned long long& state, Mem m) {
    emu::Mbar& mb = mbar(m);
    state = mb.phase;
    release_into(mb);
    arrive(mb);
    emu::maybe_yield();
}
void mbarrier_arrive_shared__cta_b64(unsigned long long& state, Mem m) { mbarrier_arrive_shared_b64(state, m); }
void mbarrier_expect_tx_shared__cta_b64(Mem m, unsigned tx) { mbar(m).tx += tx; }
void mbarrier_expect_tx_relaxed_cta_shared__cta_b64(Mem m, unsigned tx) { mbar(m).tx += tx; }
void mbarrier_arrive_expect_tx_shared__cta_b64(unsigned long long& state, Mem m, unsigned tx) {
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
void cp_async_mbarrier_arrive_shared_b64(Mem m) {
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
void cp_async_mbarrier_arrive_shared__cta_b64(Mem m) { cp_async_mbarrier_arrive_shared_b64(m); }

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
void mbarrier_try_wait_parity_shared__cta_b64(bool& p, Mem m, unsigned parity) { p = test_parity(m, parity); }
void mbarrier_try_wait_parity_shared_b64(bool& p, Mem m, unsigned parity) { p = test_parity(m, parity); }
void mbarrier_test_wait_parity_shared_b64(bool& p, Mem m, unsigned parity) { p = test_parity(m, parity); }
void mbarrier_test_wait_parity_shared__cta_b64(bool& p, Mem m, unsigned parity) { p = test_parity(m, parity); }

// ---- cp.async.bulk global -> shared, completing `size` bytes of tx on an mbarrier
void cp_async_bulk_shared__cluster_global_mbarrier__complete_tx__bytes(Mem dst, Mem src, unsigned size, Mem bar) {
    Block& b = block();
    unsigned d = (unsigned)dst.a;
    if (d % 16 || src.a % 16 || size % 16 || size == 0) {
        char buf[128];
        snprintf(buf, sizeof buf, "emu: cp.async.bulk needs 16-byte alignment and size (shared %u, size %u)", d, size);
        emu::error(buf);
        return;
    }
    emu::copy_issue_check(d, size);
    emu::proxy_copy_check(d, size);
    emu::Thread* t = b.cur;
    emu::Copy c{d, gptr(src.a), size, true, ++t->copy_clk, ++b.seq};
    emu::Mbar& mb = mbar(bar);
    emu::proxy_mbar_check(mb, (unsigned)bar.a);
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
void cp_async_bulk_shared__cta_global_mbarrier__complete_tx__bytes(Mem dst, Mem src, unsigned size, Mem bar) {
    cp_async_bulk_shared__cluster_global_mbarrier__complete_tx__bytes(dst, src, size, bar);
}

// proxy fences: the thread's clock now (its next release covers the fence)
void fence_proxy_async_shared__cta() { block().threads[emu::tid()].proxy_fences.push_back(emu::my_vc()[emu::tid()]); }
void fence_mbarrier_init_release_cluster() { block().threads[emu::tid()].init_fences.push_back(emu::my_vc()[emu::tid()]); }

}  // namespace ptx
