#!/usr/bin/env bash
# Every code reference in README.md and docs/*.md resolves: what a reader is sent to look at
# exists. Run from scripts/test.sh; takes about a second.
#
# What is checked, in `backticks` outside fenced code blocks:
# - A path: a span of path characters that starts with one of the repository's top-level
#   entries (`src/...`, `tests/...`, `scripts/x.sh`), or that names a source file (`*.rs`,
#   `*.sh`, `*.py`, `*.c`, `*.h`, `*.md`, `*.toml`, `*.proto`). It must exist in the repository
#   (tracked or not ignored), relative to its root; or, when it has a directory part and does
#   not start with a top-level entry, relative to a directory named earlier on the same line
#   (README's layout table: `src/cuda/` ... `dump/put_back.rs`); a bare file name anywhere. A
#   `*` matches within one path component.
# - A name that looks like Rust (or C, Python, shell) code: `snake_case` with an underscore,
#   `SCREAMING_CASE`, `CamelCase` with two humps, `name()`, `a::b::C`. It must occur as a word
#   in the repository's .rs, .sh, .py, .c or .h files.
# - A name tied to a file: `path` (`name`, `Type::method`, ...), `name` (`path`) and `name` in
#   `path`. There every name-shaped span counts, also a plain word (`pause`), and it must occur
#   in that file (or under that directory): this is what catches a function that moved.
#
# scripts/doc-refs-allow.txt lists references that look like code but are not this
# repository's (another project's function, a kernel symbol): one per line, `#` comments. Keep
# it short: a stale reference is fixed in the doc, never allowed here.
#
# Output: one line per reference that does not resolve, `FILE:LINE: ...`; exit status 1 if any.
set -euo pipefail
REPO=$(cd "$(dirname "$(readlink -f -- "${BASH_SOURCE[0]}")")/.." && pwd -P)
cd "$REPO"
exec python3 - "$@" <<'PY'
import bisect, fnmatch, os, re, signal, subprocess, sys

signal.signal(signal.SIGPIPE, signal.SIG_DFL)

files = subprocess.run(
    ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
    check=True, capture_output=True,
).stdout.decode().split("\0")
files = [f for f in files if f and os.path.exists(f)]
fileset = set(files)
dirs = set()
for f in files:
    d = os.path.dirname(f)
    while d:
        dirs.add(d)
        d = os.path.dirname(d)
top = {f.split("/")[0] for f in files}
basenames = {os.path.basename(f) for f in files} | {os.path.basename(d) for d in dirs}

CODE_EXT = (".rs", ".sh", ".py", ".c", ".h")
PATH_EXT = CODE_EXT + (".md", ".toml", ".proto")
WORD = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")

words_of = {}  # file -> set of words
def words(f):
    if f not in words_of:
        try:
            with open(f, encoding="utf-8", errors="replace") as fh:
                words_of[f] = set(WORD.findall(fh.read()))
        except OSError:
            words_of[f] = set()
    return words_of[f]

all_words = set()
for f in files:
    if f.endswith(CODE_EXT):
        all_words |= words(f)

allow = set()
if os.path.exists("scripts/doc-refs-allow.txt"):
    for line in open("scripts/doc-refs-allow.txt", encoding="utf-8"):
        line = line.split("#", 1)[0].strip()
        if line:
            allow.add(line)

PATHY = re.compile(r"[A-Za-z0-9_.*+\-]+(/[A-Za-z0-9_.*+\-]+)*/?")
IDENT = re.compile(r"([A-Za-z_][A-Za-z0-9_]*(?:::[A-Za-z_][A-Za-z0-9_]*)*)(\(\))?")
CAMEL = re.compile(r"[A-Z][a-z0-9]+(?:[A-Z][a-z0-9]*)+")

def is_path(s):
    if not PATHY.fullmatch(s) or s.startswith((".", "-")) or "--" in s:
        return False
    first = s.split("/")[0]
    if "/" in s and first in top:
        return True
    return s.rstrip("/").endswith(PATH_EXT)

def exists(p):
    p = p.rstrip("/")
    if "*" in p:
        return any(fnmatch.fnmatchcase(f, p) for f in files) or any(
            fnmatch.fnmatchcase(d, p) for d in dirs)
    return p in fileset or p in dirs

