"""The reasoning split: a thinking model's <think> text apart from its answer, whole and streamed in pieces."""

import pytest

from entrypoints.reasoning import ReasoningSplitter, prompt_opens_reasoning, template_thinks


def split(text: str, piece: int, in_reasoning: bool = False) -> tuple[str, str]:
    splitter = ReasoningSplitter(in_reasoning)
    parts = [splitter.feed(text[i : i + piece]) for i in range(0, len(text), piece)] + [splitter.finish()]
    reasoning, content = "".join(p[0] for p in parts), "".join(p[1] for p in parts)
    assert (reasoning, content) == (splitter.reasoning, splitter.content)
    return reasoning, content


@pytest.mark.parametrize("piece", [1, 2, 5, 1000])
@pytest.mark.parametrize(
    "text, in_reasoning, expected",
    [
        ("<think>\nThe user wants 2+2.\n</think>\n\nIt is 4.", False, ("The user wants 2+2.\n", "It is 4.")),
        ("It is 4, with no <think> at the start.", False, ("", "It is 4, with no <think> at the start.")),
        ("The prompt opened it.\n</think>\n\nAnswer.", True, ("The prompt opened it.\n", "Answer.")),
        ("<think>\nCut off by max_tok", False, ("Cut off by max_tok", "")),
        ("<thin", False, ("", "<thin")),
        ("  <think>a < b </thinking> still</think>done", False, ("a < b </thinking> still", "done")),
        ("", True, ("", "")),
    ],
)
def test_reasoning_is_split_from_the_answer(text, in_reasoning, expected, piece):
    assert split(text, piece, in_reasoning) == expected


def test_templates_and_prompts_that_think():
    assert template_thinks("{{ '<think>\\n\\n</think>\\n\\n' }}") and not template_thinks("{{ messages }}")
    assert prompt_opens_reasoning("<｜Assistant｜><think>\n")
    assert not prompt_opens_reasoning("<|im_start|>assistant\n<think>\n\n</think>\n\n")
