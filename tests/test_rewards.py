"""Reward functions: the built-ins' parsing and comparisons, user functions by dotted path, the registry, and
errors that name the setting, row, data_source and function."""
import textwrap

import numpy as np
import pytest

from rollplex_megatron.data import rewards
from rollplex_megatron.data.rewards import (BUILTINS, RewardRegistry, RewardResult, bbox_iou, box_iou,
                                            choice_letter, exact_match, load_function, math_boxed, math_equal,
                                            multiple_choice, parse_box, to_result, with_format_reward)


# --- exact_match -------------------------------------------------------------------------------------------

@pytest.mark.parametrize("response,truth", [
    ("Paris", "Paris"),
    ("  paris.  ", "Paris"),
    ('"The Eiffel   Tower"', "eiffel tower"),
    ("It is red, I think. Answer: Red!", "red"),
    ("<think>maybe blue</think><answer> a cat </answer>", "cat"),
    ("answer: the New York\nbecause it is big", "new york"),
    ("**Two**", ["2", "two"]),
    ("The answer is \\boxed{42}", "42"),
])
def test_exact_match_positives(response, truth):
    assert exact_match(response, truth, {}) == {"score": 1.0, "acc": 1.0, "answered": 1.0}


@pytest.mark.parametrize("response,truth,answered", [
    ("London", "Paris", 1.0),
    ("Paris is the capital", "Paris", 1.0),  # the whole response is the answer when there is no marker
    ("<answer>dog</answer> cat", "cat", 1.0),  # the tag wins over the rest
    ("theater", "ater", 1.0),  # "the" is dropped only as a word
    ("Answer:", "x", 0.0),
    ("...", "x", 0.0),
    ("", "", 0.0),
])
def test_exact_match_negatives(response, truth, answered):
    assert exact_match(response, truth, {}) == {"score": 0.0, "acc": 0.0, "answered": answered}


def test_exact_match_mutation_identity_normaliser_fails(monkeypatch):
    """With the normaliser patched to identity, a case that passed (case, article, punctuation) fails."""
    assert exact_match("The Cat.", "cat", {})["score"] == 1.0
    monkeypatch.setattr(rewards, "normalize_text", lambda s: s)
    assert exact_match("The Cat.", "cat", {})["score"] == 0.0


# --- multiple_choice ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("response,letter", [
    ("\\boxed{B}", "B"),
    ("I pick (A) first but the final is \\boxed{\\text{C}}", "C"),
    ("<answer>d</answer>", "D"),
    ("<answer>(C) the red one</answer>", "C"),
    ("Answer: (B)", "B"),
    ("the answer is e.", "E"),
    ("I think the answer is clearly B because", "B"),
    ("Looking at the image, (C) is right.", "C"),
    ("B. The dog", "B"),
    ("D) none of these", "D"),
    ("My choice: J", "J"),
    ("A dog is sitting; option C fits.", "C"),  # "A" before a lowercase word is an article
    ("I think C", "C"),  # "I" as a pronoun
    ("A is correct", "A"),
    ("I'm sure: F", "F"),
])
def test_choice_letter(response, letter):
    assert choice_letter(response) == letter


@pytest.mark.parametrize("response", [
    "Because it is obvious",  # capitals inside words are not letters
    "ABCD are all wrong",
    "The BEST answer is unclear",
    "option K",  # outside A-J
    "\\Beta and x-B-y",
    "",
])
def test_choice_letter_none(response):
    assert choice_letter(response) is None


@pytest.mark.parametrize("truth", ["B", "b", "(B)", "B. a cat", " (b) a cat", ["A", "B"]])
def test_multiple_choice_ground_truth_forms(truth):
    assert multiple_choice("Answer: B", truth, {}) == {"score": 1.0, "acc": 1.0, "answered": 1.0}


def test_multiple_choice_wrong_and_unanswered():
    assert multiple_choice("\\boxed{C}", "B", {}) == {"score": 0.0, "acc": 0.0, "answered": 1.0}
    assert multiple_choice("Because reasons", "B", {}) == {"score": 0.0, "acc": 0.0, "answered": 0.0}
    # An explicit marker wins over an earlier standalone letter.
    assert multiple_choice("(A) looks tempting, but the answer is B", "B", {})["score"] == 1.0


def test_multiple_choice_bad_ground_truth():
    with pytest.raises(ValueError, match=r"ground_truth 'blue' does not start with a letter A-J"):
        multiple_choice("B", "blue", {})


