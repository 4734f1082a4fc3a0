// pybind11 bindings of the C++ core as pyrl._C. Arguments arrive through the buffer protocol
// (numpy views of CPU tensors, bf16 as raw 16-bit), so nothing is copied and libtorch is not linked.
// Buffers are checked here (format, size, contiguity); values are checked by the core. The core's mode enums
// are exported as pybind11 enums under the names pyrl.ops uses: Python's tables and the Triton kernels' named
// constants are read from them (pyrl/ops/codes.py), so a code is written down once, in csrc/include/pyrl.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <string>

#include "pyrl/ops.h"
#include "pyrl/packing.h"

namespace py = pybind11;

namespace {

struct View {
  void* ptr = nullptr;
  int64_t size = 0;
  py::buffer_info info;
};

bool is_int64_format(const std::string& f) { return f == "l" || f == "q" || f == "<l" || f == "<q"; }
bool is_float32_format(const std::string& f) { return f == "f" || f == "<f"; }

// A 1-D (or any-rank, C-contiguous) buffer of float32 or int64.
View view(const py::buffer& obj, const char* name, bool want_int64, bool writable) {
  View v;
  v.info = obj.request(writable);
  const bool ok = want_int64 ? (v.info.itemsize == 8 && is_int64_format(v.info.format))
                             : (v.info.itemsize == 4 && is_float32_format(v.info.format));
  if (!ok)
    throw py::type_error(std::string(name) + ": expected a " + (want_int64 ? "int64" : "float32") +
                         " buffer, got format '" + v.info.format + "'");
  int64_t expected = v.info.itemsize;
  for (int64_t d = v.info.ndim - 1; d >= 0; --d) {
    if (v.info.shape[d] > 1 && v.info.strides[d] != expected)
      throw py::value_error(std::string(name) + ": must be contiguous");
    expected *= v.info.shape[d];
  }
  v.ptr = v.info.ptr;
  v.size = v.info.size;
  return v;
}

template <class T>
T* opt_ptr(const py::object& obj, const char* name, bool want_int64, bool writable, int64_t expected_size) {
  if (obj.is_none()) return nullptr;
  View v = view(obj.cast<py::buffer>(), name, want_int64, writable);
  if (v.size != expected_size)
    throw py::value_error(std::string(name) + ": expected " + std::to_string(expected_size) + " elements, got " +
                          std::to_string(v.size));
  return static_cast<T*>(v.ptr);
}

template <class T>
T* req_ptr(const py::object& obj, const char* name, bool want_int64, bool writable, int64_t expected_size) {
  if (obj.is_none()) throw py::value_error(std::string(name) + ": required, got None");
  return opt_ptr<T>(obj, name, want_int64, writable, expected_size);
}

// A C-contiguous [rows, width] buffer of 1-byte elements (bool / uint8 / int8 masks).
View byte_matrix(const py::buffer& obj, const char* name, int64_t& rows, int64_t& width) {
  View v;
  v.info = obj.request();
  if (v.info.itemsize != 1)
    throw py::type_error(std::string(name) + ": expected a bool or uint8 buffer, got format '" + v.info.format + "'");
  if (v.info.ndim != 2)
    throw py::value_error(std::string(name) + ": expected 2 dims [batch, tokens], got " + std::to_string(v.info.ndim));
  rows = v.info.shape[0];
  width = v.info.shape[1];
  if ((width > 1 && v.info.strides[1] != 1) || (rows > 1 && v.info.strides[0] != width))
    throw py::value_error(std::string(name) + ": must be contiguous");
  v.ptr = v.info.ptr;
  v.size = v.info.size;
  return v;
}

// Lists of indices as (flat int64 array, offsets [lists + 1]): two buffers instead of a Python int
// object per index; Python splits them.
py::tuple flatten(const std::vector<std::vector<int64_t>>& lists) {
  py::array_t<int64_t> offsets(static_cast<py::ssize_t>(lists.size() + 1));
  int64_t* off = offsets.mutable_data();
  off[0] = 0;
  for (size_t i = 0; i < lists.size(); ++i) off[i + 1] = off[i] + static_cast<int64_t>(lists[i].size());
  py::array_t<int64_t> flat(static_cast<py::ssize_t>(off[lists.size()]));
  int64_t* out = flat.mutable_data();
  for (size_t i = 0; i < lists.size(); ++i) std::copy(lists[i].begin(), lists[i].end(), out + off[i]);
  return py::make_tuple(flat, offsets);
}

struct Logits {
  const void* ptr;
  int64_t rows, vocab, row_stride;
  pyrl::FloatKind kind;
};

// logits: 2-D buffer [rows, vocab] with unit stride along vocab; rows may be strided.
Logits logits_view(const py::buffer& obj, pyrl::FloatKind kind, bool writable = false) {
  py::buffer_info info = obj.request(writable);
  if (info.itemsize != static_cast<py::ssize_t>(pyrl::itemsize(kind)))
    throw py::type_error("logits: itemsize " + std::to_string(info.itemsize) + " does not match its dtype");
  if (info.ndim != 2) throw py::value_error("logits: expected 2 dims [rows, vocab], got " + std::to_string(info.ndim));
  if (info.shape[1] > 1 && info.strides[1] != info.itemsize)
    throw py::value_error("logits: the vocabulary dimension must be contiguous");
  const int64_t row_stride = info.shape[0] > 1 ? info.strides[0] / info.itemsize : info.shape[1];
  if (info.shape[0] > 1 && (info.strides[0] % info.itemsize != 0 || row_stride < info.shape[1]))
    throw py::value_error("logits: rows must not overlap");
  return {info.ptr, info.shape[0], info.shape[1], row_stride, kind};
}

void logprobs_forward(const py::buffer& logits, pyrl::FloatKind kind, const py::object& labels, float inv_t,
                      const py::object& logp, const py::object& lse, const py::object& entropy) {
  const Logits l = logits_view(logits, kind);
  const int64_t* lab = opt_ptr<const int64_t>(labels, "labels", true, false, l.rows);
  float* lp = opt_ptr<float>(logp, "logp", false, true, l.rows);
  float* ls = req_ptr<float>(lse, "lse", false, true, l.rows);
  float* en = opt_ptr<float>(entropy, "entropy", false, true, l.rows);
  py::gil_scoped_release release;
  pyrl::logprobs_forward(l.ptr, l.kind, l.rows, l.vocab, l.row_stride, lab, inv_t, lp, ls, en);
}

void logprobs_backward(const py::buffer& logits, pyrl::FloatKind kind, const py::object& labels, float inv_t,
                       const py::object& lse, const py::object& entropy, const py::object& grad_logp,
                       const py::object& grad_entropy, const py::buffer& grad_logits) {
  const Logits l = logits_view(logits, kind);
  const Logits g = logits_view(grad_logits, kind, true);
  if (g.rows != l.rows || g.vocab != l.vocab || g.row_stride != g.vocab)
    throw py::value_error("grad_logits: must be a contiguous buffer shaped like logits");
  const int64_t* lab = opt_ptr<const int64_t>(labels, "labels", true, false, l.rows);
  const float* ls = req_ptr<const float>(lse, "lse", false, false, l.rows);
  const float* en = opt_ptr<const float>(entropy, "entropy", false, false, l.rows);
  const float* gl = opt_ptr<const float>(grad_logp, "grad_logp", false, false, l.rows);
  const float* ge = opt_ptr<const float>(grad_entropy, "grad_entropy", false, false, l.rows);
  py::gil_scoped_release release;
  pyrl::logprobs_backward(l.ptr, l.kind, l.rows, l.vocab, l.row_stride, lab, inv_t, ls, en, gl, ge,
                          const_cast<void*>(g.ptr));
}

void kl_forward(const py::buffer& logp, const py::buffer& ref_logp, pyrl::KLKind kind, const py::buffer& out) {
  View lp = view(logp, "logp", false, false);
  const float* rp = req_ptr<const float>(ref_logp, "ref_logp", false, false, lp.size);
  float* o = req_ptr<float>(out, "out", false, true, lp.size);
  py::gil_scoped_release release;
  pyrl::kl_forward(static_cast<const float*>(lp.ptr), rp, lp.size, kind, o);
}

void kl_backward(const py::buffer& logp, const py::buffer& ref_logp, const py::buffer& grad_out, pyrl::KLKind kind,
                 bool straight_through, const py::buffer& grad_logp) {
  View lp = view(logp, "logp", false, false);
  const float* rp = req_ptr<const float>(ref_logp, "ref_logp", false, false, lp.size);
  const float* go = req_ptr<const float>(grad_out, "grad_out", false, false, lp.size);
  float* gl = req_ptr<float>(grad_logp, "grad_logp", false, true, lp.size);
  py::gil_scoped_release release;
  pyrl::kl_backward(static_cast<const float*>(lp.ptr), rp, go, lp.size, kind,
                    straight_through, gl);
}

void gae(const py::buffer& rewards, const py::buffer& values, const py::object& mask, const py::object& cu_seqlens,
         int64_t n_seqs, int64_t seq_len, float gamma, float lam, bool whiten, const py::buffer& advantages,
         const py::buffer& returns) {
  View r = view(rewards, "rewards", false, false);
  const float* v = req_ptr<const float>(values, "values", false, false, r.size);
  const float* mk = opt_ptr<const float>(mask, "mask", false, false, r.size);
  const int64_t* cu = opt_ptr<const int64_t>(cu_seqlens, "cu_seqlens", true, false, n_seqs + 1);
  if (cu) {
    if (cu[n_seqs] != r.size)
      throw py::value_error("cu_seqlens: last entry " + std::to_string(cu[n_seqs]) + " != number of tokens " +
                            std::to_string(r.size));
  } else if (n_seqs * seq_len != r.size) {
    throw py::value_error("rewards: expected " + std::to_string(n_seqs) + " x " + std::to_string(seq_len) +
                          " elements, got " + std::to_string(r.size));
  }
  float* a = req_ptr<float>(advantages, "advantages", false, true, r.size);
  float* ret = req_ptr<float>(returns, "returns", false, true, r.size);
  py::gil_scoped_release release;
  pyrl::gae(static_cast<const float*>(r.ptr), v, mk, cu, n_seqs, seq_len, gamma, lam, whiten, a, ret);
}

void group_advantages(const py::buffer& scores, const py::buffer& group_ids, const py::object& lengths,
                      pyrl::GroupEstimator estimator, bool norm_by_std, float eps, const py::buffer& out) {
  View s = view(scores, "scores", false, false);
  const int64_t* g = req_ptr<const int64_t>(group_ids, "group_index", true, false, s.size);
  const float* len = opt_ptr<const float>(lengths, "lengths", false, false, s.size);
  float* o = req_ptr<float>(out, "out", false, true, s.size);
  py::gil_scoped_release release;
  pyrl::group_advantages(static_cast<const float*>(s.ptr), g, len, s.size,
                         estimator, norm_by_std, eps, o);
}

py::tuple policy_loss_forward(pyrl::PolicyLossMode mode, const py::buffer& logp, const py::buffer& old_logp,
                              const py::buffer& advantages, const py::buffer& mask, float clip_low, float clip_high,
                              float clip_c, const py::buffer& loss, const py::buffer& dloss) {
  View lp = view(logp, "log_prob", false, false);
  const float* olp = req_ptr<const float>(old_logp, "old_log_prob", false, false, lp.size);
  const float* adv = req_ptr<const float>(advantages, "advantages", false, false, lp.size);
  const float* mk = req_ptr<const float>(mask, "response_mask", false, false, lp.size);
  float* l = req_ptr<float>(loss, "loss", false, true, lp.size);
  float* dl = req_ptr<float>(dloss, "dloss", false, true, lp.size);
  double sums[4] = {0, 0, 0, 0};
  {
    py::gil_scoped_release release;
    pyrl::policy_loss_forward(mode, static_cast<const float*>(lp.ptr), olp,
                              adv, mk, lp.size, clip_low, clip_high, clip_c, l, dl, sums);
  }
  return py::make_tuple(sums[0], sums[1], sums[2], sums[3]);
}

py::tuple value_loss_forward(const py::buffer& values, const py::buffer& old_values, const py::buffer& returns,
                             const py::buffer& mask, float cliprange, const py::buffer& loss, const py::buffer& dloss) {
  View v = view(values, "values", false, false);
  const float* ov = req_ptr<const float>(old_values, "old_values", false, false, v.size);
  const float* r = req_ptr<const float>(returns, "returns", false, false, v.size);
  const float* mk = req_ptr<const float>(mask, "response_mask", false, false, v.size);
  float* l = req_ptr<float>(loss, "loss", false, true, v.size);
  float* dl = req_ptr<float>(dloss, "dloss", false, true, v.size);
  double sums[2] = {0, 0};
  {
    py::gil_scoped_release release;
    pyrl::value_loss_forward(static_cast<const float*>(v.ptr), ov, r, mk, v.size, cliprange, l, dl, sums);
  }
  return py::make_tuple(sums[0], sums[1]);
}

void layout_from_mask(const py::buffer& mask, const py::buffer& cu_seqlens, const py::buffer& starts) {
  int64_t rows = 0, width = 0;
  View mk = byte_matrix(mask, "mask", rows, width);
  int64_t* cu = req_ptr<int64_t>(cu_seqlens, "cu_seqlens", true, true, rows + 1);
  int64_t* st = req_ptr<int64_t>(starts, "starts", true, true, rows);
  py::gil_scoped_release release;
  pyrl::layout_from_mask(static_cast<const uint8_t*>(mk.ptr), rows, width, cu, st);
}

void padded_index(const py::buffer& cu_seqlens, const py::buffer& starts, int64_t width, const py::buffer& out) {
  View st = view(starts, "starts", true, false);
  const int64_t* cu = req_ptr<const int64_t>(cu_seqlens, "cu_seqlens", true, false, st.size + 1);
  int64_t* o = req_ptr<int64_t>(out, "out", true, true, cu[st.size]);
  py::gil_scoped_release release;
  pyrl::padded_index(cu, static_cast<const int64_t*>(st.ptr), st.size, width, o);
}

void positions(const py::buffer& cu_seqlens, const py::buffer& out) {
  View cu = view(cu_seqlens, "cu_seqlens", true, false);
  if (cu.size < 1) throw py::value_error("cu_seqlens: expected at least one entry");
  const int64_t* c = static_cast<const int64_t*>(cu.ptr);
  int64_t* o = req_ptr<int64_t>(out, "out", true, true, c[cu.size - 1]);
  py::gil_scoped_release release;
  pyrl::positions(c, cu.size - 1, o);
}

int64_t count_taken_tokens(const py::buffer& cu_seqlens, const py::buffer& take) {
  View cu = view(cu_seqlens, "cu_seqlens", true, false);
  View tk = view(take, "indices", true, false);
  if (cu.size < 1) throw py::value_error("cu_seqlens: expected at least one entry");
  return pyrl::count_taken_tokens(static_cast<const int64_t*>(cu.ptr), cu.size - 1,
                                  static_cast<const int64_t*>(tk.ptr), tk.size);
}

void take_rows(const py::buffer& cu_seqlens, const py::buffer& take, const py::buffer& new_cu,
               const py::buffer& token_index) {
  View cu = view(cu_seqlens, "cu_seqlens", true, false);
  View tk = view(take, "indices", true, false);
  if (cu.size < 1) throw py::value_error("cu_seqlens: expected at least one entry");
  const int64_t* c = static_cast<const int64_t*>(cu.ptr);
  const int64_t* t = static_cast<const int64_t*>(tk.ptr);
  const int64_t n_tokens = pyrl::count_taken_tokens(c, cu.size - 1, t, tk.size);
  int64_t* nc = req_ptr<int64_t>(new_cu, "new_cu", true, true, tk.size + 1);
  int64_t* ti = req_ptr<int64_t>(token_index, "token_index", true, true, n_tokens);
  py::gil_scoped_release release;
  pyrl::take_rows(c, cu.size - 1, t, tk.size, nc, ti);
}

py::tuple balanced_partitions(const py::buffer& seqlens, int64_t k, bool equal_size) {
  View s = view(seqlens, "seqlens", true, false);
  std::vector<std::vector<int64_t>> parts;
  {
    py::gil_scoped_release release;
    parts = pyrl::balanced_partitions(static_cast<const int64_t*>(s.ptr), s.size, k, equal_size);
  }
  return flatten(parts);
}

py::tuple token_budget_micro_batches(const py::buffer& seqlens, int64_t max_tokens, bool balanced) {
  View s = view(seqlens, "seqlens", true, false);
  std::vector<int64_t> oversized;
  std::vector<std::vector<int64_t>> batches;
  {
    py::gil_scoped_release release;
    batches = pyrl::token_budget_micro_batches(static_cast<const int64_t*>(s.ptr), s.size, max_tokens, balanced,
                                               &oversized);
  }
  return py::make_tuple(flatten(batches), oversized);
}

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "pyrl C++ core (CPU kernels behind pyrl.ops)";

