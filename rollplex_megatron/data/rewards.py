"""Reward functions for VLM RL datasets in verl's format, a loader for user ones, and a per-source registry.

Rows carry `data_source`, `reward_model = {"ground_truth": ..., "style": "rule"}` and `extra_info`. Every
reward function, built-in or user's (named "package.module:function" by `reward.fn` / `reward.fns`), is

    fn(response: str, ground_truth, extra_info: dict) -> float | dict

A float is the score. A dict has at least "score"; optional "acc" (correctness, 0/1) and "answered" (0/1:
a parsable answer was given); its other numeric keys are extra metrics (non-numeric ones are ignored).
Without "acc", acc = 1.0 if score > 0 else 0.0; without "answered", answered = 1.0.
A user function runs in a worker process (rollplex_megatron/user_code.py: its arguments and result are pickled),
at most `reward.timeout_s` seconds per response.

Built-ins: `exact_match`, `multiple_choice`, `math_boxed`, `bbox_iou` (each documents its parsing).
"""
from __future__ import annotations

import ast
import difflib
import functools
import importlib
import inspect
import json
import math
import numbers
import operator
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from fractions import Fraction
from typing import Any

from rollplex_megatron.user_code import UserCodeError, UserCodeStopped, UserCodeTimeout, UserFunctions

RewardFn = Callable[[str, Any, dict], "float | dict"]


# --- Shared parsing ---------------------------------------------------------------------------------------------------
_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.IGNORECASE | re.DOTALL)
_ANSWER_COLON = re.compile(r"\banswer\s*[:：]", re.IGNORECASE)
_EDGE_PUNCT = " \t\r\n.,;:!?\"'`()[]{}<>*_“”‘’«»"
_ARTICLE = re.compile(r"^(?:a|an|the)\s+")
_WRAPPERS = ("text", "textbf", "textrm", "mathrm", "mathbf", "mbox")
_WRAPPER = re.compile(r"\\(?:" + "|".join(_WRAPPERS) + r")\s*(?=\{)")
_BOXED = re.compile(r"\\boxed\s*(?=\{)")
_BRACE = re.compile(r"[{}]")


def _brace_pairs(text: str) -> dict[int, int]:
    """Index of each "{" -> index of its "}" (unclosed ones absent)."""
    # One pass for all braces: a degenerate response of thousands of unclosed "\boxed{" stays linear.
    pairs, stack = {}, []
    for m in _BRACE.finditer(text):
        if m.group() == "{":
            stack.append(m.start())
        elif stack:
            pairs[stack.pop()] = m.start()
    return pairs


def _unwrap(text: str) -> str:
    """`\\text{content}` (and the other `_WRAPPERS`) -> `content`, nested braces inside kept."""
    pairs, drop = None, set()
    for m in _WRAPPER.finditer(text):
        pairs = _brace_pairs(text) if pairs is None else pairs
        if m.end() in pairs:  # drop "\text{" and its "}": the other braces keep their pairs
            drop.update(range(m.start(), m.end() + 1), (pairs[m.end()],))
    return "".join(ch for i, ch in enumerate(text) if i not in drop) if drop else text


def last_boxed(text: str) -> str | None:
    """The content of the last balanced `\\boxed{...}` (nested braces kept), or None."""
    starts = [m.end() for m in _BOXED.finditer(text)]
    pairs = _brace_pairs(text) if starts else {}
    found = [start for start in starts if start in pairs]
    return text[found[-1] + 1:pairs[found[-1]]] if found else None


def answer_section(text: str) -> str:
    """The part of a response that holds its answer: the last <answer>...</answer>, else the last \\boxed{...},
    else the rest of the line after the last "answer:", else the whole response."""
    tags = _ANSWER_TAG.findall(text)
    if tags:
        return tags[-1]
    boxed = last_boxed(text)
    if boxed is not None:
        return boxed
    marks = list(_ANSWER_COLON.finditer(text))
    if marks:
        rest = text[marks[-1].end():].strip()
        return rest.splitlines()[0] if rest else ""
    return text


def normalize_text(text: str) -> str:
    """Lowercase, collapse whitespace, strip surrounding punctuation/quotes and a leading a/an/the."""
    text = re.sub(r"\s+", " ", text.lower()).strip(_EDGE_PUNCT)
    return _ARTICLE.sub("", text).strip(_EDGE_PUNCT)