# --- math_boxed --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("pred,truth", [
    ("\\frac{1}{2}", "0.5"),
    ("\\dfrac{1}{2}", "\\frac12"),
    ("2^3", "8"),
    ("2^{10}", "1024"),
    ("\\left( 3 \\right)", "(3)"),
    ("3.", "3"),
    ("$-4$", "-4"),
    ("1,000", "1000"),
    ("10\\text{ cm}", "10cm"),
    ("50\\%", "50"),
    ("0.333333333", "1/3"),
    ("2\\sqrt{2}", "\\sqrt{8}"),
    ("\\sqrt[3]{27}", "3"),
    ("3 \\cdot 4", "12"),
    ("6 \\times 7", "42"),
    ("-\\frac{3}{4}", "-0.75"),
    ("\\frac{\\sqrt{3}}{2}", "0.8660254037844386"),
    ("(1+2)(3)", "9"),
    ("x^2+1", "x^2 + 1"),  # symbolic answers match as normalised strings
    ("60^\\circ", "60"),
])
def test_math_equal_positives(pred, truth):
    assert math_equal(pred, truth)


@pytest.mark.parametrize("pred,truth", [
    ("50\\%", "0.5"),  # percentages are not converted
    ("0.5001", "0.5"),
    ("\\frac{1}{3}", "0.33"),
    ("2^3", "9"),
    ("x+1", "1+x"),  # no algebra: only numbers and arithmetic
    ("\\frac{1}{0}", "1"),
    ("9^{9^{9}}", "1"),  # overflows fast instead of hanging
    ("\\sqrt{-1}", "1"),
    ("__import__('os')", "1"),
    ("", ""),
])
def test_math_equal_negatives(pred, truth):
    assert not math_equal(pred, truth)


def test_math_boxed_takes_last_box_with_nested_braces():
    response = "First \\boxed{3}. Then, correcting: \\boxed{\\frac{\\sqrt{4}}{{4}}} is final."
    assert rewards.last_boxed(response) == "\\frac{\\sqrt{4}}{{4}}"
    assert math_boxed(response, "0.5", {}) == {"score": 1.0, "acc": 1.0, "answered": 1.0}
    assert math_boxed(response, "3", {})["score"] == 0.0
    assert math_boxed("\\boxed{12}", ["11", "\\boxed{12}"], {})["score"] == 1.0
    assert math_boxed("\\boxed{7}", 7, {})["score"] == 1.0


def test_math_boxed_unanswered():
    assert math_boxed("the answer is 0.5", "0.5", {}) == {"score": 0.0, "acc": 0.0, "answered": 0.0}
    assert math_boxed("\\boxed{1", "1", {})["answered"] == 0.0  # unclosed


def test_math_boxed_mutation_no_numeric_fallback(monkeypatch):
    """Without the expression evaluator, "2^3" no longer equals "8": the fallback is what matches it."""
    assert math_boxed("\\boxed{2^3}", "8", {})["score"] == 1.0
    monkeypatch.setattr(rewards, "eval_simple", lambda s: None)
    assert math_boxed("\\boxed{2^3}", "8", {})["score"] == 0.0


# --- bbox_iou ----------------------------------------------------------------------------------------------

def test_box_iou_by_hand():
    assert box_iou([0, 0, 10, 10], [0, 0, 10, 10]) == 1.0
    assert box_iou([0, 0, 10, 10], [10, 0, 20, 10]) == 0.0  # touching edges
    assert box_iou([0, 0, 10, 10], [5, 0, 15, 10]) == pytest.approx(50 / 150)
    assert box_iou([0, 0, 10, 10], [2, 2, 6, 6]) == pytest.approx(16 / 100)
    assert box_iou([0, 0, 4, 4], [2, 2, 6, 6]) == pytest.approx(4 / 28)


@pytest.mark.parametrize("response,box", [
    ("[10, 20, 30, 40]", [10, 20, 30, 40]),
    ("The cat is at (1.5, 2, 3.5, 4.25).", [1.5, 2, 3.5, 4.25]),
    ('{"bbox_2d": [[5, 6, 7, 8]], "label": "cat"}', [5, 6, 7, 8]),
    ("<answer>[1, 2, 3, 4]</answer> not [0, 0, 9, 9]", [1, 2, 3, 4]),
    ("top-left (10, 20), bottom-right (30, 40)", [10, 20, 30, 40]),
    ("step (1) then [x1=10, y1=20, x2=30, y2=40]", [10, 20, 30, 40]),  # the 1 of "x1" is no number
])
def test_parse_box(response, box):
    assert parse_box(response) == box


