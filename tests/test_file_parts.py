"""OpenAI's file content parts on /v1: a file's bytes (base64, a data URL or bare) read as the app reads an attached
file and put in the prompt as a document block where the part is; what cannot be read is a 400 that says why."""

import base64

import pytest

from entrypoints.documents import document_block
from entrypoints.openai.errors import APIError
from entrypoints.openai.protocol import ChatMessage
from entrypoints.responses.protocol import text_of
from tests.app.document_files import docx_bytes, pdf_bytes


def data_url(data: bytes, media: str = "application/pdf") -> str:
    return f"data:{media};base64,{base64.b64encode(data).decode()}"


def test_a_chat_file_part_becomes_its_document_block_where_it_is():
    pdf = pdf_bytes(["The keeper is Ada."])
    message = ChatMessage(
        role="user",
        content=[
            {"type": "text", "text": "Read this:\n"},
            {"type": "file", "file": {"filename": "keeper.pdf", "file_data": data_url(pdf)}},
            {"type": "text", "text": "\nWho is the keeper?"},
        ],
    )
    assert message.text() == f"Read this:\n{document_block('keeper.pdf', 'The keeper is Ada.')}\nWho is the keeper?"


def test_a_responses_input_file_reads_bare_base64_too():
    docx = docx_bytes(["The ship is the Ortolan."])
    part = {"type": "input_file", "filename": "ship.docx", "file_data": base64.b64encode(docx).decode()}
    assert text_of([part], "input.0.content") == document_block("ship.docx", "The ship is the Ortolan.")


@pytest.mark.parametrize(
    "file, says",
    [
        ({"file_id": "file-abc123"}, "file_id is not supported: Pagoda has no Files API"),
        ({"filename": "a.pdf", "file_data": data_url(b"%PDF-1.4 cut off")}, "could not be read as a PDF"),
        ({"filename": "a.exe", "file_data": data_url(b"MZ")}, "cannot read .exe files"),
        ({"filename": "a.txt", "file_data": "data:text/plain;base64,@@@"}, "is not base64"),
        ({"file_data": data_url(b"hello")}, "needs its filename"),
    ],
)
def test_a_file_part_that_cannot_be_read_is_a_400_that_says_why(file, says):
    with pytest.raises(APIError, match=says) as chat_error:
        ChatMessage(role="user", content=[{"type": "file", "file": file}]).text()
    assert chat_error.value.status == 400
    with pytest.raises(APIError, match=says):
        text_of([{"type": "input_file", **file}], "input.0.content")
