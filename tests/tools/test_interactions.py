"""Interactions (verl 0.5-0.8's interface): the guess-number user playing a scripted game, the interaction
YAML registry, and a verl-style interaction file (verl renamed to pyrl) loaded through it."""

import asyncio

import pytest

from pyrl.interactions.base import BaseInteraction
from pyrl.interactions.guess_number import GuessNumberInteraction, parse_guess
from pyrl.interactions.registry import initialize_interactions_from_config


def test_guess_number_scripted_game():
    """Binary search on 1..100 for 37, as the agent loop drives it: start with interaction_kwargs, one
    generate_response per assistant turn on the whole conversation, score, finalize."""
    interaction = GuessNumberInteraction({"name": "guess_number"})
    kwargs = {"name": "guess_number", "target": 37}
    script = [("I guess <answer>50</answer>", False, "lower", 0.0),
              ("Then <answer>25</answer>.", False, "higher", 0.0),
              ("Hmm, no number this time.", False, "Please give your guess as <answer>N</answer>.", 0.0),
              ("<answer>30</answer> no wait <answer>37</answer>", True, "correct", 1.0)]

    async def play():
        instance_id = await interaction.start_interaction("req-1", **kwargs)
        messages = [{"role": "user", "content": "Guess my number between 1 and 100."}]
        results = []
        for assistant_text, *_ in script:
            messages.append({"role": "assistant", "content": assistant_text})
            done, reply, score, extra = await interaction.generate_response(instance_id, messages, **kwargs)
            results.append((done, reply, score, extra))
            messages.append({"role": "user", "content": reply})
        final = await interaction.calculate_score(instance_id)
        await interaction.finalize_interaction(instance_id)
        return instance_id, results, final

    instance_id, results, final = asyncio.run(play())
    assert instance_id == "req-1"
    assert [(done, reply, score) for done, reply, score, _ in results] == [row[1:] for row in script]
    assert [extra["guesses"] for *_, extra in results] == [1, 2, 2, 3]  # a turn without a guess does not count
    assert final == 1.0 and interaction._instance_dict == {}


def test_guess_number_unsolved_scores_zero_and_instances_are_separate():
    interaction = GuessNumberInteraction({"name": "guess_number"})

    async def go():
        a = await interaction.start_interaction(target=5)
        b = await interaction.start_interaction(target="9")  # from a string column
        assert a != b
        assert (await interaction.generate_response(a, [{"role": "assistant", "content": "<answer>9</answer>"}]))[:3] \
            == (False, "lower", 0.0)
        assert (await interaction.generate_response(b, [{"role": "assistant", "content": "<answer>9</answer>"}]))[:3] \
            == (True, "correct", 1.0)
        return await interaction.calculate_score(a), await interaction.calculate_score(b)

    assert asyncio.run(go()) == (0.0, 1.0)


@pytest.mark.parametrize("target", [None, "abc", 3.5, True])
def test_guess_number_needs_an_integer_target(target):
    with pytest.raises(ValueError, match="interaction_kwargs.target: expected an integer"):
        asyncio.run(GuessNumberInteraction({"name": "guess_number"}).start_interaction("x", target=target))


def test_parse_guess():
    assert parse_guess("<answer> -12 </answer>") == -12
    assert parse_guess("<answer>1</answer> <answer>2</answer>") == 2
    assert parse_guess("<answer>two</answer>") is None and parse_guess("") is None


def test_base_interaction_defaults():
    interaction = BaseInteraction({})
    assert interaction.name == "interaction_agent"

    async def go():
        instance_id = await interaction.start_interaction()
        reply = await interaction.generate_response(instance_id, [])
        return instance_id, reply, await interaction.calculate_score(instance_id)

    instance_id, reply, score = asyncio.run(go())
    assert isinstance(instance_id, str) and len(instance_id) == 36
    assert reply == (False, "Your current result seems acceptable.", 0.8, {}) and score == 0.0