  // ---- the mode codes (pyrl/ops/codes.py reads them; the Python names are pyrl.ops's). py::arithmetic: a
  // member compares and hashes as its code (the Triton kernels take int(member)); the functions take members only
  py::enum_<pyrl::FloatKind>(m, "FloatKind", py::arithmetic())
      .value("float32", pyrl::FloatKind::F32)
      .value("bfloat16", pyrl::FloatKind::BF16)
      .value("float16", pyrl::FloatKind::F16);
  py::enum_<pyrl::KLKind>(m, "KLKind", py::arithmetic())
      .value("k1", pyrl::KLKind::K1)
      .value("abs", pyrl::KLKind::ABS)
      .value("k2", pyrl::KLKind::K2)
      .value("k3", pyrl::KLKind::K3);
  py::enum_<pyrl::GroupEstimator>(m, "GroupEstimator", py::arithmetic())
      .value("grpo", pyrl::GroupEstimator::GRPO)
      .value("rloo", pyrl::GroupEstimator::RLOO)
      .value("reinforce_plus_plus_baseline", pyrl::GroupEstimator::RPP_BASELINE)
      .value("opo", pyrl::GroupEstimator::OPO)
      .value("grpo_passk", pyrl::GroupEstimator::GRPO_PASSK)
      .value("gpg", pyrl::GroupEstimator::GPG);
  py::enum_<pyrl::PolicyLossMode>(m, "PolicyLossMode", py::arithmetic())
      .value("vanilla", pyrl::PolicyLossMode::VANILLA)
      .value("cispo", pyrl::PolicyLossMode::CISPO)
      .value("gpg", pyrl::PolicyLossMode::GPG);

