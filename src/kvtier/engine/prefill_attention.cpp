// bfloat16 prefill attention with AVX512_BF16 dot products (engine/prefill_attention.py
// builds and loads this file). torch's CPU flash attention widens bf16 to float32 and runs at
// float32 speed; here both products (Q.K^T and P.V) take `vdpbf16ps`, which multiplies pairs
// of bf16 and accumulates in float32, the softmax staying in float32.
//
// q [kv_heads, rows, 64] (the query heads sharing a KV head folded along the row axis),
// k, v [kv_heads, n, 64], all bf16 (read as uint16). Row r's query sits at position
// q_offset + r % m; causal: it sees keys [0, that position]; otherwise all n keys.
// out [kv_heads, rows, 64] float32 (normalised), lse [kv_heads, rows] float32.
//
// Determinism: a row's bits depend only on its query and the keys it sees. Keys are taken in
// blocks of KB at fixed offsets from key 0, in key order, with an online softmax per row; no
// arithmetic mixes rows (rows share only loads of K and V), every reduction has a fixed order,
// and a block that lies wholly in a row's future changes nothing of that row exactly (its
// scores are masked to -inf, so the running max stays, the rescale is exp(0) = 1 exactly, and
// the weights added are exact zeros). So neither which rows share a tile or a work item, nor
// how many threads run, nor m (rows per head) moves a row's result.
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

constexpr int D = 64;  // head_dim
constexpr int PAIRS = D / 2;  // bf16 pairs per row (one 32-bit word each)
constexpr int KB = 64;  // keys per block: 4 vectors of 16 scores per row
constexpr int KV = KB / 16;  // score vectors per row and block
constexpr int R = 6;  // query rows per register tile: 6 x 4 accumulators
constexpr int QB = 48;  // query rows per work item (8 tiles)
constexpr int64_t CHUNK = 512;  // keys per pass over an item's tiles (its K and V stay in L2)

