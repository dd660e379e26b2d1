#!/usr/bin/env python3
"""Keeps the repository speaking of itself only. Run by `make lint`.

Fails, naming file and line, when:

(a) a file of the repository carries a package registry's address;
(b) a relative link in a Markdown file does not resolve to a file or
    folder of the repository (or to a heading of the linked page);
(c) README.md or a page under docs/ links outside the repository (an
    http or https address: name the thing in words instead);
(d) README.md or a page under docs/ names, in a code span, a repository
    path that does not exist, or a test (`path/to/file.rs::test_name`)
    that is not a test (`#[test]`, `#[tokio::test]`) in that file;
(e) a row of docs/security.md's table of promises names no test.

"The repository" is what git tracks, and the files git would add (not
ignored), so that the check runs the same before a commit as after it.
Python 3 standard library only.
"""

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# (a) Package registries: where language package managers fetch from.
# Each address is put together from its parts, so that this file never
# carries one and the check can read it like any other file. A name matches
# with any subdomain in front (the index and download hosts under a
# registry's own name). Container image references (`image:` in the
# manifests) are not package-registry addresses and are not checked here.
_REGISTRY_PARTS = [
    ("crates", "io"),
    ("proxy", "golang", "org"),
    ("sum", "golang", "org"),
    ("index", "golang", "org"),
    ("goproxy", "io"),
    ("goproxy", "cn"),
    ("pypi", "org"),
    ("pypi", "python", "org"),
    ("pythonhosted", "org"),
    ("npmjs", "org"),
    ("npmjs", "com"),
    ("yarnpkg", "com"),
    ("maven", "apache", "org"),
    ("repo1", "maven", "org"),
    ("central", "sonatype", "com"),
    ("rubygems", "org"),
    ("nuget", "org"),
    ("packagist", "org"),
    ("hex", "pm"),
]
REGISTRY = re.compile(
    r"(?<![A-Za-z0-9.-])(?:[A-Za-z0-9-]+\.)*(?:"
    + "|".join(r"\.".join(parts) for parts in _REGISTRY_PARTS)
    + r")(?![A-Za-z0-9])",
    re.IGNORECASE,
)

# Machine-written lockfiles: their format records where each package came
# from (Cargo.lock's `source = "registry+…"` lines), and the tools that
# write them put it back on every update. Nobody writes these by hand.
LOCKFILES = {"Cargo.lock", "go.sum", "package-lock.json", "yarn.lock", "poetry.lock"}

# (c) The loopback is not outside the repository: a page may show how to
# reach an endpoint on the reader's own machine.
LOOPBACK = re.compile(r"https?://(?:localhost|127\.0\.0\.1|\[::1\])(?:[:/]|$)", re.IGNORECASE)
ADDRESS = re.compile(r"\bhttps?://[^\s)>\]`'\"]*|(?<![\w./@-])www\.[\w-]+\.[\w.-]+", re.IGNORECASE)

# (d) Code spans that name a repository path: those under these folders.
PATH_SPAN = re.compile(
    r"^(?:crates|e2e|bench|config|crds|docs|fuzz|images|scripts)/[\w./-]*$"
)
TEST_SPAN = re.compile(r"^([\w./-]+\.rs)::(\w+)$")

FENCE = re.compile(r"^\s*(```|~~~)")
INLINE_LINK = re.compile(r"!?\[(?:[^\]\\]|\\.)*\]\(\s*(<[^>]*>|[^)\s]*)(?:\s+[\"'(][^)]*)?\)")
REFERENCE_DEF = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*(<[^>]*>|\S+)")
AUTOLINK = re.compile(r"<((?:https?|ftp)://[^>\s]+)>", re.IGNORECASE)
CODE_SPAN = re.compile(r"(`+)(.+?)\1")


def repository_files():
    out = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        check=True,
        capture_output=True,
    ).stdout
    files = sorted({f for f in out.decode().split("\0") if f and (ROOT / f).is_file()})
    folders = {str(Path(f).parent) for f in files}
    for f in list(folders):
        p = Path(f)
        while str(p) not in (".", ""):
            folders.add(str(p))
            p = p.parent
    return files, folders


def text_of(path):
    data = (ROOT / path).read_bytes()
    if b"\0" in data:
        return None
    return data.decode("utf-8", errors="replace")


def outside_fences(text):
    """Each line outside fenced code blocks, as (number, line)."""
    fenced = None
    for n, line in enumerate(text.splitlines(), 1):
        m = FENCE.match(line)
        if m:
            if fenced is None:
                fenced = m.group(1)
            elif m.group(1) == fenced:
                fenced = None
            continue
        if fenced is None:
            yield n, line


def prose_lines(text):
    """Each line outside fenced code blocks, with inline code spans blanked
    out (links inside code are examples, not links), as (number, line)."""
    for n, line in outside_fences(text):
        yield n, CODE_SPAN.sub(lambda s: " " * len(s.group(0)), line)


def code_spans(text):
    for n, line in outside_fences(text):
        for s in CODE_SPAN.finditer(line):
            yield n, s.group(2).strip()


