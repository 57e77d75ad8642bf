// Fused CPU kernels for the block-sparse attention's band, column and summary terms (XLA FFI).
//
// On XLA:CPU each term ran as batched matmuls on tiles plus tile copies into and out of the
// grid layout, zeroed accumulators and separate elementwise passes over the scores, and scored
// every masked key of its tiles. Here a call goes through the term's query blocks one at a
// time, flash-style: the block's queries and keys are gathered once for all heads, keys are
// transposed in registers, scores stay in a cache-sized tile, keys that no row of a panel of
// kMR queries sees are skipped, and results are written straight back into the grid layout.
// The Python side (sparse_jax/native.py) builds this file with the host's compiler and
// registers the handlers; attention.py calls them (docs/design.md §3).
//
// * Column term: causal attention inside each column of the grid [B, R, l, H, d]: query
//   (r, col) sees keys (r', col) with r - r' >= min_rows.
// * Band term: query i (in sequence order) sees keys j in [lo(i), i], lo(i) the largest of 0,
//   i - max_distance (if >= 0), the start of the row prev rows before i's (rows of `block`),
//   and i's own row start (if same_row).
// * Summary term: query i sees the keys at residues res[0..s) of every grid row before its own.
// * Dense causal attention: query i sees keys [0, i], alone (pattern "dense"; its own drivers
//   write the output and log-sum-exp, and dq, dk, dv, instead of merging into a joint softmax).
// Forward: merges the term into the running maximum, sum of exponentials and weighted values
// (not divided) of the joint softmax. Backward: adds the term's dq, dk and dv, given the joint
// log-sum-exp and D = dO · O per query. Float32 only.

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <utility>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

#if defined(__AVX512F__)
constexpr int kVW = 16;   // floats per vector
constexpr int kNV = 4;    // vectors per microkernel row (64 columns)
#else
constexpr int kVW = 8;    // AVX2 or narrower
constexpr int kNV = 2;
#endif
constexpr int kMR = 6;    // rows per microkernel
constexpr int kQB = 64;   // query rows per block
constexpr int kKB = 128;  // key rows per block (a multiple of kVW)
constexpr float kFloor = -1e20f;  // the row maximum's floor, as attention.py's _FLOOR

typedef float vf __attribute__((vector_size(kVW * 4)));

inline vf load(const float* p) { vf x; std::memcpy(&x, p, sizeof x); return x; }
inline void store(float* p, vf x) { std::memcpy(p, &x, sizeof x); }
inline vf splat(float x) { return vf{} + x; }
typedef int32_t vi __attribute__((vector_size(kVW * 4)));
template <int W, int... T>
inline vf swap_lanes(vf x, std::integer_sequence<int, T...>) {
#if defined(__clang__)
  return __builtin_shufflevector(x, x, (T ^ W)...);
#else
  return __builtin_shuffle(x, vi{(T ^ W)...});
#endif
}
template <int W>
inline vf swap_lanes(vf x) {  // lane t <- lane t ^ W
  return swap_lanes<W>(x, std::make_integer_sequence<int, kVW>{});
}
template <class Op>
inline float reduce(vf x, Op op) {  // a tree: log2(kVW) dependent steps, not kVW
  if constexpr (kVW == 16) x = op(x, swap_lanes<8>(x));
  x = op(x, swap_lanes<4>(x));
  x = op(x, swap_lanes<2>(x));
  x = op(x, swap_lanes<1>(x));
  return x[0];
}
inline float hsum(vf x) { return reduce(x, [](vf a, vf b) { return a + b; }); }
inline float hmax(vf x) { return reduce(x, [](vf a, vf b) { return a > b ? a : b; }); }
const vf iota = [] { vf x; for (int t = 0; t < kVW; ++t) x[t] = t; return x; }();  // 0, 1, ...

// exp(x) in float32 (Cephes' polynomial on [-ln2/2, ln2/2], ~1 ulp); 0 below -87.3.
inline vf vexp(vf x) {
  const vf lo = splat(-87.3f);
  vf y = x < lo ? lo : x;
  y = y > splat(88.3f) ? splat(88.3f) : y;
  const vf magic = splat(12582912.0f);  // 1.5 * 2^23: adding it rounds to an integer
  vf t = y * splat(1.44269504088896341f) + magic;
  vf n = t - magic;
  vf r = y - n * splat(0.693359375f) + n * splat(2.12194440e-4f);
  vf p = splat(1.9875691500e-4f);
  p = p * r + splat(1.3981999507e-3f);
  p = p * r + splat(8.3334519073e-3f);
  p = p * r + splat(4.1665795894e-2f);
  p = p * r + splat(1.6666665459e-1f);
  p = p * r + splat(5.0000001201e-1f);
  p = p * r * r + r + splat(1.0f);
  const vi bits = ((vi)t - (vi)magic + 127) << 23;  // 2^n (vector casts keep the bits)
  const vf out = p * (vf)bits;
  return x < lo ? splat(0.0f) : out;
}

// C[0:M, 0:NV*kVW] (= or +=) sum_{c in [k0, k1)} A(i, c) * B[c, :], A(i, c) = a[i*ars + c*acs],
// B's row c at b + c*bs.
template <int M, int NV>
void micro(int k0, int k1, const float* a, long ars, long acs, const float* b, long bs,
           float* c, long cs, bool accumulate) {
  vf acc[M][NV];
  for (int i = 0; i < M; ++i)
    for (int j = 0; j < NV; ++j) acc[i][j] = accumulate ? load(c + i * cs + j * kVW) : vf{};
  for (int p = k0; p < k1; ++p) {
    vf bv[NV];
    for (int j = 0; j < NV; ++j) bv[j] = load(b + p * bs + j * kVW);
    for (int i = 0; i < M; ++i) {
      vf av = splat(a[i * ars + p * acs]);
      for (int j = 0; j < NV; ++j) acc[i][j] += av * bv[j];
    }
  }
  for (int i = 0; i < M; ++i)
    for (int j = 0; j < NV; ++j) store(c + i * cs + j * kVW, acc[i][j]);
}

using Micro = void (*)(int, int, const float*, long, long, const float*, long, float*, long, bool);

template <int M, int... N>
constexpr std::array<Micro, kNV> micro_row(std::integer_sequence<int, N...>) {
  return {&micro<M, N + 1>...};
}
template <int... M>
constexpr std::array<std::array<Micro, kNV>, kMR> micro_table(std::integer_sequence<int, M...>) {
  return {micro_row<M + 1>(std::make_integer_sequence<int, kNV>{})...};
}
constexpr auto kMicro = micro_table(std::make_integer_sequence<int, kMR>{});

