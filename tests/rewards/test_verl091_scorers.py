"""pyrl's rule-based scorers give verl 0.9.1's scores: math_dapo and search_r1 (ports of verl's math_dapo.py and
search_r1_like_qa_em.py), math_answer (math_reward.py) and gsm8k (gsm8k.py). Every expected value below was computed
by verl 0.9.1's own functions (verl/utils/reward_score/*.py, loaded by path) on these inputs on 2026-11-30; verl is
not installed here, so the tests hold only the table. Where verl returns the int 0 (no answer found) pyrl returns
0.0, which verl's default_compute_score turns every score into anyway.

Cases are (the compute_score arguments, verl's result)."""

import pytest

from pyrl.rewards import gsm8k, math_answer, math_dapo, search_r1

MATH_DAPO_CASES = [
    (("The answer is \\boxed{42}.", "42"), {"score": 1.0, "acc": True, "pred": "42"}),
    (("Answer: 42", "42"), {"score": 1.0, "acc": True, "pred": "42"}),
    (("so the final answer : 42", "42"), {"score": 1.0, "acc": True, "pred": "42"}),
    (("Answer: 41", "42"), {"score": -1.0, "acc": False, "pred": "41"}),
    (("Answer: 1,000", "1000"), {"score": 1.0, "acc": True, "pred": "1000"}),
    (("Answer: 1000", "1,000"), {"score": 1.0, "acc": True, "pred": "1000"}),
    (("Answer: 5 cm", "5"), {"score": 1.0, "acc": True, "pred": "5"}),
    (("Answer: 12 students", "12"), {"score": 1.0, "acc": True, "pred": "12"}),
    (("Answer: 10 dollars", "10"), {"score": 1.0, "acc": True, "pred": "10"}),
    (("Answer: \\text{5}", "5"), {"score": 1.0, "acc": True, "pred": "5"}),
    (("Answer: \\textbf{B}", "B"), {"score": 1.0, "acc": True, "pred": "B"}),
    (("Answer: $\\frac{1}{2}$.", "\\frac{1}{2}"), {"score": 1.0, "acc": True, "pred": "\\frac{1}{2}"}),
    (("Answer: \\frac12", "\\frac{1}{2}"), {"score": 1.0, "acc": True, "pred": "\\frac{1}{2}"}),
    (("Answer: \\sqrt2", "\\sqrt{2}"), {"score": 1.0, "acc": True, "pred": "\\sqrt{2}"}),
    (("Answer: x = 7", "7"), {"score": 1.0, "acc": True, "pred": "7"}),
    (("Answer: 90^\\circ", "90"), {"score": 1.0, "acc": True, "pred": "90"}),
    (("Answer: \\boxed{12}", "12"), {"score": 1.0, "acc": True, "pred": "12"}),
    (("Answer: 1 2", "12"), {"score": 1.0, "acc": True, "pred": "12"}),
    (("Answer: 3\nso \\boxed{4}", "4"), {"score": -1.0, "acc": False, "pred": "3"}),
    (("Answer: 4\nAnswer: 3", "3"), {"score": 1.0, "acc": True, "pred": "3"}),
    (("\\boxed{ 42 }", "42"), {"score": -1.0, "acc": False, "pred": " 42 "}),
    (("\\boxed{\\frac{1}{2}}", "\\frac{1}{2}"), {"score": 1.0, "acc": True, "pred": "\\frac{1}{2}"}),
    (("\\boxed{0.5}", "\\frac{1}{2}"), {"score": -1.0, "acc": False, "pred": "0.5"}),
    (("first \\boxed{3} then \\boxed{4}", "4"), {"score": 1.0, "acc": True, "pred": "4"}),
    (("", "42"), {"score": -1.0, "acc": False, "pred": "[INVALID]"}),
    (("no answer here", "42"), {"score": -1.0, "acc": False, "pred": "[INVALID]"}),
    (("Answer: 42", "42", True), {"score": -1.0, "acc": False, "pred": None}),
    (("work... \\boxed{42}", "42", True), {"score": 1.0, "acc": True, "pred": "42"}),
    (("\\boxed{42}" + "x" * 150, "42", True), {"score": -1.0, "acc": False, "pred": None}),
    (("\\boxed{42}" + "x" * 150, "42"), {"score": -1.0, "acc": False, "pred": "[INVALID]"}),
    (("Answer: 42\n" + "y" * 300, "42"), {"score": -1.0, "acc": False, "pred": "[INVALID]"}),
    (("z" * 1000 + "Answer: 42", "42"), {"score": 1.0, "acc": True, "pred": "42"}),
    (("a" * 150 + "\\boxed{7}" + "b" * 100, "7", True, [0, 0, 0, 159]), {"score": 1.0, "acc": True, "pred": "7"}),
    (("a" * 150 + "\\boxed{7}" + "b" * 100, "7", True), {"score": -1.0, "acc": False, "pred": None}),
    (("a" * 150 + "\\boxed{7}" + "b" * 100, "7", False, [0, 0, 0, 159]), {"score": 1.0, "acc": True, "pred": "7"}),
]

