#!/usr/bin/env python3
"""Every code reference in README.md and docs/*.md resolves: what a reader is sent to look at
exists. Run from scripts/test.sh; takes about a second.

What is checked, in `backticks` outside fenced code blocks:

- A path: a span of path characters that starts with one of the repository's top-level entries
  (`src/...`, `tests/...`, `scripts/x.sh`), or that names a source file (`*.rs`, `*.sh`, `*.py`,
  `*.c`, `*.h`, `*.md`, `*.toml`, `*.proto`). It must exist in the repository (tracked or not
  ignored), relative to its root; or, when it has a directory part and does not start with a
  top-level entry, relative to a directory named earlier on the same line (a layout table:
  `core/src/cuda/` ... `dump/put_back.rs`); a bare file name anywhere. A `*` matches within one
  path component.
- A name that looks like Rust (or C, Python, shell) code: `snake_case` with an underscore,
  `SCREAMING_CASE`, `CamelCase` with two humps, `name()`, `a::b::C`. It must occur as a word in
  the repository's .rs, .sh, .py, .c or .h files.
- A name tied to a file: `path` (`name`, `Type::method`, ...), `name` (`path`) and `name` in
  `path`. There every name-shaped span counts, also a plain word (`pause`), and it must occur in
  that file (or under that directory): this is what catches a function that moved.

docs/results/ holds raw records of past runs and is not checked: its references are to the code
as it was then.

scripts/doc-refs-allow.txt lists references that look like code but are not this repository's
(another project's function, a kernel symbol): one per line, `#` comments. Keep it short: a stale
reference is fixed in the doc, never allowed here.

Output: one line per reference that does not resolve, `FILE:LINE: ...`; exit status 1 if any.
"""

import bisect
import fnmatch
import os
import re
import signal
import subprocess
import sys

CODE_EXT = (".rs", ".sh", ".py", ".c", ".h")
PATH_EXT = CODE_EXT + (".md", ".toml", ".proto")
ALLOW_FILE = "scripts/doc-refs-allow.txt"

WORD = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
PATHY = re.compile(r"[A-Za-z0-9_.*+\-]+(/[A-Za-z0-9_.*+\-]+)*/?")
IDENT = re.compile(r"([A-Za-z_][A-Za-z0-9_]*(?:::[A-Za-z_][A-Za-z0-9_]*)*)(\(\))?")
CAMEL = re.compile(r"[A-Z][a-z0-9]+(?:[A-Z][a-z0-9]*)+")
SPAN = re.compile(r"`([^`\n]+)`")
FENCE = re.compile(r"(?ms)^\s*```.*?^\s*```[^\n]*$")


class Repository:
    """The files a doc may name: tracked or not ignored, as git lists them."""

    def __init__(self):
        listed = subprocess.run(
            ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
            check=True, capture_output=True,
        ).stdout.decode().split("\0")
        self.files = [f for f in listed if f and os.path.exists(f)]
        self.fileset = set(self.files)
        self.dirs = set()
        for f in self.files:
            d = os.path.dirname(f)
            while d:
                self.dirs.add(d)
                d = os.path.dirname(d)
        self.top = {f.split("/")[0] for f in self.files}
        self.basenames = ({os.path.basename(f) for f in self.files}
                          | {os.path.basename(d) for d in self.dirs})
        self._words = {}
        self.all_words = set()
        for f in self.files:
            if f.endswith(CODE_EXT):
                self.all_words |= self.words(f)

    def words(self, path):
        """The identifier-shaped words of one file."""
        if path not in self._words:
            try:
                with open(path, encoding="utf-8", errors="replace") as fh:
                    self._words[path] = set(WORD.findall(fh.read()))
            except OSError:
                self._words[path] = set()
        return self._words[path]

    def is_path(self, span):
        """Whether a backticked span is meant as a repository path."""
        if not PATHY.fullmatch(span) or span.startswith((".", "-")) or "--" in span:
            return False
        if "/" in span and span.split("/")[0] in self.top:
            return True
        return span.rstrip("/").endswith(PATH_EXT)

    def exists(self, path):
        path = path.rstrip("/")
        if "*" in path:
            return (any(fnmatch.fnmatchcase(f, path) for f in self.files)
                    or any(fnmatch.fnmatchcase(d, path) for d in self.dirs))
        return path in self.fileset or path in self.dirs

    def resolve(self, span, bases):
        """The repository path `span` names, or None. `bases`: directories named before it on
        the same line."""
        if self.exists(span):
            return span.rstrip("/")
        bare = span.rstrip("/")
        if "/" not in bare:
            if bare in self.basenames or (
                    "*" in span and any(fnmatch.fnmatchcase(b, bare) for b in self.basenames)):
                return bare
            return None
        # Relative to a directory named before it on the line (`core/` ... `src/plugin.rs`),
        # even when its first part is also a top-level name.
        for base in reversed(bases):
            if self.exists(base + "/" + span):
                return (base + "/" + span).rstrip("/")
        return None

    def name_in(self, name, path):
        """Whether `name` occurs in the file `path`, or in a code file under the directory."""
        if path in self.fileset:
            return not path.endswith(CODE_EXT) or name in self.words(path)
        return any(name in self.words(f) for f in self.files
                   if f.startswith(path + "/") and f.endswith(CODE_EXT))


