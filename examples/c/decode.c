/* Sparse MLA decode from C with nothing but the repository's cuda/ folder: the generated
 * kernels (the .cu files of cuda/, compiled to cubin or PTX) and cuda/sparse_mla.h (launch rules and plan
 * helpers). Loads the kernels through the CUDA driver API, plans each call the way the
 * sparse-mla runtime does, launches, and checks out and lse against a CPU reference in double.
 *
 * Build and run (docs/integration.md; tools/gpu-integrate.sh does this on a GPU machine):
 *   cc -O2 -std=c99 -I cuda -I $CUDA_HOME/include examples/c/decode.c -o decode \
 *      -L $CUDA_HOME/lib64/stubs -lcuda -lm
 *   mkdir -p build
 *   for k in $(./decode --list | sort -u); do nvcc -cubin -arch=sm_90 -o build/$k.cubin cuda/$k.cu; done
 *   ./decode build [seed]
 */
#include <cuda.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "sparse_mla.h"

#define CK(x)                                                                          \
    do {                                                                               \
        CUresult r_ = (x);                                                             \
        if (r_ != CUDA_SUCCESS) {                                                      \
            const char* s_ = 0;                                                        \
            cuGetErrorString(r_, &s_);                                                 \
            fprintf(stderr, "%s:%d: %s failed: %s\n", __FILE__, __LINE__, #x, s_ ? s_ : "?"); \
            exit(2);                                                                   \
        }                                                                              \
    } while (0)

/* ---- host helpers: random numbers, bf16 and e4m3 ---- */
static uint64_t rng_state;
static uint64_t rng_next(void) { /* splitmix64 */
    uint64_t z = (rng_state += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}
static double rng_unit(void) { return (double)(rng_next() >> 11) / 9007199254740992.0; }
static unsigned rng_below(unsigned n) { return (unsigned)(rng_next() % n); }

static uint16_t f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    u += 0x7FFFu + ((u >> 16) & 1u); /* round to nearest even (inputs are finite) */
    return (uint16_t)(u >> 16);
}
static double bf16_to_f64(uint16_t b) {
    uint32_t u = (uint32_t)b << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}
static double e4m3_to_f64(uint8_t b) { /* e4m3fn: no infinities, 0x7f / 0xff are NaN */
    int e = (b >> 3) & 15, m = b & 7;
    double v = e == 0 ? ldexp(m / 8.0, -6) : ldexp(1.0 + m / 8.0, e - 7);
    if ((b & 0x7F) == 0x7F) return NAN;
    return (b & 0x80) ? -v : v;
}

/* ---- one test case ---- */
typedef struct {
    int format;
    unsigned heads, tokens, topk, page_size, num_pages;
    unsigned splits;     /* 0: the runtime's model */
    int with_length;     /* topk_length given */
} decode_case;

/* Kernel functions by name, loaded once from DIR/NAME.cubin (else DIR/NAME.ptx). */
#define MAX_FUNCS 16
static struct { const char* name; CUfunction f; } funcs[MAX_FUNCS];
static CUfunction get_function(const char* dir, const char* name, unsigned dynamic_smem) {
    char path[4096];
    CUmodule m;
    CUfunction f;
    int i;
    FILE* probe;
    for (i = 0; i < MAX_FUNCS && funcs[i].name; ++i)
        if (strcmp(funcs[i].name, name) == 0) return funcs[i].f;
    snprintf(path, sizeof path, "%s/%s.cubin", dir, name);
    probe = fopen(path, "rb");
    if (!probe) snprintf(path, sizeof path, "%s/%s.ptx", dir, name);
    else fclose(probe);
    CK(cuModuleLoad(&m, path));
    CK(cuModuleGetFunction(&f, m, name));
    /* the tensor-core kernels take 78-99 KB of dynamic shared memory: opt in first */
    CK(sparse_mla_allow_smem(f, dynamic_smem));
    if (i < MAX_FUNCS) { funcs[i].name = name; funcs[i].f = f; }
    return f;
}

static int run_case(const char* dir, CUdevice dev, const decode_case* c, unsigned case_no) {
    const unsigned D = SPARSE_MLA_D_QK, DV = SPARSE_MLA_D_V;
    const unsigned row_bytes = sparse_mla_row_bytes(c->format);
    const unsigned long long num_slots = (unsigned long long)c->num_pages * c->page_size;
    const unsigned T = c->tokens, H = c->heads, K = c->topk;
    const float scale = 0.0625f;
    sparse_mla_decode_plan plan;
    sparse_mla_decode_params prm;
    sparse_mla_decode_buffers b;
    unsigned sms = 0, v6_per_sm = 0, resident = 0, row_w = 0, page_w = 0, t, h, j, i;
    const char* err;
    CUfunction first, combine = 0;
    uint16_t *q, *out;
    uint8_t* cache;
    int32_t *idx, *len;
    float* lse;
    unsigned char* referenced;
    double err2 = 0, ref2 = 0, lse_err = 0;
    int bad = 0;

    memset(&b, 0, sizeof b);
    /* 1. the kernel for this call on this GPU, as the runtime picks it: by format, heads, tokens
          and SMs (the large-batch kernel at H <= 16: bf16 when T * ceil(H / 16) * 2 >= SMs, or
          5 * T * ceil(H / 16) >= 4 * SMs where two v6 workgroups fit an SM; fp8_ds_mla when
          16 * T * ceil(H / 16) > SMs), else for
          bf16 by how many workgroups of the v6 split kernel for H one SM holds (v6 where two
          fit: H100/H200; v7 where one: SM120, sm_86/89). Then its function and the workgroups
          of it the device runs at once. SMs and v6_per_sm are per GPU (and head count): a real
          integrator asks once; get_function() loads each kernel once. */
    CK(sparse_mla_sm_count(dev, &sms));
    if (c->format == SPARSE_MLA_CACHE_BF16) {
        sparse_mla_decode_plan v6;
        err = sparse_mla_v6_kernel(H, &v6);
        if (err) { fprintf(stderr, "case %u: %s\n", case_no, err); return 1; }
        CK(sparse_mla_v6_per_sm(get_function(dir, v6.split_kernel, v6.dynamic_smem), &v6, &v6_per_sm));
    } else {
        v6_per_sm = 1; /* fp8_ds_mla runs v7 at any v6 occupancy */
    }
    err = sparse_mla_decode_variant(c->format, H, T, K, sms, v6_per_sm, &plan);
    if (err) { fprintf(stderr, "case %u: %s\n", case_no, err); return 1; }
    first = get_function(dir, plan.split_kernel, plan.dynamic_smem);
    CK(sparse_mla_resident(first, &plan, dev, &resident));
    /* 2. the plan for this call shape (the same kernel, its splits for `resident`) */
    err = sparse_mla_plan_decode(c->format, H, T, K, num_slots, 1, sms, v6_per_sm, resident, c->splits, &plan);
    if (!err) err = sparse_mla_cache_strides(c->format, c->num_pages, c->page_size, 0, 0, &row_w, &page_w);
    if (err) { fprintf(stderr, "case %u: %s\n", case_no, err); return 1; }
    if (plan.splits > 1) combine = get_function(dir, plan.combine_kernel, 0);

    /* 3. inputs: every cache row NaN, then real rows at the slots some index references */
    q = malloc((size_t)T * H * D * 2);
    cache = malloc((size_t)num_slots * row_bytes);
    idx = malloc((size_t)T * K * 4);
    len = malloc((size_t)T * 4);
    out = malloc((size_t)T * H * DV * 2);
    lse = malloc((size_t)T * H * 4);
    referenced = calloc((size_t)num_slots, 1);
    memset(cache, 0xFF, (size_t)num_slots * row_bytes); /* NaN as bf16 and as e4m3fn */
    for (i = 0; i < T * H * D; ++i) q[i] = f32_to_bf16((float)(rng_unit() * 2 - 1));
    for (t = 0; t < T; ++t) {
        for (j = 0; j < K; ++j) {
            int32_t s = (int32_t)rng_below((unsigned)num_slots);
            if (rng_below(10) == 0) s = -1 - (int32_t)rng_below(3); /* invalid: negative */
            if (rng_below(20) == 0) s = (int32_t)(num_slots + rng_below(5)); /* invalid: past the cache */
            if (j == 0) s = -1;                                 /* -1 at the row start */
            if (t == T - 1 && T > 1) s = -1;                    /* a whole row of -1: out 0, lse +inf */
            idx[t * K + j] = s;
        }
        len[t] = c->with_length ? (int32_t)rng_below(K + 1) : (int32_t)K;
        for (j = 0; j < K; ++j)
            if (idx[t * K + j] >= 0 && (unsigned long long)idx[t * K + j] < num_slots && (int32_t)j < len[t])
                referenced[idx[t * K + j]] = 1;
    }
    for (i = 0; i < num_slots; ++i) {
        uint8_t* row = cache + (size_t)i * row_bytes;
        unsigned k;
        if (!referenced[i]) continue;
        if (c->format == SPARSE_MLA_CACHE_BF16) {
            for (k = 0; k < D; ++k) {
                uint16_t v = f32_to_bf16((float)(rng_unit() * 2 - 1));
                memcpy(row + 2 * k, &v, 2);
            }
        } else {
            for (k = 0; k < 512; ++k) {
                uint8_t v = (uint8_t)rng_below(256);
                if ((v & 0x7F) == 0x7F) v ^= 1; /* a finite e4m3 */
                row[k] = v;
            }
            for (k = 0; k < 4; ++k) {
                float s = (float)ldexp(1.0 + rng_unit(), -9); /* arbitrary f32 scales, ~amax / 448 */
                memcpy(row + 512 + 4 * k, &s, 4);
            }
            for (k = 0; k < 64; ++k) {
                uint16_t v = f32_to_bf16((float)(rng_unit() * 2 - 1));
                memcpy(row + 528 + 2 * k, &v, 2);
            }
        }
    }

    /* 4. device buffers (cuMemAlloc is 256-byte aligned: the 16 bytes q and the cache need) */
    CK(cuMemAlloc(&b.q, (size_t)T * H * D * 2));
    CK(cuMemAlloc(&b.kv_cache, (size_t)num_slots * row_bytes));
    CK(cuMemAlloc(&b.indices, (size_t)T * K * 4));
    if (c->with_length) CK(cuMemAlloc(&b.topk_length, (size_t)T * 4));
    CK(cuMemAlloc(&b.out, (size_t)T * H * DV * 2));
    CK(cuMemAlloc(&b.lse, (size_t)T * H * 4));
    if (plan.splits > 1) {
        CK(cuMemAlloc(&b.o_part, plan.o_part_bytes));
        CK(cuMemAlloc(&b.lse_part, plan.lse_part_bytes));
    }
    CK(cuMemcpyHtoD(b.q, q, (size_t)T * H * D * 2));
    CK(cuMemcpyHtoD(b.kv_cache, cache, (size_t)num_slots * row_bytes));
    CK(cuMemcpyHtoD(b.indices, idx, (size_t)T * K * 4));
    if (c->with_length) CK(cuMemcpyHtoD(b.topk_length, len, (size_t)T * 4));
    CK(cuMemsetD8(b.out, 0x7F, (size_t)T * H * DV * 2)); /* poison: every element must be written */
    CK(cuMemsetD8(b.lse, 0x7F, (size_t)T * H * 4));

    /* 5. launch as planned */
    memset(&prm, 0, sizeof prm);
    prm.tokens = T; prm.heads = H; prm.topk = K; prm.num_slots = (unsigned)num_slots;
    prm.scale = scale; prm.page_size = c->page_size; prm.row_stride_w = row_w; prm.page_stride_w = page_w;
    prm.lse_s_q = 1;
    CK(sparse_mla_launch_decode(&plan, first, combine, prm, &b, 0));
    CK(cuCtxSynchronize());
    CK(cuMemcpyDtoH(out, b.out, (size_t)T * H * DV * 2));
    CK(cuMemcpyDtoH(lse, b.lse, (size_t)T * H * 4));

    /* 6. the reference in double */
    for (t = 0; t < T; ++t) {
        for (h = 0; h < H; ++h) {
            double m = -INFINITY, sum = 0, o[512], l;
            double* s = malloc(sizeof(double) * K);
            const uint16_t* qr = q + ((size_t)t * H + h) * D;
            memset(o, 0, sizeof o);
            for (j = 0; j < K; ++j) {
                int32_t slot = idx[t * K + j];
                const uint8_t* row;
                double dot = 0;
                unsigned k;
                s[j] = -INFINITY;
                if (slot < 0 || (unsigned long long)slot >= num_slots || (int32_t)j >= len[t]) continue;
                row = cache + (size_t)slot * row_bytes;
                for (k = 0; k < D; ++k) {
                    double kv;
                    if (c->format == SPARSE_MLA_CACHE_BF16) {
                        uint16_t v; memcpy(&v, row + 2 * k, 2); kv = bf16_to_f64(v);
                    } else if (k < 512) {
                        float sc; memcpy(&sc, row + 512 + 4 * (k / 128), 4); kv = e4m3_to_f64(row[k]) * sc;
                    } else {
                        uint16_t v; memcpy(&v, row + 528 + 2 * (k - 512), 2); kv = bf16_to_f64(v);
                    }
                    dot += bf16_to_f64(qr[k]) * kv;
                }
                s[j] = dot * scale;
                if (s[j] > m) m = s[j];
            }
            for (j = 0; j < K; ++j) {
                int32_t slot = idx[t * K + j];
                const uint8_t* row;
                double p;
                unsigned k;
                if (s[j] == -INFINITY) continue;
                p = exp(s[j] - m);
                sum += p;
                row = cache + (size_t)slot * row_bytes;
                for (k = 0; k < DV; ++k) {
                    double kv;
                    if (c->format == SPARSE_MLA_CACHE_BF16) {
                        uint16_t v; memcpy(&v, row + 2 * k, 2); kv = bf16_to_f64(v);
                    } else {
                        float sc; memcpy(&sc, row + 512 + 4 * (k / 128), 4); kv = e4m3_to_f64(row[k]) * sc;
                    }
                    o[k] += p * kv;
                }
            }
            l = sum > 0 ? m + log(sum) : INFINITY;
            for (i = 0; i < DV; ++i) {
                double want = sum > 0 ? o[i] / sum : 0.0;
                double got = bf16_to_f64(out[((size_t)t * H + h) * DV + i]);
                if (isnan(got)) bad = 1;
                err2 += (got - want) * (got - want);
                ref2 += want * want;
            }
            {
                double got = lse[(size_t)t * H + h];
                if (isinf(l)) { if (!(isinf(got) && got > 0)) bad = 1; }
                else if (!(fabs(got - l) <= lse_err)) lse_err = isnan(got) ? INFINITY : fabs(got - l);
            }
            free(s);
        }
    }
    {
        double rel = sqrt(err2 / (ref2 > 0 ? ref2 : 1));
        int pass = !bad && rel <= 1e-2 && lse_err <= 1e-3;
        printf("| %-10s | %3u | %3u | %4u | %4u | %2u%s | %-58s | %9u | %9.2e | %9.2e | %s |\n",
               c->format ? "fp8_ds_mla" : "bf16", H, T, K, c->page_size, plan.splits, c->splits ? "*" : " ",
               plan.split_kernel, v6_per_sm, rel, lse_err, pass ? "pass" : "FAIL");
        free(q); free(cache); free(idx); free(len); free(out); free(lse); free(referenced);
        cuMemFree(b.q); cuMemFree(b.kv_cache); cuMemFree(b.indices); cuMemFree(b.out); cuMemFree(b.lse);
        if (b.topk_length) cuMemFree(b.topk_length);
        if (b.o_part) { cuMemFree(b.o_part); cuMemFree(b.lse_part); }
        return pass ? 0 : 1;
    }
}

int main(int argc, char** argv) {
    static const decode_case cases[] = {
        /* format, H, T, topk, page, pages, splits, length */
        {SPARSE_MLA_CACHE_BF16, 1, 1, 64, 64, 64, 0, 0},
        {SPARSE_MLA_CACHE_BF16, 16, 4, 2048, 64, 256, 0, 0},
        {SPARSE_MLA_CACHE_BF16, 16, 64, 2048, 64, 512, 1, 1},
        {SPARSE_MLA_CACHE_BF16, 16, 128, 1024, 64, 512, 0, 1},  /* a large batch on <= 160 SMs */
        {SPARSE_MLA_CACHE_BF16, 128, 3, 777, 53, 300, 0, 1},
        {SPARSE_MLA_CACHE_BF16, 64, 2, 100, 1, 20000, 0, 0},
        {SPARSE_MLA_CACHE_BF16, 40, 1, 2048, 64, 256, 0, 0},     /* v6 in 16-head blocks above 16 heads */
        {SPARSE_MLA_CACHE_FP8_DS_MLA, 16, 2, 2048, 64, 256, 0, 1},
        {SPARSE_MLA_CACHE_FP8_DS_MLA, 3, 130, 500, 53, 400, 0, 0},   /* a large batch below 2080 SMs */
        {SPARSE_MLA_CACHE_FP8_DS_MLA, 128, 5, 300, 1, 40000, 0, 0},
        {SPARSE_MLA_CACHE_FP8_DS_MLA, 32, 7, 1000, 53, 200, 1, 1},
    };
    const unsigned n = sizeof cases / sizeof cases[0];
    const char* dir = argc > 1 ? argv[1] : "build";
    unsigned long long seed = argc > 2 ? strtoull(argv[2], 0, 10) : 20261201ull;
    CUdevice dev;
    CUcontext ctx;
    char name[256];
    unsigned i, failed = 0;

    if (argc > 1 && strcmp(argv[1], "--list") == 0) {
        /* the kernels every case may load on any GPU: for bf16 the v6 kernel whose occupancy
           is asked, and its split kernel and the combine on a GPU of any SM count from 1 to
           4096 (each rule's band of sizes: large batch, narrow, small call, ...) and of very
           many, holding one v6 workgroup per SM or two (duplicates are printed: sort -u) */
        for (i = 0; i < n; ++i) {
            unsigned g, v6;
            sparse_mla_decode_plan p;
            if (cases[i].format == SPARSE_MLA_CACHE_BF16 && sparse_mla_v6_kernel(cases[i].heads, &p) == 0)
                printf("%s\n", p.split_kernel);
            for (g = 1u; g <= 4097u; ++g) {
                unsigned sms = g <= 4096u ? g : 0xFFFFFFFFu; /* the last: very many */
                for (v6 = 1; v6 <= 2; ++v6)
                    if (sparse_mla_decode_variant(cases[i].format, cases[i].heads, cases[i].tokens, cases[i].topk,
                                                  sms, v6, &p) == 0)
                        printf("%s\n%s\n", p.split_kernel, p.combine_kernel);
            }
        }
        return 0;
    }
    rng_state = seed;
    CK(cuInit(0));
    CK(cuDeviceGet(&dev, 0));
    CK(cuDeviceGetName(name, sizeof name, dev));
    CK(cuDevicePrimaryCtxRetain(&ctx, dev));
    CK(cuCtxSetCurrent(ctx));
    printf("sparse MLA decode from C (cuda/ only): %s, kernels from %s, seed %llu\n", name, dir, seed);
    printf("| cache      |   H |   T | topk | page | splits | first kernel                                               | v6 per SM | rel L2    | lse err   | result |\n");
    printf("|---|---|---|---|---|---|---|---|---|---|---|\n");
    for (i = 0; i < n; ++i) failed += (unsigned)run_case(dir, dev, &cases[i], i);
    printf("%u of %u cases passed (* = splits forced; rel L2 <= 1e-2, lse error <= 1e-3, empty rows out 0 / lse +inf)\n",
           n - failed, n);
    return failed ? 1 : 0;
}
