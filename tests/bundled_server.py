"""The OpenAI server on the bundled model as test_openai_server.py and test_openai_refusals.py run it: its
API key, served name and settings."""

from pathlib import Path

from tests.processes import ServeProcess

KEY = "sk-pagoda-test"
DEFAULT_MAX_TOKENS = 20  # the server's cap for requests that send no max_tokens
MODEL = "smollm2"


def serve_bundled(bundled_model: Path, log: Path) -> ServeProcess:
    """`python -m engine.serve` on the bundled model, ready to answer."""
    return ServeProcess(
        bundled_model,
        log,
        "--served-model-name",
        MODEL,
        "--api-key",
        KEY,
        "--max-num-seqs",
        "16",
        "--max-model-len",
        "2048",
        "--default-max-tokens",
        str(DEFAULT_MAX_TOKENS),
        # float32: its sums come out the same whether a prompt's system prompt was cached by an
        # earlier test or not, so replies and logprobs can be compared with the reference's exactly
        "--dtype",
        "float32",
    ).wait_ready()


def running_server(bundled_model: Path, tmp_path_factory):
    """A module's `server` fixture: the bundled server while the module's tests run."""
    srv = serve_bundled(bundled_model, tmp_path_factory.mktemp("serve") / "server.log")
    yield srv
    srv.stop()