VERL_STYLE_INTERACTION = '''
from typing import Any, Optional
from uuid import uuid4

from pyrl.interactions.base import BaseInteraction


class EchoAnswerInteraction(BaseInteraction):
    """Shaped like verl's Gsm8kInteraction."""

    def __init__(self, config: dict):
        super().__init__(config)
        self._instance_dict = {}

    async def start_interaction(self, instance_id: Optional[str] = None, ground_truth: Optional[str] = None,
                                **kwargs) -> str:
        if instance_id is None:
            instance_id = str(uuid4())
        self._instance_dict[instance_id] = {"response": "", "ground_truth": ground_truth, "reward": 0.0}
        return instance_id

    async def generate_response(self, instance_id: str, messages: list[dict[str, Any]], **kwargs
                                ) -> tuple[bool, str, float, dict]:
        content = ""
        for i in range(len(messages) - 1, -1, -1):
            if messages[i].get("role") == "assistant":
                content = messages[i].get("content")
                break
        self._instance_dict[instance_id]["response"] = content
        reward = await self.calculate_score(instance_id)
        if reward == 1.0:
            return True, "Your response is correct!", reward, {}
        return False, "Your response is incorrect! You need to reflect on your answer and try again.", reward, {}

    async def calculate_score(self, instance_id: str, **kwargs) -> float:
        state = self._instance_dict[instance_id]
        return 1.0 if state["response"].strip() == state["ground_truth"] else 0.0

    async def finalize_interaction(self, instance_id: str, **kwargs) -> None:
        del self._instance_dict[instance_id]
'''


def test_registry_loads_named_unnamed_and_verl_style_interactions(tmp_path, monkeypatch):
    (tmp_path / "verl_style_interactions.py").write_text(VERL_STYLE_INTERACTION)
    monkeypatch.syspath_prepend(str(tmp_path))
    config = tmp_path / "interaction.yaml"
    config.write_text("""
interaction:
  - name: "numbers"
    class_name: "pyrl.interactions.guess_number.GuessNumberInteraction"
    config: {}
  - class_name: "pyrl.interactions.guess_number.GuessNumberInteraction"
    config: {note: unnamed}
  - name: "echo"
    class_name: "verl_style_interactions.EchoAnswerInteraction"
    config: {}
""")
    interactions = initialize_interactions_from_config(str(config))
    assert list(interactions) == ["numbers", "guessnumber", "echo"]  # verl: class name less "Interaction", lower-cased
    assert interactions["numbers"].name == "numbers" and interactions["numbers"].config == {"name": "numbers"}
    assert interactions["guessnumber"].config == {"note": "unnamed", "name": "guessnumber"}

    echo = interactions["echo"]

    async def go():
        instance_id = await echo.start_interaction("r", name="echo", ground_truth="42")
        wrong = await echo.generate_response(instance_id, [{"role": "assistant", "content": "41"}], name="echo")
        right = await echo.generate_response(instance_id, [{"role": "assistant", "content": " 42"}], name="echo")
        await echo.finalize_interaction(instance_id)
        return wrong, right

    wrong, right = asyncio.run(go())
    assert wrong[0] is False and wrong[2] == 0.0
    assert right == (True, "Your response is correct!", 1.0, {})


@pytest.mark.parametrize("text, message", [
    ("interactions: []", "top-level `interaction:`"),
    ("interaction:\n  - name: a\n    config: {}", "interaction\\[0\\]: expected `class_name`"),
    ("interaction:\n  - {name: a, class_name: pyrl.interactions.guess_number.GuessNumberInteraction}\n"
     "  - {name: a, class_name: pyrl.interactions.guess_number.GuessNumberInteraction}",
     "duplicate interaction name 'a'"),
    ("interaction:\n  - {class_name: pyrl.interactions.guess_number.Nope}", "has no Nope"),
])
def test_bad_interaction_configs_name_the_problem(tmp_path, text, message):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises((ValueError, ImportError), match=message):
        initialize_interactions_from_config(str(path))