def resolve(s, bases):
    """The repository path `s` names, or None."""
    if exists(s):
        return s.rstrip("/")
    if "/" not in s.rstrip("/"):
        if s.rstrip("/") in basenames or (
                "*" in s and any(fnmatch.fnmatchcase(b, s.rstrip("/")) for b in basenames)):
            return s.rstrip("/")
        return None
    # Relative to a directory named before it on the line (`core/` ... `src/plugin.rs`), even
    # when its first part is also a top-level name.
    for b in reversed(bases):
        if exists(b + "/" + s):
            return (b + "/" + s).rstrip("/")
    return None

def ident(s):
    """The names of a span that looks like code, or None."""
    m = IDENT.fullmatch(s)
    if not m:
        return None
    parts = m.group(1).split("::")
    if m.group(2) or len(parts) > 1:
        return parts
    w = parts[0]
    if "_" in w.strip("_") or CAMEL.fullmatch(w):
        return parts
    return None

def any_ident(s):
    m = IDENT.fullmatch(s)
    return m.group(1).split("::") if m else None

def in_path(name, p):
    if p in fileset:
        return not p.endswith(CODE_EXT) or name in words(p)
    return any(name in words(f) for f in files
               if f.startswith(p + "/") and f.endswith(CODE_EXT))

SPAN = re.compile(r"`([^`\n]+)`")
problems = []

def check(doc):
    text = open(doc, encoding="utf-8").read()
    # Blank out fenced blocks, keeping offsets (and so line numbers).
    def blank(m):
        return re.sub(r"[^\n]", " ", m.group(0))
    text = re.sub(r"(?ms)^\s*```.*?^\s*```[^\n]*$", blank, text)
    starts = [0] + [i + 1 for i, c in enumerate(text) if c == "\n"]
    lineno = lambda off: bisect.bisect_right(starts, off)
    spans = list(SPAN.finditer(text))
    bases_of = {}  # line -> directories named on it so far
    resolved = {}  # span index -> repository path
    for i, m in enumerate(spans):
        s = m.group(1)
        ln = lineno(m.start())
        bases = bases_of.setdefault(ln, [])
        if s in allow:
            continue
        if is_path(s):
            r = resolve(s, bases)
            if r is None:
                problems.append(f"{doc}:{ln}: `{s}`: no such file or directory")
                continue
            resolved[i] = r
            if r in dirs:
                bases.append(r)
            elif "/" in r:
                bases.append(os.path.dirname(r))
            continue
        names = ident(s)
        if names:
            for n in names:
                if n not in all_words and n not in allow:
                    problems.append(f"{doc}:{ln}: `{s}`: `{n}` not found in the code")
                    break
    # Names tied to a file.
    def tied(name_span, p, ln):
        s = name_span.group(1)
        if s in allow or is_path(s):
            return
        names = any_ident(s)
        if not names:
            return
        n = names[-1]
        if not in_path(n, p):
            problems.append(f"{doc}:{ln}: `{s}`: `{n}` not found in `{p}`")
    for i, m in enumerate(spans):
        if i in resolved:
            p = resolved[i]
            # `path` (`a`, `b`): the parenthesis right after the path.
            rest = text[m.end():]
            pm = re.match(r"\s*\(", rest)
            if pm:
                depth, j = 1, pm.end()
                while j < len(rest) and depth and j < 2000:
                    depth += {"(": 1, ")": -1}.get(rest[j], 0)
                    j += 1
                for k in range(i + 1, len(spans)):
                    # Names after another path in the parenthesis are that path's.
                    if spans[k].start() >= m.end() + j or k in resolved:
                        break
                    tied(spans[k], p, lineno(spans[k].start()))
            # `name` (`path`) and `name` in `path`.
            if i > 0 and (i - 1) not in resolved:
                between = text[spans[i - 1].end():m.start()]
                if re.fullmatch(r"\s*\(\s*", between) and text[m.end():m.end() + 1] == ")":
                    tied(spans[i - 1], p, lineno(spans[i - 1].start()))
                elif re.fullmatch(r"\s+in\s+", between):
                    tied(spans[i - 1], p, lineno(spans[i - 1].start()))

docs = sorted(["README.md"] + [os.path.join("docs", f) for f in os.listdir("docs")
                               if f.endswith(".md")])
for d in docs:
    check(d)
for p in problems:
    print(p)
if problems:
    print(f"[check-doc-refs] {len(problems)} reference(s) in {', '.join(docs)} do not resolve "
          "(fix the doc; scripts/doc-refs-allow.txt is only for names that are not this repository's)",
          file=sys.stderr)
    sys.exit(1)
print(f"[check-doc-refs] every code reference in {len(docs)} files resolves")
PY