def _result(hit: bool, answered: bool) -> dict:
    """The dict a built-in returns: score = acc = hit."""
    return {"score": float(hit), "acc": float(hit), "answered": float(answered)}


def _as_list(ground_truth: Any) -> list:
    """A ground truth as a list of acceptable answers (a str or number is one answer)."""
    return [ground_truth] if isinstance(ground_truth, (str, numbers.Number)) else list(ground_truth)


# --- exact_match ------------------------------------------------------------------------------------------------------
def exact_match(response: str, ground_truth: Any, extra_info: dict) -> dict:
    """1 when the response's answer section equals one of the ground truths after `normalize_text`."""
    pred = normalize_text(answer_section(response))
    hit = any(pred == normalize_text(str(gt)) for gt in _as_list(ground_truth))
    return _result(hit and bool(pred), bool(pred))


# --- multiple_choice --------------------------------------------------------------------------------------------------
# A capital A-J standing alone: not part of a word, a number, a LaTeX command or a contraction ("I'm").
_LONE_LETTER = re.compile(r"(?<![A-Za-z0-9\\'’-])(\()?([A-J])(\))?(?![A-Za-z0-9'’-])")
_WORD_AFTER = re.compile(r"\s+([a-z]+)")
_SOLE_LETTER = re.compile(r"\W*([A-Ja-j])\W*")
_LEADING_LETTER = re.compile(r"\s*\(?([A-Ja-j])[).:]")
_ANSWER_IS = re.compile(r"\banswers?\b(?:\s+is)?\s*[:：]?(.*)", re.IGNORECASE)


def _lone_letter(text: str) -> str | None:
    """The first standalone capital letter; a bare "A"/"I" before a lowercase word is an article/pronoun
    ("A dog", "I think"), unless that word is "is" ("A is correct")."""
    for m in _LONE_LETTER.finditer(text):
        bare = not (m.group(1) or m.group(3))
        word = _WORD_AFTER.match(text, m.end())
        if bare and m.group(2) in "AI" and word and word.group(1) != "is":
            continue
        return m.group(2)
    return None


def _letter_in(section: str) -> str | None:
    """The letter of a marked answer section: a sole letter (any case), a leading "b)"/"(b)"/"b.", else the
    first standalone capital letter."""
    section = _unwrap(section)
    m = _SOLE_LETTER.fullmatch(section) or _LEADING_LETTER.match(section)
    return m.group(1).upper() if m else _lone_letter(section)


def choice_letter(response: str) -> str | None:
    """The chosen letter A-J, by priority: the last \\boxed{...}, the last <answer>...</answer>, the line after
    the last "answer:" / "answer is", then the first standalone letter of the response ("(B)", "B.", "B)", "B")."""
    tags = _ANSWER_TAG.findall(response)
    marks = list(_ANSWER_IS.finditer(response))
    for section in (last_boxed(response), tags[-1] if tags else None, marks[-1].group(1) if marks else None):
        letter = _letter_in(section) if section is not None else None
        if letter:
            return letter
    return _lone_letter(response)


def _gt_letter(ground_truth: Any) -> str:
    """The letter of a ground truth "B", "(b)" or "B. text"; ValueError when it has none."""
    m = re.match(r"\s*\(?([A-Ja-j])(?![A-Za-z0-9])", str(ground_truth))
    if not m:
        raise ValueError(f"multiple_choice: ground_truth {ground_truth!r} does not start with a letter A-J")
    return m.group(1).upper()


def multiple_choice(response: str, ground_truth: Any, extra_info: dict) -> dict:
    """1 when the chosen letter (`choice_letter`) is the ground truth's (or one of a list's); answered=0 if none."""
    letter = choice_letter(response)
    hit = letter is not None and letter in {_gt_letter(gt) for gt in _as_list(ground_truth)}
    return _result(hit, letter is not None)


# --- math_boxed -------------------------------------------------------------------------------------------------------
_NUMBER = r"[-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?"
_MAX_EXPR = 256  # longer "expressions" are not simple; refusing them bounds parse time
_MAX_ANSWER = 1000  # longer answers are compared as strings only (the number regexes backtrack on long digit runs)