// C (= or +=) A B over row panels of kMR rows of C's M rows: `range(i0, i1, &k0, &k1, &j0, &j1)`
// gives a panel's inner range and its columns [j0, j1) (multiples of kVW; others untouched).
template <class Range>
void gemm(int M, const float* a, long ars, long acs, const float* b, long bs, float* c, long cs,
          bool accumulate, Range range) {
  for (int i = 0; i < M; i += kMR) {
    const int mr = std::min(kMR, M - i);
    int k0, k1, j0, j1;
    range(i, i + mr, &k0, &k1, &j0, &j1);
    for (int j = j0; j < j1; j += kNV * kVW) {
      const int nv = std::min(kNV, (j1 - j) / kVW);
      kMicro[mr - 1][nv - 1](k0, std::max(k0, k1), a + i * ars, ars, acs, b + j, bs,
                             c + i * cs + j, cs, accumulate);
    }
  }
}

inline int round_up(int x, int m) { return (x + m - 1) / m * m; }
inline int round_down(int x, int m) { return x / m * m; }

#if defined(__AVX512F__)
// dst[c * ds + j] = scale * src[j * ss + c] for a 16 x 16 block (in registers: three rounds of
// shuffles instead of 256 scalar loads and stores).
inline void transpose16(const float* src, long ss, float* dst, long ds, float scale) {
  __m512 r[16], t[16];
  const __m512 f = _mm512_set1_ps(scale);
  for (int i = 0; i < 16; ++i) r[i] = _mm512_mul_ps(_mm512_loadu_ps(src + i * ss), f);
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
  }
  auto pd = [](__m512 x) { return _mm512_castps_pd(x); };
  for (int i = 0; i < 4; ++i) {
    r[4 * i + 0] = _mm512_castpd_ps(_mm512_unpacklo_pd(pd(t[4 * i + 0]), pd(t[4 * i + 2])));
    r[4 * i + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(pd(t[4 * i + 0]), pd(t[4 * i + 2])));
    r[4 * i + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(pd(t[4 * i + 1]), pd(t[4 * i + 3])));
    r[4 * i + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(pd(t[4 * i + 1]), pd(t[4 * i + 3])));
  }
  for (int g = 0; g < 2; ++g)
    for (int i = 0; i < 4; ++i) {
      t[8 * g + i] = _mm512_shuffle_f32x4(r[8 * g + i], r[8 * g + 4 + i], 0x88);
      t[8 * g + 4 + i] = _mm512_shuffle_f32x4(r[8 * g + i], r[8 * g + 4 + i], 0xdd);
    }
  for (int i = 0; i < 8; ++i) {
    r[i] = _mm512_shuffle_f32x4(t[i], t[8 + i], 0x88);
    r[8 + i] = _mm512_shuffle_f32x4(t[i], t[8 + i], 0xdd);
  }
  for (int i = 0; i < 16; ++i) _mm512_storeu_ps(dst + i * ds, r[i]);
}
#endif

// Kt[c, j] = scale * K[j][c] (K's rows rs apart) for j < kn, zeros up to a multiple of kVW.
void pack_transposed(const float* k, long rs, int kn, int d, float scale, float* kt) {
  const int knp = round_up(kn, kVW);
  int j0 = 0;
#if defined(__AVX512F__)
  if (d % 16 == 0)
    for (; j0 + 16 <= kn; j0 += 16)
      for (int c = 0; c < d; c += 16)
        transpose16(k + j0 * rs + c, rs, kt + c * kKB + j0, kKB, scale);
#endif
  for (int c = 0; c < d; ++c) {
    float* dst = kt + c * kKB;
    for (int j = j0; j < kn; ++j) dst[j] = scale * k[j * rs + c];
    for (int j = kn; j < knp; ++j) dst[j] = 0.0f;
  }
}

// Which keys each query row of a block sees: [lo[i], hi[i]) in the block's key rows, both
// non-decreasing in i. Within a key block [k0, k0 + kn) the kept columns of row i, and for a
// panel of rows the columns any of them keeps (rounded out to whole vectors).
struct Keys {
  const int* lo;
  const int* hi;
  int k0, kn;
  int a(int i) const { return std::clamp(lo[i] - k0, 0, kn); }
  int b(int i) const { return std::clamp(hi[i] - k0, 0, kn); }
  void panel(int i0, int i1, int* j0, int* j1) const {
    *j0 = round_down(a(i0), kVW);
    *j1 = std::max(*j0, round_up(b(i1 - 1), kVW));
  }
  // The query rows [*q0, *q1) of the block's qn that see a key of columns [j0, j1).
  void queries(int qn, int j0, int j1, int* q0, int* q1) const {
    int i = 0;
    while (i < qn && hi[i] - k0 <= j0) ++i;
    int e = i;
    while (e < qn && lo[e] - k0 < j1) ++e;
    *q0 = i;
    *q1 = e;
  }
};

// S = Q Kt for the block's queries, panel by panel over the columns a panel keeps.
void scores(const float* q, int qn, const float* kt, int d, const Keys& keys, float* s) {
  gemm(qn, q, d, 1, kt, kKB, s, kKB, false, [&](int i0, int i1, int* a, int* b, int* j0, int* j1) {
    *a = 0; *b = d; keys.panel(i0, i1, j0, j1);
  });
}

struct Work {  // scratch of one call, reused from block to block
  std::vector<float> kt, vt, s, ds;
  void reserve(int d, int dv) {
    kt.resize(kKB * d); vt.resize(kKB * dv); s.resize(kQB * kKB); ds.resize(kQB * kKB);
  }
};

