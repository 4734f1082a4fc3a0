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

// Larger sum first, then more items, then the smaller first index: a total order, so results are
// deterministic.
bool part_before(const Part& a, const Part& b) {
  if (a.sum != b.sum) return a.sum > b.sum;
  if (a.count != b.count) return a.count > b.count;
  return a.head < b.head;
}

// A partial solution: k parts of which only the non-empty ones are stored, sorted by part_before
// (the empty ones are implicitly last), so that n single-item states cost O(n), not O(n k).
struct State {
  std::vector<Part> parts;
  int64_t spread(int64_t k) const {
    const int64_t smallest = static_cast<int64_t>(parts.size()) == k ? parts.back().sum : 0;
    return parts.empty() ? 0 : parts.front().sum - smallest;
  }
};

void check_seqlens(const int64_t* seqlens, int64_t n) {
  for (int64_t i = 0; i < n; ++i)
    if (seqlens[i] < 0)
      fail("seqlens: entry " + std::to_string(i) + " is " + std::to_string(seqlens[i]) + ", expected >= 0");
}

// Merge b into a as largest differencing does: a's i-th largest part takes b's i-th smallest.
void merge_states(State& a, const State& b, int64_t k, std::vector<int64_t>& next) {
  const int64_t na = static_cast<int64_t>(a.parts.size()), nb = static_cast<int64_t>(b.parts.size());
  std::vector<Part> out;
  out.reserve(static_cast<size_t>(std::min(k, na + nb)));
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
  std::sort(out.begin(), out.end(), part_before);
  a.parts = std::move(out);
}

std::vector<std::vector<int64_t>> karmarkar_karp(const int64_t* seqlens, const std::vector<int64_t>& items, int64_t k,
                                                 bool equal_size) {
  const int64_t n = static_cast<int64_t>(items.size());
  std::vector<int64_t> order(items);  // ascending by (seqlen, index), as verl sorts
  std::sort(order.begin(), order.end(), [&](int64_t a, int64_t b) {
    return std::tie(seqlens[a], a) < std::tie(seqlens[b], b);
  });
  std::vector<int64_t> next(static_cast<size_t>(*std::max_element(items.begin(), items.end()) + 1), -1);
  std::vector<State> states;
  const int64_t group = equal_size ? k : 1;
  states.reserve(static_cast<size_t>(n / group));
  for (int64_t off = 0; off < n; off += group) {
    State s;
    for (int64_t j = 0; j < group; ++j) {
      const int64_t idx = order[off + j];
      s.parts.push_back({seqlens[idx], 1, idx, idx});
    }
    std::sort(s.parts.begin(), s.parts.end(), part_before);
    states.push_back(std::move(s));
  }
  // Max-heap on (spread, largest part sum), ties to the older state.
  using Key = std::tuple<int64_t, int64_t, int64_t>;  // spread, largest sum, -id
  std::priority_queue<Key> heap;
  const auto push = [&](int64_t id) {
    heap.emplace(states[id].spread(k), states[id].parts.front().sum, -id);
  };
  for (int64_t id = 0; id < static_cast<int64_t>(states.size()); ++id) push(id);
  while (heap.size() > 1) {
    const int64_t a = -std::get<2>(heap.top());
    heap.pop();
    const int64_t b = -std::get<2>(heap.top());
    heap.pop();
    merge_states(states[a], states[b], k, next);
    states[b].parts.clear();
    states[b].parts.shrink_to_fit();
    push(a);
  }
  const State& final_state = states[-std::get<2>(heap.top())];
  std::vector<std::vector<int64_t>> partitions;
  partitions.reserve(static_cast<size_t>(k));
  for (const Part& p : final_state.parts) {
    std::vector<int64_t> members;
    members.reserve(static_cast<size_t>(p.count));
    for (int64_t i = p.head; i != -1; i = next[i]) {
      members.push_back(i);
      if (i == p.tail) break;
    }
    std::sort(members.begin(), members.end());
    partitions.push_back(std::move(members));
  }
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
