"""Anthropic's Messages API (/v1/messages), on the request path every API shares."""