@pytest.mark.parametrize("response", ["no box", "[1, 2, 3]", "[30, 20, 10, 40]", "[1, 1, 1, 5]", "[1e999, 0, 2, 2]"])
def test_parse_box_rejects(response):
    assert parse_box(response) is None


def test_bbox_iou_scores():
    assert bbox_iou("[0, 0, 10, 10]", [0, 0, 10, 10], {}) == {"score": 1.0, "acc": 1.0, "answered": 1.0}
    half = bbox_iou("box: [5, 0, 15, 10]", "[0, 0, 10, 10]", {})
    assert half["score"] == pytest.approx(1 / 3) and half["acc"] == 0.0 and half["answered"] == 1.0
    assert bbox_iou("[5, 0, 15, 10]", [0, 0, 10, 10], {"iou_threshold": 0.3})["acc"] == 1.0
    assert bbox_iou("[10, 10, 5, 5]", [0, 0, 10, 10], {}) == {"score": 0.0, "acc": 0.0, "answered": 0.0}
    assert bbox_iou("nothing", (0, 0, 10, 10), {})["answered"] == 0.0
    assert bbox_iou("[0, 0, 10, 10]", np.array([0, 0, 10, 10]), {})["score"] == 1.0  # parquet gives arrays


def test_bbox_iou_bad_ground_truth():
    with pytest.raises(ValueError, match=r"bbox_iou: ground_truth \[0, 0, 10\] is not a box"):
        bbox_iou("[0, 0, 1, 1]", [0, 0, 10], {})
    with pytest.raises(ValueError, match=r"bbox_iou: ground_truth 'box' is not a box"):
        bbox_iou("[0, 0, 1, 1]", "box", {})


# --- results and the format reward -------------------------------------------------------------------------

def test_to_result_float_and_dict():
    assert to_result(0.7) == RewardResult(0.7, 1.0, 1.0, {})
    assert to_result(0) == RewardResult(0.0, 0.0, 1.0, {})
    assert to_result({"score": -1.0, "pred": "B", "len": 3}) == RewardResult(-1.0, 0.0, 1.0, {"len": 3.0})
    assert to_result({"score": 0.2, "acc": 0, "answered": 0}) == RewardResult(0.2, 0.0, 0.0, {})


def test_with_format_reward():
    fn = with_format_reward(multiple_choice, 0.1)
    assert fn("\\boxed{B}", "B", {}) == {"format": 1.0, "score": 1.1, "acc": 1.0, "answered": 1.0}
    assert fn("\\boxed{C}", "B", {}) == {"format": 1.0, "score": pytest.approx(0.1), "acc": 0.0, "answered": 1.0}
    assert fn("no letter", "B", {})["score"] == 0.0
    assert fn.__name__ == "multiple_choice"


# --- loading and the registry ------------------------------------------------------------------------------

