// Fused CPU kernels for the block-sparse attention's column term (XLA FFI custom calls).
//
// The column term (docs/design.md §3) is causal attention inside each column of the grid
// [B, R, l, H, d]: query (r, col) attends keys (r', col) with r - r' >= min_rows. On XLA:CPU it
// ran as batched [R, R] matmuls plus tile copies into and out of the grid layout, zeroed
// accumulators and separate elementwise passes over the scores. Here one call goes through the
// columns one at a time, flash-style: the column's keys are packed once per block, its scores
// stay in a cache-sized tile, the masked triangle is skipped panel by panel, and the results
// are written straight into the grid layout. The Python side (sparse_jax/native.py) builds this
// file with the host's compiler and registers the handlers; attention.py calls them.
//
// Forward: the running maximum, the sum of exponentials and the weighted values (not divided),
// what the term writes as the first term of the joint softmax. Backward: dq, dk and dv of the
// term, given the joint log-sum-exp and D = dO · O per query. Float32 only.

#include <algorithm>
#include <array>
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
constexpr vi xor_lanes(std::integer_sequence<int, T...>) { return vi{(T ^ W)...}; }
template <int W>
inline vf swap_lanes(vf x) {  // lane t <- lane t ^ W
  return __builtin_shuffle(x, xor_lanes<W>(std::make_integer_sequence<int, kVW>{}));
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
  vi bits = (reinterpret_cast<vi&>(t) - reinterpret_cast<const vi&>(magic) + 127) << 23;
  vf scale = reinterpret_cast<vf&>(bits);
  vf out = p * scale;
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

// C[M, :] (= or +=) A B over row panels of kMR rows; `range(i0, i1, &k0, &k1, &n)` gives the
// panel's inner range and its width (a multiple of kVW; columns past it are left alone).
template <class Range>
void gemm(int M, const float* a, long ars, long acs, const float* b, long bs, float* c, long cs,
          bool accumulate, Range range) {
  for (int i = 0; i < M; i += kMR) {
    const int mr = std::min(kMR, M - i);
    int k0, k1, n;
    range(i, i + mr, &k0, &k1, &n);
    for (int j = 0; j < n; j += kNV * kVW) {
      const int nv = std::min(kNV, (n - j) / kVW);
      kMicro[mr - 1][nv - 1](k0, std::max(k0, k1), a + i * ars, ars, acs, b + j, bs,
                             c + i * cs + j, cs, accumulate);
    }
  }
}

inline int round_up(int x, int m) { return (x + m - 1) / m * m; }

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
      for (int c = 0; c < d; c += 16) transpose16(k + j0 * rs + c, rs, kt + c * kKB + j0, kKB, scale);
#endif
  for (int c = 0; c < d; ++c) {
    float* dst = kt + c * kKB;
    for (int j = j0; j < kn; ++j) dst[j] = scale * k[j * rs + c];
    for (int j = kn; j < knp; ++j) dst[j] = 0.0f;
  }
}

// The keys of block row i (block-relative) in a key block starting kb rows after the query
// block: query row q0 + i sees key rows up to q0 + i - min_rows.
struct Causal {
  int q0, k0, kn, min_rows;
  int limit(int i) const { return std::clamp(q0 + i - min_rows - k0 + 1, 0, kn); }
};

// S = Q Kt for a query block, panel by panel: only the columns a panel's rows can see.
void scores(const float* q, long rs, int qn, const float* kt, int kn, int d, const Causal& cz,
            float* s) {
  gemm(qn, q, rs, 1, kt, kKB, s, kKB, false, [&](int i0, int i1, int* k0, int* k1, int* n) {
    *k0 = 0; *k1 = d; *n = round_up(cz.limit(i1 - 1), kVW);
  });
}

