"""The user documentation cannot rot: the quickstart runs and matches one device, and
every relative link of README.md and docs/*.md points to a file (and heading) that exists."""

import os
import re

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCS = [os.path.join(ROOT, "README.md")] + sorted(
    os.path.join(ROOT, "docs", f) for f in os.listdir(os.path.join(ROOT, "docs")) if f.endswith(".md"))


@pytest.mark.timeout(120)
def test_quickstart_matches_one_device():
  from examples import quickstart

  losses, plain = quickstart.main(steps=3)
  assert len(losses) == len(plain) == 3
  assert np.all(np.isfinite(losses))
  np.testing.assert_allclose(losses, plain, rtol=1e-5)  # the pipeline's losses are one device's
  assert len(set(losses)) == 3  # three different batches, three steps that ran


def _slug(heading: str) -> str:
  """GitHub's anchor of a Markdown heading: its text, lower case, without punctuation."""
  text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link counts as its text
  text = text.strip().lower().replace("`", "").replace("*", "")
  return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def _anchors(path: str) -> set[str]:
  text = re.sub(r"```.*?```", "", open(path, encoding="utf-8").read(), flags=re.S)
  return {_slug(m) for m in re.findall(r"^#{1,6}\s+(.*?)\s*#*\s*$", text, flags=re.M)}


def _links(path: str) -> list[str]:
  text = open(path, encoding="utf-8").read()
  text = re.sub(r"```.*?```", "", text, flags=re.S)  # code blocks
  text = re.sub(r"`[^`\n]*`", "", text)  # inline code
  return re.findall(r"\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)", text)


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: os.path.relpath(p, ROOT))
def test_relative_links_exist(doc):
  broken = []
  for link in _links(doc):
    if re.match(r"[a-z][a-z0-9+.-]*:", link):  # http:, https:, mailto:
      continue
    target, _, anchor = link.partition("#")
    path = os.path.normpath(os.path.join(os.path.dirname(doc), target)) if target else doc
    if not os.path.exists(path):
      broken.append(f"{link} (no file {os.path.relpath(path, ROOT)})")
    elif anchor and path.endswith(".md") and anchor not in _anchors(path):
      broken.append(f"{link} (no heading #{anchor} in {os.path.relpath(path, ROOT)})")
  assert not broken, f"{os.path.relpath(doc, ROOT)}: broken links: {broken}"


def test_readme_links_every_docs_page():
  linked = {os.path.normpath(os.path.join(ROOT, link.partition("#")[0]))
            for link in _links(os.path.join(ROOT, "README.md"))}
  missing = [os.path.relpath(d, ROOT) for d in DOCS[1:] if d not in linked]
  assert not missing, f"README.md does not link {missing}"
