// Packed layouts: mask -> cu_seqlens/starts, padded indices, positions, and row selection.
#include <string>

#include "pyrl/packing.h"

namespace pyrl {

void layout_from_mask(const uint8_t* mask, int64_t rows, int64_t width, int64_t* cu_seqlens, int64_t* starts) {
  check(rows >= 0 && width >= 0, "mask: expected a [batch, tokens] mask");
  cu_seqlens[0] = 0;
  int64_t bad_row = -1;
#pragma omp parallel for schedule(static) if (rows * width >= (1 << 18))
  for (int64_t i = 0; i < rows; ++i) {
    const uint8_t* row = mask + i * width;
    int64_t first = 0;
    while (first < width && !row[first]) ++first;
    int64_t last = width;
    while (last > first && !row[last - 1]) --last;
    int64_t inside = 0;
    for (int64_t t = first; t < last; ++t) inside += row[t] != 0;
    if (inside != last - first) {
#pragma omp critical(pyrl_layout_bad_row)
      if (bad_row < 0 || i < bad_row) bad_row = i;
    }
    starts[i] = last > first ? first : 0;
    cu_seqlens[i + 1] = last - first;  // lengths for now, prefix-summed below
  }
  if (bad_row >= 0)
    fail("mask: row " + std::to_string(bad_row) +
         " has gaps (its tokens are not one contiguous run); pack with the attention mask and keep masks "
         "with holes (e.g. multi-turn loss masks) as packed fields");
  for (int64_t i = 0; i < rows; ++i) cu_seqlens[i + 1] += cu_seqlens[i];
}

void padded_index(const int64_t* cu_seqlens, const int64_t* starts, int64_t rows, int64_t width, int64_t* out) {
  for (int64_t i = 0; i < rows; ++i) {
    const int64_t len = cu_seqlens[i + 1] - cu_seqlens[i];
    check(len >= 0 && starts[i] >= 0 && starts[i] + len <= width,
          "starts: row " + std::to_string(i) + " (start " + std::to_string(starts[i]) + ", length " +
              std::to_string(len) + ") does not fit in width " + std::to_string(width));
  }
#pragma omp parallel for schedule(static) if (cu_seqlens[rows] >= (1 << 18))
  for (int64_t i = 0; i < rows; ++i) {
    const int64_t base = i * width + starts[i] - cu_seqlens[i];
    for (int64_t t = cu_seqlens[i]; t < cu_seqlens[i + 1]; ++t) out[t] = base + t;
  }
}

void positions(const int64_t* cu_seqlens, int64_t rows, int64_t* out) {
#pragma omp parallel for schedule(static) if (cu_seqlens[rows] >= (1 << 18))
  for (int64_t i = 0; i < rows; ++i)
    for (int64_t t = cu_seqlens[i]; t < cu_seqlens[i + 1]; ++t) out[t] = t - cu_seqlens[i];
}

int64_t count_taken_tokens(const int64_t* cu_seqlens, int64_t rows, const int64_t* take, int64_t n_take) {
  int64_t total = 0;
  for (int64_t j = 0; j < n_take; ++j) {
    const int64_t r = take[j];
    if (r < 0 || r >= rows)
      fail("indices: entry " + std::to_string(j) + " is " + std::to_string(r) + ", outside [0, " +
           std::to_string(rows) + ")");
    total += cu_seqlens[r + 1] - cu_seqlens[r];
  }
  return total;
}

void take_rows(const int64_t* cu_seqlens, int64_t rows, const int64_t* take, int64_t n_take, int64_t* new_cu,
               int64_t* token_index) {
  count_taken_tokens(cu_seqlens, rows, take, n_take);  // range check before any write
  new_cu[0] = 0;
  for (int64_t j = 0; j < n_take; ++j) new_cu[j + 1] = new_cu[j] + cu_seqlens[take[j] + 1] - cu_seqlens[take[j]];
#pragma omp parallel for schedule(static) if (new_cu[n_take] >= (1 << 18))
  for (int64_t j = 0; j < n_take; ++j) {
    const int64_t shift = cu_seqlens[take[j]] - new_cu[j];
    for (int64_t t = new_cu[j]; t < new_cu[j + 1]; ++t) token_index[t] = t + shift;
  }
}

}  // namespace pyrl