def normalize_math(text: str) -> str:
    """Strip spaces, $, \\left/\\right, \\! and thin spaces, \\% and degrees, a trailing "."; unwrap \\text{...};
    \\dfrac/\\tfrac -> \\frac."""
    text = _unwrap(text)
    text = re.sub(r"\\[dt]frac(?![A-Za-z])", r"\\frac", text)
    text = re.sub(r"\\(?:left|right)(?![A-Za-z])", "", text)
    text = re.sub(r"\\[!,;: ]", "", text)
    for junk in ("$", "\\%", "%", "^{\\circ}", "^\\circ"):
        text = text.replace(junk, "")
    return re.sub(r"\s+", "", text).rstrip(".")


def _parse_number(text: str) -> Fraction | None:
    """An int, decimal, "1,000", "a/b" or "\\frac{a}{b}" (of plain numbers) as an exact fraction, else None."""
    if re.fullmatch(r"[-+]?\d{1,3}(?:,\d{3})+(?:\.\d+)?", text):
        text = text.replace(",", "")
    m = (re.fullmatch(rf"({_NUMBER})/({_NUMBER})", text)
         or re.fullmatch(rf"([-+]?)\\frac\{{({_NUMBER})\}}\{{({_NUMBER})\}}", text))
    try:
        if m is None:
            return Fraction(text) if re.fullmatch(_NUMBER, text) else None
        *sign, num, den = m.groups()
        value = Fraction(num) / Fraction(den)
        return -value if sign == ["-"] else value
    except (ValueError, ZeroDivisionError):
        return None


def _latex_arg(text: str, i: int) -> tuple[str, int]:
    """The argument of a LaTeX command at `text[i]`: a brace group or one character (as in `\\frac12`)."""
    if text.startswith("{", i):
        close = _brace_pairs(text).get(i)
        if close is not None:
            return text[i + 1:close], close + 1
    elif i < len(text):
        return text[i], i + 1
    raise ValueError("missing or unclosed argument")


def _latex_command(text: str, i: int) -> tuple[str, int]:
    """Python for the LaTeX command at `text[i]` ("\\"), and the index after it; ValueError for unsupported ones."""
    name = re.match(r"\\([A-Za-z]+)", text[i:])
    if name is None:
        raise ValueError(f"unsupported LaTeX at {text[i:i + 2]!r}")
    j = i + len(name.group(0))
    if name.group(1) in ("cdot", "times", "div"):
        return ("/" if name.group(1) == "div" else "*"), j
    if name.group(1) == "frac":
        num, j = _latex_arg(text, j)
        den, j = _latex_arg(text, j)
        return f"(({latex_to_python(num)})/({latex_to_python(den)}))", j
    if name.group(1) == "sqrt":
        root = None
        if text.startswith("[", j):
            close = text.index("]", j)
            root, j = text[j + 1:close], close + 1
        arg, j = _latex_arg(text, j)
        inner = latex_to_python(arg)
        return (f"sqrt({inner})" if root is None else f"(({inner})**(1/({latex_to_python(root)})))"), j
    raise ValueError(f"unsupported LaTeX command \\{name.group(1)}")


def latex_to_python(text: str) -> str:
    """A normalised LaTeX arithmetic expression as Python source (\\frac, \\sqrt, \\cdot, \\times, ^, braces)."""
    out, i = [], 0
    while i < len(text):
        if text[i] == "\\":
            piece, i = _latex_command(text, i)
        else:
            piece, i = {"^": "**", "{": "(", "}": ")"}.get(text[i], text[i]), i + 1
        out.append(piece)
    # Implicit products ("2\sqrt{3}", "2(3)", ")(") become explicit so `ast` can parse them.
    return re.sub(r"(?<=[0-9.)])(?=\(|sqrt)", "*", "".join(out))


_BINOPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
           ast.Pow: operator.pow}
_UNARY = {ast.USub: operator.neg, ast.UAdd: operator.pos}