void column_forward(const float* q, const float* k, const float* v, int R, int d, int dv,
                    int min_rows, float scale, float* m_out, float* l_out, float* o_out,
                    std::vector<float>& work) {
  work.resize(kKB * d + kQB * kKB + kQB * dv + 2 * kQB);
  float* kt = work.data();
  float* s = kt + kKB * d;
  float* o = s + kQB * kKB;
  float* m = o + kQB * dv;
  float* l = m + kQB;
  for (int q0 = 0; q0 < R; q0 += kQB) {
    const int qn = std::min(kQB, R - q0);
    const int last = q0 + qn - 1 - min_rows;  // the last key row any of these queries sees
    std::fill(m, m + qn, kFloor);
    std::fill(l, l + qn, 0.0f);
    std::fill(o, o + qn * dv, 0.0f);
    for (int k0 = 0; k0 <= last; k0 += kKB) {
      const int kn = std::min(kKB, last + 1 - k0);
      const int knp = round_up(kn, kVW);
      const Causal cz{q0, k0, kn, min_rows};
      pack_transposed(k + k0 * d, d, kn, d, scale, kt);
      scores(q + q0 * d, d, qn, kt, kn, d, cz, s);
      for (int i = 0; i < qn; ++i) {
        float* si = s + i * kKB;
        const int lim = cz.limit(i);
        vf mv = splat(m[i]);
        for (int j = 0; j < lim; j += kVW) {
          const vf x = load(si + j);
          mv = iota + float(j) < float(lim) && x > mv ? x : mv;
        }
        const float mx = hmax(mv);
        vf sum{};
        for (int j = 0; j < knp; j += kVW) {
          const vf p = vexp(load(si + j) - mx);
          store(si + j, iota + float(j) < float(lim) ? p : vf{});
          sum += iota + float(j) < float(lim) ? p : vf{};
        }
        if (k0 == 0) {  // the first key block: nothing to rescale
          l[i] = hsum(sum);
        } else {
          const float alpha = vexp(splat(m[i] - mx))[0];
          l[i] = l[i] * alpha + hsum(sum);
          for (int c = 0; c < dv; c += kVW) store(o + i * dv + c, load(o + i * dv + c) * alpha);
        }
        m[i] = mx;
      }
      gemm(qn, s, kKB, 1, v + k0 * dv, dv, o, dv, true,
           [&](int i0, int i1, int* a, int* b, int* n) { *a = 0; *b = cz.limit(i1 - 1); *n = dv; });
    }
    for (int i = 0; i < qn; ++i) {
      m_out[q0 + i] = m[i];
      l_out[q0 + i] = l[i];
      std::memcpy(o_out + (q0 + i) * dv, o + i * dv, dv * sizeof(float));
    }
  }
}