SEARCH_R1_CASES = [
    (("<answer>Paris</answer>", {"target": "Paris"}), 1.0),
    (("<answer> the Paris! </answer>", {"target": ["paris"]}), 1.0),
    (("<answer>London</answer>", {"target": ["Paris", "London"]}), 1.0),
    (("<answer>London</answer>", {"target": ("Paris", "London")}), 1.0),
    (("<answer>Rome</answer>", {"target": ["Paris"]}), 0.0),
    (("<answer>Rome</answer>", {"target": ["Paris"]}, "strict", 0.1), 0.1),
    (("Paris", {"target": ["Paris"]}, "strict", 0.1), 0),
    (("<answer>Paris", {"target": ["Paris"]}), 0),
    (("<answer>Rome</answer> no, <answer>Paris</answer>", {"target": ["Paris"]}), 1.0),
    (("<answer>\nParis\n</answer>", {"target": ["Paris"]}), 1.0),
    (("<answer>An Apple</answer>", {"target": ["apple"]}), 1.0),
    (("<answer>New-York</answer>", {"target": ["newyork"]}), 1.0),
    (("<answer>Paris</answer>", {"target": ["Paris, France"]}), 0.0),
    (("<answer>it is Paris, France</answer>", {"target": ["paris"]}), 0.0),
    (("<answer>Paris</answer>", {"target": []}), 0.0),
    (("<answer>x</answer>" * 9 + "<answer>Paris</answer>", {"target": ["Paris"]}), 1.0),
    (("<answer>x</answer>" * 10 + "<answer>Paris</answer>", {"target": ["Paris"]}), 0.25),
    (("<answer>x</answer>" * 10 + "<answer>Paris</answer>", {"target": ["Paris"]}, "strict", 0.0, 2.0), 0.5),
]

SEARCH_R1_SUBEM_CASES = [
    (("<answer>it is Paris, France</answer>", {"target": ["paris"]}), 1.0),
    (("<answer>Paris</answer>", {"target": ["Paris, France"]}), 0.0),
    (("<answer>x</answer>" * 10 + "<answer>Paris</answer>", {"target": "Paris"}), 1.0),
    (("Paris", {"target": ["Paris"]}), 0),
]

