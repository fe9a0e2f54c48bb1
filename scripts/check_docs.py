#!/usr/bin/env python3
"""Checks the documentation's references (run by scripts/test.sh):

- every relative link of every markdown file of the repository resolves:
  `[text](path)`, `[text](path#anchor)`, `[text](#anchor)` and reference
  definitions `[id]: path`; the path names a file or folder of the
  repository, and an anchor into a markdown file names one of its
  headings (GitHub's anchors: lower case, punctuation dropped, spaces as
  hyphens, a repeated heading suffixed -1, -2, ...);
- every file of the repository (sources, scripts, comments) that names a
  page as `docs/<name>.md` or `runs/<name>.md` names one that exists;
- every "NAME.md section N" (or "sections N and M", "sections N to M") in
  those files names a page with a heading numbered N ("## N. ...").

Links with a scheme (https:, mailto:) are not followed. Text inside code
blocks and code spans of markdown files is not read for links.

    python3 scripts/check_docs.py          # exit status 1 and one line per fault
"""
import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

INLINE = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
REFDEF = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+.*)?$")
MENTION = re.compile(r"(?<![\w/.$-])((?:docs|runs)/[A-Za-z0-9_.-]+\.md)\b")
SECTION = re.compile(
    r"(?<![\w$-])((?:[\w.-]+/)*[\w.-]+\.md)\)?,?\s+sections?\s+(\d+)((?:(?:,\s*|\s+and\s+|\s+to\s+|\s*-\s*)\d+)*)"
)
SCHEME = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:")


def repo_files():
    try:
        out = subprocess.run(
            ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
            cwd=ROOT, check=True, capture_output=True,
        ).stdout.decode()
        files = [f for f in out.split("\0") if f]
    except (OSError, subprocess.CalledProcessError):
        files = []
        for d, dirs, names in os.walk(ROOT):
            dirs[:] = [x for x in dirs if not x.startswith(".") and x not in ("target", "build")]
            files += [os.path.relpath(os.path.join(d, n), ROOT) for n in names]
    return sorted(f for f in files if os.path.isfile(os.path.join(ROOT, f)))


def strip_code(text, spans=True):
    """Markdown text with fenced and indented code blocks blanked, and
    code spans too unless `spans` is False (line numbers kept)."""
    out, fence = [], None
    for line in text.split("\n"):
        m = re.match(r"^\s{0,3}(`{3,}|~{3,})", line)
        if fence:
            if m and m.group(1)[0] == fence[0] and len(m.group(1)) >= len(fence):
                fence = None
            out.append("")
            continue
        if m:
            fence = m.group(1)
            out.append("")
            continue
        if line.startswith("    ") and not line.lstrip().startswith(("-", "*", "|")) and (not out or out[-1].strip() == "" or out[-1].startswith("    ")):
            out.append("")  # an indented code block
            continue
        out.append(re.sub(r"(`+)(?:(?!\1).)+?\1", lambda m: " " * len(m.group(0)), line) if spans else line)
    return "\n".join(out)


def slug(heading):
    s = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return s.replace(" ", "-")


_anchors = {}


def anchors(path):
    if path not in _anchors:
        seen, found = {}, set()
        with open(path, encoding="utf-8") as f:
            text = strip_code(f.read(), spans=False)
        for line in text.split("\n"):
            m = re.match(r"^\s{0,3}#{1,6}\s+(.*?)\s*#*\s*$", line)
            if not m:
                continue
            base = slug(re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", m.group(1)))
            n = seen.get(base, 0)
            seen[base] = n + 1
            found.add(base if n == 0 else f"{base}-{n}")
        _anchors[path] = found
    return _anchors[path]


def numbered_sections(path):
    with open(path, encoding="utf-8") as f:
        text = strip_code(f.read())
    return {int(m.group(1)) for m in re.finditer(r"^#{2,6}\s+(\d+)\.", text, re.M)}


def check_link(src, target, line, faults):
    if SCHEME.match(target) or target.startswith("//"):
        return
    path, _, anchor = target.partition("#")
    base = os.path.dirname(os.path.join(ROOT, src))
    dest = os.path.normpath(os.path.join(base, path)) if path else os.path.join(ROOT, src)
    where = f"{src}:{line}"
    if not dest.startswith(ROOT + os.sep) and dest != ROOT:
        faults.append(f"{where}: link {target!r} leaves the repository")
        return
    if not os.path.exists(dest):
        faults.append(f"{where}: link {target!r}: {os.path.relpath(dest, ROOT)} does not exist")
        return
    if anchor and dest.endswith(".md") and anchor.lower() not in anchors(dest):
        faults.append(f"{where}: link {target!r}: no heading with anchor #{anchor} in {os.path.relpath(dest, ROOT)}")


def resolve_page(src, name):
    """The page a mention "NAME.md" in `src` means: beside src, from the
    root, or in docs/."""
    for cand in (os.path.join(os.path.dirname(src), name), name, os.path.join("docs", name)):
        p = os.path.normpath(os.path.join(ROOT, cand))
        if os.path.isfile(p):
            return p
    return None


def main():
    faults = []
    for src in repo_files():
        full = os.path.join(ROOT, src)
        try:
            with open(full, encoding="utf-8") as f:
                text = f.read()
        except (UnicodeDecodeError, OSError):
            continue
        if src.endswith(".md"):
            body = strip_code(text)
            for i, line in enumerate(body.split("\n"), 1):
                for m in INLINE.finditer(line):
                    check_link(src, m.group(1), i, faults)
                m = REFDEF.match(line)
                if m:
                    check_link(src, m.group(1), i, faults)
        if src.startswith(("fuzz/corpus/", "target/")):
            continue
        for i, line in enumerate(text.split("\n"), 1):
            for m in MENTION.finditer(line):
                if not os.path.isfile(os.path.join(ROOT, m.group(1))):
                    faults.append(f"{src}:{i}: names {m.group(1)}, which does not exist")
            for m in SECTION.finditer(line):
                page = resolve_page(src, m.group(1))
                if page is None:
                    continue  # a file this check does not know (a report's name); mentions are checked above
                nums = [int(m.group(2))] + [int(x) for x in re.findall(r"\d+", m.group(3))]
                if re.search(r"\bto\b|-", m.group(3) or ""):
                    nums = list(range(nums[0], nums[-1] + 1))
                have = numbered_sections(page)
                for n in nums:
                    if n not in have:
                        faults.append(
                            f"{src}:{i}: names {m.group(1)} section {n}; {os.path.relpath(page, ROOT)} has no section {n}"
                        )
    for f in faults:
        print(f)
    if faults:
        print(f"check_docs: {len(faults)} broken reference(s)", file=sys.stderr)
        return 1
    print("check_docs: every link, page name and section number resolves")
    return 0


if __name__ == "__main__":
    sys.exit(main())