// exp(x) for x <= 0 (the same polynomial as paged_decode.cpp): Cody-Waite reduction to
// r in [-ln2/2, ln2/2] and a degree-6 Taylor polynomial; below -87 clamped. exp(0) = 1 exactly.
inline __m512 exp_le0(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
    const __m512 t = _mm512_fmadd_ps(x, _mm512_set1_ps(1.4426950408889634f), _mm512_set1_ps(0.5f));
    const __m512 kf = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(kf, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(kf, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.0f / 720.0f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    const __m512i bits = _mm512_slli_epi32(
        _mm512_add_epi32(_mm512_cvtps_epi32(kf), _mm512_set1_epi32(127)), 23);
    return _mm512_mul_ps(p, _mm512_castsi512_ps(bits));
}

// The 16 lanes summed in a fixed tree (halves, quarters, ...).
inline float lanes_sum(__m512 x) {
    __m256 h = _mm256_add_ps(_mm512_castps512_ps256(x), _mm512_extractf32x8_ps(x, 1));
    __m128 q = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
    q = _mm_add_ps(q, _mm_movehl_ps(q, q));
    q = _mm_add_ss(q, _mm_movehdup_ps(q));
    return _mm_cvtss_f32(q);
}

inline __m512 dot(__m512 acc, __m512i a, __m512i b) {
    return _mm512_dpbf16_ps(acc, (__m512bh)a, (__m512bh)b);
}

inline __m512i bcast(const uint16_t* p) {  // a pair of bf16 as one 32-bit word, in every lane
    uint32_t w;
    std::memcpy(&w, p, sizeof w);
    return _mm512_set1_epi32(static_cast<int>(w));
}

// K of one head repacked for Q.K^T: groups of 16 keys, per group [32 dim pairs][16 keys] of
// 32-bit words (two bf16 dims): one vector per dim pair holds that pair of 16 keys.
// V repacked for P.V: per pair of keys [64 dims] of 32-bit words (the two keys' values of
// that dim). Keys past n are zero (and masked). One group of 16 keys (8 pairs) at a time.
void pack(const uint16_t* k, const uint16_t* v, int64_t n, int64_t g, uint32_t* kp,
          uint32_t* vp) {
    const uint32_t* kw = reinterpret_cast<const uint32_t*>(k);
    uint32_t* kg = kp + g * PAIRS * 16;
    uint32_t* vg = vp + g * 8 * D;
    if (g * 16 + 16 <= n) {  // whole groups: gathers and an interleave, no bounds tests
        const __m512i rows = _mm512_mullo_epi32(
            _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
            _mm512_set1_epi32(PAIRS));
        const uint32_t* base = kw + g * 16 * PAIRS;
        for (int p = 0; p < PAIRS; ++p)
            _mm512_storeu_si512(kg + p * 16, _mm512_i32gather_epi32(rows, base + p, 4));
        // output c, 16-bit element 2 j (2 j + 1): dim 16 c + j of the first (second) key, which
        // is element (16 c + j) % 32 of that key's half c / 2 (index + 32: the second source)
        __m512i idx[4];
        for (int c = 0; c < 4; ++c) {
            uint16_t e[32];
            for (int j = 0; j < 16; ++j) {
                e[2 * j] = static_cast<uint16_t>((16 * c + j) % 32);
                e[2 * j + 1] = static_cast<uint16_t>(32 + (16 * c + j) % 32);
            }
            std::memcpy(&idx[c], e, sizeof e);
        }
        for (int pair = 0; pair < 8; ++pair) {
            const uint16_t* a = v + (g * 16 + 2 * pair) * D;
            const uint16_t* b = a + D;
            for (int c = 0; c < 4; ++c) {
                // dims 16 c .. 16 c + 15 lie in the 32-dim half c / 2 of each row
                const __m512i x = _mm512_loadu_si512(a + c / 2 * 32);
                const __m512i y = _mm512_loadu_si512(b + c / 2 * 32);
                _mm512_storeu_si512(vg + pair * D + 16 * c,
                                    _mm512_permutex2var_epi16(x, idx[c], y));
            }
        }
        return;
    }
    for (int p = 0; p < PAIRS; ++p)
        for (int t = 0; t < 16; ++t) {
            const int64_t key = g * 16 + t;
            kg[p * 16 + t] = key < n ? kw[key * PAIRS + p] : 0u;
        }
    for (int pair = 0; pair < 8; ++pair) {
        const int64_t a = g * 16 + 2 * pair, b = a + 1;
        for (int d = 0; d < D; ++d) {
            const uint32_t x = a < n ? v[a * D + d] : 0u, y = b < n ? v[b * D + d] : 0u;
            vg[pair * D + d] = x | y << 16;
        }
    }
}

struct Rows {  // per row of a work item: running max, sum of weights, unnormalised output
    float m[QB], l[QB];
    alignas(64) float o[QB][D];
};

// One tile of T rows (first row `row` of the item, query pointers q[t]) against the key block
// starting at `key`. limit[t]: the last key row t sees.
template <int T>
void block(const uint16_t* const* q, const int64_t* limit, int64_t key, const uint32_t* kp,
           const uint32_t* vp, float scale, Rows& st, int row) {
    __m512 s[T][KV];
    for (int t = 0; t < T; ++t)
        for (int j = 0; j < KV; ++j) s[t][j] = _mm512_setzero_ps();
    const uint32_t* kb = kp + key * PAIRS;  // groups key/16 .. key/16 + KV
    for (int p = 0; p < PAIRS; ++p) {
        __m512i kk[KV];
        for (int j = 0; j < KV; ++j) kk[j] = _mm512_loadu_si512(kb + (j * PAIRS + p) * 16);
        for (int t = 0; t < T; ++t) {
            const __m512i qq = bcast(q[t] + 2 * p);
            for (int j = 0; j < KV; ++j) s[t][j] = dot(s[t][j], kk[j], qq);
        }
    }
    alignas(64) uint16_t pb[T][KB];  // the weights, rounded to bf16
    float alpha[T];
    const __m512i lane = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
    for (int t = 0; t < T; ++t) {
        __m512 high = _mm512_set1_ps(-INFINITY);
        __mmask16 seen[KV];
        for (int j = 0; j < KV; ++j) {
            // keys key + 16 j + lane <= limit[t]; positions fit in 32 bits
            const __m512i idx = _mm512_add_epi32(lane, _mm512_set1_epi32(static_cast<int>(key + 16 * j)));
            seen[j] = _mm512_cmple_epi32_mask(idx, _mm512_set1_epi32(static_cast<int>(limit[t])));
            s[t][j] = _mm512_mask_mul_ps(_mm512_set1_ps(-INFINITY), seen[j], s[t][j],
                                         _mm512_set1_ps(scale));
            high = _mm512_max_ps(high, s[t][j]);
        }
        const float old = st.m[row + t];
        const float peak = std::max(old, _mm512_reduce_max_ps(high));  // a max: order-free
        const __m512 mp = _mm512_set1_ps(peak);
        __m512 total = _mm512_setzero_ps();
        for (int j = 0; j < KV; ++j) {
            const __m512 w = _mm512_maskz_mov_ps(seen[j], exp_le0(_mm512_sub_ps(s[t][j], mp)));
            const __m256i h = (__m256i)_mm512_cvtneps_pbh(w);
            _mm256_store_si256(reinterpret_cast<__m256i*>(pb[t] + 16 * j), h);
            // the sum of the rounded weights: what the values are weighed with
            total = _mm512_add_ps(total, _mm512_castsi512_ps(
                                             _mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16)));
        }
        // exp(old - peak): 1 where the block did not raise the max (what exp_le0(0) gives too,
        // exactly: skipping it changes no bit); 0 before the first block (old = -inf; l and o
        // are 0 then anyway)
        const float a = old == peak          ? 1.0f
                        : old == -INFINITY ? 0.0f
                                           : _mm512_cvtss_f32(exp_le0(_mm512_set1_ps(old - peak)));
        alpha[t] = a;
        st.m[row + t] = peak;
        st.l[row + t] = st.l[row + t] * a + lanes_sum(total);
    }
    __m512 o[T][4];
    for (int t = 0; t < T; ++t) {
        const __m512 a = _mm512_set1_ps(alpha[t]);
        for (int c = 0; c < 4; ++c) o[t][c] = _mm512_mul_ps(_mm512_load_ps(st.o[row + t] + 16 * c), a);
    }
    const uint32_t* vb = vp + key / 2 * D;
    for (int p = 0; p < KB / 2; ++p) {
        __m512i vv[4];
        for (int c = 0; c < 4; ++c) vv[c] = _mm512_loadu_si512(vb + p * D + 16 * c);
        for (int t = 0; t < T; ++t) {
            const __m512i ww = bcast(pb[t] + 2 * p);
            for (int c = 0; c < 4; ++c) o[t][c] = dot(o[t][c], vv[c], ww);
        }
    }
    for (int t = 0; t < T; ++t)
        for (int c = 0; c < 4; ++c) _mm512_store_ps(st.o[row + t] + 16 * c, o[t][c]);
}

template <int T>
void tile(const uint16_t* qh, int64_t m, int64_t q_offset, int causal, int64_t n, int64_t r0,
          int row, int64_t from, int64_t to, const uint32_t* kp, const uint32_t* vp, float scale,
          Rows& st) {
    const uint16_t* q[T];
    int64_t limit[T], last = 0;
    for (int t = 0; t < T; ++t) {
        const int64_t r = r0 + row + t;
        q[t] = qh + r * D;
        limit[t] = causal ? q_offset + r % m : n - 1;
        last = std::max(last, limit[t]);
    }
    for (int64_t key = from; key < to && key <= last; key += KB)
        block<T>(q, limit, key, kp, vp, scale, st, row);
}

}  // namespace

