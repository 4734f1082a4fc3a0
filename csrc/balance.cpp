// Balancing sequence lengths: Karmarkar-Karp partitions across ranks and token-budget micro-batches.
#include <algorithm>
#include <numeric>
#include <queue>
#include <string>
#include <tuple>
#include <utility>

#include "pyrl/packing.h"

namespace pyrl {
namespace {

// One partition under construction: its items are a linked list through `next`, so merging two is O(1).
struct Part {
  int64_t sum = 0, count = 0, head = -1, tail = -1;
};

// verl's order of sets, largest first: by sum, then item count, then first item index (verl compares
// the item lists, whose first entries differ). A total order, so results are deterministic and equal
// verl's. (A functor, not a function pointer, so std::sort inlines it.)
struct PartBefore {
  bool operator()(const Part& a, const Part& b) const {
    if (a.sum != b.sum) return a.sum > b.sum;
    if (a.count != b.count) return a.count > b.count;
    return a.head > b.head;
  }
};

// A partial solution: k parts of which only the non-empty ones are stored, sorted by PartBefore
// (the empty ones are implicitly last), so that n single-item states cost O(n), not O(n k).
struct State {
  std::vector<Part> parts;
  int64_t spread(int64_t k) const {
    const int64_t smallest = static_cast<int64_t>(parts.size()) == k ? parts.back().sum : 0;
    return parts.empty() ? 0 : parts.front().sum - smallest;
  }
};

int bit_width(uint64_t x) {
  int bits = 0;
  while (x >> bits) ++bits;
  return bits;
}

// LSD radix sort of keys below 2^key_bits, 8 bits per pass (256 buckets stay in L1).
void radix_sort(std::vector<uint64_t>& keys, int key_bits) {
  constexpr int kDigit = 8;
  std::vector<uint64_t> buffer(keys.size());
  std::vector<size_t> count(size_t{1} << kDigit);
  for (int shift = 0; shift < key_bits; shift += kDigit) {
    std::fill(count.begin(), count.end(), 0);
    for (uint64_t k : keys) ++count[(k >> shift) & ((1u << kDigit) - 1)];
    size_t total = 0;
    for (size_t& c : count) total += std::exchange(c, total);
    for (uint64_t k : keys) buffer[count[(k >> shift) & ((1u << kDigit) - 1)]++] = k;
    keys.swap(buffer);
  }
}

// items ordered by (seqlen, index) ascending, as verl sorts. When both fit, the pair is packed into one
// integer key, radix-sorted.
std::vector<int64_t> sorted_by_length(const int64_t* seqlens, const std::vector<int64_t>& items) {
  std::vector<int64_t> order(items);
  if (items.empty()) return order;
  const int64_t max_index = *std::max_element(items.begin(), items.end());
  int64_t max_len = 0;
  for (int64_t i : items) max_len = std::max(max_len, seqlens[i]);
  int index_bits = 1;
  while ((int64_t{1} << index_bits) <= max_index) ++index_bits;
  if (index_bits < 62 && max_len < (int64_t{1} << (62 - index_bits))) {
    std::vector<uint64_t> keys(items.size());
    for (size_t j = 0; j < items.size(); ++j)
      keys[j] = (static_cast<uint64_t>(seqlens[items[j]]) << index_bits) | static_cast<uint64_t>(items[j]);
    radix_sort(keys, index_bits + bit_width(static_cast<uint64_t>(max_len)));
    const uint64_t index_mask = (uint64_t{1} << index_bits) - 1;
    for (size_t j = 0; j < items.size(); ++j) order[j] = static_cast<int64_t>(keys[j] & index_mask);
  } else {
    std::sort(order.begin(), order.end(),
              [&](int64_t a, int64_t b) { return std::tie(seqlens[a], a) < std::tie(seqlens[b], b); });
  }
  return order;
}

void check_seqlens(const int64_t* seqlens, int64_t n) {
  for (int64_t i = 0; i < n; ++i)
    if (seqlens[i] < 0)
      fail("seqlens: entry " + std::to_string(i) + " is " + std::to_string(seqlens[i]) + ", expected >= 0");
}

// Merge b into a as largest differencing does: a's i-th largest part takes b's i-th smallest.
void merge_states(State& a, const State& b, int64_t k, std::vector<int64_t>& next) {
  const int64_t na = static_cast<int64_t>(a.parts.size()), nb = static_cast<int64_t>(b.parts.size());
  thread_local std::vector<Part> out;  // reused: no allocation per merge
  out.clear();
  const auto join = [&](const Part* pa, const Part* pb) {
    if (!pa) return out.push_back(*pb);
    if (!pb) return out.push_back(*pa);
    Part p = *pa;
    next[p.tail] = pb->head;
    p.tail = pb->tail;
    p.sum += pb->sum;
    p.count += pb->count;
    out.push_back(p);
  };
  // Slot i pairs a.parts[i] (if i < na) with b.parts[k - 1 - i] (if i >= k - nb); visit only slots
  // where at least one side is non-empty.
  for (int64_t i = 0; i < na; ++i) join(&a.parts[i], i >= k - nb ? &b.parts[k - 1 - i] : nullptr);
  for (int64_t i = std::max(na, k - nb); i < k; ++i) join(nullptr, &b.parts[k - 1 - i]);
  std::sort(out.begin(), out.end(), PartBefore{});
  a.parts.assign(out.begin(), out.end());
}

std::vector<std::vector<int64_t>> karmarkar_karp(const int64_t* seqlens, const std::vector<int64_t>& items, int64_t k,
                                                 bool equal_size) {
  const int64_t n = static_cast<int64_t>(items.size());
  const std::vector<int64_t> order = sorted_by_length(seqlens, items);
  std::vector<int64_t> next(static_cast<size_t>(*std::max_element(items.begin(), items.end()) + 1), -1);
  std::vector<State> states;
  const int64_t group = equal_size ? k : 1;
  states.reserve(static_cast<size_t>(n / group));
  for (int64_t off = 0; off < n; off += group) {
    // order is ascending by (length, index), so the group reversed is already sorted by PartBefore.
    State s;
    s.parts.reserve(static_cast<size_t>(group));
    for (int64_t j = group - 1; j >= 0; --j) {
      const int64_t idx = order[off + j];
      s.parts.push_back({seqlens[idx], 1, idx, idx});
    }
    states.push_back(std::move(s));
  }
  // verl's heap order: the largest spread first, then the state whose largest part comes first by
  // PartBefore (distinct first items make this a total order).
  using Key = std::tuple<int64_t, int64_t, int64_t, int64_t, int64_t>;  // spread, sum, count, head, id
  std::priority_queue<Key> heap;
  const auto push = [&](int64_t id) {
    const Part& top = states[id].parts.front();
    heap.emplace(states[id].spread(k), top.sum, top.count, top.head, id);
  };
  for (int64_t id = 0; id < static_cast<int64_t>(states.size()); ++id) push(id);
  while (heap.size() > 1) {
    const int64_t a = std::get<4>(heap.top());
    heap.pop();
    const int64_t b = std::get<4>(heap.top());
    heap.pop();
    merge_states(states[a], states[b], k, next);
    states[b].parts.clear();
    states[b].parts.shrink_to_fit();
    push(a);
  }
  // Label every item with its part by walking the lists, then fill the parts in index order: each
  // comes out sorted without a sort.
  const State& final_state = states[std::get<4>(heap.top())];
  std::vector<int64_t> owner(next.size(), -1);
  std::vector<std::vector<int64_t>> partitions(final_state.parts.size());
  for (size_t p = 0; p < final_state.parts.size(); ++p) {
    const Part& part = final_state.parts[p];
    partitions[p].reserve(static_cast<size_t>(part.count));
    for (int64_t i = part.head; i != -1; i = next[i]) {
      owner[i] = static_cast<int64_t>(p);
      if (i == part.tail) break;
    }
  }
  for (size_t i = 0; i < owner.size(); ++i)
    if (owner[i] >= 0) partitions[owner[i]].push_back(static_cast<int64_t>(i));
  check(static_cast<int64_t>(partitions.size()) == k, "balanced_partitions: internal error, a partition is empty");
  return partitions;
}

// Longest processing time first: each sequence, longest first, goes to the part with the fewest tokens.
std::vector<std::vector<int64_t>> longest_first(const int64_t* seqlens, const std::vector<int64_t>& items, int64_t k) {
  std::vector<int64_t> order(items);
  std::sort(order.begin(), order.end(), [&](int64_t a, int64_t b) {
    return std::tie(seqlens[b], a) < std::tie(seqlens[a], b);
  });
  using Load = std::pair<int64_t, int64_t>;  // tokens, part id
  std::priority_queue<Load, std::vector<Load>, std::greater<Load>> lightest;
  for (int64_t p = 0; p < k; ++p) lightest.emplace(0, p);
  std::vector<std::vector<int64_t>> parts(static_cast<size_t>(k));
  for (int64_t idx : order) {
    auto [tokens, p] = lightest.top();
    lightest.pop();
    parts[p].push_back(idx);
    lightest.emplace(tokens + seqlens[idx], p);
  }
  for (auto& part : parts) std::sort(part.begin(), part.end());
  return parts;
}

// k parts of `items` with balanced token sums: Karmarkar-Karp as verl, while its cost (about n k merges
// of part lists) stays small; beyond that longest-first, which is O(n log k) and close to it when parts
// hold many sequences.
std::vector<std::vector<int64_t>> balanced_split(const int64_t* seqlens, const std::vector<int64_t>& items, int64_t k) {
  if (static_cast<double>(items.size()) * static_cast<double>(k) <= 1e7) return karmarkar_karp(seqlens, items, k, false);
  return longest_first(seqlens, items, k);
}

}  // namespace

std::vector<std::vector<int64_t>> balanced_partitions(const int64_t* seqlens, int64_t n, int64_t k, bool equal_size) {
  check(k >= 1, "k: expected at least 1 partition, got " + std::to_string(k));
  check(n >= k, "seqlens: " + std::to_string(n) + " sequences cannot fill " + std::to_string(k) +
                    " non-empty partitions");
  if (equal_size)
    check(n % k == 0, "seqlens: equal_size needs the number of sequences (" + std::to_string(n) +
                          ") to be a multiple of k (" + std::to_string(k) + ")");
  check_seqlens(seqlens, n);
  std::vector<int64_t> items(static_cast<size_t>(n));
  std::iota(items.begin(), items.end(), 0);
  return karmarkar_karp(seqlens, items, k, equal_size);
}

std::vector<std::vector<int64_t>> token_budget_micro_batches(const int64_t* seqlens, int64_t n, int64_t max_tokens,
                                                             bool balanced, std::vector<int64_t>* oversized) {
  check(max_tokens >= 1, "max_tokens: expected a budget of at least 1 token, got " + std::to_string(max_tokens));
  check_seqlens(seqlens, n);
  std::vector<std::vector<int64_t>> batches;
  std::vector<int64_t> fitting;
  int64_t fitting_tokens = 0;
  for (int64_t i = 0; i < n; ++i) {
    if (seqlens[i] > max_tokens) {
      if (oversized) oversized->push_back(i);
      if (balanced) batches.push_back({i});
      continue;
    }
    fitting.push_back(i);
    fitting_tokens += seqlens[i];
  }
  if (!balanced) {
    // Greedy consecutive runs in input order; an oversized sequence closes the run and stands alone.
    std::vector<int64_t> current;
    int64_t current_tokens = 0;
    for (int64_t i = 0; i < n; ++i) {
      const bool alone = seqlens[i] > max_tokens;
      if (!current.empty() && (alone || current_tokens + seqlens[i] > max_tokens)) {
        batches.push_back(std::move(current));
        current.clear();
        current_tokens = 0;
      }
      if (alone) {
        batches.push_back({i});
        continue;
      }
      current.push_back(i);
      current_tokens += seqlens[i];
    }
    if (!current.empty()) batches.push_back(std::move(current));
    return batches;
  }
  const int64_t n_fit = static_cast<int64_t>(fitting.size());
  if (n_fit > 0) {
    // The fewest balanced parts that all fit: from ceil(total / budget) up, galloping then bisecting
    // (n_fit parts of one sequence each always fit).
    std::vector<std::vector<int64_t>> best;
    const auto fits = [&](int64_t m) {
      auto parts = balanced_split(seqlens, fitting, m);
      for (const auto& p : parts) {
        int64_t s = 0;
        for (int64_t i : p) s += seqlens[i];
        if (s > max_tokens) return false;
      }
      best = std::move(parts);
      return true;
    };
    const int64_t lo = std::min(n_fit, std::max<int64_t>(1, (fitting_tokens + max_tokens - 1) / max_tokens));
    int64_t bad = lo - 1, good = lo;
    for (int64_t step = 1; !fits(good); step *= 2) {
      bad = good;
      good = std::min(n_fit, lo + step);
    }
    std::vector<std::vector<int64_t>> good_parts = std::move(best);
    while (good - bad > 1) {
      const int64_t mid = bad + (good - bad) / 2;
      if (fits(mid)) {
        good = mid;
        good_parts = std::move(best);
      } else {
        bad = mid;
      }
    }
    for (auto& p : good_parts) batches.push_back(std::move(p));
  }
  std::sort(batches.begin(), batches.end(),
            [](const std::vector<int64_t>& a, const std::vector<int64_t>& b) { return a.front() < b.front(); });
  return batches;
}

}  // namespace pyrl
