"""Documents in a prompt: the text of a file (plain text, Markdown, code, CSV/JSON, PDF by pypdf, DOCX by
python-docx), and the block it makes. The app puts a chat's files right after the system prompt (app/attach_events.py);
/v1 takes OpenAI's file content parts (base64 data) and puts each block where the part is.

Placed after the system prompt, a chat's documents are a prefix: the second question about a file, in the same chat
or in another that attaches it, finds its KV in the prefix cache instead of reading it again."""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
from pathlib import Path

__all__ = [
    "DEFAULT_MAX_FILE_MB",
    "DocumentError",
    "READABLE",
    "content_hash",
    "document_block",
    "extract_text",
    "file_part_block",
    "with_documents",
]

DEFAULT_MAX_FILE_MB = 20  # the largest file the app takes (the --max-file-mb setting)
TEXT_SUFFIXES = frozenset(
    ".txt .text .md .markdown .rst .org .log .csv .tsv .json .jsonl .yaml .yml .toml .ini .cfg .conf .xml .html "
    ".htm .css .scss .tex .bib .srt .py .pyi .ipynb .js .mjs .ts .tsx .jsx .vue .svelte .java .kt .kts .scala .c .h "
    ".cc .cpp .cxx .hpp .cs .go .rs .rb .php .swift .m .mm .r .jl .lua .pl .sh .bash .zsh .fish .ps1 .bat .sql "
    ".graphql .proto .dart .ex .exs .erl .hs .ml .clj .el .vim .dockerfile .makefile .cmake .gradle .env".split()
)
READABLE = "plain text, Markdown, code, CSV, JSON, PDF or DOCX"


class DocumentError(ValueError):
    """A file Pagoda cannot read: the message says why and what to attach instead."""


def content_hash(data: bytes) -> str:
    """The key a file is kept under: one copy however many chats attach it."""
    return hashlib.sha256(data).hexdigest()


def extract_text(name: str, data: bytes) -> str:
    """The text of file `name` (its suffix says how to read it). Raises DocumentError for a file of an unknown
    kind, a damaged one, or one with no text in it."""
    suffix = Path(name).suffix.lower()
    if suffix == ".pdf":
        text = _pdf_text(name, data)
    elif suffix == ".docx":
        text = _docx_text(name, data)
    elif suffix in TEXT_SUFFIXES or Path(name).name.lower() in ("makefile", "dockerfile", "readme", "license"):
        try:
            text = data.decode("utf-8-sig")
        except UnicodeDecodeError:
            raise DocumentError(f"{name} is not UTF-8 text. Save it as UTF-8 and attach it again.") from None
    else:
        kind = f"{suffix} files" if suffix else "files without a suffix"
        raise DocumentError(f"Pagoda cannot read {kind} ({name}) yet. Attach {READABLE}.")
    text = text.replace("\r\n", "\n").strip()
    if not text:
        raise DocumentError(
            f"{name} has no text in it{' (a scan? Pagoda does not read images of text)' if suffix == '.pdf' else ''}."
        )
    return text


def _pdf_text(name: str, data: bytes) -> str:
    import pypdf

    try:
        reader = pypdf.PdfReader(io.BytesIO(data))
        if reader.is_encrypted and not reader.decrypt(""):
            raise DocumentError(f"{name} is protected by a password. Save an unprotected copy and attach that.")
        return "\n\n".join((page.extract_text() or "").strip() for page in reader.pages)
    except DocumentError:
        raise
    except Exception as e:  # pypdf raises many kinds on a damaged file (PyPdfError, ValueError, KeyError, ...)
        raise DocumentError(
            f"{name} could not be read as a PDF ({e}): it may be damaged. Open it and save it again."
        ) from None


def _docx_text(name: str, data: bytes) -> str:
    import docx

    try:
        document = docx.Document(io.BytesIO(data))
    except Exception as e:  # a bad zip, a missing part, malformed XML (lxml's XMLSyntaxError), ...
        raise DocumentError(f"{name} could not be read as a Word document ({e}): it may be damaged.") from None
    parts = [p.text for p in document.paragraphs]
    for table in document.tables:  # after the text: python-docx lists paragraphs and tables apart
        parts.extend(" | ".join(cell.text for cell in row.cells) for row in table.rows)
    return "\n".join(parts)


def document_block(name: str, text: str) -> str:
    """One document as the prompt has it."""
    return f'<document name="{name}">\n{text}\n</document>'


def with_documents(system_prompt: str, documents: list[tuple[str, str]]) -> str:
    """The system prompt with the chat's documents ((name, text), in the order attached) right after it."""
    return "\n\n".join([system_prompt.strip(), *(document_block(n, t) for n, t in documents)]).strip()


def file_part_block(filename: object, file_data: object, file_id: object = None) -> str:
    """An OpenAI file content part (chat: {"type": "file", "file": {...}}; Responses: {"type": "input_file", ...}) as
    its document block. Raises DocumentError, with what to send instead, for a part that cannot be read."""
    if file_id is not None and file_data is None:
        raise DocumentError("file_id is not supported: Pagoda has no Files API. Send the file's bytes as file_data.")
    if not isinstance(filename, str) or not filename.strip():
        raise DocumentError("a file part needs its filename (its suffix says how to read it).")
    if not isinstance(file_data, str):
        raise DocumentError('a file part needs file_data: "data:<media type>;base64,<the file\'s bytes>".')
    encoded = file_data.split(",", 1)[1] if file_data.startswith("data:") and "," in file_data else file_data
    try:
        data = base64.b64decode(encoded, validate=True)
    except (binascii.Error, ValueError):
        raise DocumentError(f"the file_data of {filename} is not base64.") from None
    return document_block(filename.strip(), extract_text(filename.strip(), data))