  m.def("logprobs_forward", &logprobs_forward, py::arg("logits"), py::arg("kind"), py::arg("labels"),
        py::arg("inv_temperature"), py::arg("logp"), py::arg("lse"), py::arg("entropy"));
  m.def("logprobs_backward", &logprobs_backward, py::arg("logits"), py::arg("kind"), py::arg("labels"),
        py::arg("inv_temperature"), py::arg("lse"), py::arg("entropy"), py::arg("grad_logp"), py::arg("grad_entropy"),
        py::arg("grad_logits"));
  m.def("kl_forward", &kl_forward, py::arg("logp"), py::arg("ref_logp"), py::arg("kind"), py::arg("out"));
  m.def("kl_backward", &kl_backward, py::arg("logp"), py::arg("ref_logp"), py::arg("grad_out"), py::arg("kind"),
        py::arg("straight_through"), py::arg("grad_logp"));
  m.def("gae", &gae, py::arg("rewards"), py::arg("values"), py::arg("mask"), py::arg("cu_seqlens"), py::arg("n_seqs"),
        py::arg("seq_len"), py::arg("gamma"), py::arg("lam"), py::arg("whiten"), py::arg("advantages"),
        py::arg("returns"));
  m.def("group_advantages", &group_advantages, py::arg("scores"), py::arg("group_ids"), py::arg("lengths"),
        py::arg("estimator"), py::arg("norm_by_std"), py::arg("eps"), py::arg("out"));
  m.def("policy_loss_forward", &policy_loss_forward, py::arg("mode"), py::arg("logp"), py::arg("old_logp"),
        py::arg("advantages"), py::arg("mask"), py::arg("clip_low"), py::arg("clip_high"), py::arg("clip_c"),
        py::arg("loss"), py::arg("dloss"));
  m.def("value_loss_forward", &value_loss_forward, py::arg("values"), py::arg("old_values"), py::arg("returns"),
        py::arg("mask"), py::arg("cliprange"), py::arg("loss"), py::arg("dloss"));
  // ---- packed layouts and balancing (pyrl.protocol) ----
  m.def("layout_from_mask", &layout_from_mask, py::arg("mask"), py::arg("cu_seqlens"), py::arg("starts"));
  m.def("padded_index", &padded_index, py::arg("cu_seqlens"), py::arg("starts"), py::arg("width"), py::arg("out"));
  m.def("positions", &positions, py::arg("cu_seqlens"), py::arg("out"));
  m.def("count_taken_tokens", &count_taken_tokens, py::arg("cu_seqlens"), py::arg("indices"));
  m.def("take_rows", &take_rows, py::arg("cu_seqlens"), py::arg("indices"), py::arg("new_cu"), py::arg("token_index"));
  m.def("balanced_partitions", &balanced_partitions, py::arg("seqlens"), py::arg("k"), py::arg("equal_size"));
  m.def("token_budget_micro_batches", &token_budget_micro_batches, py::arg("seqlens"), py::arg("max_tokens"),
        py::arg("balanced"));
}
