"""Plain-text corpora for pre-training: reading document files, and the embedded default corpus.

A corpus is a sequence of *documents*; a document is a list of *segments* (non-empty lines
of text). BERT's pipeline packs contiguous segments of one document into sentence A and B,
so document boundaries matter and line order inside a document is kept.

Input formats (``--doc-split``):
  * ``blank``: one document per blank-line-separated block (the layout of the original
    BERT data: one sentence per line, documents separated by empty lines);
  * ``file``: one document per file (its blank lines only separate paragraphs).
A line longer than ``max_segment_chars`` is split at sentence ends (". ", "? ", "! ")
so that a single-line document still yields several segments.

The embedded corpus needs no download: the docstrings (modules, classes, functions) of the
running Python's standard library, read with ``ast`` from the source files (nothing is
imported, so no module side effects), in a deterministic order: files sorted by path, then
the order of ``ast.walk``. One docstring is one document.
"""
from __future__ import annotations

import ast
import glob
import hashlib
import os
import re
import sys
import sysconfig
from typing import Iterable, Iterator, List, Optional, Sequence

from bertfast.data.textfile import non_utf8_error

Document = List[str]

_SENTENCE_END = re.compile(r"(?<=[.!?])\s+(?=[A-Z0-9(\"'`])")
# Directories of the standard library that hold tests, third-party packages or generated data.
_STDLIB_SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__", "test", "tests", "idle_test",
                     "lib2to3", "ensurepip", "turtledemo", "config-3", "pydoc_data"}


class CorpusError(ValueError):
    """A corpus input that cannot be read; the message names the file (and line where known)."""


def split_long_line(line: str, max_chars: int) -> List[str]:
    """Split one line into sentence-like segments no longer than ~max_chars (never mid-word)."""
    line = line.strip()
    if len(line) <= max_chars:
        return [line] if line else []
    out: List[str] = []
    current = ""
    for sentence in _SENTENCE_END.split(line):
        if current and len(current) + 1 + len(sentence) > max_chars:
            out.append(current)
            current = sentence
        else:
            current = f"{current} {sentence}" if current else sentence
    if current:
        out.append(current)
    return out


def _lines_to_segments(lines: Iterable[str], max_segment_chars: int) -> Document:
    segments: Document = []
    for line in lines:
        segments.extend(split_long_line(line, max_segment_chars))
    return segments


def expand_inputs(inputs: Sequence[str]) -> List[str]:
    """Files named by ``inputs`` (files, directories searched recursively for *.txt, or globs), sorted."""
    files: List[str] = []
    for item in inputs:
        if os.path.isdir(item):
            found = sorted(glob.glob(os.path.join(item, "**", "*.txt"), recursive=True))
            if not found:
                raise CorpusError(f"corpus directory {item!r} contains no *.txt files")
            files.extend(found)
        elif os.path.isfile(item):
            files.append(item)
        else:
            found = sorted(glob.glob(item, recursive=True))
            if not found:
                raise CorpusError(f"corpus input {item!r}: no such file, directory or glob match")
            files.extend(f for f in found if os.path.isfile(f))
    return files


def read_documents(files: Sequence[str], doc_split: str = "blank",
                   max_segment_chars: int = 400) -> Iterator[Document]:
    """Yield the documents of ``files`` in order (see the module docstring for the formats)."""
    if doc_split not in ("blank", "file"):
        raise ValueError(f"doc_split must be 'blank' or 'file', got {doc_split!r}")
    for path in files:
        try:
            with open(path, encoding="utf-8") as f:
                if doc_split == "file":
                    doc = _lines_to_segments(f, max_segment_chars)
                    if doc:
                        yield doc
                    continue
                block: List[str] = []
                for lineno, line in enumerate(f, 1):
                    if line.strip():
                        block.append(line)
                    elif block:
                        doc = _lines_to_segments(block, max_segment_chars)
                        block = []
                        if doc:
                            yield doc
                if block:
                    doc = _lines_to_segments(block, max_segment_chars)
                    if doc:
                        yield doc
        except UnicodeDecodeError:
            line, message = non_utf8_error(path)
            raise CorpusError(f"{path}:{line}: {message}" if line else f"{path}: {message}") from None
        except OSError as e:
            raise CorpusError(f"{path}: cannot read ({e.strerror})") from None


# --------------------------------------------------------------------------- embedded corpus
def stdlib_source_files(max_files: Optional[int] = None) -> List[str]:
    """The standard library's .py files (no tests, no site-packages), sorted by relative path."""
    root = sysconfig.get_paths()["stdlib"]
    files: List[str] = []
    for directory, dirs, names in os.walk(root):
        dirs[:] = sorted(d for d in dirs if d not in _STDLIB_SKIP_DIRS and not d.startswith(("test", "config-")))
        for name in sorted(names):
            if name.endswith(".py") and not name.startswith("test_"):
                files.append(os.path.join(directory, name))
    files.sort(key=lambda p: os.path.relpath(p, root))
    return files[:max_files] if max_files is not None else files


def stdlib_documents(max_files: Optional[int] = None, max_docs: Optional[int] = None,
                     min_chars: int = 40, min_segments: int = 2,
                     max_segment_chars: int = 400) -> List[Document]:
    """Docstrings of the standard library as documents (deterministic for a given Python).

    One-line docstrings are left out (``min_segments``): a one-segment document can only
    pair with a random B, which would tilt the NSP labels away from 50/50.
    """
    docs: List[Document] = []
    for path in stdlib_source_files(max_files):
        try:
            with open(path, encoding="utf-8") as f:
                tree = ast.parse(f.read(), filename=path)
        except (SyntaxError, UnicodeDecodeError, ValueError, OSError):
            continue  # a few stdlib files are templates or use another encoding
        for node in ast.walk(tree):
            if not isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            text = ast.get_docstring(node, clean=True)
            if not text or len(text) < min_chars:
                continue
            doc = _lines_to_segments(text.splitlines(), max_segment_chars)
            if len(doc) >= min_segments:
                docs.append(doc)
                if max_docs is not None and len(docs) >= max_docs:
                    return docs
    return docs


def write_documents(docs: Iterable[Document], path: str) -> int:
    """Write documents in the ``blank`` format (one segment per line, blank line between documents)."""
    n = 0
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        for doc in docs:
            for seg in doc:
                f.write(seg.replace("\n", " ") + "\n")
            f.write("\n")
            n += 1
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return n


def stdlib_corpus_file(cache_dir: str, max_files: Optional[int] = None,
                       max_docs: Optional[int] = None) -> str:
    """Materialise the embedded corpus as a text file in ``cache_dir`` (reused when present)."""
    tag = f"py{sys.version_info[0]}{sys.version_info[1]}"
    if max_files is not None:
        tag += f"-f{max_files}"
    if max_docs is not None:
        tag += f"-d{max_docs}"
    path = os.path.join(cache_dir, f"stdlib-docstrings-{tag}.txt")
    if not os.path.exists(path):
        os.makedirs(cache_dir, exist_ok=True)
        write_documents(stdlib_documents(max_files=max_files, max_docs=max_docs), path)
    return path


def files_fingerprint(files: Sequence[str]) -> str:
    """A short hash of the names, sizes and modification times of ``files``."""
    h = hashlib.sha256()
    for path in files:
        st = os.stat(path)
        h.update(f"{os.path.abspath(path)}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
    return h.hexdigest()[:16]
