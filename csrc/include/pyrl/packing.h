// Packed-sequence layouts and the index work of batching, on plain arrays (no torch).
//
// A layout of B sequences is cu_seqlens[B + 1] (sequence i owns packed tokens [cu[i], cu[i+1])) plus,
// for the padded view [B, width], starts[B]: the padded column of each sequence's first token.
// Sequences are contiguous runs in their padded rows (left- or right-padded, or a left-padded prompt
// followed by a right-padded response), so the layout costs O(B), not O(tokens).
#pragma once

#include <cstdint>
#include <vector>

#include "pyrl/common.h"

namespace pyrl {

// mask [B, width] (nonzero = token) -> cu_seqlens [B + 1], starts [B]. Fails naming the first row
// whose tokens are not one contiguous run.
void layout_from_mask(const uint8_t* mask, int64_t rows, int64_t width, int64_t* cu_seqlens, int64_t* starts);

// Flat padded index (row * width + column) of every packed token: out[cu[B]].
void padded_index(const int64_t* cu_seqlens, const int64_t* starts, int64_t rows, int64_t width, int64_t* out);

// Position of every packed token within its sequence (0, 1, ...): out[cu[B]].
void positions(const int64_t* cu_seqlens, int64_t rows, int64_t* out);

// Number of packed tokens the rows `take` (indices into [0, rows), repeats allowed) select; fails naming
// the first index out of range.
int64_t count_taken_tokens(const int64_t* cu_seqlens, int64_t rows, const int64_t* take, int64_t n_take);

// The layout of rows `take`, in that order: new_cu[n_take + 1], and token_index[new_cu[n_take]], the
// packed token each new token comes from (for a gather of the packed values).
void take_rows(const int64_t* cu_seqlens, int64_t rows, const int64_t* take, int64_t n_take, int64_t* new_cu,
               int64_t* token_index);

// Karmarkar-Karp largest differencing (verl's get_seqlen_balanced_partitions): k partitions of the
// indices [0, n) whose seqlens sums are close; with equal_size every partition has n / k items.
// Each partition is sorted ascending; partitions come largest sum first. Deterministic.
std::vector<std::vector<int64_t>> balanced_partitions(const int64_t* seqlens, int64_t n, int64_t k, bool equal_size);

// Micro-batches of sequences whose seqlens sum stays <= max_tokens; a sequence longer than max_tokens
// is alone in its micro-batch (its index is appended to `oversized`). ordered: consecutive runs in
// input order (greedy); balanced: the fewest Karmarkar-Karp partitions that all fit, as verl's
// dynamic batch size, sorted by first index.
std::vector<std::vector<int64_t>> token_budget_micro_batches(const int64_t* seqlens, int64_t n, int64_t max_tokens,
                                                             bool balanced, std::vector<int64_t>* oversized);

}  // namespace pyrl
