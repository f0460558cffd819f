"""Imports point one way: `ir/` imports only itself, `lowering/` only `ir/` and itself, the
planner reaches the lowering only through `piper_jax.lowering`'s public names, and no
function imports a module of the package (a cycle is resolved by the modules' layout,
not hidden in a function)."""

import ast
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The package's source folders: piper_jax.ir and piper_jax.lowering live at the top.
PACKAGE = ("piper_jax", "ir", "lowering")
LOWERING_MODULES = {f[:-3] for f in os.listdir(os.path.join(ROOT, "lowering"))
                    if f.endswith(".py") and f != "__init__.py"}


def _trees(folder: str):
  """(path relative to the root, parsed module) of every Python file under `folder`."""
  for dirpath, _, files in os.walk(os.path.join(ROOT, folder)):
    for f in sorted(files):
      if f.endswith(".py"):
        path = os.path.join(dirpath, f)
        with open(path, encoding="utf-8") as fh:
          yield os.path.relpath(path, ROOT), ast.parse(fh.read(), path)


def _imported(node: ast.AST) -> list[str]:
  """The modules an import statement names: `from a import b` names `a.b` as well as `a`,
  since `b` may be a submodule. A relative import counts as the package's own."""
  if isinstance(node, ast.Import):
    return [a.name for a in node.names]
  if isinstance(node, ast.ImportFrom):
    base = node.module or ""
    if node.level:
      base = "piper_jax" + (f".{base}" if base else "")
    return [base] + [f"{base}.{a.name}" for a in node.names]
  return []


def _imports(folder: str):
  for path, tree in _trees(folder):
    for node in ast.walk(tree):
      for module in _imported(node):
        if module == "piper_jax" or module.startswith("piper_jax."):
          yield path, module


@pytest.mark.parametrize("folder,allowed", [("ir", ("piper_jax.ir",)),
                                            ("lowering", ("piper_jax.ir", "piper_jax.lowering"))])
def test_layers_import_only_below(folder, allowed):
  wrong = [(path, m) for path, m in _imports(folder)
           if not any(m == a or m.startswith(a + ".") for a in allowed)]
  assert not wrong, f"{folder}/ imports what sits above it: {wrong}"


def test_the_planner_reaches_the_lowering_only_through_its_package():
  found = list(_imports("piper_jax/planner"))
  assert any(m == "piper_jax.lowering" for _, m in found)  # the check sees its imports
  wrong = [(path, m) for path, m in found if m.startswith("piper_jax.lowering.")
           and m.split(".")[2] in LOWERING_MODULES]
  assert not wrong, f"the planner imports the lowering's modules, not its public names: {wrong}"


def test_no_function_imports_a_module_of_the_package():
  wrong = []
  for folder in PACKAGE:
    for path, tree in _trees(folder):
      for fn in ast.walk(tree):
        if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
          continue
        for node in ast.walk(fn):
          if any(m == "piper_jax" or m.startswith("piper_jax.") for m in _imported(node)):
            wrong.append(f"{path}:{node.lineno}")
  assert not wrong, f"imports of the package inside functions: {wrong}"
