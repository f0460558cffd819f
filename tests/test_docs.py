"""Every code block of README.md and docs/*.md runs as written: a file's Python blocks run
in order in one fresh process (as a reader pastes them), from a scratch folder, on 8
simulated CPU devices. A block marked `<!-- excerpt of PATH -->` must appear line by line
in PATH, so that it cannot drift from the file it shows; one marked `<!-- needs a GPU -->`
is only compiled."""

import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCS = ["README.md"] + sorted(f"docs/{f}" for f in os.listdir(os.path.join(ROOT, "docs"))
                              if f.endswith(".md"))
BLOCK = re.compile(r"(?:<!-- (?P<mark>[^>]*?) -->\n)?```python\n(?P<code>.*?)```", re.S)
# The suite's XLA options (conftest.py: its lowest CPU optimization level, half the
# compile time of these scripts) stay; the devices are set as a reader would set them.
HEADER = """import os
os.environ["JAX_PLATFORMS"] = "cpu"
os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
"""


def _blocks(doc):
  text = open(os.path.join(ROOT, doc), encoding="utf-8").read()
  return [(m.group("mark") or "", m.group("code")) for m in BLOCK.finditer(text)]


@pytest.mark.parametrize("doc", [d for d in DOCS if _blocks(d)])
def test_code_blocks_run(doc, tmp_path):
  runnable = []
  for i, (mark, code) in enumerate(_blocks(doc)):
    compile(code, f"{doc} block {i}", "exec")  # every block is valid Python
    if mark.startswith("excerpt of "):
      source = open(os.path.join(ROOT, mark[len("excerpt of "):]), encoding="utf-8").read()
      same = lambda line: " ".join(line.split())  # spacing before a comment may differ
      lines = {same(l) for l in source.splitlines()}
      missing = [l for l in code.splitlines() if l.strip() and same(l) not in lines]
      assert not missing, f"{doc} block {i} is not in {mark[11:]}: {missing[:3]}"
    elif mark != "needs a GPU":
      assert not mark, f"{doc} block {i}: unknown mark {mark!r}"
      runnable.append(f"# {doc} block {i}\n{code}")
  if not runnable:
    return
  script = tmp_path / "doc.py"
  script.write_text(HEADER + "\n".join(runnable))
  env = dict(os.environ, PYTHONPATH=ROOT, MPLBACKEND="Agg")
  env["XLA_FLAGS"] = re.sub(r"--xla_force_host_platform_device_count=\S+", "",
                            env.get("XLA_FLAGS", "")).strip()
  proc = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env,
                        capture_output=True, text=True, timeout=500)
  assert proc.returncode == 0, f"{doc}:\n{proc.stderr[-3000:]}"