def _eval_node(node: ast.AST) -> float:
    """Evaluate numbers, + - * / **, unary signs and sqrt(x); ValueError for anything else."""
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return float(node.value)  # floats: a huge power overflows at once instead of building a huge int
    if isinstance(node, ast.BinOp) and type(node.op) in _BINOPS:
        return _BINOPS[type(node.op)](_eval_node(node.left), _eval_node(node.right))
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_eval_node(node.operand))
    if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "sqrt"
            and len(node.args) == 1 and not node.keywords):
        return math.sqrt(_eval_node(node.args[0]))
    raise ValueError(f"not allowed in a simple expression: {type(node).__name__}")


def eval_simple(text: str) -> float | None:
    """The value of a normalised LaTeX arithmetic expression, or None when it is not one (or does not evaluate)."""
    if not text or len(text) > _MAX_EXPR:
        return None
    try:
        value = _eval_node(ast.parse(latex_to_python(text), mode="eval").body)
    except (ValueError, SyntaxError, ZeroDivisionError, OverflowError, TypeError, MemoryError, RecursionError):
        return None
    # A negative base to a fractional power is complex: not a real answer.
    return value if isinstance(value, float) and math.isfinite(value) else None


def math_equal(pred: str, truth: str) -> bool:
    """Equal after `normalize_math`, else as numbers (relative tolerance 1e-6), else as simple expressions."""
    a, b = normalize_math(pred), normalize_math(truth)
    if a == b or max(len(a), len(b)) > _MAX_ANSWER:
        return a == b and bool(a)
    na, nb = _parse_number(a), _parse_number(b)
    if na is not None and nb is not None:
        return na == nb or _close(na, nb)
    va, vb = eval_simple(a), eval_simple(b)
    return va is not None and vb is not None and _close(va, vb)


def _close(a: float | Fraction, b: float | Fraction) -> bool:
    """Equal within relative tolerance 1e-6 (False when a fraction is too large for a float)."""
    try:
        return math.isclose(a, b, rel_tol=1e-6)
    except OverflowError:
        return False


def math_boxed(response: str, ground_truth: Any, extra_info: dict) -> dict:
    """1 when the last \\boxed{...} of the response `math_equal`s the ground truth (or one of a list);
    answered=0 when there is no \\boxed. A ground truth may itself be boxed."""
    pred = last_boxed(response)
    if pred is None:
        return _result(False, False)
    truths = [last_boxed(str(gt)) or str(gt) for gt in _as_list(ground_truth)]
    return _result(any(math_equal(pred, t) for t in truths), True)


# --- bbox_iou ---------------------------------------------------------------------------------------------------------
_GROUP = re.compile(r"[\[(]([^\[\]()]*)[\])]")
_BOX_NUMBER = re.compile(r"(?<![A-Za-z0-9_.])[-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?")


def _valid_box(box: list[float]) -> bool:
    """Four finite numbers with x2 > x1 and y2 > y1."""
    return len(box) == 4 and all(math.isfinite(v) for v in box) and box[2] > box[0] and box[3] > box[1]


def parse_box(response: str) -> list[float] | None:
    """[x1, y1, x2, y2] from the answer tag (else the response): the first [...] / (...) group with >= 4 numbers
    (its first 4), else the first two groups of 2 ("(x1, y1), (x2, y2)"); None when absent or degenerate."""
    tags = _ANSWER_TAG.findall(response)
    groups = [[float(x) for x in _BOX_NUMBER.findall(g)] for g in _GROUP.findall(tags[-1] if tags else response)]
    box = next((g[:4] for g in groups if len(g) >= 4), None)
    pairs = [g for g in groups if len(g) == 2]
    if box is None and len(pairs) >= 2:
        box = pairs[0] + pairs[1]
    return box if box is not None and _valid_box(box) else None


def box_iou(a: list[float], b: list[float]) -> float:
    """Intersection over union of two valid [x1, y1, x2, y2] boxes."""
    inter = max(0.0, min(a[2], b[2]) - max(a[0], b[0])) * max(0.0, min(a[3], b[3]) - max(a[1], b[1]))
    union = (a[2] - a[0]) * (a[3] - a[1]) + (b[2] - b[0]) * (b[3] - b[1]) - inter
    return inter / union


