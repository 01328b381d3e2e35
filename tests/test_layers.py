"""The package's layering (docs/design/layering.md), checked on the source: which folder may import what, no import
cycle, and which modules may act at import time. Every import counts, also the ones inside functions."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

from tests.support import HANG_TIMEOUT_S

PKG = Path(__file__).resolve().parents[1] / "zorro_verl"

#: Layer of a module = the first matching prefix. Arrows point down this list: a layer may import itself and the
#: zorro_verl layers named in ALLOWED, plus the third-party packages named there (the standard library always).
LAYERS = [
    ("zorro_verl.packing", "packing"),
    ("zorro_verl.logprob", "logprob"),
    ("zorro_verl.attention", "attention"),
    ("zorro_verl.recurrent", "recurrent"),
    ("zorro_verl.integrations.transformers", "transformers"),
    ("zorro_verl.integrations.verl", "verl"),
    ("zorro_verl.integrations.openrlhf", "openrlhf"),
    ("zorro_verl.integrations.megatron", "megatron"),
    ("zorro_verl.integrations.trl", "trl"),
    ("zorro_verl.integrations", "integrations"),
    ("zorro_verl.api", "api"),
    ("zorro_verl.testing", "testing"),
    ("zorro_verl.bench", "bench"),
    ("zorro_verl.demo", "entry"),
    ("zorro_verl.cli", "entry"),
    ("zorro_verl.doctor", "entry"),
    ("zorro_verl.configs", "data"),
    ("zorro_verl.refusals", "refusals"),
    ("zorro_verl", "root"),
]
CORE = {"packing", "logprob", "attention", "recurrent"}
ALLOWED = {
    "packing": ({"packing"}, {"torch"}),
    "logprob": ({"logprob"}, {"torch"}),
    # flash-attn only lazily, inside functions (checked below)
    "attention": ({"attention", "packing"}, {"torch", "flash_attn", "flash_attn_interface"}),
    "recurrent": ({"recurrent", "packing"}, {"torch"}),
    "transformers": (CORE | {"transformers", "integrations"}, {"torch", "transformers", "peft"}),
    "integrations": ({"integrations"}, set()),
    "api": (CORE | {"transformers", "api"}, {"torch"}),
    # the Megatron engine subclass (v09/megatron_engine.py) imports megatron-core and the megatron layer; Ray only
    # lazily (the trainer-side metrics hook reads a non-blocking worker call's per-rank futures, as verl does)
    "verl": (CORE | {"transformers", "verl", "integrations", "megatron"},
             {"torch", "verl", "wrapt", "omegaconf", "megatron", "ray"}),
    # OpenRLHF, Ray, transformers only lazily; of the verl layer only its verl-free settings and common (checked below)
    "openrlhf": (CORE | {"transformers", "verl", "integrations", "openrlhf"},
                 {"torch", "openrlhf", "wrapt", "ray", "transformers"}),
    # Hugging Face TRL's GRPOTrainer; of the verl layer only its verl-free settings (checked below)
    "trl": (CORE | {"transformers", "verl", "integrations", "trl"}, {"torch", "trl", "transformers", "peft"}),
    # megatron-core's GPTModel (no verl, no transformers: the engine subclass lives in the verl layer)
    "megatron": (CORE | {"megatron"}, {"torch", "megatron"}),
    "root": ({"api", "packing", "root"}, set()),
    "data": (set(), set()),  # the Hydra presets: package data, no code
    # the refusal list: data at the bottom, imports nothing of the package; every layer may import it (below)
    "refusals": (set(), set()),
    "testing": (None, None),  # may use anything
    "bench": (None, None),
    "entry": (None, None),
}
#: Who may import the test/benchmark support: only themselves and the command-line entry points.
SUPPORT_IMPORTERS = {"testing": {"testing", "bench", "entry"}, "bench": {"bench", "entry"}}
LAZY_ONLY = {"flash_attn", "flash_attn_interface", "transformers", "peft", "wrapt", "openrlhf", "ray"}
#: The verl-layer modules the OpenRLHF integration may import: they import no verl (the shared settings and refusals).
VERL_FREE = {"zorro_verl.integrations.verl.settings", "zorro_verl.integrations.verl.common"}


def _module_name(path: Path) -> str:
    rel = path.relative_to(PKG.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


MODULES = {_module_name(p): p for p in sorted(PKG.rglob("*.py"))}


def _layer(mod: str) -> str:
    for prefix, layer in LAYERS:
        if mod == prefix or mod.startswith(prefix + "."):
            return layer
    raise AssertionError(f"module {mod} is in no layer: add its folder to LAYERS")


def _resolve(mod: str, node: ast.ImportFrom) -> str:
    if node.level == 0:
        return node.module or ""
    base = mod.split(".")
    if not MODULES[mod].name == "__init__.py":
        base = base[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _imports(mod: str):
    """``(imported module, lineno, top_level)`` of every import in ``mod``; ``from pkg import sub`` resolves to the
    submodule when ``sub`` is one."""
    tree = ast.parse(MODULES[mod].read_text())
    top = {id(n) for n in tree.body}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                yield a.name, node.lineno, id(node) in top
        elif isinstance(node, ast.ImportFrom):
            target = _resolve(mod, node)
            for a in node.names:
                sub = f"{target}.{a.name}"
                yield (sub if sub in MODULES else target), node.lineno, id(node) in top


def _third_party(name: str) -> str | None:
    root = name.split(".")[0]
    if root in ("zorro_verl", "__future__") or root in sys.stdlib_module_names:
        return None
    return root


def test_every_module_is_in_a_layer():
    assert len(MODULES) > 40
    for mod in MODULES:
        _layer(mod)


@pytest.mark.parametrize("mod", sorted(MODULES))
def test_imports_follow_the_layers(mod):
    layer = _layer(mod)
    own_ok, third_ok = ALLOWED[layer]
    for name, line, top in _imports(mod):
        where = f"{MODULES[mod].relative_to(PKG.parent)}:{line} imports {name}"
        third = _third_party(name)
        if third is not None:
            if third_ok is not None:
                assert third in third_ok, f"{where}: layer {layer!r} may import only {sorted(third_ok)}"
            if third in LAZY_ONLY and layer in CORE | {"transformers", "verl", "openrlhf", "api", "root"}:
                assert not top, f"{where}: optional dependency imported at module level (import it lazily)"
            continue
        if not name.startswith("zorro_verl"):
            continue
        target = _layer(name)
        if own_ok is not None and target != "refusals":
            assert target in own_ok, f"{where}: layer {layer!r} may import only {sorted(own_ok)}"
        if layer == "trl" and target == "verl":
            assert name in VERL_FREE, f"{where}: the TRL integration may import only {sorted(VERL_FREE)} of verl's"
        if layer == "openrlhf" and target == "verl":
            assert name in VERL_FREE, f"{where}: the OpenRLHF integration may import only {sorted(VERL_FREE)} of verl's"
        if target in SUPPORT_IMPORTERS:
            assert layer in SUPPORT_IMPORTERS[target], f"{where}: only {sorted(SUPPORT_IMPORTERS[target])} may " \
                                                       f"import {target!r}"


def test_no_import_cycle():
    """Between modules (a package's ``__init__`` re-exports are glue: an import of ``pkg.sub`` is an edge to
    ``pkg.sub`` only), counting imports inside functions too."""
    graph = {m: {n for n, _, _ in _imports(m) if n in MODULES and n != m} for m in MODULES}
    for m in MODULES:
        if m.endswith("__init__") or MODULES[m].name == "__init__.py":
            graph[m] = set()  # re-exports only
    state: dict[str, int] = {}

    def visit(m, stack):
        state[m] = 1
        for n in graph[m]:
            if state.get(n) == 1:
                raise AssertionError("import cycle: " + " -> ".join(stack[stack.index(n):] + [n]))
            if n not in state:
                visit(n, stack + [n])
        state[m] = 2

    for m in MODULES:
        if m not in state:
            visit(m, [m])


def test_only_the_plugins_act_at_import_time():
    """In the verl integration a module-level call is allowed only in the one plugin module of each generation."""
    allowed = {"zorro_verl.integrations.verl.v09.plugin", "zorro_verl.integrations.verl.v07.plugin"}
    acting = set()
    for mod, path in MODULES.items():
        if not mod.startswith("zorro_verl.integrations.verl"):
            continue
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.Expr) and isinstance(node.value, ast.Call):
                acting.add(mod)
            if isinstance(node, ast.If):  # e.g. `if ...: register()` at module level
                if any(isinstance(n, ast.Call) for s in node.body for n in ast.walk(s) if isinstance(s, ast.Expr)):
                    acting.add(mod)
    assert acting == allowed


def test_core_imports_without_transformers_or_verl():
    import subprocess

    code = ("import sys, zorro_verl, zorro_verl.api, zorro_verl.integrations.transformers, "
            "zorro_verl.integrations.verl.settings, zorro_verl.integrations.verl.common, "
            "zorro_verl.integrations.openrlhf.settings, zorro_verl.integrations.openrlhf.layout, "
            "zorro_verl.integrations.openrlhf.boot\n"
            "bad = sorted(m for m in ('transformers', 'verl', 'flash_attn', 'openrlhf') if m in sys.modules)\n"
            "assert not bad, bad\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=HANG_TIMEOUT_S)
    assert out.returncode == 0, out.stderr[-2000:]
