"""Evaluation corpora, as a list of documents (strings) to be joined with "\\n\\n".

- ``wikitext2``: the ``wikitext-2-raw-v1`` test split through ``datasets`` (one row per line
  of the original files, as GPTQ and most quantization papers use it). When the hub cannot be
  reached a cached copy is used; without one, the error says what to pass instead. The hub is
  probed with a short TCP connect first (unless a proxy is configured) so an offline machine
  fails in seconds instead of sitting through the hub client's retries.
- a local ``.txt`` file, read here as one document (the file's text, line breaks kept), never
  through ``datasets`` (whose loaders would open a compressed or archive file named ``.txt``):
  streamed in 1 MiB chunks and decoded as strict UTF-8, so a binary file fails at its first
  chunk; ``max_chars`` stops reading once that much text is in hand (a caller that needs N tokens
  passes ``chars_for_tokens(N)``, so a 2 GB file is not read whole for a few windows).
- a local ``.jsonl`` / ``.json`` / ``.parquet`` file through ``datasets``' local loaders: a
  ``text`` column, one document per row.
- ``pydoc``: the help topics every CPython installation carries (``pydoc_data.topics``), one
  document per topic in sorted key order -- an offline corpus of about 0.5 MB of English prose
  and code.
"""

from __future__ import annotations

import codecs
import contextlib
import os
import socket
from pathlib import Path
from urllib.parse import urlparse

__all__ = ["DatasetError", "load_texts", "chars_for_tokens", "DATASET_NAMES", "hub_reachable"]

WIKITEXT2_NAMES = ("wikitext2", "wikitext-2", "wikitext-2-raw-v1", "wikitext")
PYDOC_NAMES = ("pydoc",)
DATASET_NAMES = ("wikitext2", "pydoc")
FILE_SUFFIXES = {".txt": "text", ".jsonl": "json", ".json": "json", ".parquet": "parquet"}
_WHAT_TO_PASS = "pass wikitext2, pydoc, or the path of a local .txt, .jsonl or .parquet file"
_TXT_CHUNK = 1 << 20
# A token of real text spans a few characters (English prose ~4); reading 32 per token needed
# leaves room for whitespace runs and markup without reading a huge file whole.
CHARS_PER_TOKEN = 32


class DatasetError(ValueError):
    """A dataset that cannot be found, read or used; the message is one line."""


def chars_for_tokens(n_tokens: int) -> int:
    """How many characters of a text file to read for ``n_tokens`` tokens (``load_texts(max_chars=)``)."""
    return CHARS_PER_TOKEN * max(int(n_tokens), 0) + _TXT_CHUNK


def load_texts(dataset: str | os.PathLike, max_chars: int | None = None) -> list[str]:
    """The documents of ``dataset`` (a name or a local file path, see the module doc).

    ``max_chars``: read at most this many characters of a local ``.txt`` file (its text may then
    end early); the other datasets are returned whole.
    """
    name = str(dataset)
    key = name.strip().lower()
    if key in WIKITEXT2_NAMES:
        return _wikitext2()
    if key in PYDOC_NAMES:
        return _pydoc()
    p = Path(name).expanduser()
    if p.exists():
        return _local_file(p, max_chars)
    if p.suffix.lower() in FILE_SUFFIXES or os.sep in name or "/" in name:
        raise DatasetError(f"{name}: no such file")
    raise DatasetError(f"unknown dataset {name!r}: {_WHAT_TO_PASS}")


def _nonempty(texts: list[str], what: str) -> list[str]:
    texts = [t for t in texts if isinstance(t, str)]
    if not any(t.strip() for t in texts):
        raise DatasetError(f"{what}: empty (no text)")
    return texts


def _local_file(p: Path, max_chars: int | None = None) -> list[str]:
    if p.is_dir():
        raise DatasetError(f"{p}: is a directory; {_WHAT_TO_PASS}")
    loader = FILE_SUFFIXES.get(p.suffix.lower())
    if loader is None:
        raise DatasetError(f"{p}: unsupported file type {p.suffix or '(none)'!r}; {_WHAT_TO_PASS}")
    if p.stat().st_size == 0:
        raise DatasetError(f"{p}: empty file")
    if loader == "text":
        return _nonempty([_read_text(p, max_chars)], str(p))
    import datasets

    try:
        with _quiet_datasets():
            ds = datasets.load_dataset(loader, data_files=str(p), split="train")
    except Exception as e:  # noqa: BLE001 - any reader failure is a bad file for the user
        raise DatasetError(f"{p}: cannot read as {loader} ({_first_line(e)})") from e
    if "text" not in ds.column_names:
        raise DatasetError(
            f"{p}: no 'text' column (columns: {', '.join(ds.column_names) or 'none'})"
        )
    return _nonempty(list(ds["text"]), str(p))