void column_backward(const float* q, const float* k, const float* v, const float* dout,
                     const float* lse, const float* delta, int R, int d,
                     int dv, int min_rows, float scale, float* dq, float* dk, float* dvo,
                     std::vector<float>& work) {
  work.resize(kKB * d + kKB * dv + 2 * kQB * kKB + kQB * d + R * (d + dv));
  float* kt = work.data();
  float* vt = kt + kKB * d;
  float* p = vt + kKB * dv;
  float* ds = p + kQB * kKB;
  float* dq_blk = ds + kQB * kKB;
  float* dk_acc = dq_blk + kQB * d;
  float* dv_acc = dk_acc + R * d;
  std::fill(dk_acc, dk_acc + R * (d + dv), 0.0f);
  for (int q0 = 0; q0 < R; q0 += kQB) {
    const int qn = std::min(kQB, R - q0);
    const int last = q0 + qn - 1 - min_rows;
    std::fill(dq_blk, dq_blk + qn * d, 0.0f);
    for (int k0 = 0; k0 <= last; k0 += kKB) {
      const int kn = std::min(kKB, last + 1 - k0);
      const int knp = round_up(kn, kVW);
      const Causal cz{q0, k0, kn, min_rows};
      pack_transposed(k + k0 * d, d, kn, d, scale, kt);
      pack_transposed(v + k0 * dv, dv, kn, dv, 1.0f, vt);
      scores(q + q0 * d, d, qn, kt, kn, d, cz, p);
      gemm(qn, dout + q0 * dv, dv, 1, vt, kKB, ds, kKB, false,  // dP = dO Vᵀ
           [&](int i0, int i1, int* a, int* b, int* n) {
             *a = 0; *b = dv; *n = round_up(cz.limit(i1 - 1), kVW);
           });
      for (int i = 0; i < qn; ++i) {
        float* pi = p + i * kKB;
        float* dsi = ds + i * kKB;
        const int lim = cz.limit(i);
        const float li = lse[q0 + i], di = delta[q0 + i];
        for (int j = 0; j < knp; j += kVW) {
          const vf keep = iota + float(j) < float(lim) ? splat(1.0f) : vf{};
          if (j >= lim) {  // past the row's keys (and maybe past what was computed)
            store(pi + j, vf{});
            store(dsi + j, vf{});
            continue;
          }
          vf pj = vexp(load(pi + j) - li) * keep;
          store(pi + j, pj);
          store(dsi + j, pj * (load(dsi + j) - di));
        }
      }
      gemm(qn, ds, kKB, 1, k + k0 * d, d, dq_blk, d, true,  // dQ += dS K
           [&](int i0, int i1, int* a, int* b, int* n) { *a = 0; *b = cz.limit(i1 - 1); *n = d; });
      auto seen_by = [&](int j0, int j1, int* a, int* b, int* n) {  // queries that see key j0
        *a = std::clamp(k0 + j0 + min_rows - q0, 0, qn); *b = qn; *n = 0;
      };
      gemm(kn, ds, 1, kKB, q + q0 * d, d, dk_acc + k0 * d, d, true,  // dK += dSᵀ Q
           [&](int j0, int j1, int* a, int* b, int* n) { seen_by(j0, j1, a, b, n); *n = d; });
      gemm(kn, p, 1, kKB, dout + q0 * dv, dv, dv_acc + k0 * dv, dv, true,  // dV += Pᵀ dO
           [&](int j0, int j1, int* a, int* b, int* n) { seen_by(j0, j1, a, b, n); *n = dv; });
    }
    for (int i = 0; i < qn; ++i)
      for (int c = 0; c < d; ++c) dq[(q0 + i) * d + c] = scale * dq_blk[i * d + c];
  }
  for (int i = 0; i < R * d; ++i) dk[i] = scale * dk_acc[i];
  std::memcpy(dvo, dv_acc, R * dv * sizeof(float));
}

// A column's rows of a grid array [B, R, l, H, w] (all heads: for each row one contiguous run
// of H * w floats) to and from [H, R, w]. The kernels work on such copies: the rows of a column
// lie l * H * w floats apart in the grid, and strides of that size alias in the caches.
struct Column {
  long R, l, H;
  long at(long b, long r, long col) const { return ((b * R + r) * l + col) * H; }
  void gather(const float* x, long w, long b, long col, float* out) const {
    for (long r = 0; r < R; ++r) {
      const float* src = x + at(b, r, col) * w;
      for (long h = 0; h < H; ++h) std::memcpy(out + (h * R + r) * w, src + h * w, w * 4);
    }
  }
  void scatter(const float* in, long w, long b, long col, float* x) const {
    for (long r = 0; r < R; ++r) {
      float* dst = x + at(b, r, col) * w;
      for (long h = 0; h < H; ++h) std::memcpy(dst + h * w, in + (h * R + r) * w, w * 4);
    }
  }
};

ffi::Error check_grid(const ffi::AnyBuffer::Dimensions& dims) {
  if (dims.size() != 5) return ffi::Error::InvalidArgument("expected a [B, R, l, H, d] grid");
  if (dims[4] % kVW) return ffi::Error::InvalidArgument("head dims must be multiples of 16");
  return ffi::Error::Success();
}