// Merges qn queries' attention over nk keys (q [qn, d], k [nk, d], v [nk, dv], contiguous rows)
// into the running maximum m, sum l and values o [qn, dv]; row i sees keys [lo[i], hi[i]).
// qn <= kQB.
void attend_forward(const float* q, const float* k, const float* v, int qn, int nk, int d,
                    int dv, const int* lo, const int* hi, float scale, float* m, float* l,
                    float* o, Work& w) {
  float* kt = w.kt.data();
  float* s = w.s.data();
  for (int k0 = 0; k0 < nk; k0 += kKB) {
    const int kn = std::min(kKB, nk - k0);
    if (hi[qn - 1] <= k0 || lo[0] >= k0 + kn) continue;  // no row sees this key block
    const Keys keys{lo, hi, k0, kn};
    pack_transposed(k + k0 * d, d, kn, d, scale, kt);
    scores(q, qn, kt, d, keys, s);
    for (int i0 = 0; i0 < qn; i0 += kMR) {
      const int i1 = std::min(qn, i0 + kMR);
      int j0, j1;
      keys.panel(i0, i1, &j0, &j1);
      for (int i = i0; i < i1; ++i) {
        float* si = s + i * kKB;
        const float a = keys.a(i), b = keys.b(i);
        vf mv = splat(m[i]);
        for (int j = j0; j < j1; j += kVW) {
          const vf x = load(si + j), at = iota + float(j);
          mv = at >= a && at < b && x > mv ? x : mv;
        }
        const float mx = hmax(mv);
        vf sum{};
        for (int j = j0; j < j1; j += kVW) {
          const vf at = iota + float(j);
          const vf p = at >= a && at < b ? vexp(load(si + j) - mx) : vf{};
          store(si + j, p);
          sum += p;
        }
        if (mx != m[i]) {
          const float alpha = vexp(splat(m[i] - mx))[0];
          l[i] *= alpha;
          for (int c = 0; c < dv; c += kVW) store(o + i * dv + c, load(o + i * dv + c) * alpha);
          m[i] = mx;
        }
        l[i] += hsum(sum);
      }
    }
    gemm(qn, s, kKB, 1, v + k0 * dv, dv, o, dv, true,  // O += P V (over real keys only)
         [&](int i0, int i1, int* a, int* b, int* j0, int* j1) {
           keys.panel(i0, i1, a, b); *b = std::min(*b, kn); *j0 = 0; *j1 = dv;
         });
  }
}

// Adds qn queries' gradients over nk keys: dq [qn, d] += scale dS K, dk [nk, d] += scale dSᵀ Q,
// dv [nk, dv] += Pᵀ dO, with P = exp(scale Q Kᵀ - lse) on the kept keys and
// dS = P (dO Vᵀ - delta). qn <= kQB.
void attend_backward(const float* q, const float* k, const float* v, const float* dout,
                     const float* lse, const float* delta, int qn, int nk, int d, int dv,
                     const int* lo, const int* hi, float scale, float* dq, float* dk, float* dvo,
                     Work& w) {
  float* kt = w.kt.data();
  float* vt = w.vt.data();
  float* p = w.s.data();
  float* ds = w.ds.data();
  for (int k0 = 0; k0 < nk; k0 += kKB) {
    const int kn = std::min(kKB, nk - k0);
    if (hi[qn - 1] <= k0 || lo[0] >= k0 + kn) continue;
    const int knp = round_up(kn, kVW);
    const Keys keys{lo, hi, k0, kn};
    pack_transposed(k + k0 * d, d, kn, d, scale, kt);
    pack_transposed(v + k0 * dv, dv, kn, dv, 1.0f, vt);
    scores(q, qn, kt, d, keys, p);
    gemm(qn, dout, dv, 1, vt, kKB, ds, kKB, false,  // dP = dO Vᵀ
         [&](int i0, int i1, int* a, int* b, int* j0, int* j1) {
           *a = 0; *b = dv; keys.panel(i0, i1, j0, j1);
         });
    for (int i0 = 0; i0 < qn; i0 += kMR) {
      const int i1 = std::min(qn, i0 + kMR);
      int j0, j1;
      keys.panel(i0, i1, &j0, &j1);
      for (int i = i0; i < i1; ++i) {
        float* pi = p + i * kKB;
        float* dsi = ds + i * kKB;
        const float a = keys.a(i), b = keys.b(i), li = lse[i], di = delta[i];
        for (int j = 0; j < knp; j += kVW) {  // every column: the key-side products read them
          const vf at = iota + float(j);
          if (j < j0 || j >= j1) {
            store(pi + j, vf{});
            store(dsi + j, vf{});
            continue;
          }
          const vf pj = at >= a && at < b ? vexp(load(pi + j) - li) : vf{};
          store(pi + j, pj);
          store(dsi + j, pj * (load(dsi + j) - di) * scale);
        }
      }
    }
    gemm(qn, ds, kKB, 1, k + k0 * d, d, dq, d, true,  // dQ += dS K
         [&](int i0, int i1, int* a, int* b, int* j0, int* j1) {
           keys.panel(i0, i1, a, b); *b = std::min(*b, kn); *j0 = 0; *j1 = d;
         });
    auto seen_by = [&](int j0, int j1, int* a, int* b) { keys.queries(qn, j0, j1, a, b); };
    gemm(kn, ds, 1, kKB, q, d, dk + k0 * d, d, true,  // dK += dSᵀ Q
         [&](int j0, int j1, int* a, int* b, int* c0, int* c1) {
           seen_by(j0, j1, a, b); *c0 = 0; *c1 = d;
         });
    gemm(kn, p, 1, kKB, dout, dv, dvo + k0 * dv, dv, true,  // dV += Pᵀ dO
         [&](int j0, int j1, int* a, int* b, int* c0, int* c1) {
           seen_by(j0, j1, a, b); *c0 = 0; *c1 = dv;
         });
  }
}

// dst[0:w] = src[0:w]: inline vector moves for whole vectors (a memcpy call per row of one head
// cost more than the copy), else a call.
inline void copy_row(float* dst, const float* src, long w) {
  if (w % kVW) {
    std::memcpy(dst, src, w * 4);
    return;
  }
  for (long c = 0; c < w; c += kVW) store(dst + c, load(src + c));
}

// Rows of a grid array [B, N, H, w] (N positions) at positions start + r * step, r < count,
// all heads (each row one run of H * w floats), to and from [H, hs, w] (hs: rows per head in
// the buffer, count unless given).
struct Rows {
  long N, H, start, step, count;
  const float* at(const float* x, long w, long b, long r) const {
    return x + ((b * N + start + r * step) * H) * w;
  }
  void gather(const float* x, long w, long b, float* out, long hs = 0) const {
    hs = hs ? hs : count;
    for (long r = 0; r < count; ++r) {
      const float* src = at(x, w, b, r);
      for (long h = 0; h < H; ++h) copy_row(out + (h * hs + r) * w, src + h * w, w);
    }
  }
  void scatter(const float* in, long w, long b, float* x, long hs = 0) const {
    hs = hs ? hs : count;
    for (long r = 0; r < count; ++r) {
      float* dst = const_cast<float*>(at(x, w, b, r));
      for (long h = 0; h < H; ++h) copy_row(dst + h * w, in + (h * hs + r) * w, w);
    }
  }
};