def _read_text(p: Path, max_chars: int | None = None) -> str:
    """A text file's text, streamed in chunks and decoded as strict UTF-8 (a leading BOM is
    dropped), stopping after ``max_chars`` characters. Bytes that do not decode, or a NUL byte
    (binary data), fail at the chunk that holds them, naming the file and the byte offset."""
    decoder = codecs.getincrementaldecoder("utf-8-sig")("strict")
    parts: list[str] = []
    n = offset = 0
    try:
        with open(p, "rb") as f:
            while max_chars is None or n < max_chars:
                raw = f.read(_TXT_CHUNK)
                pending = len(decoder.getstate()[0])  # bytes of a character the last chunk cut
                try:
                    text = decoder.decode(raw, final=not raw)
                except UnicodeDecodeError as e:
                    at = offset - pending + e.start
                    raise DatasetError(f"{p}: not UTF-8 text (undecodable byte at offset {at}); pass a text file") from None
                nul = text.find("\x00")
                if nul >= 0:
                    raise DatasetError(f"{p}: binary data (a NUL byte in the first {offset + len(raw)} bytes); pass a text file")
                if max_chars is not None:
                    text = text[: max_chars - n]
                parts.append(text)
                n += len(text)
                offset += len(raw)
                if not raw:
                    break
    except OSError as e:
        raise DatasetError(f"{p}: cannot read ({e.strerror or e})") from None
    return "".join(parts)


def _pydoc() -> list[str]:
    try:
        from pydoc_data.topics import topics
    except ImportError as e:
        raise DatasetError(
            "pydoc: this Python installation lacks pydoc_data; pass a local .txt, .jsonl or .parquet file"
        ) from e
    return _nonempty([topics[k] for k in sorted(topics)], "pydoc")


def hub_reachable(timeout: float = 3.0) -> bool:
    """False when offline mode is set or the hub's host does not accept a TCP connection."""
    from huggingface_hub import constants

    if constants.HF_HUB_OFFLINE or _env_true("HF_HUB_OFFLINE") or _env_true("HF_DATASETS_OFFLINE"):
        return False
    if any(os.environ.get(v) for v in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy")):
        return True  # a direct probe says nothing about the proxy: let the hub client try
    url = urlparse(constants.ENDPOINT)
    port = url.port or (443 if url.scheme == "https" else 80)
    try:
        with socket.create_connection((url.hostname, port), timeout=timeout):
            return True
    except OSError:
        return False


def _wikitext2() -> list[str]:
    import datasets

    online = hub_reachable()
    try:
        with _quiet_datasets(), contextlib.ExitStack() as stack:
            if not online:
                stack.enter_context(_offline_mode())
            ds = datasets.load_dataset("wikitext", "wikitext-2-raw-v1", split="test")
    except Exception as e:  # noqa: BLE001
        if online:
            raise DatasetError(
                f"wikitext2: cannot load wikitext-2-raw-v1 from the Hugging Face hub ({_first_line(e)}); "
                "pass --dataset PATH (a local .txt, .jsonl or .parquet file) or --dataset pydoc"
            ) from e
        raise DatasetError(
            "wikitext2: the Hugging Face hub is not reachable (offline) and no cached copy exists; "
            "pass --dataset PATH (a local .txt, .jsonl or .parquet file) or --dataset pydoc"
        ) from e
    return _nonempty(list(ds["text"]), "wikitext2")


@contextlib.contextmanager
def _offline_mode():
    """Make ``datasets`` and ``huggingface_hub`` use the local cache only, for this call."""
    import datasets.config as dconf
    from huggingface_hub import constants

    saved = dconf.HF_HUB_OFFLINE, getattr(dconf, "HF_DATASETS_OFFLINE", None), constants.HF_HUB_OFFLINE
    dconf.HF_HUB_OFFLINE = True
    dconf.HF_DATASETS_OFFLINE = True
    constants.HF_HUB_OFFLINE = True
    try:
        yield
    finally:
        dconf.HF_HUB_OFFLINE, dconf.HF_DATASETS_OFFLINE, constants.HF_HUB_OFFLINE = saved


@contextlib.contextmanager
def _quiet_datasets():
    """No progress bars or cache warnings from ``datasets`` on our stderr."""
    import datasets

    was_enabled = datasets.utils.logging.is_progress_bar_enabled()
    level = datasets.utils.logging.get_verbosity()
    datasets.utils.logging.disable_progress_bar()
    datasets.utils.logging.set_verbosity_error()
    try:
        yield
    finally:
        datasets.utils.logging.set_verbosity(level)
        if was_enabled:
            datasets.utils.logging.enable_progress_bar()


def _env_true(name: str) -> bool:
    return os.environ.get(name, "").strip().upper() in {"1", "ON", "YES", "TRUE"}


def _first_line(e: BaseException) -> str:
    s = str(e).strip()
    return s.splitlines()[0] if s else type(e).__name__