extern "C" {

// See the top of the file; K and V of head h start at k + h * k_stride, v + h * v_stride (their
// rows contiguous: a slice of a longer gathered cache needs no copy). causal needs
// q_offset + m <= n. threads: OpenMP threads to use.
void kvtier_prefill_attention(const uint16_t* q, const uint16_t* k, const uint16_t* v,
                              int64_t k_stride, int64_t v_stride,
                              int64_t kv_heads, int64_t rows, int64_t m, int64_t n,
                              int64_t q_offset, int causal, float scale, float* out, float* lse,
                              int threads) {
    const int64_t padded = (n + KB - 1) / KB * KB;
    // The repacked K and V, kept per calling thread between calls: a fresh allocation of
    // several MB would be zeroed and page-faulted in on every call (~10% of an 8K call).
    thread_local std::vector<uint32_t> scratch;
    const int64_t size = kv_heads * padded * PAIRS;
    if (static_cast<int64_t>(scratch.size()) < 2 * size) scratch.resize(2 * size);
    uint32_t* const kp = scratch.data();
    uint32_t* const vp = kp + size;
    const int64_t groups = padded / 16;
    const int64_t blocks = (rows + QB - 1) / QB, items = kv_heads * blocks;
#pragma omp parallel num_threads(threads) if (threads > 1)
    {
#pragma omp for schedule(static)
        for (int64_t it = 0; it < kv_heads * groups; ++it) {
            const int64_t h = it / groups;
            pack(k + h * k_stride, v + h * v_stride, n, it % groups, kp + h * padded * PAIRS,
                 vp + h * padded * PAIRS);
        }
        Rows st;
#pragma omp for schedule(dynamic, 1)
        for (int64_t item = 0; item < items; ++item) {
            const int64_t h = item / blocks, r0 = item % blocks * QB;
            const int count = static_cast<int>(std::min<int64_t>(QB, rows - r0));
            const uint16_t* qh = q + h * rows * D;
            const uint32_t* kh = kp + h * padded * PAIRS;
            const uint32_t* vh = vp + h * padded * PAIRS;
            int64_t last = 0;
            for (int i = 0; i < count; ++i) {
                st.m[i] = -INFINITY;
                st.l[i] = 0.0f;
                std::fill(st.o[i], st.o[i] + D, 0.0f);
                last = std::max(last, causal ? q_offset + (r0 + i) % m : n - 1);
            }
            for (int64_t from = 0; from <= last; from += CHUNK) {
                const int64_t to = std::min(from + CHUNK, n);
                int row = 0;
                for (; row + R <= count; row += R)
                    tile<R>(qh, m, q_offset, causal, n, r0, row, from, to, kh, vh, scale, st);
                switch (count - row) {
                    case 5: tile<5>(qh, m, q_offset, causal, n, r0, row, from, to, kh, vh, scale, st); break;
                    case 4: tile<4>(qh, m, q_offset, causal, n, r0, row, from, to, kh, vh, scale, st); break;
                    case 3: tile<3>(qh, m, q_offset, causal, n, r0, row, from, to, kh, vh, scale, st); break;
                    case 2: tile<2>(qh, m, q_offset, causal, n, r0, row, from, to, kh, vh, scale, st); break;
                    case 1: tile<1>(qh, m, q_offset, causal, n, r0, row, from, to, kh, vh, scale, st); break;
                    default: break;
                }
            }
            for (int i = 0; i < count; ++i) {
                const int64_t r = h * rows + r0 + i;
                const float l = st.l[i];
                for (int d = 0; d < D; ++d) out[r * D + d] = st.o[i][d] / l;
                lse[r] = st.m[i] + std::log(l);
            }
        }
    }
}
}
