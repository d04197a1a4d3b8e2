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
//
// Two entry points: `kvtier_prefill_attention` over contiguous K/V (a prefill chunk, the
// default mode), and `kvtier_paged_attention` over the block pool through block tables,
// every row of a step at once (deterministic mode): the same packing, blocks and arithmetic,
// so a row gets the same bits from either.
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

// r[0..16) as the rows of a 16 x 16 matrix of 32-bit words, transposed in place (lane t of
// output c = word c of input t): unpacks within 128-bit lanes, then shuffles across them.
inline void transpose16(__m512i r[16]) {
    __m512i t[16];
    for (int i = 0; i < 8; ++i) {
        t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
    }
    for (int i = 0; i < 4; ++i) {
        r[4 * i] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
        r[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
        r[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
        r[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
    }
    for (int h = 0; h < 2; ++h)
        for (int i = 0; i < 4; ++i) {
            t[8 * h + i] = _mm512_shuffle_i32x4(r[8 * h + i], r[8 * h + 4 + i], 0x88);
            t[8 * h + 4 + i] = _mm512_shuffle_i32x4(r[8 * h + i], r[8 * h + 4 + i], 0xdd);
        }
    for (int i = 0; i < 8; ++i) {
        r[i] = _mm512_shuffle_i32x4(t[i], t[8 + i], 0x88);
        r[8 + i] = _mm512_shuffle_i32x4(t[i], t[8 + i], 0xdd);
    }
}

// For `_mm512_permutex2var_epi16(x, idx[c], y)` with x, y one 32-dim half of two keys' values:
// output c, 16-bit element 2 j (2 j + 1) is dim 16 c + j of the first (second) key, which is
// element (16 c + j) % 32 of that key's half c / 2 (index + 32: the second source).
inline void interleave_indices(__m512i idx[4]) {
    for (int c = 0; c < 4; ++c) {
        uint16_t e[32];
        for (int j = 0; j < 16; ++j) {
            e[2 * j] = static_cast<uint16_t>((16 * c + j) % 32);
            e[2 * j + 1] = static_cast<uint16_t>(32 + (16 * c + j) % 32);
        }
        std::memcpy(&idx[c], e, sizeof e);
    }
}

// The K of one group of 16 keys (rows of D from k, `valid` of them real, the rest zeros) as
// 32 vectors, vector p holding dim pair p of the 16 keys: one 16 x 16 transpose per half.
inline void keys_by_pair(const uint16_t* k, int64_t valid, __m512i out[PAIRS]) {
    for (int half = 0; half < 2; ++half) {  // dim pairs 0..15, then 16..31
        __m512i r[16];
        for (int t = 0; t < 16; ++t)
            r[t] = t < valid ? _mm512_loadu_si512(k + t * D + 32 * half) : _mm512_setzero_si512();
        transpose16(r);
        for (int c = 0; c < 16; ++c) out[16 * half + c] = r[c];
    }
}

// K of one head repacked for Q.K^T: groups of 16 keys, per group [32 dim pairs][16 keys] of
// 32-bit words (two bf16 dims): one vector per dim pair holds that pair of 16 keys.
// V repacked for P.V: per pair of keys [64 dims] of 32-bit words (the two keys' values of
// that dim). One group of 16 keys (8 pairs) at a time: k, v point at the group's first key
// row (rows of D contiguous), `valid` of its 16 keys exist; the others are packed as zeros
// (masked, and never a NaN that 0 * NaN would spread).
void pack_group(const uint16_t* k, const uint16_t* v, int64_t valid, uint32_t* kg,
                uint32_t* vg) {
    __m512i kk[PAIRS];
    keys_by_pair(k, valid, kk);
    for (int p = 0; p < PAIRS; ++p) _mm512_storeu_si512(kg + p * 16, kk[p]);
    if (valid >= 16) {  // whole groups: an interleave, no bounds tests
        __m512i idx[4];
        interleave_indices(idx);
        for (int pair = 0; pair < 8; ++pair) {
            const uint16_t* a = v + 2 * pair * D;
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
    for (int pair = 0; pair < 8; ++pair) {
        const int64_t a = 2 * pair, b = a + 1;
        for (int d = 0; d < D; ++d) {
            const uint32_t x = a < valid ? v[a * D + d] : 0u, y = b < valid ? v[b * D + d] : 0u;
            vg[pair * D + d] = x | y << 16;
        }
    }
}

// Group g of one head's n contiguous keys.
void pack(const uint16_t* k, const uint16_t* v, int64_t n, int64_t g, uint32_t* kp,
          uint32_t* vp) {
    pack_group(k + g * 16 * D, v + g * 16 * D, n - g * 16, kp + g * PAIRS * 16, vp + g * 8 * D);
}

struct Rows {  // per row of a work item: running max, sum of weights, unnormalised output
    float m[QB], l[QB];
    alignas(64) float o[QB][D];
};

// One tile of T rows (first row `row` of the item, query pointers q[t]) against the key block
// starting at `key`. limit[t]: the last key row t sees.
// Where `block` reads a key block's K and V vectors from: the packed copy (`Packed`) or the
// pool itself (`FromPool`, the same vectors built in registers). Both hand over the same bits.
struct Packed {
    const uint32_t* kp;  // one head's packed K and V (`pack`)
    const uint32_t* vp;
    const uint32_t* kb = nullptr;
    const uint32_t* vb = nullptr;
    void start(int64_t key) {  // the block of KB keys from `key`
        kb = kp + key * PAIRS;  // groups key/16 .. key/16 + KV
        vb = vp + key / 2 * D;
    }
    __m512i k(int j, int p) const { return _mm512_loadu_si512(kb + (j * PAIRS + p) * 16); }
    __m512i v(int p, int c) const { return _mm512_loadu_si512(vb + p * D + 16 * c); }
};

template <int T, typename Source>
void block(const uint16_t* const* q, const int64_t* limit, int64_t key, Source& src,
           float scale, Rows& st, int row) {
    src.start(key);
    __m512 s[T][KV];
    for (int t = 0; t < T; ++t)
        for (int j = 0; j < KV; ++j) s[t][j] = _mm512_setzero_ps();
    for (int p = 0; p < PAIRS; ++p) {
        __m512i kk[KV];
        for (int j = 0; j < KV; ++j) kk[j] = src.k(j, p);
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
    for (int p = 0; p < KB / 2; ++p) {
        __m512i vv[4];
        for (int c = 0; c < 4; ++c) vv[c] = src.v(p, c);
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
    Packed src{kp, vp};
    for (int64_t key = from; key < to && key <= last; key += KB)
        block<T>(q, limit, key, src, scale, st, row);
}

// One head's K and V read straight from the block pool, each block's vectors built in
// registers exactly as `pack` lays them out (zeros past the sequence's n keys): for a sequence
// with few query rows, whose keys each row tile reads once, packing first would only write
// and read every key once more.
struct FromPool {
    const uint16_t* k0;  // layer's K of head h in block 0 (V: + kv_stride)
    int64_t kv_stride, block_stride, block_size, n;
    const int64_t* table;  // the sequence's blocks
    __m512i idx[4];
    const uint16_t* kg[KV];  // per group of 16 keys of the current block: its first K row
    int64_t valid[KV];  // its keys below n (0..16)
    // The current block's K as `pack` lays it out, per group [32 dim pairs] of 16 keys:
    // transposed in registers (gathers took twice as long), kept in L1 for the block.
    alignas(64) __m512i kt[KV][PAIRS];

    FromPool(const uint16_t* k0_, int64_t kv_stride_, int64_t block_stride_,
             int64_t block_size_, int64_t n_, const int64_t* table_)
        : k0(k0_), kv_stride(kv_stride_), block_stride(block_stride_), block_size(block_size_),
          n(n_), table(table_) {
        interleave_indices(idx);
    }
    // Asks for the K and V rows of the block of KB keys from `key` to be brought toward the
    // core (to L2: locality 1, as paged_decode.cpp does): a sequence's blocks lie anywhere in
    // the pool, so the hardware prefetcher cannot guess the next one, and at long context
    // every block comes from memory (without this, 8K-context decode ran 20% slower).
    void prefetch(int64_t key) const {
        for (int j = 0; j < KV; ++j) {
            const int64_t first = key + 16 * j;
            if (first >= n) return;
            const char* k = reinterpret_cast<const char*>(
                k0 + table[first / block_size] * block_stride + first % block_size * D);
            const int64_t bytes = std::min<int64_t>(16, n - first) * D * 2;
            for (int64_t line = 0; line < bytes; line += 64) {
                __builtin_prefetch(k + line, 0, 1);
                __builtin_prefetch(k + kv_stride * 2 + line, 0, 1);
            }
        }
    }
    void start(int64_t key) {
        if (key % CHUNK == 0) prefetch(key + KB);  // a piece's first blocks
        prefetch(key + 2 * KB);
        for (int j = 0; j < KV; ++j) {
            const int64_t first = key + 16 * j;
            valid[j] = std::max<int64_t>(0, std::min<int64_t>(16, n - first));
            kg[j] = valid[j] ? k0 + table[first / block_size] * block_stride +
                                   first % block_size * D
                             : nullptr;
            if (valid[j]) keys_by_pair(kg[j], valid[j], kt[j]);
        }
    }
    __m512i k(int j, int p) const { return valid[j] ? kt[j][p] : _mm512_setzero_si512(); }
    __m512i v(int p, int c) const {
        const int j = p / 8, a = 2 * (p % 8);  // keys a and a + 1 of group j
        const uint16_t* va = kg[j] + kv_stride + a * D + c / 2 * 32;
        const __m512i x = a < valid[j] ? _mm512_loadu_si512(va) : _mm512_setzero_si512();
        const __m512i y = a + 1 < valid[j] ? _mm512_loadu_si512(va + D) : _mm512_setzero_si512();
        return _mm512_permutex2var_epi16(x, idx[c], y);
    }
};

// One tile of T rows whose query pointers and last visible keys the caller gives.
template <int T, typename Source>
void tile_at(const uint16_t* const* q, const int64_t* limit, int row, int64_t from, int64_t to,
             Source& src, float scale, Rows& st) {
    const int64_t last = *std::max_element(limit, limit + T);
    for (int64_t key = from; key < to && key <= last; key += KB)
        block<T>(q, limit, key, src, scale, st, row);
}

// The rows of one work item (count <= QB) against the keys of one piece [from, from + CHUNK):
// each row's softmax statistics and unnormalised output over that piece alone, from fresh.
template <typename Source>
void piece(const uint16_t* const* qp, const int64_t* limit, int count, int64_t from, int64_t n,
           Source& src, float scale, Rows& st) {
    for (int i = 0; i < count; ++i) {
        st.m[i] = -INFINITY;
        st.l[i] = 0.0f;
        std::fill(st.o[i], st.o[i] + D, 0.0f);
    }
    const int64_t to = std::min(from + CHUNK, n);
    int row = 0;
    for (; row + R <= count; row += R)
        tile_at<R>(qp + row, limit + row, row, from, to, src, scale, st);
    switch (count - row) {
        case 5: tile_at<5>(qp + row, limit + row, row, from, to, src, scale, st); break;
        case 4: tile_at<4>(qp + row, limit + row, row, from, to, src, scale, st); break;
        case 3: tile_at<3>(qp + row, limit + row, row, from, to, src, scale, st); break;
        case 2: tile_at<2>(qp + row, limit + row, row, from, to, src, scale, st); break;
        case 1: tile_at<1>(qp + row, limit + row, row, from, to, src, scale, st); break;
        default: break;
    }
}

// Folds one piece's statistics (m, l, o) into a row's running ones (M, L, O), pieces taken in
// key order: the same explicit operations wherever it runs (no contraction left to the
// compiler), so a row merged inside a prefill item and one merged from pieces that other
// threads computed get the same bits. A piece the row does not reach (m = -inf) changes
// nothing; the first one it reaches is copied.
inline void merge(float& M, float& L, float* O, float m, float l, const float* o) {
    if (m == -INFINITY) return;
    if (M == -INFINITY) {
        M = m;
        L = l;
        std::memcpy(O, o, D * sizeof(float));
        return;
    }
    const float top = std::max(M, m);
    const float a = M == top ? 1.0f : _mm512_cvtss_f32(exp_le0(_mm512_set1_ps(M - top)));
    const float b = m == top ? 1.0f : _mm512_cvtss_f32(exp_le0(_mm512_set1_ps(m - top)));
    M = top;
    L = std::fma(L, a, l * b);
    const __m512 va = _mm512_set1_ps(a), vb = _mm512_set1_ps(b);
    for (int c = 0; c < 4; ++c)
        _mm512_storeu_ps(O + 16 * c, _mm512_fmadd_ps(_mm512_loadu_ps(O + 16 * c), va,
                                                     _mm512_mul_ps(_mm512_loadu_ps(o + 16 * c), vb)));
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

extern "C" {

// Every row of a step, each against its own sequence's keys [0, its position], read from the
// block pool through the block tables: the row's bits are those the contiguous entry above
// gives it (same packing, same blocks of KB keys from key 0, same online softmax), so a
// token's attention is the same whether it is decoded alone, decoded beside others, or
// recomputed inside a prefill chunk of any length starting anywhere.
//
// q [rows, heads, 64] bf16: sequence s owns rows row_start[s] .. row_start[s + 1], the first
// at position first_pos[s], each next one position further; its keys [0, first_pos[s] + its
// row count) lie in the pool `kv` [blocks, layers, 2, kv_heads, block_size, 64] bf16, layer
// `layer`, blocks tables[s * table_width + i] (block_size a multiple of 16). The query heads
// h * group .. h * group + group - 1 share KV head h. out [rows, heads, 64] float32.
void kvtier_paged_attention(const uint16_t* q, int64_t heads, int64_t kv_heads,
                            const uint16_t* kv, int64_t layers, int64_t layer,
                            int64_t block_size, const int64_t* tables, int64_t table_width,
                            const int64_t* row_start, const int64_t* first_pos, int64_t seqs,
                            float scale, float* out, int threads) {
    // A row's result: its keys [0, position] in pieces of CHUNK keys from key 0, each piece's
    // softmax computed from fresh (blocks of KB keys, `block`), the pieces folded in key order
    // (`merge`), then normalised. A sequence of many rows (a prefill chunk) is packed first
    // and split into items of QB folded rows per head, each item taking its pieces in turn. A
    // sequence of few rows (a decode: one item's worth per head) reads the pool directly
    // (`FromPool`), one item per (head, piece), so that one long sequence spreads over the
    // threads; their pieces are folded afterwards, in the same order by the same `merge`.
    const int64_t group = heads / kv_heads;
    const auto rows_of = [&](int64_t s) { return row_start[s + 1] - row_start[s]; };
    const auto keys_of = [&](int64_t s) { return first_pos[s] + rows_of(s); };
    const auto padded_of = [&](int64_t s) { return (keys_of(s) + KB - 1) / KB * KB; };
    const auto pieces_of = [&](int64_t s) { return (keys_of(s) + CHUNK - 1) / CHUNK; };
    const auto packs = [&](int64_t s) { return group * rows_of(s) > QB; };
    // Per sequence, counted before it: packed words and 16-key groups (packed sequences),
    // work items, and piece states (direct sequences: per head, piece and folded row).
    std::vector<int64_t> packed_at(seqs + 1, 0), groups_before(seqs + 1, 0),
        items_before(seqs + 1, 0), states_before(seqs + 1, 0);
    for (int64_t s = 0; s < seqs; ++s) {
        const int64_t folded = group * rows_of(s);
        const int64_t padded = packs(s) ? padded_of(s) : 0;
        packed_at[s + 1] = packed_at[s] + kv_heads * padded * PAIRS;
        groups_before[s + 1] = groups_before[s] + kv_heads * (padded / 16);
        items_before[s + 1] = items_before[s] +
                              kv_heads * (packs(s) ? (folded + QB - 1) / QB : pieces_of(s));
        states_before[s + 1] = states_before[s] + (packs(s) ? 0 : kv_heads * pieces_of(s) * folded);
    }
    constexpr int64_t STATE = 2 + D;  // m, l, o
    thread_local std::vector<uint32_t> scratch;
    thread_local std::vector<float> states;
    const int64_t size = packed_at[seqs];
    if (static_cast<int64_t>(scratch.size()) < 2 * size) scratch.resize(2 * size);
    if (static_cast<int64_t>(states.size()) < states_before[seqs] * STATE)
        states.resize(states_before[seqs] * STATE);
    uint32_t* const kp = scratch.data();
    uint32_t* const vp = kp + size;
    float* const state = states.data();
    const auto seq_of = [](const std::vector<int64_t>& before, int64_t index) {
        return static_cast<int64_t>(
            std::upper_bound(before.begin(), before.end(), index) - before.begin() - 1);
    };
    const int64_t kv_stride = kv_heads * block_size * D;  // K -> V of a (block, layer)
    const int64_t block_stride = layers * 2 * kv_stride;
    const uint16_t* layer_k = kv + layer * 2 * kv_stride;  // block 0, this layer, K, head 0
    // folded row r of head h: token r / group of the sequence, query head h * group + r % group
    const auto out_row = [&](int64_t s, int64_t h, int64_t r) {
        return out + ((row_start[s] + r / group) * heads + h * group + r % group) * D;
    };
#pragma omp parallel num_threads(threads) if (threads > 1)
    {
#pragma omp for schedule(static)
        for (int64_t it = 0; it < groups_before[seqs]; ++it) {
            const int64_t s = seq_of(groups_before, it);
            const int64_t local = it - groups_before[s];
            const int64_t n = keys_of(s), padded = padded_of(s);
            const int64_t h = local / (padded / 16), g = local % (padded / 16);
            uint32_t* kg = kp + packed_at[s] + h * padded * PAIRS + g * PAIRS * 16;
            uint32_t* vg = vp + packed_at[s] + h * padded * PAIRS + g * 8 * D;
            const int64_t key = g * 16;
            if (key >= n) {
                pack_group(nullptr, nullptr, 0, kg, vg);
                continue;
            }
            const uint16_t* base = layer_k + tables[s * table_width + key / block_size] *
                                                 block_stride +
                                   h * block_size * D + key % block_size * D;
            pack_group(base, base + kv_stride, n - key, kg, vg);
        }
        Rows st;
        float total_m[QB], total_l[QB];
        alignas(64) float total_o[QB][D];
        const uint16_t* qp[QB];
        int64_t limit[QB];
#pragma omp for schedule(dynamic, 1)
        for (int64_t item = 0; item < items_before[seqs]; ++item) {
            const int64_t s = seq_of(items_before, item);
            const int64_t m = rows_of(s), n = keys_of(s), folded = group * m;
            const int64_t local = item - items_before[s];
            if (packs(s)) {
                const int64_t per_head = (folded + QB - 1) / QB;
                const int64_t h = local / per_head, r0 = local % per_head * QB;
                const int count = static_cast<int>(std::min<int64_t>(QB, folded - r0));
                for (int i = 0; i < count; ++i) {
                    qp[i] = q + (row_start[s] + (r0 + i) / group) * heads * D +
                            (h * group + (r0 + i) % group) * D;
                    limit[i] = first_pos[s] + (r0 + i) / group;
                    total_m[i] = -INFINITY;
                    total_l[i] = 0.0f;
                }
                const int64_t padded = padded_of(s);
                Packed src{kp + packed_at[s] + h * padded * PAIRS,
                           vp + packed_at[s] + h * padded * PAIRS};
                const int64_t last = *std::max_element(limit, limit + count);
                for (int64_t from = 0; from <= last; from += CHUNK) {
                    piece(qp, limit, count, from, n, src, scale, st);
                    for (int i = 0; i < count; ++i)
                        merge(total_m[i], total_l[i], total_o[i], st.m[i], st.l[i], st.o[i]);
                }
                for (int i = 0; i < count; ++i) {
                    float* o = out_row(s, h, r0 + i);
                    for (int d = 0; d < D; ++d) o[d] = total_o[i][d] / total_l[i];
                }
                continue;
            }
            const int64_t h = local / pieces_of(s), k = local % pieces_of(s);
            const int count = static_cast<int>(folded);
            for (int i = 0; i < count; ++i) {
                qp[i] = q + (row_start[s] + i / group) * heads * D + (h * group + i % group) * D;
                limit[i] = first_pos[s] + i / group;
            }
            FromPool src(layer_k + h * block_size * D, kv_stride, block_stride, block_size, n,
                         tables + s * table_width);
            piece(qp, limit, count, k * CHUNK, n, src, scale, st);
            float* saved = state + (states_before[s] + (h * pieces_of(s) + k) * folded) * STATE;
            for (int i = 0; i < count; ++i) {
                saved[i * STATE] = st.m[i];
                saved[i * STATE + 1] = st.l[i];
                std::memcpy(saved + i * STATE + 2, st.o[i], D * sizeof(float));
            }
        }
        // the direct sequences' pieces, folded in key order per row
#pragma omp for schedule(static)
        for (int64_t s = 0; s < seqs; ++s) {
            if (packs(s)) continue;
            const int64_t folded = group * rows_of(s), pieces = pieces_of(s);
            for (int64_t h = 0; h < kv_heads; ++h)
                for (int64_t r = 0; r < folded; ++r) {
                    float total_m_r = -INFINITY, total_l_r = 0.0f;
                    alignas(64) float total_o_r[D];
                    for (int64_t k = 0; k < pieces; ++k) {
                        const float* saved =
                            state + (states_before[s] + (h * pieces + k) * folded + r) * STATE;
                        merge(total_m_r, total_l_r, total_o_r, saved[0], saved[1], saved + 2);
                    }
                    float* o = out_row(s, h, r);
                    for (int d = 0; d < D; ++d) o[d] = total_o_r[d] / total_l_r;
                }
        }
    }
}
}