def _gt_box(ground_truth: Any) -> list[float]:
    """A ground-truth box from a list / array of 4 numbers or a JSON string of one; ValueError when invalid."""
    try:
        box = [float(v) for v in (json.loads(ground_truth) if isinstance(ground_truth, str) else ground_truth)]
    except (TypeError, ValueError):  # json's errors are ValueErrors
        box = []
    if not _valid_box(box):
        raise ValueError(f"bbox_iou: ground_truth {ground_truth!r} is not a box [x1, y1, x2, y2] with x2>x1, y2>y1")
    return box


def bbox_iou(response: str, ground_truth: Any, extra_info: dict) -> dict:
    """score = IoU of the parsed box with the ground truth; acc = IoU >= extra_info["iou_threshold"] (0.5)."""
    truth = _gt_box(ground_truth)
    box = parse_box(response)
    if box is None:
        return {"score": 0.0, "acc": 0.0, "answered": 0.0}
    iou = box_iou(box, truth)
    return {"score": iou, "acc": float(iou >= extra_info.get("iou_threshold", 0.5)), "answered": 1.0}


BUILTINS: dict[str, RewardFn] = {"exact_match": exact_match, "multiple_choice": multiple_choice,
                                 "math_boxed": math_boxed, "bbox_iou": bbox_iou}


def _answers(ground_truth: Any) -> list:
    """The acceptable answers of a text ground truth: a str or number, or a non-empty list of them."""
    if isinstance(ground_truth, (list, tuple)):
        answers = list(ground_truth)
    else:
        answers = [ground_truth]
    if not answers or not all(isinstance(a, (str, numbers.Number)) and not isinstance(a, bool) for a in answers):
        raise ValueError(f"ground_truth {ground_truth!r} is not a string or number, or a non-empty list of them")
    return answers


def _iou_threshold(extra_info: dict) -> None:
    t = extra_info.get("iou_threshold", 0.5)
    if not isinstance(t, numbers.Real) or isinstance(t, bool) or not 0 <= t <= 1:
        raise ValueError(f"extra_info.iou_threshold {t!r} is not a number in [0, 1]")


# What each built-in reads from a row, checked when the dataset is loaded (the functions check it again, per
# response, mid-run): a ValueError says what is wrong.
GROUND_TRUTH_CHECKS: dict[str, Callable[[Any, dict], None]] = {
    "exact_match": lambda gt, info: _answers(gt),
    "math_boxed": lambda gt, info: _answers(gt),
    "multiple_choice": lambda gt, info: [_gt_letter(a) for a in _answers(gt)],
    "bbox_iou": lambda gt, info: (_gt_box(gt), _iou_threshold(info)),
}


# --- Results, the format reward, loading, the registry ----------------------------------------------------------------
@dataclass(frozen=True)
class RewardResult:
    """One response's reward, correctness (0/1), whether it gave a parsable answer (0/1), and extra metrics."""

    score: float
    acc: float
    answered: float
    extra: dict[str, float] = field(default_factory=dict)


def _finite(value: Any, key: str) -> float:
    """`value` as a finite float; TypeError/ValueError naming `key` otherwise."""
    if not isinstance(value, numbers.Real):
        raise TypeError(f"{key} of type {type(value).__name__} (want a number)")
    if not math.isfinite(float(value)):
        raise ValueError(f"non-finite {key} {value!r}")
    return float(value)


def to_result(out: Any) -> RewardResult:
    """A reward function's return (float or dict, see the module docstring) as a RewardResult."""
    if isinstance(out, dict):
        if "score" not in out:
            raise ValueError(f"a dict without 'score' (keys {sorted(map(str, out))})")
        score = _finite(out["score"], "score")
        acc = _finite(out.get("acc", float(score > 0)), "acc")
        answered = _finite(out.get("answered", 1.0), "answered")
        extra = {str(k): _finite(v, str(k)) for k, v in out.items()
                 if k not in ("score", "acc", "answered") and isinstance(v, numbers.Real)}
        return RewardResult(score, acc, answered, extra)
    score = _finite(out, "score")
    return RewardResult(score, float(score > 0), 1.0)