ffi::Error ColumnForwardImpl(ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k,
                             ffi::Buffer<ffi::F32> v, ffi::ResultBuffer<ffi::F32> row_max,
                             ffi::ResultBuffer<ffi::F32> total, ffi::ResultBuffer<ffi::F32> acc,
                             int64_t min_rows, float scale) {
  const auto qd = q.dimensions(), vd = v.dimensions();
  if (auto e = check_grid(qd); e.failure()) return e;
  if (auto e = check_grid(vd); e.failure()) return e;
  const long B = qd[0], R = qd[1], l = qd[2], H = qd[3], d = qd[4], dv = vd[4];
  const Column grid{R, l, H};
  std::vector<float> qc(H * R * d), kc(H * R * d), vc(H * R * dv), mc(H * R), lc(H * R),
      oc(H * R * dv), work;
  for (long b = 0; b < B; ++b)
    for (long col = 0; col < l; ++col) {
      grid.gather(q.typed_data(), d, b, col, qc.data());
      grid.gather(k.typed_data(), d, b, col, kc.data());
      grid.gather(v.typed_data(), dv, b, col, vc.data());
      for (long h = 0; h < H; ++h)
        column_forward(qc.data() + h * R * d, kc.data() + h * R * d, vc.data() + h * R * dv, R,
                       d, dv, min_rows, scale, mc.data() + h * R, lc.data() + h * R,
                       oc.data() + h * R * dv, work);
      grid.scatter(mc.data(), 1, b, col, row_max->typed_data());
      grid.scatter(lc.data(), 1, b, col, total->typed_data());
      grid.scatter(oc.data(), dv, b, col, acc->typed_data());
    }
  return ffi::Error::Success();
}

ffi::Error ColumnBackwardImpl(ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k,
                              ffi::Buffer<ffi::F32> v, ffi::Buffer<ffi::F32> d_out,
                              ffi::Buffer<ffi::F32> lse, ffi::Buffer<ffi::F32> delta,
                              ffi::ResultBuffer<ffi::F32> d_q, ffi::ResultBuffer<ffi::F32> d_k,
                              ffi::ResultBuffer<ffi::F32> d_v, int64_t min_rows, float scale) {
  const auto qd = q.dimensions(), vd = v.dimensions();
  if (auto e = check_grid(qd); e.failure()) return e;
  if (auto e = check_grid(vd); e.failure()) return e;
  const long B = qd[0], R = qd[1], l = qd[2], H = qd[3], d = qd[4], dv = vd[4];
  const Column grid{R, l, H};
  const long nq = H * R * d, nv = H * R * dv;  // one column's q (or k) and v (or dO) floats
  std::vector<float> qc(nq), kc(nq), vc(nv), oc(nv), lc(H * R), dc(H * R), dqc(nq), dkc(nq),
      dvc(nv), work;
  for (long b = 0; b < B; ++b)
    for (long col = 0; col < l; ++col) {
      grid.gather(q.typed_data(), d, b, col, qc.data());
      grid.gather(k.typed_data(), d, b, col, kc.data());
      grid.gather(v.typed_data(), dv, b, col, vc.data());
      grid.gather(d_out.typed_data(), dv, b, col, oc.data());
      grid.gather(lse.typed_data(), 1, b, col, lc.data());
      grid.gather(delta.typed_data(), 1, b, col, dc.data());
      for (long h = 0; h < H; ++h)
        column_backward(qc.data() + h * R * d, kc.data() + h * R * d, vc.data() + h * R * dv,
                        oc.data() + h * R * dv, lc.data() + h * R, dc.data() + h * R, R, d, dv,
                        min_rows, scale, dqc.data() + h * R * d, dkc.data() + h * R * d,
                        dvc.data() + h * R * dv, work);
      grid.scatter(dqc.data(), d, b, col, d_q->typed_data());
      grid.scatter(dkc.data(), d, b, col, d_k->typed_data());
      grid.scatter(dvc.data(), dv, b, col, d_v->typed_data());
    }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(SparseJaxColumnForward, ColumnForwardImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int64_t>("min_rows")
                                  .Attr<float>("scale"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(SparseJaxColumnBackward, ColumnBackwardImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int64_t>("min_rows")
                                  .Attr<float>("scale"));
