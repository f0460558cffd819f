"""Imports point one way: `ir/` imports only itself, `lowering/` only `ir/` and itself."""

import os
import re

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
IMPORT = re.compile(r"^\s*(?:from|import)\s+(piper_jax(?:\.\w+)*)", re.M)


def _imports(folder):
  for dirpath, _, files in os.walk(os.path.join(ROOT, folder)):
    for f in files:
      if f.endswith(".py"):
        path = os.path.join(dirpath, f)
        for module in IMPORT.findall(open(path, encoding="utf-8").read()):
          yield os.path.relpath(path, ROOT), module


@pytest.mark.parametrize("folder,allowed", [("ir", ("piper_jax.ir",)),
                                            ("lowering", ("piper_jax.ir", "piper_jax.lowering"))])
def test_layers_import_only_below(folder, allowed):
  wrong = [(path, m) for path, m in _imports(folder)
           if not any(m == a or m.startswith(a + ".") for a in allowed)]
  assert not wrong, f"{folder}/ imports what sits above it: {wrong}"