def code_names(span):
    """The names of a span that looks like code, or None."""
    m = IDENT.fullmatch(span)
    if not m:
        return None
    parts = m.group(1).split("::")
    if m.group(2) or len(parts) > 1:
        return parts
    word = parts[0]
    if "_" in word.strip("_") or CAMEL.fullmatch(word):
        return parts
    return None


def any_names(span):
    """The names of any identifier-shaped span, or None."""
    m = IDENT.fullmatch(span)
    return m.group(1).split("::") if m else None


def read_allowed():
    allowed = set()
    if os.path.exists(ALLOW_FILE):
        with open(ALLOW_FILE, encoding="utf-8") as fh:
            for line in fh:
                line = line.split("#", 1)[0].strip()
                if line:
                    allowed.add(line)
    return allowed


def check(doc, repo, allowed):
    """The problems of one doc, as `FILE:LINE: ...` lines."""
    problems = []
    with open(doc, encoding="utf-8") as fh:
        text = fh.read()
    # Blank out fenced blocks, keeping offsets (and so line numbers).
    text = FENCE.sub(lambda m: re.sub(r"[^\n]", " ", m.group(0)), text)
    starts = [0] + [i + 1 for i, c in enumerate(text) if c == "\n"]

    def lineno(offset):
        return bisect.bisect_right(starts, offset)

    spans = list(SPAN.finditer(text))
    bases_of = {}  # line -> directories named on it so far
    resolved = {}  # span index -> repository path
    for i, m in enumerate(spans):
        span = m.group(1)
        ln = lineno(m.start())
        bases = bases_of.setdefault(ln, [])
        if span in allowed:
            continue
        if repo.is_path(span):
            path = repo.resolve(span, bases)
            if path is None:
                problems.append(f"{doc}:{ln}: `{span}`: no such file or directory")
                continue
            resolved[i] = path
            if path in repo.dirs:
                bases.append(path)
            elif "/" in path:
                bases.append(os.path.dirname(path))
            continue
        names = code_names(span)
        if names:
            for n in names:
                if n not in repo.all_words and n not in allowed:
                    problems.append(f"{doc}:{ln}: `{span}`: `{n}` not found in the code")
                    break

    def tied(name_span, path):
        span = name_span.group(1)
        if span in allowed or repo.is_path(span):
            return
        names = any_names(span)
        if not names:
            return
        if not repo.name_in(names[-1], path):
            problems.append(f"{doc}:{lineno(name_span.start())}: `{span}`: "
                            f"`{names[-1]}` not found in `{path}`")

    # Names tied to a file.
    for i, m in enumerate(spans):
        if i not in resolved:
            continue
        path = resolved[i]
        # `path` (`a`, `b`): the parenthesis right after the path.
        rest = text[m.end():]
        paren = re.match(r"\s*\(", rest)
        if paren:
            depth, j = 1, paren.end()
            while j < len(rest) and depth and j < 2000:
                depth += {"(": 1, ")": -1}.get(rest[j], 0)
                j += 1
            for k in range(i + 1, len(spans)):
                # Names after another path in the parenthesis are that path's.
                if spans[k].start() >= m.end() + j or k in resolved:
                    break
                tied(spans[k], path)
        # `name` (`path`) and `name` in `path`.
        if i > 0 and (i - 1) not in resolved:
            between = text[spans[i - 1].end():m.start()]
            if re.fullmatch(r"\s*\(\s*", between) and text[m.end():m.end() + 1] == ")":
                tied(spans[i - 1], path)
            elif re.fullmatch(r"\s+in\s+", between):
                tied(spans[i - 1], path)
    return problems


def main():
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)
    os.chdir(os.path.join(os.path.dirname(os.path.realpath(__file__)), ".."))
    repo = Repository()
    allowed = read_allowed()
    docs = sorted(["README.md"] + [os.path.join("docs", f) for f in os.listdir("docs")
                                   if f.endswith(".md")])
    problems = [p for doc in docs for p in check(doc, repo, allowed)]
    for p in problems:
        print(p)
    if problems:
        print(f"[check-doc-refs] {len(problems)} reference(s) in {', '.join(docs)} do not "
              "resolve (fix the doc; scripts/doc-refs-allow.txt is only for names that are not "
              "this repository's)", file=sys.stderr)
        return 1
    print(f"[check-doc-refs] every code reference in {len(docs)} files resolves")
    return 0


if __name__ == "__main__":
    sys.exit(main())