def with_format_reward(fn: RewardFn, weight: float) -> RewardFn:
    """`fn` with `weight * answered` added to its score (acc and answered kept; extra "format" = answered)."""
    weight = _finite(weight, "format weight")

    @functools.wraps(fn)
    def scored(response: str, ground_truth: Any, extra_info: dict) -> dict:
        """`fn`'s result with the format reward added."""
        res = to_result(fn(response, ground_truth, extra_info))
        return {**res.extra, "format": res.answered, "score": res.score + weight * res.answered,
                "acc": res.acc, "answered": res.answered}

    return scored


def _one_line(e: BaseException) -> str:
    """An exception as "Type: message" on one line."""
    return " ".join(f"{type(e).__name__}: {e}".split())


def load_function(spec: str, setting: str) -> RewardFn:
    """The callable named by `spec` (a built-in name or "package.module:function"); one-line ValueErrors name
    `setting` and the fix."""
    if spec in BUILTINS:
        return BUILTINS[spec]
    module_name, _, attr = str(spec).partition(":")
    if not module_name or not attr:
        raise ValueError(f"{setting}={spec!r} is neither a built-in ({', '.join(BUILTINS)}) nor "
                         "'package.module:function'; use one of those forms")
    if "/" in module_name or "\\" in module_name or module_name.endswith(".py"):
        stem = module_name.replace("\\", "/").rsplit("/", 1)[-1].removesuffix(".py")
        raise ValueError(f"{setting}={spec!r}: the part before the colon is a file path, not a module; put the "
                         f"file's folder on PYTHONPATH and name the module: {stem}:{attr}")
    try:
        obj = importlib.import_module(module_name)
    except (Exception, SystemExit) as e:  # a broken user module (SyntaxError, ImportError, exit()): the same fix
        raise ValueError(f"{setting}={spec!r}: cannot import module {module_name!r} ({_one_line(e)}); "
                         "put it on PYTHONPATH or fix the module name") from e
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ValueError(f"{setting}={spec!r}: {module_name!r} has no attribute {attr!r}; "
                             "fix the function name after the colon")
        obj = getattr(obj, part)
    if not callable(obj):
        raise ValueError(f"{setting}={spec!r}: {attr!r} is a {type(obj).__name__}, not callable; "
                         "name a function fn(response, ground_truth, extra_info)")
    try:
        signature = inspect.signature(obj)
    except (TypeError, ValueError):  # a callable without an inspectable signature (a C function): called as is
        return obj
    try:
        signature.bind("", None, {})
    except TypeError:
        raise ValueError(f"{setting}={spec!r}: {attr}{signature} cannot be called as fn(response, ground_truth, "
                         "extra_info); give it those three parameters") from None
    return obj


