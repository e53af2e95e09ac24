"""The API's default limits, kept apart from its routes so that command lines can show them with the standard
library alone (launcher.py checks its options before anything is installed)."""

# What a request without max_tokens gets. Open WebUI sends its tags and follow-up tasks without one, and
# a small model that never stops then ran for 7,465 tokens (15 minutes on a CPU). 2048 tokens is a
# long answer (about 1,500 words) and bounds a runaway; a reply cut there ends with finish_reason
# "length". None: the rest of the context, as vLLM does.
DEFAULT_MAX_TOKENS = 2048

# The most bytes a request body may have (the server's --max-request-bytes). 4 MiB holds far more text
# than any local model's context (about a million characters); a 10 MB body once took 21 s to refuse and
# four of them held 4.9 GB after they were gone.
MAX_REQUEST_BYTES = 4 << 20