// The band's key windows in per-head buffers [H, cap, w] holding positions [b0, end): a query
// block gathers only the rows its window adds (windows overlap: strided l = 128 reads each key
// in three blocks), and the buffer moves its rows to the front when the next window would not
// fit, first handing the rows it drops to `drop` (positions [b0, w0)).
struct Window {
  long N, H, cap, b0 = 0, end = 0;
  template <class Drop, class Buffers>
  void advance(long w0, long e, Drop drop, Buffers buffers) {
    if (e - b0 > cap) {
      drop(Rows{N, H, b0, 1, w0 - b0});
      for (auto [buf, w] : buffers)
        for (long h = 0; h < H; ++h)
          std::memmove(buf + h * cap * w, buf + (h * cap + w0 - b0) * w, (end - w0) * w * 4);
      b0 = w0;
    }
    fresh = Rows{N, H, end, 1, e - end};
    end = e;
  }
  float* rows(float* buf, long w, long h, long from) const {  // head h's row of position from
    return buf + (h * cap + from - b0) * w;
  }
  Rows fresh{0, 0, 0, 1, 0};  // the rows the last advance added
};

struct Shape {
  long B, N, H, d, dv;
};

ffi::Error shape_of(const ffi::Buffer<ffi::F32>& q, const ffi::Buffer<ffi::F32>& v, Shape* s) {
  const auto qd = q.dimensions(), vd = v.dimensions();
  if (qd.size() != 4 || vd.size() != 4)
    return ffi::Error::InvalidArgument("expected [B, n, H, d] arrays");
  if (qd[3] % kVW || vd[3] % kVW)
    return ffi::Error::InvalidArgument("head dims must be multiples of 16");
  *s = Shape{qd[0], qd[1], qd[2], qd[3], vd[3]};
  return ffi::Error::Success();
}

// One query block's kept keys [lo, hi) for the band term, in the key window [w0, i0 + qn).
struct Band {
  long max_distance, block, prev;
  bool same_row;
  long lo(long i) const {
    long x = std::max(0L, (i / block - prev) * block);
    if (max_distance >= 0) x = std::max(x, i - max_distance);
    if (same_row) x = std::max(x, i / block * block);
    return x;
  }
};

// Buffers of the drivers below, per head: queries, keys, values, their statistics.
struct Blocks {
  std::vector<float> q, k, v, o, m, l, x, y, z;
  std::vector<int> lo, hi;
};

// A backward call's outputs start as the gradients of the terms before it: its inputs, or the
// same buffers where XLA aliased them.
void start_from(const ffi::Buffer<ffi::F32>& in, ffi::ResultBuffer<ffi::F32>& out) {
  if (in.typed_data() != out->typed_data())
    std::memcpy(out->typed_data(), in.typed_data(), in.element_count() * 4);
}

ffi::Error ColumnForwardImpl(ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k,
                             ffi::Buffer<ffi::F32> v, ffi::ResultBuffer<ffi::F32> row_max,
                             ffi::ResultBuffer<ffi::F32> total, ffi::ResultBuffer<ffi::F32> acc,
                             int64_t stride, int64_t min_rows, float scale) {
  Shape s;
  if (auto e = shape_of(q, v, &s); e.failure()) return e;
  const long R = s.N / stride, H = s.H, d = s.d, dv = s.dv;
  Blocks c;
  c.q.resize(H * R * d); c.k.resize(H * R * d); c.v.resize(H * R * dv);
  c.m.resize(H * R); c.l.resize(H * R); c.o.resize(H * R * dv);
  c.lo.assign(R, 0); c.hi.resize(R);
  for (long r = 0; r < R; ++r) c.hi[r] = std::max(0L, r - min_rows + 1);
  Work w;
  w.reserve(d, dv);
  for (long b = 0; b < s.B; ++b)
    for (long col = 0; col < stride; ++col) {
      const Rows rows{s.N, H, col, stride, R};
      rows.gather(q.typed_data(), d, b, c.q.data());
      rows.gather(k.typed_data(), d, b, c.k.data());
      rows.gather(v.typed_data(), dv, b, c.v.data());
      std::fill(c.m.begin(), c.m.end(), kFloor);
      std::fill(c.l.begin(), c.l.end(), 0.0f);
      std::fill(c.o.begin(), c.o.end(), 0.0f);
      for (long h = 0; h < H; ++h)
        for (long q0 = 0; q0 < R; q0 += kQB)
          attend_forward(c.q.data() + (h * R + q0) * d, c.k.data() + h * R * d,
                         c.v.data() + h * R * dv, std::min<long>(kQB, R - q0), R, d, dv,
                         c.lo.data() + q0, c.hi.data() + q0, scale, c.m.data() + h * R + q0,
                         c.l.data() + h * R + q0, c.o.data() + (h * R + q0) * dv, w);
      rows.scatter(c.m.data(), 1, b, row_max->typed_data());
      rows.scatter(c.l.data(), 1, b, total->typed_data());
      rows.scatter(c.o.data(), dv, b, acc->typed_data());
    }
  return ffi::Error::Success();
}

