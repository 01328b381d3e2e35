"""The refusal list (zorro_verl/refusals.py), its page (docs/refusals.md) and the package's messages agree: the page is
the generated text, every record's phrase occurs in a string of its module, and every refusal message in the sources
carries a registered phrase (or an exemption with its reason)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from zorro_verl.refusals import EXEMPT, REFUSALS, WHEN, WHERE, markdown

REPO_ROOT = Path(__file__).resolve().parents[1]
PKG = REPO_ROOT / "zorro_verl"
PAGE = REPO_ROOT / "docs" / "refusals.md"
REGENERATE = "python -m zorro_verl.refusals > docs/refusals.md"

#: A raise whose message says how users get around zorro (switch it off, ``warn``) or that a setting is refused.
MARKERS = re.compile(r"on_unsupported|zorro\.enable|enable=false|refus|not supported|unsupported|without zorro|"
                     r"zorro off|disable zorro", re.I)
#: Functions whose string returns are refusal reasons (``*_unsupported`` checks), and helpers that raise one.
REASON_FUNCTIONS = re.compile(r"unsupported|refus")
REFUSE_HELPERS = re.compile(r"_?refuse")


def _text(node) -> str | None:
    """A string expression's text (implicit concatenation is joined by the parser; f-string fields as ``{}``)."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr):
        return "".join(v.value if isinstance(v, ast.Constant) else "{}" for v in node.values)
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        a, b = _text(node.left), _text(node.right)
        return None if a is None and b is None else (a or "{}") + (b or "{}")
    return None


def _strings(node) -> list[str]:
    """The maximal string expressions under ``node`` (longer than a word)."""
    found = [t for n in ast.walk(node) if (t := _text(n)) is not None and len(t) > 12]
    return [t for t in found if not any(t != u and t in u for u in found)]


def _module(path: Path) -> str:
    parts = list(path.relative_to(REPO_ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


SOURCES = {_module(p): p for p in sorted(PKG.rglob("*.py"))}
TREES = {m: ast.parse(p.read_text()) for m, p in SOURCES.items()}


def _message_strings(tree) -> list[str]:
    """Every string expression of a module but its docstrings (a phrase must come from a message)."""
    docs = {id(n.body[0].value) for n in ast.walk(tree)
            if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and n.body
            and isinstance(n.body[0], ast.Expr) and isinstance(n.body[0].value, ast.Constant)}
    return [t for n in ast.walk(tree) if id(n) not in docs and (t := _text(n)) is not None]


def _refusal_messages():
    """``(module, line, message)`` of every refusal message in the package (not its test-support layer)."""
    for mod, tree in TREES.items():
        if mod.startswith("zorro_verl.testing") or mod == "zorro_verl.refusals":
            continue
        func_of = {}
        for f in ast.walk(tree):
            if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef)):
                for n in ast.walk(f):
                    func_of[n] = f.name  # innermost wins: nested functions are walked after their parents
        for n in ast.walk(tree):
            if isinstance(n, ast.Raise) and n.exc is not None:
                for t in _strings(n.exc):
                    if MARKERS.search(t):
                        yield mod, n.lineno, t
            elif isinstance(n, ast.Return) and n.value is not None and REASON_FUNCTIONS.search(func_of.get(n, "")):
                t = _text(n.value)  # a returned reason (not the arguments of a call whose result is returned)
                if t is not None and len(t) > 12:
                    yield mod, n.lineno, t
            elif isinstance(n, ast.Call) and REFUSE_HELPERS.fullmatch(getattr(n.func, "id", "") or ""):
                texts = _strings(n)
                if texts:
                    yield mod, n.lineno, " ".join(texts)


def test_page_is_the_generated_table():
    assert PAGE.read_text() == markdown(), f"docs/refusals.md is stale: run `{REGENERATE}`"


def test_records_are_well_formed():
    keys = [r.key for r in REFUSALS]
    assert len(set(keys)) == len(keys), sorted(k for k in keys if keys.count(k) > 1)
    for r in REFUSALS:
        assert r.where in WHERE, f"{r.key}: where {r.where!r} is not one of {list(WHERE)}"
        assert r.when in WHEN, f"{r.key}: when {r.when!r} is not one of {WHEN}"
        assert r.module in SOURCES, f"{r.key}: module {r.module} does not exist"
        assert "{}" not in r.phrase and len(r.phrase) >= 10, f"{r.key}: phrase {r.phrase!r} too short or has {{}}"
    assert {r.where for r in REFUSALS} == set(WHERE), "an integration without refusals: drop it from WHERE"


def test_every_phrase_is_in_its_module():
    """A changed or removed message breaks this: the record must follow it (or go)."""
    missing = []
    entries = [(r.key, r.module, r.phrase) for r in REFUSALS] + [(f"EXEMPT {k}", *k) for k in EXEMPT]
    for key, module, phrase in entries:
        assert module in TREES, f"{key}: module {module} does not exist"
        if not any(phrase in t for t in _message_strings(TREES[module])):
            missing.append(f"{key}: {phrase!r} is in no string of {module}")
    assert not missing, "\n".join(missing) + "\nupdate the phrase in zorro_verl/refusals.py, then " + REGENERATE


def test_every_refusal_message_is_registered():
    """The other direction: a new refusal in the code needs its record (or an exemption saying why it is none)."""
    phrases: dict[str, list[str]] = {}
    for r in REFUSALS:
        phrases.setdefault(r.module, []).append(r.phrase)
    for mod, phrase in EXEMPT:
        phrases.setdefault(mod, []).append(phrase)
    seen, unregistered = set(), []
    for mod, line, msg in _refusal_messages():
        if any(p in msg for p in phrases.get(mod, ())) or (mod, msg) in seen:
            continue
        seen.add((mod, msg))
        piece = max(msg.split("{}"), key=len).strip()[:60]
        unregistered.append(
            f"{SOURCES[mod].relative_to(REPO_ROOT)}:{line}: {msg[:160]!r}\n"
            f"  add to REFUSALS in zorro_verl/refusals.py (under its integration):\n"
            f"    Refusal(\"<integration>.<name>\", <one of WHERE>, \"<setting>\", \"<why>\", \"<{'|'.join(WHEN)}>\", "
            f"\"{mod}\", {piece!r}),\n"
            f"  or to EXEMPT with the reason it is no refusal; then run `{REGENERATE}`")
    assert not unregistered, f"{len(unregistered)} refusal message(s) not registered:\n" + "\n".join(unregistered)


def test_the_scan_finds_the_known_kinds():
    """The drift check sees raises, ``*_unsupported`` returns and ``_refuse`` calls (else it would pass vacuously)."""
    found = list(_refusal_messages())
    mods = {m for m, _, _ in found}
    assert {"zorro_verl.integrations.transformers.lora", "zorro_verl.integrations.megatron.moe",
            "zorro_verl.integrations.verl.v09.megatron_checks", "zorro_verl.integrations.openrlhf.actor"} <= mods
    assert len(found) > 60
