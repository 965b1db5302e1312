# SPDX-License-Identifier: Apache-2.0
"""A deterministic Python-source corpus from the machine's own installation.

The corpus is the ``.py`` files under a list of *roots*: ``"stdlib"`` (the
running interpreter's standard library) or an importable package name
(``"torch"``, ``"transformers"``, ...).  Files are ordered by a hash of
``<root>/<relative path>``, so a byte cap keeps a spread-out sample rather
than the alphabetically first directories, and the same installation always
gives the same corpus.  A fixed fraction of files (again chosen by hash) is
held out for evaluation prompts.
"""

from __future__ import annotations

import hashlib
import importlib.util
import sysconfig
import zlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

# Directories that hold tests, caches or vendored copies rather than
# ordinary library code.
_SKIP_DIRS = {"__pycache__", "test", "tests", "idle_test", "site-packages"}
_MAX_FILE_BYTES = 256 * 1024  # skip generated tables and similar giants
_HELDOUT_MODULUS = 32  # one file in 32 is held out


@dataclass(frozen=True)
class SourceFile:
    root: str  # "stdlib" or the package name
    rel: str  # path relative to the root directory
    path: Path

    @property
    def key(self) -> str:
        return f"{self.root}/{self.rel}"

    @property
    def held_out(self) -> bool:
        return zlib.crc32(self.key.encode()) % _HELDOUT_MODULUS == 0

    def read(self) -> str:
        return self.path.read_text(encoding="utf-8", errors="replace")


def _root_dir(root: str) -> Path:
    if root == "stdlib":
        return Path(sysconfig.get_paths()["stdlib"])
    spec = importlib.util.find_spec(root)
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(f"corpus root {root!r} is neither 'stdlib' nor a package")
    return Path(next(iter(spec.submodule_search_locations)))


def _order_key(f: SourceFile) -> str:
    return hashlib.sha256(f.key.encode()).hexdigest()


def list_files(roots: Sequence[str], max_bytes: int) -> list[SourceFile]:
    """The corpus files of ``roots`` in hash order, up to ``max_bytes``."""
    found: list[SourceFile] = []
    for root in roots:
        base = _root_dir(root)
        for path in base.rglob("*.py"):
            rel = path.relative_to(base)
            if _SKIP_DIRS.intersection(rel.parts[:-1]) or not path.is_file():
                continue
            if path.stat().st_size > _MAX_FILE_BYTES:
                continue
            found.append(SourceFile(root, rel.as_posix(), path))
    found.sort(key=_order_key)
    kept, total = [], 0
    for f in found:
        size = f.path.stat().st_size
        if total + size > max_bytes:
            continue
        kept.append(f)
        total += size
    return kept


def fingerprint(files: Sequence[SourceFile]) -> str:
    """Hash of the file list and contents: equal iff the corpus is equal."""
    h = hashlib.sha256()
    for f in files:
        h.update(f.key.encode() + b"\0" + f.path.read_bytes() + b"\0")
    return h.hexdigest()[:16]


def iter_lines(files: Sequence[SourceFile]) -> Iterator[str]:
    for f in files:
        yield from f.read().splitlines(keepends=True)


def token_stream(tokenizer, files: Sequence[SourceFile]) -> list[int]:
    """All files tokenized and concatenated, each followed by EOS."""
    texts = [f.read() for f in files]
    eos = tokenizer.eos_token_id
    stream: list[int] = []
    for ids in tokenizer(texts, add_special_tokens=False)["input_ids"]:
        stream.extend(ids)
        stream.append(eos)
    return stream


def heldout_prompts(
    tokenizer, files: Sequence[SourceFile], num: int, length: int
) -> list[list[int]]:
    """``num`` prompts of ``length`` tokens cut from the held-out files.

    Prompts are taken round-robin over the files (one window per file per
    round, windows advancing by ``2 * length`` tokens), so they cover as many
    files as possible.
    """
    if not files:
        raise ValueError("no held-out files: the corpus is too small")
    encoded = tokenizer([f.read() for f in files], add_special_tokens=False)
    streams = [ids for ids in encoded["input_ids"] if len(ids) >= length]
    prompts: list[list[int]] = []
    offset = 0
    while len(prompts) < num and streams:
        streams = [s for s in streams if offset + length <= len(s)]
        for s in streams:
            if len(prompts) == num:
                break
            prompts.append(s[offset : offset + length])
        offset += 2 * length
    return prompts