ffi::Error ColumnBackwardImpl(ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k,
                              ffi::Buffer<ffi::F32> v, ffi::Buffer<ffi::F32> d_out,
                              ffi::Buffer<ffi::F32> lse, ffi::Buffer<ffi::F32> delta,
                              ffi::ResultBuffer<ffi::F32> d_q, ffi::ResultBuffer<ffi::F32> d_k,
                              ffi::ResultBuffer<ffi::F32> d_v, int64_t stride, int64_t min_rows,
                              float scale) {
  Shape s;
  if (auto e = shape_of(q, v, &s); e.failure()) return e;
  const long R = s.N / stride, H = s.H, d = s.d, dv = s.dv;
  Blocks c;
  c.q.resize(H * R * d); c.k.resize(H * R * d); c.v.resize(H * R * dv); c.o.resize(H * R * dv);
  c.m.resize(H * R); c.l.resize(H * R);
  c.x.resize(H * R * d); c.y.resize(H * R * d); c.z.resize(H * R * dv);
  c.lo.assign(R, 0); c.hi.resize(R);
  for (long r = 0; r < R; ++r) c.hi[r] = std::max(0L, r - min_rows + 1);
  Work w;
  w.reserve(d, dv);
  for (long b = 0; b < s.B; ++b)
    for (long col = 0; col < stride; ++col) {
      const Rows rows{s.N, H, col, stride, R};
      rows.gather(q.typed_data(), d, b, c.q.data());
      rows.gather(k.typed_data(), d, b, c.k.data());
      rows.gather(v.typed_data(), dv, b, c.v.data());
      rows.gather(d_out.typed_data(), dv, b, c.o.data());
      rows.gather(lse.typed_data(), 1, b, c.m.data());
      rows.gather(delta.typed_data(), 1, b, c.l.data());
      std::fill(c.x.begin(), c.x.end(), 0.0f);
      std::fill(c.y.begin(), c.y.end(), 0.0f);
      std::fill(c.z.begin(), c.z.end(), 0.0f);
      for (long h = 0; h < H; ++h)
        for (long q0 = 0; q0 < R; q0 += kQB)
          attend_backward(c.q.data() + (h * R + q0) * d, c.k.data() + h * R * d,
                          c.v.data() + h * R * dv, c.o.data() + (h * R + q0) * dv,
                          c.m.data() + h * R + q0, c.l.data() + h * R + q0,
                          std::min<long>(kQB, R - q0), R, d, dv, c.lo.data() + q0,
                          c.hi.data() + q0, scale, c.x.data() + (h * R + q0) * d,
                          c.y.data() + h * R * d, c.z.data() + h * R * dv, w);
      rows.scatter(c.x.data(), d, b, d_q->typed_data());
      rows.scatter(c.y.data(), d, b, d_k->typed_data());
      rows.scatter(c.z.data(), dv, b, d_v->typed_data());
    }
  return ffi::Error::Success();
}

// The band term's query blocks of kQB in sequence order, each with its window of keys.
struct BandBlock {
  long i0, qn, w0, nw;  // queries [i0, i0 + qn), keys [w0, w0 + nw)
  BandBlock(const Band& band, long N, long i0_) : i0(i0_), qn(std::min<long>(kQB, N - i0_)) {
    w0 = band.lo(i0);
    nw = i0 + qn - w0;
  }
  void limits(const Band& band, std::vector<int>& lo, std::vector<int>& hi) const {
    for (long i = 0; i < qn; ++i) {
      lo[i] = band.lo(i0 + i) - w0;
      hi[i] = i0 + i + 1 - w0;
    }
  }
};

ffi::Error BandForwardImpl(ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k,
                           ffi::Buffer<ffi::F32> v, ffi::Buffer<ffi::F32> m_in,
                           ffi::Buffer<ffi::F32> l_in, ffi::Buffer<ffi::F32> acc_in,
                           ffi::ResultBuffer<ffi::F32> row_max, ffi::ResultBuffer<ffi::F32> total,
                           ffi::ResultBuffer<ffi::F32> acc, int64_t block, int64_t prev,
                           int64_t max_distance, bool same_row, float scale) {
  Shape s;
  if (auto e = shape_of(q, v, &s); e.failure()) return e;
  const long H = s.H, d = s.d, dv = s.dv;
  const Band band{max_distance, block, prev, same_row};
  long most = 0;  // the widest window
  for (long i0 = 0; i0 < s.N; i0 += kQB) most = std::max(most, BandBlock(band, s.N, i0).nw);
  const long cap = most + 16 * kQB;
  Blocks c;
  c.q.resize(H * kQB * d); c.k.resize(H * cap * d); c.v.resize(H * cap * dv);
  c.m.resize(H * kQB); c.l.resize(H * kQB); c.o.resize(H * kQB * dv);
  c.lo.resize(kQB); c.hi.resize(kQB);
  Work w;
  w.reserve(d, dv);
  for (long b = 0; b < s.B; ++b) {
    Window win{s.N, H, cap};
    for (long i0 = 0; i0 < s.N; i0 += kQB) {
      const BandBlock blk(band, s.N, i0);
      blk.limits(band, c.lo, c.hi);
      win.advance(blk.w0, i0 + blk.qn, [](const Rows&) {},
                  std::array{std::pair{c.k.data(), d}, std::pair{c.v.data(), dv}});
      win.fresh.gather(k.typed_data(), d, b, win.rows(c.k.data(), d, 0, win.fresh.start), cap);
      win.fresh.gather(v.typed_data(), dv, b, win.rows(c.v.data(), dv, 0, win.fresh.start), cap);
      const Rows queries{s.N, H, i0, 1, blk.qn};
      queries.gather(q.typed_data(), d, b, c.q.data());
      queries.gather(m_in.typed_data(), 1, b, c.m.data());
      queries.gather(l_in.typed_data(), 1, b, c.l.data());
      queries.gather(acc_in.typed_data(), dv, b, c.o.data());
      for (long h = 0; h < H; ++h)
        attend_forward(c.q.data() + h * blk.qn * d, win.rows(c.k.data(), d, h, blk.w0),
                       win.rows(c.v.data(), dv, h, blk.w0), blk.qn, blk.nw, d, dv, c.lo.data(),
                       c.hi.data(), scale, c.m.data() + h * blk.qn, c.l.data() + h * blk.qn,
                       c.o.data() + h * blk.qn * dv, w);
      queries.scatter(c.m.data(), 1, b, row_max->typed_data());
      queries.scatter(c.l.data(), 1, b, total->typed_data());
      queries.scatter(c.o.data(), dv, b, acc->typed_data());
    }
  }
  return ffi::Error::Success();
}

