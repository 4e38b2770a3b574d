"""Every relative markdown link of the docs resolves (issue 43, item 4: the docs as a map).

README.md, docs/*.md and docs/api/*.md: a link to a file names one that exists; a link with
'#anchor' into a markdown file (or into the page itself) names one of its headings, by GitHub's
slug (lower case, punctuation but '-' and '_' dropped, spaces to '-', '-1', '-2' ... for repeats).
Fenced code blocks and inline code are skipped. Pure text scanning: well under a second."""

import functools
import glob
import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_FENCE = re.compile(r"^(```|~~~).*?^\1", re.M | re.S)
_LINK = re.compile(r"\]\(([^)\s]+)\)")


def _slug(heading: str) -> str:
    heading = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link in a heading: its text
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _strip_code(text: str) -> str:
    text = _FENCE.sub("", text)
    return re.sub(r"`[^`\n]*`", "", text)


@functools.lru_cache(maxsize=None)
def _anchors(path: str) -> frozenset:
    with open(path, encoding="utf-8") as f:
        text = _FENCE.sub("", f.read())
    seen, out = {}, set()
    for heading in re.findall(r"^#{1,6}\s+(.+?)\s*#*\s*$", text, re.M):
        s = _slug(heading)
        n = seen.get(s, 0)
        out.add(s if n == 0 else f"{s}-{n}")
        seen[s] = n + 1
    out |= set(re.findall(r"<a\s+(?:name|id)=\"([^\"]+)\"", text))
    return frozenset(out)


def doc_pages():
    pages = ["README.md"] + sorted(glob.glob(os.path.join(ROOT, "docs", "*.md"))) \
        + sorted(glob.glob(os.path.join(ROOT, "docs", "api", "*.md")))
    return [os.path.relpath(os.path.join(ROOT, p), ROOT) for p in pages]


def broken_links():
    bad, n = [], 0
    for src in doc_pages():
        path = os.path.join(ROOT, src)
        with open(path, encoding="utf-8") as f:
            text = _strip_code(f.read())
        for target in _LINK.findall(text):
            if re.match(r"[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto: ...
                continue
            n += 1
            file_part, _, anchor = target.partition("#")
            dest = os.path.normpath(os.path.join(os.path.dirname(path), file_part)) if file_part else path
            if not os.path.exists(dest):
                bad.append(f"{src}: {target} (no such file)")
            elif anchor and dest.endswith(".md") and anchor not in _anchors(dest):
                bad.append(f"{src}: {target} (no such heading)")
    return n, bad


def test_every_relative_doc_link_resolves():
    n, bad = broken_links()
    assert n > 100 and not bad, "\n".join(bad)


def test_the_docs_index_lists_every_page():
    """docs/README.md is the one list of the doc pages: every page under docs/ is linked from it."""
    with open(os.path.join(ROOT, "docs", "README.md"), encoding="utf-8") as f:
        index = f.read()
    linked = {os.path.normpath(t.partition("#")[0]) for t in _LINK.findall(index)}
    pages = {os.path.relpath(p, os.path.join(ROOT, "docs"))
             for p in glob.glob(os.path.join(ROOT, "docs", "*.md")) + glob.glob(os.path.join(ROOT, "docs", "api", "*.md"))}
    missing = sorted(pages - linked - {"README.md"})
    assert not missing, missing
