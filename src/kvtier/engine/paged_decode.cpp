// Decode attention read straight from kvtier's block pool (engine/paged_decode.py builds and
// loads this file). One query per sequence; K/V of layer `layer` of the pool
// [blocks, layers, 2, kv_heads, block_size, 64], bfloat16 (read as uint16, widened exactly by
// a 16-bit shift) or float32. Work items are (sequence, piece of PIECE keys at a fixed
// absolute position); each writes its own softmax statistics and unnormalised output, and the
// pieces of a sequence are merged in piece order afterwards. So a sequence's result depends on
// nothing but its own inputs: not on the batch, the thread count or which thread took an item.
// Items run on OpenMP threads: linked against libgomp.so.1, which is torch's own copy once
// torch is loaded, so they run on the pool torch's operations use (its workers are awake
// between the model's matmuls), not on a second one.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>
#ifdef __AVX512BF16__
#include <immintrin.h>
#endif

namespace {

typedef float v16 __attribute__((vector_size(64)));
typedef int32_t i16v __attribute__((vector_size(64)));
typedef uint32_t u32x16 __attribute__((vector_size(64)));

constexpr int D = 64;  // head_dim
constexpr int CH = D / 16;  // 16-float chunks per row
constexpr int64_t PIECE = 512;  // keys per item; a multiple of every block size used

inline v16 load(const float* p) {
    v16 out;
    std::memcpy(&out, p, sizeof out);
    return out;
}

inline void store(float* p, v16 x) { std::memcpy(p, &x, sizeof x); }

// A row of 64 widened to float32 in the kernel's order of dims. bfloat16 rows are widened 32
// dims at a time, the even dims then the odd ones: a shift and a mask of the 32-bit words
// holding two bf16 each (exact, and no shuffles across lanes). float32 rows keep their order.
// Queries are put in the same order (`position`), outputs put back.
inline void widen(const uint16_t* src, v16 out[CH]) {
    for (int c = 0; c < 2; ++c) {
        u32x16 words;
        std::memcpy(&words, src + 32 * c, sizeof words);
        const u32x16 even = words << 16, odd = words & 0xffff0000u;
        std::memcpy(&out[2 * c], &even, sizeof even);
        std::memcpy(&out[2 * c + 1], &odd, sizeof odd);
    }
}

inline void widen(const float* src, v16 out[CH]) { std::memcpy(out, src, CH * sizeof(v16)); }

inline int position(const uint16_t*, int d) { return d / 32 * 32 + d % 2 * 16 + d % 32 / 2; }

inline int position(const float*, int d) { return d; }

inline v16 splat(float x) { return v16{} + x; }

// The 16 lanes summed in a fixed tree (halves, quarters, ...).
inline float lanes_sum(v16 x) {
    x += __builtin_shuffle(x, i16v{8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7});
    x += __builtin_shuffle(x, i16v{4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11});
    x += __builtin_shuffle(x, i16v{2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13});
    x += __builtin_shuffle(x, i16v{1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14});
    return x[0];
}

inline float lanes_max(v16 x) {
    float m = x[0];
    for (int i = 1; i < 16; ++i) m = x[i] > m ? x[i] : m;
    return m;
}

// Pairs of vectors summed lane group by lane group: level `w` adds the two halves of each
// group of 2w lanes of a and of b, a's sums landing in the first half of each group of the
// result and b's in the second. Four levels turn 16 vectors into one of their 16 lane sums.
template <int W>
inline v16 fold(v16 a, v16 b) {
    i16v lo, hi;
    for (int i = 0; i < 16; ++i) {
        const int group = i / (2 * W), within = i % (2 * W);
        const int source = within < W ? 0 : 16;  // a, then b
        lo[i] = source + group * 2 * W + within % W;
        hi[i] = lo[i] + W;
    }
    return __builtin_shuffle(a, b, lo) + __builtin_shuffle(a, b, hi);
}

// The lane sums of a[0..16) as one vector, lane t = sum of a[t]'s lanes (a fixed tree).
inline v16 sums16(const v16 a[16]) {
    v16 b[8], c[4], d[2];
    for (int i = 0; i < 8; ++i) b[i] = fold<8>(a[2 * i], a[2 * i + 1]);
    for (int i = 0; i < 4; ++i) c[i] = fold<4>(b[2 * i], b[2 * i + 1]);
    for (int i = 0; i < 2; ++i) d[i] = fold<2>(c[2 * i], c[2 * i + 1]);
    // lane l of fold<1>(d0, d1) holds key bit_reversed(l) (four bits): put keys in order
    return __builtin_shuffle(fold<1>(d[0], d[1]),
                             i16v{0, 8, 4, 12, 2, 10, 6, 14, 1, 9, 5, 13, 3, 11, 7, 15});
}

// exp(x), x <= 0: Cody-Waite reduction to r in [-ln2/2, ln2/2] and a degree-6 Taylor
// polynomial (about 1 ulp); below -87 clamped (weight ~1e-38 instead of underflow).
inline v16 exp_le0(v16 x) {
    const v16 lowest = splat(-87.0f);
    x = x < lowest ? lowest : x;
    v16 t = x * 1.4426950408889634f + 0.5f;
    i16v k = __builtin_convertvector(t, i16v);  // truncates; floor below
    v16 kf = __builtin_convertvector(k, v16);
    i16v above = kf > t;  // -1 where truncation rounded up
    k += above;
    kf = __builtin_convertvector(k, v16);
    v16 r = (x - kf * 0.693359375f) - kf * -2.12194440e-4f;
    v16 p = splat(1.0f / 720.0f);
    p = p * r + 1.0f / 120.0f;
    p = p * r + 1.0f / 24.0f;
    p = p * r + 1.0f / 6.0f;
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    i16v bits = (k + 127) << 23;
    v16 scale;
    std::memcpy(&scale, &bits, sizeof scale);
    return p * scale;
}

struct Geometry {
    int64_t layers, kv_heads, block_size, heads, max_blocks, layer;
};

constexpr int AHEAD = 3;  // blocks prefetched ahead: a piece's blocks lie anywhere in the pool

// Asks for the `bytes` from `p` (a block's K or V half) to be brought toward the core: locality 1
// (prefetcht2, to L2 and beyond, not L1: into L1 the requests queue behind the core's few L1
// miss slots, and 30 layers at 8K context took ~1.5x longer; docs/engine.md).
inline void prefetch(const void* p, int64_t bytes) {
    const char* c = static_cast<const char*>(p);
    for (int64_t line = 0; line < bytes; line += 64) __builtin_prefetch(c + line, 0, 1);
}

// Adds w[t] * row t of `values` (count rows) to acc[j] for G query heads j (w: one row of
// weights per head, `stride` apart), each row widened once for all G heads.
template <int G, typename T>
void weigh(const T* values, int64_t count, const float* w, int64_t stride, float* acc) {
    v16 out[G][CH];
    for (int j = 0; j < G; ++j) std::memcpy(out[j], acc + j * D, sizeof out[j]);
    for (int64_t t = 0; t < count; ++t) {
        v16 v[CH];
        widen(values + t * D, v);
        for (int j = 0; j < G; ++j)
            for (int c = 0; c < CH; ++c) out[j][c] += w[j * stride + t] * v[c];
    }
    for (int j = 0; j < G; ++j) std::memcpy(acc + j * D, out[j], sizeof out[j]);
}

#ifdef __AVX512BF16__
// Scores of 16 keys of a bf16 pool (`rows`, one KV head's, D apart) for `group` query heads
// with `vdpbf16ps`: each key row's 32 dim pairs multiplied by the query's and summed into 16
// float32 lanes (two instructions per key and head, in place of widening the row and four
// multiply-adds), the lanes then reduced by `sums16` as on the widening path. `qb`: the
// heads' queries rounded to bf16, D apart, in natural order; exact for the engine's queries
// (bf16 activations times 1/8, the 64-dim scale; another scale adds one bf16 rounding), and
// a product of two bf16 is exact in float32, so only the order of the sums changes. Writes
// `out[j * stride + t]` for head j and key t.
inline void bf16_scores(const uint16_t* rows, const uint16_t* qb, int64_t group, float* out,
                        int64_t stride) {
    __m512bh k[16][2];
    for (int t = 0; t < 16; ++t)
        for (int c = 0; c < 2; ++c)
            k[t][c] = (__m512bh)_mm512_loadu_si512(rows + t * D + 32 * c);
    for (int64_t j = 0; j < group; ++j) {
        const __m512bh q0 = (__m512bh)_mm512_loadu_si512(qb + j * D);
        const __m512bh q1 = (__m512bh)_mm512_loadu_si512(qb + j * D + 32);
        v16 dots[16];
        for (int t = 0; t < 16; ++t) {
            const __m512 sum = _mm512_dpbf16_ps(_mm512_dpbf16_ps(_mm512_setzero_ps(), q0, k[t][0]),
                                                q1, k[t][1]);
            std::memcpy(&dots[t], &sum, sizeof sum);
        }
        store(out + j * stride, sums16(dots));
    }
}

// Whether a pool of this element type is scored by `bf16_scores`: bf16 pools (this file is
// built with -march=native, so only on a CPU with AVX512_BF16); float32 pools widen.
template <typename T>
constexpr bool DOT_BF16 = std::is_same_v<T, uint16_t>;
#endif

// One item: keys [first, first + n) of one sequence, all heads. q [heads, D] float32, already
// scaled. Writes stats [heads, 2] (max score, sum of exp) and acc [heads, D] (sum of exp times
// value rows). Scores of the whole piece first (the K halves of its blocks, each one
// contiguous run), then one exp pass, then the values (the V halves): no rescaling inside a
// piece. `work`: this thread's scratch.
template <typename T>
void piece(const T* kv, const Geometry& g, const float* q, const int64_t* table, int64_t first,
           int64_t n, float* stats, float* acc, std::vector<float>& work) {
    const int64_t group = g.heads / g.kv_heads;
    const int64_t bs = g.block_size;  // a multiple of 16
    const int64_t head_stride = bs * D;  // one KV head's rows in a block
    const int64_t half = g.kv_heads * head_stride;  // K of all heads, then V
    const int64_t padded = (n + bs - 1) / bs * bs;
    const int64_t blocks = padded / bs;
    // scores, q reordered, then one region that holds first a block's widened keys of one
    // head (bs rows), later acc (heads rows), then the bf16 query (heads rows of D / 2)
    const int64_t shared = std::max(bs, g.heads) * D;
    work.assign(g.heads * padded + g.heads * D + shared + g.heads * D / 2, 0.0f);
    float* scores = work.data();  // [heads, padded]
    float* qs = scores + g.heads * padded;  // q in the kernel's order of dims
    float* sums = qs + g.heads * D;  // acc in that order
    float* keys = sums;  // first: a block's keys of one head, widened
    for (int64_t h = 0; h < g.heads; ++h)
        for (int d = 0; d < D; ++d) qs[h * D + position(kv, d)] = q[h * D + d];
    [[maybe_unused]] uint16_t* qb = reinterpret_cast<uint16_t*>(sums + shared);
#ifdef __AVX512BF16__
    if constexpr (DOT_BF16<T>)
        for (int64_t h = 0; h < g.heads; ++h)
            for (int c = 0; c < 2; ++c)
                _mm512_storeu_si512(qb + h * D + 32 * c,
                                    (__m512i)_mm512_cvtne2ps_pbh(
                                        _mm512_loadu_ps(q + h * D + 32 * c + 16),
                                        _mm512_loadu_ps(q + h * D + 32 * c)));
#endif
    auto block = [&](int64_t i) {  // this layer's K/V of the piece's i-th block
        return kv + (table[first / bs + i] * g.layers + g.layer) * 2 * half;
    };
    for (int64_t i = 0; i < AHEAD && i < blocks; ++i) prefetch(block(i), half * sizeof(T));
    for (int64_t i = 0; i < blocks; ++i) {
        if (i + AHEAD < blocks) prefetch(block(i + AHEAD), half * sizeof(T));
        for (int64_t kvh = 0; kvh < g.kv_heads; ++kvh) {
            const T* rows = block(i) + kvh * head_stride;
#ifdef __AVX512BF16__
            if constexpr (DOT_BF16<T>) {
                for (int64_t t0 = 0; t0 < bs; t0 += 16)
                    bf16_scores(rows + t0 * D, qb + kvh * group * D, group,
                                scores + kvh * group * padded + i * bs + t0, padded);
                continue;
            }
#endif
            for (int64_t t = 0; t < bs; ++t) {
                v16 row[CH];
                widen(rows + t * D, row);
                std::memcpy(keys + t * D, row, sizeof row);
            }
            for (int64_t j = 0; j < group; ++j) {
                const int64_t h = kvh * group + j;
                v16 qh[CH];
                std::memcpy(qh, qs + h * D, sizeof qh);
                for (int64_t t0 = 0; t0 < bs; t0 += 16) {
                    v16 dots[16];
                    for (int t = 0; t < 16; ++t) {
                        const float* k = keys + (t0 + t) * D;
                        dots[t] = qh[0] * load(k);
                        for (int c = 1; c < CH; ++c) dots[t] += qh[c] * load(k + 16 * c);
                    }
                    store(scores + h * padded + i * bs + t0, sums16(dots));
                }
            }
        }
    }
    std::fill(sums, sums + g.heads * D, 0.0f);
    for (int64_t h = 0; h < g.heads; ++h) {
        float* row = scores + h * padded;
        for (int64_t t = n; t < padded; ++t) row[t] = -INFINITY;  // past the piece's end
        v16 high = load(row);
        for (int64_t t = 16; t < padded; t += 16) {
            const v16 x = load(row + t);
            high = x > high ? x : high;
        }
        const float peak = lanes_max(high);  // the same whatever the order: a max
        v16 total{};
        for (int64_t t = 0; t < padded; t += 16) {
            const v16 w = exp_le0(load(row + t) - peak);
            store(row + t, w);
        }
        for (int64_t t = n; t < padded; ++t) row[t] = 0.0f;
        for (int64_t t = 0; t < padded; t += 16) total += load(row + t);
        stats[2 * h] = peak;
        stats[2 * h + 1] = lanes_sum(total);
    }
    for (int64_t i = 0; i < AHEAD && i < blocks; ++i) prefetch(block(i) + half, half * sizeof(T));
    for (int64_t i = 0; i < blocks; ++i) {
        if (i + AHEAD < blocks) prefetch(block(i + AHEAD) + half, half * sizeof(T));
        const int64_t count = std::min(bs, n - i * bs);
        for (int64_t kvh = 0; kvh < g.kv_heads; ++kvh) {
            const T* values = block(i) + half + kvh * head_stride;
            for (int64_t j = 0; j < group; j += 3) {  // up to 3 heads at a time in registers
                const int64_t h = kvh * group + j;
                const float* w = scores + h * padded + i * bs;
                float* into = sums + h * D;
                switch (std::min<int64_t>(3, group - j)) {
                    case 3: weigh<3>(values, count, w, padded, into); break;
                    case 2: weigh<2>(values, count, w, padded, into); break;
                    default: weigh<1>(values, count, w, padded, into);
                }
            }
        }
    }
    for (int64_t h = 0; h < g.heads; ++h)
        for (int d = 0; d < D; ++d) acc[h * D + d] = sums[h * D + position(kv, d)];
}

template <typename T>
void decode(const T* kv, const Geometry& g, const float* q, const int64_t* tables,
            const int64_t* lengths, int64_t batch, float* out, int threads) {
    int64_t pieces = 1;
    for (int64_t b = 0; b < batch; ++b)
        pieces = std::max(pieces, (lengths[b] + PIECE - 1) / PIECE);
    std::vector<float> stats(batch * pieces * g.heads * 2);
    std::vector<float> acc(batch * pieces * g.heads * D);
    const int64_t items = batch * pieces;
#pragma omp parallel num_threads(threads) if (threads > 1)
    {
        std::vector<float> work;
#pragma omp for schedule(dynamic, 1)
        for (int64_t item = 0; item < items; ++item) {
            const int64_t b = item / pieces, p = item % pieces;
            const int64_t first = p * PIECE;
            if (first >= lengths[b]) continue;
            const int64_t n = std::min(PIECE, lengths[b] - first);
            piece(kv, g, q + b * g.heads * D, tables + b * g.max_blocks, first, n,
                  stats.data() + item * g.heads * 2, acc.data() + item * g.heads * D, work);
        }
    }
    for (int64_t b = 0; b < batch; ++b) {  // merge by log-sum-exp, in piece order
        const int64_t used = (lengths[b] + PIECE - 1) / PIECE;
        for (int64_t h = 0; h < g.heads; ++h) {
            auto stat = [&](int64_t p, int k) { return stats[((b * pieces + p) * g.heads + h) * 2 + k]; };
            float peak = stat(0, 0);
            for (int64_t p = 1; p < used; ++p) peak = std::max(peak, stat(p, 0));
            float row[D] = {};
            float total = 0.0f;
            for (int64_t p = 0; p < used; ++p) {
                const float w = std::exp(stat(p, 0) - peak);
                total += w * stat(p, 1);
                const float* a = acc.data() + ((b * pieces + p) * g.heads + h) * D;
                for (int d = 0; d < D; ++d) row[d] += w * a[d];
            }
            for (int d = 0; d < D; ++d) out[(b * g.heads + h) * D + d] = row[d] / total;
        }
    }
}

}  // namespace

extern "C" {

// kv: the pool; bf16 != 0 for a bfloat16 pool, else float32. q [batch, heads, 64] float32,
// scaled; tables [batch, max_blocks] int64 block ids; lengths [batch] int64 (each >= 1);
// out [batch, heads, 64] float32.
void kvtier_paged_decode(const void* kv, int bf16, int64_t layers, int64_t kv_heads,
                         int64_t block_size, int64_t layer, const float* q, int64_t heads,
                         const int64_t* tables, int64_t max_blocks, const int64_t* lengths,
                         int64_t batch, float* out, int threads) {
    const Geometry g{layers, kv_heads, block_size, heads, max_blocks, layer};
    if (bf16)
        decode(static_cast<const uint16_t*>(kv), g, q, tables, lengths, batch, out, threads);
    else
        decode(static_cast<const float*>(kv), g, q, tables, lengths, batch, out, threads);
}
}