ffi::Error BandBackwardImpl(ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k,
                            ffi::Buffer<ffi::F32> v, ffi::Buffer<ffi::F32> d_out,
                            ffi::Buffer<ffi::F32> lse, ffi::Buffer<ffi::F32> delta,
                            ffi::Buffer<ffi::F32> dq_in, ffi::Buffer<ffi::F32> dk_in,
                            ffi::Buffer<ffi::F32> dv_in, ffi::ResultBuffer<ffi::F32> d_q,
                            ffi::ResultBuffer<ffi::F32> d_k, ffi::ResultBuffer<ffi::F32> d_v,
                            int64_t block, int64_t prev, int64_t max_distance, bool same_row,
                            float scale) {
  Shape s;
  if (auto e = shape_of(q, v, &s); e.failure()) return e;
  const long H = s.H, d = s.d, dv = s.dv;
  start_from(dq_in, d_q);
  start_from(dk_in, d_k);
  start_from(dv_in, d_v);
  const Band band{max_distance, block, prev, same_row};
  long most = 0;
  for (long i0 = 0; i0 < s.N; i0 += kQB) most = std::max(most, BandBlock(band, s.N, i0).nw);
  const long cap = most + 16 * kQB;
  Blocks c;
  c.q.resize(H * kQB * d); c.o.resize(H * kQB * dv); c.m.resize(H * kQB); c.l.resize(H * kQB);
  c.k.resize(H * cap * d); c.v.resize(H * cap * dv);
  c.x.resize(H * kQB * d); c.y.resize(H * cap * d); c.z.resize(H * cap * dv);
  c.lo.resize(kQB); c.hi.resize(kQB);
  Work w;
  w.reserve(d, dv);
  for (long b = 0; b < s.B; ++b) {
    Window win{s.N, H, cap};
    auto write_back = [&](const Rows& rows) {  // key rows no later window holds: dk, dv final
      rows.scatter(c.y.data(), d, b, d_k->typed_data(), cap);
      rows.scatter(c.z.data(), dv, b, d_v->typed_data(), cap);
    };
    for (long i0 = 0; i0 < s.N; i0 += kQB) {
      const BandBlock blk(band, s.N, i0);
      blk.limits(band, c.lo, c.hi);
      win.advance(blk.w0, i0 + blk.qn, write_back,
                  std::array{std::pair{c.k.data(), d}, std::pair{c.v.data(), dv},
                             std::pair{c.y.data(), d}, std::pair{c.z.data(), dv}});
      const long at = win.fresh.start;
      win.fresh.gather(k.typed_data(), d, b, win.rows(c.k.data(), d, 0, at), cap);
      win.fresh.gather(v.typed_data(), dv, b, win.rows(c.v.data(), dv, 0, at), cap);
      win.fresh.gather(d_k->typed_data(), d, b, win.rows(c.y.data(), d, 0, at), cap);  // so far
      win.fresh.gather(d_v->typed_data(), dv, b, win.rows(c.z.data(), dv, 0, at), cap);
      const Rows queries{s.N, H, i0, 1, blk.qn};
      queries.gather(q.typed_data(), d, b, c.q.data());
      queries.gather(d_out.typed_data(), dv, b, c.o.data());
      queries.gather(lse.typed_data(), 1, b, c.m.data());
      queries.gather(delta.typed_data(), 1, b, c.l.data());
      queries.gather(d_q->typed_data(), d, b, c.x.data());  // read, added to, written back
      for (long h = 0; h < H; ++h)
        attend_backward(c.q.data() + h * blk.qn * d, win.rows(c.k.data(), d, h, blk.w0),
                        win.rows(c.v.data(), dv, h, blk.w0), c.o.data() + h * blk.qn * dv,
                        c.m.data() + h * blk.qn, c.l.data() + h * blk.qn, blk.qn, blk.nw, d, dv,
                        c.lo.data(), c.hi.data(), scale, c.x.data() + h * blk.qn * d,
                        win.rows(c.y.data(), d, h, blk.w0), win.rows(c.z.data(), dv, h, blk.w0),
                        w);
      queries.scatter(c.x.data(), d, b, d_q->typed_data());
    }
    write_back(Rows{s.N, H, win.b0, 1, win.end - win.b0});
  }
  return ffi::Error::Success();
}

// Dense causal attention: query i sees keys [0, i], the band whose window is the whole sequence,
// alone in its softmax. Per batch row all heads are gathered once; each query block of a head
// runs over the key blocks up to its diagonal. Forward writes the output and the log-sum-exp
// itself (no running statistics to read in or divide outside); backward computes D = dO · O and
// writes dq, dk, dv (no earlier term's gradients to add to).
ffi::Error DenseForwardImpl(ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k,
                            ffi::Buffer<ffi::F32> v, ffi::ResultBuffer<ffi::F32> out,
                            ffi::ResultBuffer<ffi::F32> lse, float scale) {
  Shape s;
  if (auto e = shape_of(q, v, &s); e.failure()) return e;
  const long N = s.N, H = s.H, d = s.d, dv = s.dv;
  Blocks c;
  c.q.resize(H * N * d); c.k.resize(H * N * d); c.v.resize(H * N * dv);
  c.m.resize(H * N); c.l.resize(H * N); c.o.resize(H * N * dv);
  c.lo.assign(kQB, 0); c.hi.resize(kQB);
  Work w;
  w.reserve(d, dv);
  const Rows all{N, H, 0, 1, N};
  for (long b = 0; b < s.B; ++b) {
    all.gather(q.typed_data(), d, b, c.q.data());
    all.gather(k.typed_data(), d, b, c.k.data());
    all.gather(v.typed_data(), dv, b, c.v.data());
    std::fill(c.m.begin(), c.m.end(), kFloor);
    std::fill(c.l.begin(), c.l.end(), 0.0f);
    std::fill(c.o.begin(), c.o.end(), 0.0f);
    for (long h = 0; h < H; ++h)
      for (long i0 = 0; i0 < N; i0 += kQB) {
        const long qn = std::min<long>(kQB, N - i0), at = h * N + i0;
        for (long i = 0; i < qn; ++i) c.hi[i] = i0 + i + 1;
        attend_forward(c.q.data() + at * d, c.k.data() + h * N * d, c.v.data() + h * N * dv, qn,
                       i0 + qn, d, dv, c.lo.data(), c.hi.data(), scale, c.m.data() + at,
                       c.l.data() + at, c.o.data() + at * dv, w);
        for (long i = at; i < at + qn; ++i) {  // every row sees its own key: l >= 1
          const vf inv = splat(1.0f / c.l[i]);
          for (long j = 0; j < dv; j += kVW) store(&c.o[i * dv + j], load(&c.o[i * dv + j]) * inv);
          c.m[i] += std::log(c.l[i]);
        }
      }
    all.scatter(c.o.data(), dv, b, out->typed_data());
    all.scatter(c.m.data(), 1, b, lse->typed_data());
  }
  return ffi::Error::Success();
}

