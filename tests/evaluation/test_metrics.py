"""Answer metrics against values computed by hand (and rouge-score's documented example)."""
import pytest

from hypic.evaluation.metrics import exact_match, first_divergence, normalize, rouge_l, token_f1


def test_normalisation_drops_case_punctuation_and_articles() -> None:
    assert normalize("The  Eiffel-Tower, in an old Paris!") == "eiffeltower in old paris"


def test_exact_match_after_normalisation_against_any_answer() -> None:
    assert exact_match("The Paris.", ["London", "paris"]) == 1.0
    assert exact_match("Paris, France", ["paris"]) == 0.0


def test_token_f1_by_hand() -> None:
    # prediction tokens: eiffel tower in paris (4); gold: eiffel tower paris (3); common 3
    # precision 3/4, recall 1 -> F1 = 2 * 0.75 / 1.75
    assert token_f1("The Eiffel Tower, in Paris!", ["Eiffel Tower Paris"]) == pytest.approx(6 / 7)
    assert token_f1("Paris", ["London", "in Paris"]) == pytest.approx(2 / 3)  # best answer: P 1, R 1/2
    assert token_f1("nothing shared", ["Paris"]) == 0.0
    assert token_f1("a an the", ["the"]) == 0.0  # articles only: no tokens left


def test_rouge_l_is_rouge_scores_documented_example() -> None:
    # LCS of "the quick brown dog jumps on the log" and "the quick brown fox jumps over the lazy dog" is
    # "the quick brown jumps the": 5 tokens; precision 5/8, recall 5/9
    expected = 2 * (5 / 8) * (5 / 9) / (5 / 8 + 5 / 9)
    assert rouge_l("The quick brown dog jumps on the log.", ["The quick brown fox jumps over the lazy dog"]) == \
        pytest.approx(expected)
    assert rouge_l("anything", []) == 0.0


def test_first_divergence() -> None:
    assert first_divergence([1, 2, 3], [1, 2, 3]) is None
    assert first_divergence([1, 5, 3], [1, 2, 3]) == 1
    assert first_divergence([1, 2], [1, 2, 3]) == 2
