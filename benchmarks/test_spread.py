"""benchmarks/spread.py's rule, on hand-computed cases: a ratio of medians, claimed only when the ranges are apart."""

from spread import ratio, rotated, show, spread


def test_spread_and_show():
    assert spread([3.0, 1.0, 2.0, 10.0]) == (2.5, 1.0, 10.0)
    assert show([1.0, 2.0, 4.0]) == "2.00 (1.00-4.00)"


def test_ratio_claimed_only_when_ranges_are_apart():
    assert ratio([4.0, 4.2, 4.4], [2.0, 2.1, 2.2]) == "2.00x"
    assert ratio([2.0, 2.1, 2.2], [4.0, 4.2, 4.4]) == "0.50x"
    assert ratio([2.0, 2.5, 3.0], [2.9, 3.0, 3.1]) == "0.83x, within noise"  # 3.0 inside 2.9-3.1
    assert ratio([1.0], [1.0]) == "1.00x, within noise"


def test_rotated_order():
    assert [rotated(["a", "b", "c"], k) for k in range(4)] == [["a", "b", "c"], ["b", "c", "a"], ["c", "a", "b"],
                                                                ["a", "b", "c"]]
