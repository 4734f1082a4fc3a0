"""The one loader of users' code (pyrl.usercode): a file path or a dotted name, the same errors for both, a file run
once per process; and each kind of user code loads through it."""

import pytest

from pyrl.usercode import load_file, load_object


def test_a_file_or_a_dotted_name(tmp_path):
    path = tmp_path / "scorer.py"
    path.write_text("RUNS = []\nRUNS.append(1)\ndef score(x):\n    return 2 * x\n")
    fn = load_object(str(path), "reward.custom_reward_function.path", name="score")
    assert fn(3) == 6
    assert load_file(str(path), "k") is load_file(str(path), "other")  # run once per process
    assert load_file(str(path), "k").RUNS == [1]
    assert load_object("pyrl.usercode.load_object", "class_name") is load_object
    assert load_object("pyrl.usercode", "k", name="load_file") is load_file
    # verl 0.9.1's prefixes: pkg:// (dots or slashes) and file://
    assert load_object("pkg://pyrl.usercode", "k", name="load_file") is load_file
    assert load_object("pkg://pyrl/usercode", "k", name="load_file") is load_file
    assert load_object(f"file://{path}", "k", name="score")(4) == 8


def test_errors_name_the_key(tmp_path):
    path = tmp_path / "scorer.py"
    path.write_text("x = 1\n")
    with pytest.raises(FileNotFoundError, match=r"data.custom_cls.path: '.*missing.py' does not exist"):
        load_object(str(tmp_path / "missing.py"), "data.custom_cls.path", name="Rows")
    with pytest.raises(AttributeError, match=r"reward.custom_reward_function.name: '.*scorer.py' defines no function "
                                             r"'score'"):
        load_object(str(path), "reward.custom_reward_function.path", name="score",
                    name_key="reward.custom_reward_function.name", what="function")
    with pytest.raises(ImportError, match=r"class_name 'pyrl.usercode.Nope': module pyrl.usercode has no Nope"):
        load_object("pyrl.usercode.Nope", "class_name")
    with pytest.raises(ImportError, match=r"class_name: cannot import module 'pyrl.nowhere'"):
        load_object("pyrl.nowhere.Tool", "class_name")
    with pytest.raises(ValueError, match=r"class_name: expected a dotted path module.Name, got 'Tool'"):
        load_object("Tool", "class_name")


def test_a_file_that_fails_is_not_half_loaded(tmp_path):
    path = tmp_path / "broken.py"
    path.write_text("raise RuntimeError('boom')\n")
    for _ in range(2):  # the second load runs it again rather than returning a half-made module
        with pytest.raises(RuntimeError, match="boom"):
            load_file(str(path), "k")


def test_a_files_functions_travel_by_value(tmp_path):
    """Another process (a spawned scoring worker) cannot import the file's module by its derived name: the
    loaded function pickles by value and runs there."""
    import concurrent.futures
    import multiprocessing

    import ray.cloudpickle

    path = tmp_path / "scorer.py"
    # a dataclass with string annotations: made only when the module can be looked up while it runs
    path.write_text("from __future__ import annotations\nimport dataclasses\n\n@dataclasses.dataclass\nclass Row:\n"
                    "    x: int\n\ndef score(x):\n    return Row(2 * x).x\n")
    fn = load_object(str(path), "reward.custom_reward_function.path", name="score")
    with concurrent.futures.ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        assert pool.submit(_call_pickled, ray.cloudpickle.dumps(fn), 4).result(timeout=120) == 8


def _call_pickled(blob, x):
    import ray.cloudpickle

    return ray.cloudpickle.loads(blob)(x)