class RewardRegistry:
    """Which reward function scores a row: `fn` for every row when set (it overrides `fns`, as `reward.fn`
    documents), else `fns[data_source]`, else the built-in named by the data_source itself. `format_weight` is
    `reward.format_reward`. Failures while scoring are RuntimeErrors naming the row, the data_source and the
    function. User functions run in a worker process (user_code.py), at most `timeout_s` seconds a call
    (`reward.timeout_s`, 0: no limit); the built-ins run here (their parsing is bounded)."""

    def __init__(self, fn: str = "", fns: dict[str, str] | None = None, format_weight: float = 0.0,
                 timeout_s: float = 60.0):
        """Load every configured function now; bad specs and weights raise ValueErrors naming the setting."""
        fns = dict(fns or {})
        if not (isinstance(format_weight, numbers.Real) and math.isfinite(format_weight) and format_weight >= 0):
            raise ValueError(f"reward.format_reward must be a finite number >= 0, got {format_weight!r}")
        if not (isinstance(timeout_s, numbers.Real) and math.isfinite(timeout_s) and timeout_s >= 0):
            raise ValueError(f"reward.timeout_s must be a finite number of seconds >= 0 (0: no limit), got "
                             f"{timeout_s!r}")
        self.fn, self.fns, self.format_weight, self.timeout_s = fn, fns, float(format_weight), float(timeout_s)
        # Loaded now so a bad spec fails at startup, before any model is built (fns too: a typo there is still one).
        settings = [("reward.fn", fn)] * bool(fn) + [(f"reward.fns[{src!r}]", spec) for src, spec in fns.items()]
        self._loaded = {spec: load_function(spec, setting) for setting, spec in settings}
        self._user = UserFunctions([spec for spec in self._loaded if spec not in BUILTINS])

    def spec_for(self, data_source: str) -> str | None:
        """The spec of the function that scores `data_source`, or None when none does."""
        if self.fn:
            return self.fn
        if data_source in self.fns:
            return self.fns[data_source]
        return data_source if data_source in BUILTINS else None

    def _missing(self, data_source: str, where: str) -> ValueError:
        """The error for a data_source that has no function."""
        if not data_source:
            return ValueError(f"{where}: the row has no data_source (the column is missing or empty), so no reward "
                              f"function is chosen for it; give each row a data_source (a built-in: "
                              f"{', '.join(BUILTINS)}, or a +reward.fns key), or set reward.fn=... to score every row")
        return ValueError(f"{where}: data_source {data_source!r} has no reward function; set "
                          f"+reward.fns={{{data_source}: 'package.module:function'}} or reward.fn=..., "
                          f"or name a built-in: {', '.join(BUILTINS)}")

    def check_fns_used(self, data_sources: set[str], files: str) -> None:
        """Every `reward.fns` key names a data_source of the rows (`files`): a key that scores no row is a typo, and
        its rows would be scored by another function without a word (none when `reward.fn` scores them all)."""
        if self.fn:
            return
        for src in self.fns:
            if src not in data_sources:
                close = difflib.get_close_matches(src, sorted(data_sources), n=1)
                hint = f"did you mean {close[0]!r}? " if close else ""
                raise ValueError(f"reward.fns names data_source {src!r}, which no row of {files} has (they have "
                                 f"{', '.join(sorted(data_sources))}); {hint}fix the key or drop it")

    def check(self, data_sources: Iterable[str], where: str) -> None:
        """Raise ValueError for the first data_source without a function (`where`: e.g. the file)."""
        for source in data_sources:
            if self.spec_for(source) is None:
                raise self._missing(source, where)

    def check_ground_truth(self, ground_truth: Any, extra_info: dict, data_source: str, where: str) -> None:
        """A row's ground truth and extra_info as its built-in reward function reads them (user functions are
        not called before the run), so a bad row fails when the dataset loads, not when it is first drawn."""
        spec = self.spec_for(data_source)
        check = GROUND_TRUTH_CHECKS.get(spec)
        if check is None:
            return
        try:
            check(ground_truth, extra_info)
        except (TypeError, ValueError) as e:
            raise ValueError(f"{where}: {' '.join(str(e).split())}, for the built-in reward {spec} (data_source "
                             f"{data_source!r}); fix the row, or score it with another function (reward.fns)") from None

    def _call(self, spec: str, data_source: str, args: tuple) -> Any:
        """A built-in's result, computed here, or a user function's, from the worker."""
        if spec in self._user.specs:
            return self._user.call(spec, args, self.timeout_s)
        fn = self._loaded.get(spec) or load_function(spec, f"data_source {data_source!r}")
        return fn(*args)

    def score(self, response: str, ground_truth: Any, extra_info: dict, data_source: str, row: str) -> RewardResult:
        """Score one response (`row` names it in errors, e.g. "train.parquet row 17"), format reward included."""
        spec = self.spec_for(data_source)
        if spec is None:
            raise self._missing(data_source, row)
        where = f"{row}: reward function {spec} (data_source {data_source!r})"
        args = (response, ground_truth, extra_info if extra_info is not None else {})
        try:
            out = self._call(spec, data_source, args)
        except UserCodeTimeout:
            raise UserCodeTimeout(f"{where} did not return within reward.timeout_s={self.timeout_s:g} s and was "
                                  "stopped; make it return sooner, or raise reward.timeout_s (0: no limit)") from None
        except UserCodeStopped as e:
            raise UserCodeStopped(f"{where} {e}; the step was abandoned") from None
        except Exception as e:
            raise UserCodeError(f"{where} raised {_one_line(e)}") from e
        try:
            res = to_result(out)
        except (TypeError, ValueError) as e:
            raise UserCodeError(f"{where} returned {e}; return a float or a dict with a finite 'score'") from e
        if self.format_weight > 0:
            res = replace(res, score=res.score + self.format_weight * res.answered,
                          extra={**res.extra, "format": res.answered})
        return res