ffi::Error DenseBackwardImpl(ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k,
                             ffi::Buffer<ffi::F32> v, ffi::Buffer<ffi::F32> out,
                             ffi::Buffer<ffi::F32> d_out, ffi::Buffer<ffi::F32> lse,
                             ffi::ResultBuffer<ffi::F32> d_q, ffi::ResultBuffer<ffi::F32> d_k,
                             ffi::ResultBuffer<ffi::F32> d_v, float scale) {
  Shape s;
  if (auto e = shape_of(q, v, &s); e.failure()) return e;
  const long N = s.N, H = s.H, d = s.d, dv = s.dv;
  Blocks c;
  c.q.resize(H * N * d); c.k.resize(H * N * d); c.v.resize(H * N * dv);
  c.o.resize(H * N * dv); c.m.resize(H * N); c.l.resize(H * N);
  c.x.resize(H * N * d); c.y.resize(H * N * d); c.z.resize(H * N * dv);
  c.lo.assign(kQB, 0); c.hi.resize(kQB);
  Work w;
  w.reserve(d, dv);
  const Rows all{N, H, 0, 1, N};
  for (long b = 0; b < s.B; ++b) {
    all.gather(q.typed_data(), d, b, c.q.data());
    all.gather(k.typed_data(), d, b, c.k.data());
    all.gather(v.typed_data(), dv, b, c.v.data());
    all.gather(d_out.typed_data(), dv, b, c.o.data());
    all.gather(lse.typed_data(), 1, b, c.m.data());
    for (long i = 0; i < N; ++i)  // D = dO · O, as [H, N]
      for (long h = 0; h < H; ++h) {
        const float* o = out.typed_data() + ((b * N + i) * H + h) * dv;
        const float* g = d_out.typed_data() + ((b * N + i) * H + h) * dv;
        vf acc{};
        for (long j = 0; j < dv; j += kVW) acc += load(o + j) * load(g + j);
        c.l[h * N + i] = hsum(acc);
      }
    std::fill(c.x.begin(), c.x.end(), 0.0f);
    std::fill(c.y.begin(), c.y.end(), 0.0f);
    std::fill(c.z.begin(), c.z.end(), 0.0f);
    for (long h = 0; h < H; ++h)
      for (long i0 = 0; i0 < N; i0 += kQB) {
        const long qn = std::min<long>(kQB, N - i0), at = h * N + i0;
        for (long i = 0; i < qn; ++i) c.hi[i] = i0 + i + 1;
        attend_backward(c.q.data() + at * d, c.k.data() + h * N * d, c.v.data() + h * N * dv,
                        c.o.data() + at * dv, c.m.data() + at, c.l.data() + at, qn, i0 + qn, d,
                        dv, c.lo.data(), c.hi.data(), scale, c.x.data() + at * d,
                        c.y.data() + h * N * d, c.z.data() + h * N * dv, w);
      }
    all.scatter(c.x.data(), d, b, d_q->typed_data());
    all.scatter(c.y.data(), d, b, d_k->typed_data());
    all.scatter(c.z.data(), dv, b, d_v->typed_data());
  }
  return ffi::Error::Success();
}

// The summary term's keys: residue res[j] of grid row r is key r * s + j; query i sees the keys
// of the rows before its own, [0, (i / block) * s).
struct Summary {
  long N, H, block;
  ffi::Span<const int64_t> res;
  long rows() const { return N / block; }
  long count() const { return rows() * static_cast<long>(res.size()); }
  const float* at(const float* x, long w, long b, long r, long j) const {
    return x + ((b * N + r * block + res[j]) * H) * w;
  }
  void gather(const float* x, long w, long b, float* out) const {  // to [H, count, w]
    const long s = res.size(), n = count();
    for (long r = 0; r < rows(); ++r)
      for (long j = 0; j < s; ++j)
        for (long h = 0; h < H; ++h)
          copy_row(out + (h * n + r * s + j) * w, at(x, w, b, r, j) + h * w, w);
  }
  void scatter(const float* in, long w, long b, float* x) const {
    const long s = res.size(), n = count();
    for (long r = 0; r < rows(); ++r)
      for (long j = 0; j < s; ++j)
        for (long h = 0; h < H; ++h)
          copy_row(const_cast<float*>(at(x, w, b, r, j)) + h * w, in + (h * n + r * s + j) * w,
                   w);
  }
  void limits(long i0, long qn, std::vector<int>& lo, std::vector<int>& hi) const {
    for (long i = 0; i < qn; ++i) {
      lo[i] = 0;
      hi[i] = (i0 + i) / block * static_cast<long>(res.size());
    }
  }
};

ffi::Error SummaryForwardImpl(ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k,
                              ffi::Buffer<ffi::F32> v, ffi::Buffer<ffi::F32> m_in,
                              ffi::Buffer<ffi::F32> l_in, ffi::Buffer<ffi::F32> acc_in,
                              ffi::ResultBuffer<ffi::F32> row_max,
                              ffi::ResultBuffer<ffi::F32> total, ffi::ResultBuffer<ffi::F32> acc,
                              int64_t block, ffi::Span<const int64_t> residues, float scale) {
  Shape s;
  if (auto e = shape_of(q, v, &s); e.failure()) return e;
  const long H = s.H, d = s.d, dv = s.dv;
  const Summary sum{s.N, H, block, residues};
  const long S = sum.count();
  Blocks c;
  c.k.resize(H * S * d); c.v.resize(H * S * dv);
  c.q.resize(H * kQB * d); c.m.resize(H * kQB); c.l.resize(H * kQB); c.o.resize(H * kQB * dv);
  c.lo.resize(kQB); c.hi.resize(kQB);
  Work w;
  w.reserve(d, dv);
  for (long b = 0; b < s.B; ++b) {
    sum.gather(k.typed_data(), d, b, c.k.data());
    sum.gather(v.typed_data(), dv, b, c.v.data());
    for (long i0 = 0; i0 < s.N; i0 += kQB) {
      const long qn = std::min<long>(kQB, s.N - i0);
      sum.limits(i0, qn, c.lo, c.hi);
      const Rows queries{s.N, H, i0, 1, qn};
      queries.gather(q.typed_data(), d, b, c.q.data());
      queries.gather(m_in.typed_data(), 1, b, c.m.data());
      queries.gather(l_in.typed_data(), 1, b, c.l.data());
      queries.gather(acc_in.typed_data(), dv, b, c.o.data());
      if (c.hi[qn - 1] > 0)
        for (long h = 0; h < H; ++h)
          attend_forward(c.q.data() + h * qn * d, c.k.data() + h * S * d,
                         c.v.data() + h * S * dv, qn, c.hi[qn - 1], d, dv, c.lo.data(),
                         c.hi.data(), scale, c.m.data() + h * qn, c.l.data() + h * qn,
                         c.o.data() + h * qn * dv, w);
      queries.scatter(c.m.data(), 1, b, row_max->typed_data());
      queries.scatter(c.l.data(), 1, b, total->typed_data());
      queries.scatter(c.o.data(), dv, b, acc->typed_data());
    }
  }
  return ffi::Error::Success();
}

