import pytest

from pyrl.rewards import countdown, default_compute_score, gsm8k, math_answer


def test_gsm8k_strict_and_flexible():
    assert gsm8k.compute_score("so the total is 72.\n#### 72", "72") == 1.0
    assert gsm8k.compute_score("#### 1,234", "1234") == 1.0  # commas are stripped
    assert gsm8k.compute_score("#### 71", "72") == 0.0
    assert gsm8k.compute_score("the answer is 72", "72") == 0.0  # strict needs ####
    assert gsm8k.extract_solution("the answer is 72.", method="flexible") == "72."
    assert gsm8k.extract_solution("x" * 400 + "#### 5") == "5"
    assert gsm8k.extract_solution("#### 5" + "x" * 400) is None  # only the last 300 characters count
    assert default_compute_score("openai/gsm8k", "#### 3", "3") == 1.0


@pytest.mark.parametrize("solution, truth, score", [
    ("so \\boxed{\\frac{1}{2}}", "\\frac12", 1.0),
    ("\\boxed{0.5}", "\\frac{1}{2}", 1.0),
    ("first \\boxed{3} then \\boxed{4}", "4", 1.0),  # the last box
    ("\\boxed{x = 5}", "5", 1.0),
    ("\\boxed{\\dfrac{3}{4}}", "3/4", 1.0),
    ("\\boxed{5}", "6", 0.0),
    ("no box here: 5", "5", 0.0),
    ("\\boxed{5", "5", 0.0),  # unbalanced
])
def test_math_boxed_equivalence(solution, truth, score):
    assert math_answer.compute_score(solution, truth) == score


@pytest.mark.parametrize("solution, score", [
    ("<answer>(1 + 2) * 3</answer>", 1.0),
    ("<answer>3 * (2 + 1)</answer>", 1.0),
    ("<answer>(1 + 2) * 3 + 1 - 1</answer>", 0.1),  # uses numbers that were not given
    ("<answer>1 + 2</answer>", 0.1),  # misses a number
    ("<answer>(1 + 2) * 3 </answer> <answer>1 * 2 * 3</answer>", 0.1),  # the last answer counts, and is wrong
    ("<answer>__import__('os').system('true') or 1 + 2 + 3</answer>", 0.1),  # never evaluated
    ("<answer>3 / (2 - 2) + 1</answer>", 0.1),
    ("no answer tags", 0.0),
])
def test_countdown_uses_each_number_once_and_never_evals_code(solution, score):
    truth = {"target": 9, "numbers": [1, 2, 3]}
    assert countdown.compute_score(solution, truth) == score


def test_countdown_safe_eval_rejects_names():
    with pytest.raises(ValueError):
        countdown.safe_eval("a + 1")
    assert countdown.safe_eval("-(2 + 3) * 4 / 2") == -10.0


def test_toy_and_unknown_sources():
    assert default_compute_score("pyrl/toy_addition", "<answer>50</answer>", "50") == 1.0
    assert default_compute_score("pyrl/toy_addition", "<answer>5</answer><answer>50</answer>", "50") == 0.0  # the first
    with pytest.raises(NotImplementedError, match="data_source 'mystery': no rule-based scorer for it"):
        default_compute_score("mystery", "x", "y")
