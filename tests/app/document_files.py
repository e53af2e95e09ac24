"""Files of the kinds a chat takes, made by the tests: a PDF with a text layer (written by hand: PDF 1.4, one
Helvetica text object per page), a Word document (python-docx), and damaged or protected ones."""

import io


def pdf_bytes(pages: list[str]) -> bytes:
    """A PDF whose pages hold these texts (one line per line)."""
    objects = ["<< /Type /Catalog /Pages 2 0 R >>", "", "<< /Type /Font /Subtype /Type1 /BaseFont /Helvetica >>"]
    kids = []
    for text in pages:
        shown = [f"({pdf_string(line)}) Tj T*" for line in text.split("\n")]
        stream = "\n".join(["BT", "/F1 12 Tf", "14 TL", "72 720 Td", *shown, "ET"])
        objects.append(f"<< /Length {len(stream.encode('latin-1'))} >>\nstream\n{stream}\nendstream")
        objects.append(
            "<< /Type /Page /Parent 2 0 R /MediaBox [0 0 612 792] /Resources << /Font << /F1 3 0 R >> >> "
            f"/Contents {len(objects)} 0 R >>"
        )
        kids.append(len(objects))
    objects[1] = f"<< /Type /Pages /Kids [{' '.join(f'{k} 0 R' for k in kids)}] /Count {len(kids)} >>"
    out = bytearray(b"%PDF-1.4\n")
    offsets = []
    for number, body in enumerate(objects, 1):
        offsets.append(len(out))
        out += f"{number} 0 obj\n{body}\nendobj\n".encode("latin-1")
    xref = len(out)
    out += f"xref\n0 {len(objects) + 1}\n0000000000 65535 f \n".encode()
    out += b"".join(f"{offset:010d} 00000 n \n".encode() for offset in offsets)
    out += f"trailer\n<< /Size {len(objects) + 1} /Root 1 0 R >>\nstartxref\n{xref}\n%%EOF\n".encode()
    return bytes(out)


def pdf_string(text: str) -> str:
    """Text as a PDF string's inside: backslashes and parentheses escaped."""
    return text.replace("\\", "\\\\").replace("(", "\\(").replace(")", "\\)")


def protected_pdf_bytes(text: str, password: str = "secret") -> bytes:
    import pypdf

    writer = pypdf.PdfWriter(clone_from=io.BytesIO(pdf_bytes([text])))
    writer.encrypt(password)
    out = io.BytesIO()
    writer.write(out)
    return out.getvalue()


def docx_bytes(paragraphs: list[str], table: list[list[str]] | None = None) -> bytes:
    import docx

    document = docx.Document()
    for paragraph in paragraphs:
        document.add_paragraph(paragraph)
    if table:
        grid = document.add_table(rows=len(table), cols=len(table[0]))
        for r, row in enumerate(table):
            for c, cell in enumerate(row):
                grid.cell(r, c).text = cell
    out = io.BytesIO()
    document.save(out)
    return out.getvalue()
