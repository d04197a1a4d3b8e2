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
#include <vector>

namespace {

typedef float v16 __attribute__((vector_size(64)));
typedef int32_t i16v __attribute__((vector_size(64)));
typedef uint32_t u32x16 __attribute__((vector_size(64)));
typedef uint16_t u16x16 __attribute__((vector_size(32)));

constexpr int D = 64;  // head_dim
constexpr int CH = D / 16;  // 16-float chunks per row
constexpr int64_t PIECE = 512;  // keys per item; a multiple of every block size used

inline v16 load(const uint16_t* p) {
    u16x16 half;
    std::memcpy(&half, p, sizeof half);
    u32x16 wide = __builtin_convertvector(half, u32x16) << 16;
    v16 out;
    std::memcpy(&out, &wide, sizeof out);
    return out;
}

inline v16 load(const float* p) {
    v16 out;
    std::memcpy(&out, p, sizeof out);
    return out;
}

inline v16 splat(float x) { return v16{} + x; }

// The 16 lanes summed in a fixed tree (halves, quarters, ...).
inline float lanes_sum(v16 x) {
    x += __builtin_shuffle(x, i16v{8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7});
    x += __builtin_shuffle(x, i16v{4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11});
    x += __builtin_shuffle(x, i16v{2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13});
    x += __builtin_shuffle(x, i16v{1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14});
    return x[0];
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

constexpr int AHEAD = 2;  // blocks prefetched ahead: a piece's blocks lie anywhere in the pool

// Asks for the `bytes` from `p` (a block's K or V half) to be brought into cache.
inline void prefetch(const void* p, int64_t bytes) {
    const char* c = static_cast<const char*>(p);
    for (int64_t line = 0; line < bytes; line += 64) __builtin_prefetch(c + line);
}

// One item: keys [first, first + n) of one sequence, all heads. q [heads, D] float32, already
// scaled. Writes stats [heads, 2] (max score, sum of exp) and acc [heads, D] (sum of exp times
// value rows). Scores of the whole piece first (the K halves of its blocks, each one
// contiguous run), then one exp pass, then the values (the V halves): no rescaling inside a
// piece.
template <typename T>
void piece(const T* kv, const Geometry& g, const float* q, const int64_t* table, int64_t first,
           int64_t n, float* stats, float* acc, std::vector<float>& scores) {
    const int64_t group = g.heads / g.kv_heads;
    const int64_t bs = g.block_size;
    const int64_t head_stride = bs * D;  // one KV head's rows in a block
    const int64_t half = g.kv_heads * head_stride;  // K of all heads, then V
    const int64_t padded = (n + 15) / 16 * 16;
    const int64_t blocks = (n + bs - 1) / bs;
    scores.assign(g.heads * padded, 0.0f);
    auto block = [&](int64_t i) {  // this layer's K/V of the piece's i-th block
        return kv + (table[first / bs + i] * g.layers + g.layer) * 2 * half;
    };
    for (int64_t i = 0; i < AHEAD && i < blocks; ++i) prefetch(block(i), half * sizeof(T));
    for (int64_t i = 0; i < blocks; ++i) {
        if (i + AHEAD < blocks) prefetch(block(i + AHEAD), half * sizeof(T));
        const int64_t start = i * bs;
        const int64_t count = n - start < bs ? n - start : bs;
        for (int64_t kvh = 0; kvh < g.kv_heads; ++kvh) {
            const T* keys = block(i) + kvh * head_stride;
            for (int64_t t = 0; t < count; ++t) {
                v16 k[CH];
                for (int c = 0; c < CH; ++c) k[c] = load(keys + t * D + 16 * c);
                for (int64_t j = 0; j < group; ++j) {
                    const int64_t h = kvh * group + j;
                    const float* qh = q + h * D;
                    v16 s = load(qh) * k[0];
                    for (int c = 1; c < CH; ++c) s += load(qh + 16 * c) * k[c];
                    scores[h * padded + start + t] = lanes_sum(s);
                }
            }
        }
    }
    for (int64_t h = 0; h < g.heads; ++h) {
        float* row = scores.data() + h * padded;
        float peak = row[0];
        for (int64_t t = 1; t < n; ++t) peak = row[t] > peak ? row[t] : peak;
        v16 total{};
        for (int64_t t = 0; t < padded; t += 16) {
            v16 w = exp_le0(load(row + t) - peak);
            std::memcpy(row + t, &w, sizeof w);
        }
        for (int64_t t = n; t < padded; ++t) row[t] = 0.0f;
        for (int64_t t = 0; t < padded; t += 16) total += load(row + t);
        stats[2 * h] = peak;
        stats[2 * h + 1] = lanes_sum(total);
    }
    std::fill(acc, acc + g.heads * D, 0.0f);
    for (int64_t i = 0; i < AHEAD && i < blocks; ++i) prefetch(block(i) + half, half * sizeof(T));
    for (int64_t i = 0; i < blocks; ++i) {
        if (i + AHEAD < blocks) prefetch(block(i + AHEAD) + half, half * sizeof(T));
        const int64_t start = i * bs;
        const int64_t count = n - start < bs ? n - start : bs;
        for (int64_t kvh = 0; kvh < g.kv_heads; ++kvh) {
            const T* values = block(i) + half + kvh * head_stride;
            for (int64_t j = 0; j < group; ++j) {
                const int64_t h = kvh * group + j;
                const float* w = scores.data() + h * padded + start;
                v16 out[CH];
                std::memcpy(out, acc + h * D, sizeof out);
                for (int64_t t = 0; t < count; ++t)
                    for (int c = 0; c < CH; ++c) out[c] += w[t] * load(values + t * D + 16 * c);
                std::memcpy(acc + h * D, out, sizeof out);
            }
        }
    }
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
        std::vector<float> scores;
#pragma omp for schedule(dynamic, 1)
        for (int64_t item = 0; item < items; ++item) {
            const int64_t b = item / pieces, p = item % pieces;
            const int64_t first = p * PIECE;
            if (first >= lengths[b]) continue;
            const int64_t n = std::min(PIECE, lengths[b] - first);
            piece(kv, g, q + b * g.heads * D, tables + b * g.max_blocks, first, n,
                  stats.data() + item * g.heads * 2, acc.data() + item * g.heads * D, scores);
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