ffi::Error SummaryBackwardImpl(ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k,
                               ffi::Buffer<ffi::F32> v, ffi::Buffer<ffi::F32> d_out,
                               ffi::Buffer<ffi::F32> lse, ffi::Buffer<ffi::F32> delta,
                               ffi::Buffer<ffi::F32> dq_in, ffi::Buffer<ffi::F32> dk_in,
                               ffi::Buffer<ffi::F32> dv_in, ffi::ResultBuffer<ffi::F32> d_q,
                               ffi::ResultBuffer<ffi::F32> d_k, ffi::ResultBuffer<ffi::F32> d_v,
                               int64_t block, ffi::Span<const int64_t> residues, float scale) {
  Shape s;
  if (auto e = shape_of(q, v, &s); e.failure()) return e;
  const long H = s.H, d = s.d, dv = s.dv;
  start_from(dq_in, d_q);
  start_from(dk_in, d_k);
  start_from(dv_in, d_v);
  const Summary sum{s.N, H, block, residues};
  const long S = sum.count();
  Blocks c;
  c.k.resize(H * S * d); c.v.resize(H * S * dv); c.y.resize(H * S * d); c.z.resize(H * S * dv);
  c.q.resize(H * kQB * d); c.o.resize(H * kQB * dv); c.m.resize(H * kQB); c.l.resize(H * kQB);
  c.x.resize(H * kQB * d);
  c.lo.resize(kQB); c.hi.resize(kQB);
  Work w;
  w.reserve(d, dv);
  for (long b = 0; b < s.B; ++b) {
    sum.gather(k.typed_data(), d, b, c.k.data());
    sum.gather(v.typed_data(), dv, b, c.v.data());
    sum.gather(d_k->typed_data(), d, b, c.y.data());  // the gradients so far, added to
    sum.gather(d_v->typed_data(), dv, b, c.z.data());
    for (long i0 = 0; i0 < s.N; i0 += kQB) {
      const long qn = std::min<long>(kQB, s.N - i0);
      sum.limits(i0, qn, c.lo, c.hi);
      if (c.hi[qn - 1] == 0) continue;  // no query of the block sees a summary key
      const Rows queries{s.N, H, i0, 1, qn};
      queries.gather(q.typed_data(), d, b, c.q.data());
      queries.gather(d_out.typed_data(), dv, b, c.o.data());
      queries.gather(lse.typed_data(), 1, b, c.m.data());
      queries.gather(delta.typed_data(), 1, b, c.l.data());
      queries.gather(d_q->typed_data(), d, b, c.x.data());
      for (long h = 0; h < H; ++h)
        attend_backward(c.q.data() + h * qn * d, c.k.data() + h * S * d,
                        c.v.data() + h * S * dv, c.o.data() + h * qn * dv, c.m.data() + h * qn,
                        c.l.data() + h * qn, qn, c.hi[qn - 1], d, dv, c.lo.data(), c.hi.data(),
                        scale, c.x.data() + h * qn * d, c.y.data() + h * S * d,
                        c.z.data() + h * S * dv, w);
      queries.scatter(c.x.data(), d, b, d_q->typed_data());
    }
    sum.scatter(c.y.data(), d, b, d_k->typed_data());
    sum.scatter(c.z.data(), dv, b, d_v->typed_data());
  }
  return ffi::Error::Success();
}

}  // namespace

#define F32 ffi::Buffer<ffi::F32>
namespace {
// Six buffers in, three out: a merging forward (q, k, v and the running maximum, sum and values
// in; those three out), or the column backward (q, k, v, dO, log-sum-exp, D in; dq, dk, dv out).
auto SixToThree() {
  return ffi::Ffi::Bind().Arg<F32>().Arg<F32>().Arg<F32>().Arg<F32>().Arg<F32>().Arg<F32>()
      .Ret<F32>().Ret<F32>().Ret<F32>();
}
// A merging backward: q, k, v, dO, log-sum-exp, D and the gradients so far in; dq, dk, dv out.
auto NineToThree() {
  return ffi::Ffi::Bind().Arg<F32>().Arg<F32>().Arg<F32>().Arg<F32>().Arg<F32>().Arg<F32>()
      .Arg<F32>().Arg<F32>().Arg<F32>().Ret<F32>().Ret<F32>().Ret<F32>();
}
}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(SparseJaxColumnForward, ColumnForwardImpl,
                              ffi::Ffi::Bind()
                                  .Arg<F32>().Arg<F32>().Arg<F32>()
                                  .Ret<F32>().Ret<F32>().Ret<F32>()
                                  .Attr<int64_t>("stride")
                                  .Attr<int64_t>("min_rows")
                                  .Attr<float>("scale"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(SparseJaxColumnBackward, ColumnBackwardImpl,
                              SixToThree()
                                  .Attr<int64_t>("stride")
                                  .Attr<int64_t>("min_rows")
                                  .Attr<float>("scale"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(SparseJaxBandForward, BandForwardImpl,
                              SixToThree()
                                  .Attr<int64_t>("block")
                                  .Attr<int64_t>("prev")
                                  .Attr<int64_t>("max_distance")
                                  .Attr<bool>("same_row")
                                  .Attr<float>("scale"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(SparseJaxBandBackward, BandBackwardImpl,
                              NineToThree()
                                  .Attr<int64_t>("block")
                                  .Attr<int64_t>("prev")
                                  .Attr<int64_t>("max_distance")
                                  .Attr<bool>("same_row")
                                  .Attr<float>("scale"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(SparseJaxDenseForward, DenseForwardImpl,
                              ffi::Ffi::Bind()
                                  .Arg<F32>().Arg<F32>().Arg<F32>()
                                  .Ret<F32>().Ret<F32>()
                                  .Attr<float>("scale"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(SparseJaxDenseBackward, DenseBackwardImpl,
                              SixToThree()
                                  .Attr<float>("scale"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(SparseJaxSummaryForward, SummaryForwardImpl,
                              SixToThree()
                                  .Attr<int64_t>("block")
                                  .Attr<ffi::Span<const int64_t>>("residues")
                                  .Attr<float>("scale"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(SparseJaxSummaryBackward, SummaryBackwardImpl,
                              NineToThree()
                                  .Attr<int64_t>("block")
                                  .Attr<ffi::Span<const int64_t>>("residues")
                                  .Attr<float>("scale"));
#undef F32