def slug(heading):
    """A heading's anchor, as GitHub makes it."""
    text = re.sub(r"<[^>]+>", "", heading).strip().lower()
    text = text.replace("`", "")
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(text):
    seen = {}
    out = set()
    for _, line in prose_lines(text):
        m = re.match(r"^\s{0,3}#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not m:
            continue
        base = slug(m.group(1))
        count = seen.get(base, 0)
        seen[base] = count + 1
        out.add(base if count == 0 else f"{base}-{count}")
    for m in re.finditer(r"<a\s+(?:name|id)=\"([^\"]+)\"", text):
        out.add(m.group(1))
    return out


def is_outside_page(path):
    return path == "README.md" or (path.startswith("docs/") and path.endswith(".md"))


def check_registries(files, problems):
    for path in files:
        if Path(path).name in LOCKFILES:
            continue
        text = text_of(path)
        if text is None:
            continue
        for n, line in enumerate(text.splitlines(), 1):
            for m in REGISTRY.finditer(line):
                problems.append(
                    f"{path}:{n}: a package registry's address ({m.group(0)}): "
                    "say what is meant without it"
                )


def check_links(markdown, files, folders, problems):
    cache = {}

    def anchors_of(path):
        if path not in cache:
            cache[path] = anchors(text_of(path) or "")
        return cache[path]

    for path in markdown:
        text = text_of(path) or ""
        here = Path(path).parent
        for n, line in prose_lines(text):
            targets = [m.group(1) for m in INLINE_LINK.finditer(line)]
            targets += [m.group(1) for m in REFERENCE_DEF.finditer(line)]
            targets += [m.group(1) for m in AUTOLINK.finditer(line)]
            for target in targets:
                target = target.strip("<>")
                if not target or re.match(r"^[a-z][a-z0-9+.-]*:", target, re.IGNORECASE):
                    continue  # an address: (c) judges those
                where, _, anchor = target.partition("#")
                if where:
                    if where.startswith("/"):
                        resolved = os.path.normpath(where.lstrip("/"))
                    else:
                        resolved = os.path.normpath(str(here / where))
                    if resolved.startswith(".."):
                        problems.append(
                            f"{path}:{n}: link to {target}, outside the repository"
                        )
                        continue
                    if resolved not in files and resolved not in folders:
                        problems.append(
                            f"{path}:{n}: link to {target}: no {resolved} in the repository"
                        )
                        continue
                else:
                    resolved = path
                if anchor and resolved.endswith(".md") and resolved in files:
                    if anchor not in anchors_of(resolved):
                        problems.append(
                            f"{path}:{n}: link to {target}: {resolved} has no heading #{anchor}"
                        )


def check_addresses(pages, problems):
    for path in pages:
        text = text_of(path) or ""
        # Everywhere, code blocks included: an address in an example is
        # still one a reader follows.
        for n, line in enumerate(text.splitlines(), 1):
            for m in ADDRESS.finditer(line):
                if LOOPBACK.match(m.group(0)):
                    continue
                problems.append(
                    f"{path}:{n}: {m.group(0)} is outside the repository: "
                    "link a file of the repository, or name the thing in words"
                )


def check_named_paths(pages, files, folders, problems):
    for path in pages:
        text = text_of(path) or ""
        for n, span in code_spans(text):
            test = TEST_SPAN.match(span)
            if test:
                source, name = test.groups()
                body = text_of(source) if source in files else None
                if body is None:
                    problems.append(f"{path}:{n}: `{span}`: no {source} in the repository")
                elif not re.search(
                    rf"#\[(?:tokio::)?test\b[^\]]*\]\s*(?:#\[[^\]]*\]\s*)*(?:async\s+)?fn\s+{re.escape(name)}\b",
                    body,
                ):
                    problems.append(f"{path}:{n}: `{span}`: no test {name} in {source}")
                continue
            if PATH_SPAN.match(span):
                named = os.path.normpath(span)
                if named not in files and named not in folders:
                    problems.append(f"{path}:{n}: `{span}`: no such path in the repository")


# (e) The promises docs/security.md makes, each held by a test it names.
PROMISES_PAGE = "docs/security.md"
PROMISES_HEADING = "## How each promise is tested"


def check_promises(problems):
    text = text_of(PROMISES_PAGE) or ""
    lines = text.splitlines()
    start = next((i for i, l in enumerate(lines) if l.strip() == PROMISES_HEADING), None)
    if start is None:
        problems.append(f"{PROMISES_PAGE}: no section {PROMISES_HEADING!r}")
        return
    rows = 0
    for n in range(start + 1, len(lines)):
        line = lines[n]
        if line.startswith("## "):
            break
        if not line.startswith("|") or set(line) <= set("|- "):
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if cells[0] == "Promise":
            continue
        rows += 1
        tests = [s for _, s in code_spans(cells[-1]) if TEST_SPAN.match(s)]
        if not tests:
            problems.append(
                f"{PROMISES_PAGE}:{n + 1}: the promise names no test (`path/to/file.rs::test_name`)"
            )
    if rows == 0:
        problems.append(f"{PROMISES_PAGE}: the table under {PROMISES_HEADING!r} has no promise")


def main():
    files, folders = repository_files()
    file_set = set(files)
    markdown = [f for f in files if f.endswith(".md")]
    pages = [f for f in markdown if is_outside_page(f)]
    problems = []
    check_registries(files, problems)
    check_links(markdown, file_set, folders, problems)
    check_addresses(pages, problems)
    check_named_paths(pages, file_set, folders, problems)
    check_promises(problems)
    for p in problems:
        print(p, file=sys.stderr)
    if problems:
        print(f"check-docs: {len(problems)} problem(s)", file=sys.stderr)
        return 1
    print(f"check-docs: {len(files)} files, {len(markdown)} Markdown pages: fine")
    return 0


if __name__ == "__main__":
    sys.exit(main())