@pytest.fixture
def user_module(tmp_path, monkeypatch):
    """A user reward module `my_rewards` on sys.path."""
    (tmp_path / "my_rewards.py").write_text(textwrap.dedent("""
        def length(response, ground_truth, extra_info):
            return {"score": len(response) / 10, "acc": float(response == ground_truth), "chars": len(response)}

        def boom(response, ground_truth, extra_info):
            return 1 / 0

        def no_score(response, ground_truth, extra_info):
            return {"acc": 1.0}

        def nan(response, ground_truth, extra_info):
            return float("nan")

        def text(response, ground_truth, extra_info):
            return "1.0"

        def one_arg(response):
            return 1.0

        def with_defaults(response, ground_truth=None, extra_info=None, scale=1.0):
            return scale

        def anything(*args, **kwargs):
            return 1.0

        NOT_CALLABLE = 3
    """))
    (tmp_path / "my_pkg").mkdir()
    (tmp_path / "my_pkg" / "__init__.py").write_text("")
    (tmp_path / "my_pkg" / "scoring.py").write_text("def half(response, ground_truth, extra_info):\n    return 0.5\n")
    (tmp_path / "broken_rewards.py").write_text("def f(:\n")
    (tmp_path / "exits_on_import.py").write_text("raise SystemExit(3)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    return "my_rewards"


def test_load_function_builtins_and_dotted(user_module):
    assert load_function("math_boxed", "reward.fn") is math_boxed
    fn = load_function(f"{user_module}:length", "reward.fn")
    assert fn("abcde", "abcde", {}) == {"score": 0.5, "acc": 1.0, "chars": 5}
    with pytest.raises(ValueError, match=r"^reward\.fn='math:sqrt': sqrt\(x, /\) cannot be called as fn\("):
        load_function("math:sqrt", "reward.fn")  # importable, callable, but not with a reward's three arguments
    assert load_function("my_pkg.scoring:half", "reward.fn")("x", "y", {}) == 0.5


@pytest.mark.parametrize("spec,match", [
    ("no_such_pkg.mod:fn", r"^reward\.fn='no_such_pkg\.mod:fn': cannot import module 'no_such_pkg\.mod' "
                           r"\(ModuleNotFoundError: No module named 'no_such_pkg'\); put it on PYTHONPATH"),
    ("my_rewards:missing", r"^reward\.fn='my_rewards:missing': 'my_rewards' has no attribute 'missing'"),
    ("my_rewards:NOT_CALLABLE", r"'NOT_CALLABLE' is a int, not callable"),
    ("exact", r"^reward\.fn='exact' is neither a built-in \(exact_match, multiple_choice, math_boxed, bbox_iou\)"),
    ("my_rewards:", r"nor 'package\.module:function'"),
    ("broken_rewards:f", r"cannot import module 'broken_rewards' \(SyntaxError: .*\); put it on PYTHONPATH"),
])
def test_load_function_errors(user_module, spec, match):
    with pytest.raises(ValueError, match=match) as info:
        load_function(spec, "reward.fn")
    assert "\n" not in str(info.value)


def test_registry_fn_applies_to_every_row(user_module):
    reg = RewardRegistry(fn=f"{user_module}:length")
    reg.check(["anything", "math_boxed"], "train.parquet")
    assert reg.score("abc", "abc", {}, "anything", "r0") == RewardResult(0.3, 1.0, 1.0, {"chars": 3.0})
    assert reg.score("ab", "x", None, "anything", "r1").score == 0.2  # a row without extra_info


def test_registry_fn_overrides_fns(user_module):
    reg = RewardRegistry(fn=f"{user_module}:length", fns={"geo": "math_boxed"})
    assert reg.spec_for("geo") == "my_rewards:length"
    assert reg.score("abc", "0.5", {}, "geo", "r0").score == pytest.approx(0.3)


def test_registry_per_source_and_builtin_names(user_module):
    reg = RewardRegistry(fns={"geo": "math_boxed", "mine": f"{user_module}:length"})
    assert reg.score("\\boxed{\\frac{1}{2}}", "0.5", {}, "geo", "r0").acc == 1.0
    assert reg.score("abcd", "x", {}, "mine", "r1") == RewardResult(0.4, 0.0, 1.0, {"chars": 4.0})
    assert reg.score("(B)", "B", {}, "multiple_choice", "r2").score == 1.0  # a built-in's own name
    assert reg.spec_for("unknown") is None


def test_registry_format_weight():
    reg = RewardRegistry(format_weight=0.5)
    right, wrong, silent = (reg.score(r, "B", {}, "multiple_choice", "r") for r in ("B.", "(C)", "none"))
    assert right == RewardResult(1.5, 1.0, 1.0, {"format": 1.0})
    assert wrong == RewardResult(0.5, 0.0, 1.0, {"format": 1.0})
    assert silent == RewardResult(0.0, 0.0, 0.0, {"format": 0.0})


def test_registry_missing_source():
    reg = RewardRegistry(fns={"geo": "math_boxed"})
    with pytest.raises(ValueError, match=r"^val\.jsonl: data_source 'chartqa' has no reward function; set "
                                         r"\+reward\.fns=\{chartqa: 'package\.module:function'\} or reward\.fn=\.\.\., "
                                         r"or name a built-in: exact_match"):
        reg.check(["geo", "chartqa", "other"], "val.jsonl")
    with pytest.raises(ValueError, match=r"^train\.parquet row 4: data_source 'chartqa' has no reward function"):
        reg.score("x", "x", {}, "chartqa", "train.parquet row 4")


def test_a_row_without_data_source_is_named_as_such(tmp_path):
    """A missing or null data_source reads as none (not the text 'None'), and the error says the row lacks one."""
    import json

    from rollplex_megatron.data.dataset import load_records

    row = {"prompt": [{"role": "user", "content": "q"}], "reward_model": {"ground_truth": "a"}, "extra_info": {}}
    (tmp_path / "r.jsonl").write_text(json.dumps(row) + "\n" + json.dumps({**row, "data_source": None}) + "\n")
    got = load_records([str(tmp_path / "r.jsonl")], ("prompt", "images", "videos"), "data.train_files")
    assert [r.data_source for r in got] == ["", ""]
    with pytest.raises(ValueError, match=r"^r\.jsonl row 0: the row has no data_source \(the column is missing or "
                                         r"empty\), so no reward function is chosen for it; give each row"):
        RewardRegistry(fns={"geo": "math_boxed"}).check([got[0].data_source], "r.jsonl row 0")


def test_registry_user_function_raises(user_module):
    """A raising reward function is the user's error: one line on the command line, whichever way the command was
    launched (under torchrun the error reaches the command line unwrapped)."""
    from rollplex_megatron.cli import USER_ERRORS
    from rollplex_megatron.user_code import UserCodeError

    reg = RewardRegistry(fns={"geo": f"{user_module}:boom"})
    with pytest.raises(UserCodeError, match=r"^train\.parquet row 17: reward function my_rewards:boom "
                                           r"\(data_source 'geo'\) raised ZeroDivisionError: division by zero$") as e:
        reg.score("x", "x", {}, "geo", "train.parquet row 17")
    assert isinstance(e.value.__cause__, ZeroDivisionError) and isinstance(e.value, USER_ERRORS)


@pytest.mark.parametrize("name,match", [
    ("no_score", r"returned a dict without 'score' \(keys \['acc'\]\)"),
    ("nan", r"returned non-finite score nan"),
    ("text", r"returned score of type str \(want a number\)"),
])
def test_registry_bad_returns(user_module, name, match):
    from rollplex_megatron.user_code import UserCodeError

    reg = RewardRegistry(fn=f"{user_module}:{name}")
    with pytest.raises(UserCodeError, match=rf"^r9: reward function my_rewards:{name} \(data_source 's'\) {match}"):
        reg.score("x", "x", {}, "s", "r9")


def test_registry_config_errors(user_module):
    with pytest.raises(ValueError, match=r"^reward\.fn='nope\.mod:f': cannot import module 'nope\.mod'"):
        RewardRegistry(fn="nope.mod:f")
    with pytest.raises(ValueError, match=r"^reward\.fns\['geo'\]='my_rewards:gone': 'my_rewards' has no attribute"):
        RewardRegistry(fns={"geo": "my_rewards:gone"})
    with pytest.raises(ValueError, match=r"^reward\.fns\['geo'\]='bad' is neither a built-in"):
        RewardRegistry(fn="math_boxed", fns={"geo": "bad"})  # checked even where reward.fn overrides them
    with pytest.raises(ValueError, match=r"reward\.format_reward must be a finite number >= 0, got -1"):
        RewardRegistry(format_weight=-1)
    # a function that cannot take (response, ground_truth, extra_info) fails at start-up, not at the first score
    with pytest.raises(ValueError, match=r"^reward\.fns\['geo'\]='my_rewards:one_arg': one_arg\(response\) cannot "
                                         r"be called as fn\(response, ground_truth, extra_info\); give it those three"):
        RewardRegistry(fns={"geo": "my_rewards:one_arg"})
    with pytest.raises(ValueError, match=r"the part before the colon is a file path, not a module; put the file's "
                                         r"folder on PYTHONPATH and name the module: my_rewards:boom"):
        RewardRegistry(fn="/some/where/my_rewards.py:boom")
    with pytest.raises(ValueError, match=r"^reward\.fn='exits_on_import:f': cannot import module 'exits_on_import'"):
        RewardRegistry(fn="exits_on_import:f")
    assert RewardRegistry(fn="my_rewards:with_defaults").score("x", "y", {}, "s", "r").score == 1.0
    assert RewardRegistry(fn="my_rewards:anything").score("x", "y", {}, "s", "r").score == 1.0


def test_builtins_registry_is_the_contract():
    assert set(BUILTINS) == {"exact_match", "multiple_choice", "math_boxed", "bbox_iou"}
    for name, fn in BUILTINS.items():
        res = to_result(fn("", "[0, 0, 1, 1]" if name == "bbox_iou" else "A", {}))
        assert res.answered == 0.0 and res.score == 0.0, name