MATH_ANSWER_CASES = [
    (("\\boxed{50%}", "50"), 0.0),
    (("\\boxed{50\\%}", "50"), 1.0),
    (("\\fbox{5}", "5"), 0.0),
    (("\\boxed{3} and \\fbox{5}", "5"), 0.0),
    (("\\boxed{3} and \\fbox{5}", "3"), 1.0),
    (("so \\boxed 3$ and then \\boxed{5}", "5"), 0.0),
    (("so \\boxed 3$ and then \\boxed{5}", "3"), 1.0),
    (("\\boxed{5\\text{ m}\\text{ s}}", "5"), 0.0),
    (("\\boxed{5\\text{ m}\\text{ s}}", "5\\text{ m}\\text{ s}"), 1.0),
    (("\\boxed{5\\text{ cm}}", "5"), 1.0),
    (("\\boxed{5}", 5), 0.0),
    (("\\boxed{\\frac12+\\frac3}", "\\frac{1}{2}+\\frac3"), 0.0),
    (("\\boxed{2 \\sqrt}", "2\\sqrt"), 0.0),
    (("\\boxed{1 \\frac}", "1\\frac"), 0.0),
    (("\\boxed{\\dfrac{1}{2}}", "0.5"), 1.0),
    (("\\boxed{1/2}", "\\frac12"), 1.0),
    (("\\boxed{.5}", "\\frac{1}{2}"), 1.0),
    (("\\boxed{k = 5}", "5"), 1.0),
    (("\\boxed{\\left( 1, 2 \\right)}", "(1,2)"), 1.0),
    (("\\boxed{90^\\circ}", "90"), 1.0),
    (("\\boxed{5", "5"), 0.0),
    (("no box here: 5", "5"), 0.0),
    (("first \\boxed{3} then \\boxed{4}", "4"), 1.0),
]

GSM8K_CASES = [
    (("#### 5", "5"), 1.0),
    (("#### 5", 5), 0.0),
    (("#### 1,234", "1234"), 1.0),
    (("#### -3", "-3"), 1.0),
    (("#### 4\n#### 5", "5"), 1.0),
    (("#### 4", "5", "strict", 0.1), 0.1),
    (("the answer is 5", "5"), 0),
    (("the answer is 5", "5", "flexible"), 1.0),
    (("5", 5, "flexible"), 0.0),
    (("5 then 7.", "7", "flexible", 0.1), 0.1),
    ((". .", "5", "flexible", 0.1), 0.1),
    ((". . .", ".", "flexible"), 1.0),
    (("no numbers", "5", "flexible", 0.1), 0),
    (("#### 5" + "x" * 300, "5"), 0),
    (("x" * 1000 + "#### 5", "5"), 1.0),
]


def _ids(cases):
    return [str(i) for i in range(len(cases))]


@pytest.mark.parametrize("args, expected", MATH_DAPO_CASES, ids=_ids(MATH_DAPO_CASES))
def test_math_dapo_matches_verl(args, expected):
    got = math_dapo.compute_score(*args)
    assert {k: (type(v), v) for k, v in got.items()} == {k: (type(v), v) for k, v in expected.items()}


NUMBER_SCORERS = {"search_r1": (search_r1.compute_score, SEARCH_R1_CASES),
                  "search_r1_subem": (search_r1.compute_score_subem, SEARCH_R1_SUBEM_CASES),
                  "math_answer": (math_answer.compute_score, MATH_ANSWER_CASES),
                  "gsm8k": (gsm8k.compute_score, GSM8K_CASES)}


@pytest.mark.parametrize("scorer, args, expected",
                         [(fn, args, expected) for fn, cases in NUMBER_SCORERS.values() for args, expected in cases],
                         ids=[f"{name}-{i}" for name, (_, cases) in NUMBER_SCORERS.items() for i in range(len(cases))])
def test_number_scorers_match_verl(scorer, args, expected):
    assert scorer(*args) == expected


def test_inputs_verl_rejects_raise():
    """verl raises on these (a TypeError, an AttributeError, an AssertionError); so does pyrl."""
    with pytest.raises(TypeError):  # search_r1's ground truth is a dict with "target"
        search_r1.compute_score("<answer>Paris</answer>", ["Paris"])
    with pytest.raises(AttributeError):  # math_dapo normalizes the ground truth as a str
        math_dapo.compute_score("Answer: 5", 5)
    with pytest.raises(ValueError):  # four pause token indices
        math_dapo.compute_score("\\boxed{5}", "5", True, [1, 2])
