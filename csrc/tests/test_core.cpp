// Native tests of the pyrl C++ core against double-precision references and hand-computed cases.
// Run by ctest (also under ASan + UBSan). Prints "N passed, M failed".
#include <algorithm>
#include <climits>
#include <cmath>
#include <numeric>
#include <cstdio>
#include <functional>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include "pyrl/ops.h"
#include "pyrl/packing.h"

using namespace pyrl;

namespace {

int g_failed_checks = 0;

#define CHECK(cond)                                                          \
  do {                                                                       \
    if (!(cond)) {                                                           \
      std::printf("  CHECK failed at %s:%d: %s\n", __FILE__, __LINE__, #cond); \
      ++g_failed_checks;                                                     \
    }                                                                        \
  } while (0)

#define CHECK_NEAR(a, b, tol) CHECK(std::fabs(static_cast<double>(a) - static_cast<double>(b)) <= (tol))

template <class F>
bool throws_invalid(F&& f, const std::string& must_contain) {
  try {
    f();
  } catch (const std::invalid_argument& e) {
    return std::string(e.what()).find(must_contain) != std::string::npos;
  }
  return false;
}

void test_fast_exp() {
  double worst = 0.0;
  for (float x = -87.0f; x <= 88.0f; x += 0.0137f) {
    const double rel = std::fabs(fast_exp(x) - std::exp(static_cast<double>(x))) / std::exp(static_cast<double>(x));
    worst = rel > worst ? rel : worst;
  }
  CHECK(worst < 5e-7);
  CHECK(fast_exp(-1000.0f) == 0.0f);
  CHECK(fast_exp(-INFINITY) == 0.0f);
  CHECK(std::isnan(fast_exp(NAN)));
}

// Double-precision log-softmax statistics of one row.
void reference_row(const std::vector<float>& z, double inv_t, double* lse, double* entropy) {
  double m = -INFINITY;
  for (float v : z) m = std::fmax(m, v * inv_t);
  double s = 0.0;
  for (float v : z) s += std::exp(v * inv_t - m);
  *lse = m + std::log(s);
  double h = *lse;
  for (float v : z)
    if (std::isfinite(v)) h -= std::exp(v * inv_t - *lse) * v * inv_t;  // p log p -> 0 for masked entries
  *entropy = h;
}

void test_logprobs(FloatKind kind, double tol) {
  std::mt19937 rng(1234);
  std::normal_distribution<float> normal(0.0f, 3.0f);
  const int64_t rows = 5, vocab = 4097 + 3, stride = vocab + 7;  // strided rows, odd vocab
  const float inv_t = 1.0f / 0.7f;
  std::vector<float> values(rows * stride);
  for (float& v : values) v = normal(rng);
  for (int64_t j = 0; j < 2100; ++j) values[j] = -INFINITY;  // a leading block of masked entries in row 0
  std::vector<uint16_t> half(values.size());
  for (size_t i = 0; i < values.size(); ++i) {
    half[i] = kind == FloatKind::BF16 ? float_to_bf16(values[i]) : float_to_f16(values[i]);
    if (kind != FloatKind::F32) values[i] = load_as_float(half.data(), kind, static_cast<int64_t>(i));
  }
  const void* data = kind == FloatKind::F32 ? static_cast<const void*>(values.data()) : half.data();
  std::vector<int64_t> labels = {2500, 0, vocab - 1, 17, 4096};
  std::vector<float> logp(rows), lse(rows), entropy(rows);
  logprobs_forward(data, kind, rows, vocab, stride, labels.data(), inv_t, logp.data(), lse.data(), entropy.data());
  std::vector<float> grad_logp = {0.3f, -1.0f, 2.0f, 0.5f, 1.0f}, grad_ent = {1.0f, 0.5f, -0.25f, 0.0f, 2.0f};
  std::vector<float> grad(rows * vocab);
  std::vector<uint16_t> grad_half(rows * vocab);
  void* gout = kind == FloatKind::F32 ? static_cast<void*>(grad.data()) : grad_half.data();
  logprobs_backward(data, kind, rows, vocab, stride, labels.data(), inv_t, lse.data(), entropy.data(), grad_logp.data(),
                    grad_ent.data(), gout);
  for (int64_t r = 0; r < rows; ++r) {
    std::vector<float> z(values.begin() + r * stride, values.begin() + r * stride + vocab);
    double rl, rh;
    reference_row(z, inv_t, &rl, &rh);
    CHECK_NEAR(lse[r], rl, 1e-4);
    CHECK_NEAR(entropy[r], rh, 1e-4);
    CHECK_NEAR(logp[r], z[labels[r]] * inv_t - rl, 1e-4);
    for (int64_t v = 0; v < vocab; v += 97) {
      const double zv = z[v] * inv_t;
      const double p = std::exp(zv - rl);
      const double ez = rl - rh;
      const double pz = p == 0.0 ? 0.0 : p * (zv - ez);
      double expected = (-(grad_logp[r] * p) - grad_ent[r] * pz + (v == labels[r] ? grad_logp[r] : 0.0)) * inv_t;
      const double got = load_as_float(gout, kind, r * vocab + v);
      CHECK_NEAR(got, expected, tol * (1.0 + std::fabs(expected)));
    }
  }
  CHECK(throws_invalid([&] {
    std::vector<int64_t> bad = {0, 0, vocab, 0, 0};
    logprobs_forward(data, kind, rows, vocab, stride, bad.data(), inv_t, logp.data(), lse.data(), nullptr);
  }, "labels: entry 2"));
  CHECK(throws_invalid([&] {
    logprobs_forward(data, kind, rows, vocab, stride, labels.data(), 0.0f, logp.data(), lse.data(), nullptr);
  }, "temperature"));
}

void test_kl() {
  const std::vector<float> lp = {0.0f, -1.0f, -2.0f, -50.0f}, rp = {0.0f, -2.0f, -1.0f, 0.0f};
  std::vector<float> out(4), grad(4), ones(4, 1.0f);
  kl_forward(lp.data(), rp.data(), 4, KLKind::K3, out.data());
  CHECK_NEAR(out[0], 0.0, 1e-7);
  CHECK_NEAR(out[1], std::exp(-1.0), 1e-6);
  CHECK_NEAR(out[2], std::exp(1.0) - 2.0, 1e-6);
  CHECK_NEAR(out[3], 10.0, 1e-6);
  kl_backward(lp.data(), rp.data(), ones.data(), 4, KLKind::K3, false, grad.data());
  CHECK_NEAR(grad[1], 1.0 - std::exp(-1.0), 1e-6);
  CHECK_NEAR(grad[3], 0.0, 0.0);  // clamped
  kl_backward(lp.data(), rp.data(), ones.data(), 4, KLKind::K3, true, grad.data());
  CHECK_NEAR(grad[3], -50.0, 1e-5);  // straight through: k2's gradient
  kl_forward(lp.data(), rp.data(), 4, KLKind::ABS, out.data());
  CHECK_NEAR(out[3], 50.0, 0.0);
  CHECK(throws_invalid([&] { kl_forward(lp.data(), rp.data(), 4, static_cast<KLKind>(9), out.data()); }, "kind"));
}

void test_gae() {
  const std::vector<float> r = {0.0f, 0.0f, 1.0f}, v = {0.5f, 0.25f, 0.0f}, m = {1.0f, 0.0f, 1.0f};
  std::vector<float> adv(3), ret(3);
  gae(r.data(), v.data(), m.data(), nullptr, 1, 3, 0.5f, 1.0f, false, adv.data(), ret.data());
  CHECK_NEAR(adv[2], 1.0, 1e-7);
  CHECK_NEAR(adv[1], 1.0, 1e-7);                    // masked: carries
  CHECK_NEAR(adv[0], 0.5 * 0.0 - 0.5 + 0.5, 1e-7);  // next value skips V1
  CHECK_NEAR(ret[1], 1.25, 1e-7);
  const std::vector<int64_t> cu = {0, 2, 1};
  CHECK(throws_invalid([&] { gae(r.data(), v.data(), nullptr, cu.data(), 2, 0, 1.0f, 1.0f, false, adv.data(), ret.data()); },
                       "cu_seqlens: must be non-decreasing"));
  // whitened, gamma = lam = 1, no mask: A = (3, 2, 1) -> mean 2, unbiased var 1.
  const std::vector<float> ones = {1.0f, 1.0f, 1.0f}, zeros = {0.0f, 0.0f, 0.0f};
  gae(ones.data(), zeros.data(), nullptr, nullptr, 1, 3, 1.0f, 1.0f, true, adv.data(), ret.data());
  CHECK_NEAR(adv[0], 1.0 / std::sqrt(1.0 + 1e-8), 1e-6);
  CHECK_NEAR(adv[1], 0.0, 1e-7);
  CHECK_NEAR(ret[2], 1.0, 0.0);  // returns are not whitened
  // 17 rows x 2 (one 16-row block plus a leftover row) agree with the row-by-row scan.
  std::vector<float> r17(34), v17(34), m17(34), a17(34), ret17(34), a_row(2), ret_row(2);
  for (int i = 0; i < 34; ++i) r17[i] = 0.1f * i, v17[i] = 0.05f * (i % 7), m17[i] = (i % 3) ? 1.0f : 0.0f;
  gae(r17.data(), v17.data(), m17.data(), nullptr, 17, 2, 0.9f, 0.8f, false, a17.data(), ret17.data());
  for (int row = 0; row < 17; ++row) {
    gae(r17.data() + 2 * row, v17.data() + 2 * row, m17.data() + 2 * row, nullptr, 1, 2, 0.9f, 0.8f, false,
        a_row.data(), ret_row.data());
    CHECK_NEAR(a17[2 * row], a_row[0], 1e-6);
    CHECK_NEAR(ret17[2 * row + 1], ret_row[1], 1e-6);
  }
  CHECK(throws_invalid([&] { gae(r.data(), v.data(), zeros.data(), nullptr, 1, 3, 1.0f, 1.0f, true, adv.data(), ret.data()); },
                       "mask sums to 0"));
}

void test_group_advantages() {
  const std::vector<float> s = {1.0f, 0.0f, 0.0f, 5.0f};
  const std::vector<int64_t> g = {7, 7, 7, -3};
  std::vector<float> out(4);
  group_advantages(s.data(), g.data(), nullptr, 4, GroupEstimator::RLOO, true, 1e-6f, out.data());
  CHECK_NEAR(out[0], 1.0, 1e-6);
  CHECK_NEAR(out[1], -0.5, 1e-6);
  CHECK_NEAR(out[3], 5.0, 1e-6);  // singleton keeps its score
  group_advantages(s.data(), g.data(), nullptr, 4, GroupEstimator::GRPO, true, 1e-6f, out.data());
  CHECK_NEAR(out[0], (2.0 / 3.0) / (std::sqrt(1.0 / 3.0) + 1e-6), 1e-5);
  CHECK(throws_invalid([&] { group_advantages(s.data(), g.data(), nullptr, 4, GroupEstimator::GRPO_PASSK, true, 1e-6f, out.data()); },
                       "group -3 has 1"));
  CHECK(throws_invalid([&] { group_advantages(s.data(), g.data(), nullptr, 4, GroupEstimator::OPO, true, 1e-6f, out.data()); },
                       "lengths"));
  // many groups: every id maps to its own baseline
  const int64_t n = 10000;
  std::vector<float> sc(n);
  std::vector<int64_t> ids(n);
  for (int64_t i = 0; i < n; ++i) {
    ids[i] = (i % 2500) * 1000003;
    sc[i] = static_cast<float>(i % 2500);
  }
  std::vector<float> o(n);
  group_advantages(sc.data(), ids.data(), nullptr, n, GroupEstimator::RPP_BASELINE, true, 0.0f, o.data());
  double worst = 0.0;
  for (float a : o) worst = std::fmax(worst, std::fabs(a));
  CHECK(worst == 0.0);
}

void test_losses() {
  const std::vector<float> lp = {std::log(1.5f), std::log(5.0f), 0.0f}, old = {0.0f, 0.0f, 0.0f};
  const std::vector<float> adv = {1.0f, -1.0f, 2.0f}, mask = {1.0f, 1.0f, 1.0f};
  std::vector<float> loss(3), dloss(3);
  double sums[4];
  policy_loss_forward(PolicyLossMode::VANILLA, lp.data(), old.data(), adv.data(), mask.data(), 3, 0.2f, 0.2f, 3.0f,
                      loss.data(), dloss.data(), sums);
  CHECK_NEAR(loss[0], -1.2, 1e-6);
  CHECK_NEAR(loss[1], 3.0, 1e-6);
  CHECK_NEAR(loss[2], -2.0, 1e-6);
  CHECK_NEAR(dloss[0], 0.0, 0.0);
  CHECK_NEAR(dloss[1], 0.0, 0.0);
  CHECK_NEAR(dloss[2], -2.0, 1e-6);
  CHECK_NEAR(sums[0], 1.0, 0.0);
  CHECK_NEAR(sums[1], 1.0, 0.0);
  CHECK_NEAR(sums[3], 3.0, 0.0);
  CHECK(throws_invalid([&] {
    policy_loss_forward(PolicyLossMode::VANILLA, lp.data(), old.data(), adv.data(), mask.data(), 3, 0.2f, 0.2f, 1.0f,
                        loss.data(), dloss.data(), sums);
  }, "clip_ratio_c"));
  const std::vector<float> v = {1.0f, 0.0f}, ov = {0.0f, 0.0f}, ret = {0.0f, 2.0f}, m2 = {1.0f, 1.0f};
  std::vector<float> vl(2), dvl(2);
  double vs[2];
  value_loss_forward(v.data(), ov.data(), ret.data(), m2.data(), 2, 0.5f, vl.data(), dvl.data(), vs);
  CHECK_NEAR(vl[0], 1.0, 1e-7);
  CHECK_NEAR(vl[1], 4.0, 1e-7);
  CHECK_NEAR(dvl[0], 2.0, 1e-7);
  CHECK_NEAR(vs[0], 0.0, 0.0);
}


void test_layouts() {
  // [B=3, width=4]: left-padded, right-padded, empty
  const std::vector<uint8_t> mask = {0, 0, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0};
  std::vector<int64_t> cu(4), starts(3);
  layout_from_mask(mask.data(), 3, 4, cu.data(), starts.data());
  CHECK((cu == std::vector<int64_t>{0, 2, 5, 5}));
  CHECK((starts == std::vector<int64_t>{2, 0, 0}));
  std::vector<int64_t> index(5), pos(5);
  padded_index(cu.data(), starts.data(), 3, 4, index.data());
  CHECK((index == std::vector<int64_t>{2, 3, 4, 5, 6}));
  positions(cu.data(), 3, pos.data());
  CHECK((pos == std::vector<int64_t>{0, 1, 0, 1, 2}));
  const std::vector<int64_t> take = {1, 0, 1, 2};
  CHECK(count_taken_tokens(cu.data(), 3, take.data(), 4) == 8);
  std::vector<int64_t> new_cu(5), token_index(8);
  take_rows(cu.data(), 3, take.data(), 4, new_cu.data(), token_index.data());
  CHECK((new_cu == std::vector<int64_t>{0, 3, 5, 8, 8}));
  CHECK((token_index == std::vector<int64_t>{2, 3, 4, 0, 1, 2, 3, 4}));
  const std::vector<int64_t> bad = {0, 3};
  CHECK(throws_invalid([&] { count_taken_tokens(cu.data(), 3, bad.data(), 2); }, "indices: entry 1 is 3"));
  const std::vector<uint8_t> holes = {1, 1, 1, 1, 0, 1};
  CHECK(throws_invalid([&] { layout_from_mask(holes.data(), 2, 3, cu.data(), starts.data()); }, "mask: row 1 has gaps"));
  const std::vector<int64_t> too_wide = {3};
  CHECK(throws_invalid([&] { padded_index(cu.data(), too_wide.data(), 1, 4, index.data()); }, "does not fit"));
}

int64_t spread(const std::vector<std::vector<int64_t>>& parts, const std::vector<int64_t>& lens) {
  int64_t lo = INT64_MAX, hi = INT64_MIN;
  for (const auto& p : parts) {
    int64_t s = 0;
    for (int64_t i : p) s += lens[i];
    lo = std::min(lo, s);
    hi = std::max(hi, s);
  }
  return hi - lo;
}

bool covers_once(const std::vector<std::vector<int64_t>>& parts, int64_t n) {
  std::vector<int64_t> all;
  for (const auto& p : parts) all.insert(all.end(), p.begin(), p.end());
  std::sort(all.begin(), all.end());
  std::vector<int64_t> expected(static_cast<size_t>(n));
  std::iota(expected.begin(), expected.end(), 0);
  return all == expected;
}

void test_balance() {
  const std::vector<int64_t> lens = {1, 2, 3, 8, 9, 10};
  const auto parts = balanced_partitions(lens.data(), 6, 3, true);
  CHECK(parts.size() == 3 && spread(parts, lens) == 0 && covers_once(parts, 6));
  std::mt19937_64 rng(7);
  std::vector<int64_t> many(3000);
  for (auto& x : many) x = 1 + static_cast<int64_t>(rng() % 4096);
  for (bool equal : {true, false}) {
    const auto p = balanced_partitions(many.data(), 3000, 30, equal);
    CHECK(p.size() == 30 && covers_once(p, 3000) && spread(p, many) <= 4096);
    if (equal)
      for (const auto& part : p) CHECK(part.size() == 100);
    CHECK(p == balanced_partitions(many.data(), 3000, 30, equal));  // deterministic
  }
  CHECK(throws_invalid([&] { balanced_partitions(lens.data(), 6, 4, true); }, "multiple of k"));
  CHECK(throws_invalid([&] { balanced_partitions(lens.data(), 2, 3, false); }, "cannot fill"));
  for (bool balanced : {false, true}) {
    std::vector<int64_t> oversized;
    const auto batches = token_budget_micro_batches(many.data(), 3000, 10000, balanced, &oversized);
    CHECK(covers_once(batches, 3000) && oversized.empty());
    for (const auto& b : batches) {
      int64_t s = 0;
      for (int64_t i : b) s += many[i];
      CHECK(s <= 10000);
    }
  }
  const std::vector<int64_t> with_long = {3, 20, 3};
  std::vector<int64_t> oversized;
  const auto batches = token_budget_micro_batches(with_long.data(), 3, 8, false, &oversized);
  CHECK(batches.size() == 3 && (oversized == std::vector<int64_t>{1}));
}

}  // namespace

int main() {
  const std::vector<std::pair<const char*, std::function<void()>>> tests = {
      {"fast_exp", test_fast_exp},
      {"logprobs_f32", [] { test_logprobs(FloatKind::F32, 1e-5); }},
      {"logprobs_bf16", [] { test_logprobs(FloatKind::BF16, 1e-2); }},
      {"logprobs_f16", [] { test_logprobs(FloatKind::F16, 2e-3); }},
      {"kl", test_kl},
      {"gae", test_gae},
      {"group_advantages", test_group_advantages},
      {"losses", test_losses},
      {"layouts", test_layouts},
      {"balance", test_balance},
  };
  int passed = 0, failed = 0;
  for (const auto& [name, fn] : tests) {
    const int before = g_failed_checks;
    try {
      fn();
    } catch (const std::exception& e) {
      std::printf("  unexpected exception: %s\n", e.what());
      ++g_failed_checks;
    }
    const bool ok = g_failed_checks == before;
    std::printf("%s %s\n", ok ? "PASS" : "FAIL", name);
    (ok ? passed : failed) += 1;
  }
  std::printf("%d passed, %d failed\n", passed, failed);
  return failed == 0 ? 0 : 1;
}
